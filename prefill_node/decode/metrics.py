"""Prometheus metrics of the reference decode server, under vLLM's names and labels.

A front door reads a decode instance's load the same way from this server and from
``vllm serve``: ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and
``vllm:kv_cache_usage_perc`` (0..1), labelled ``model_name`` and ``engine`` ("0") as vLLM
0.32 labels them; token and finish counters too. ``wavepp_decode_kv_loads`` counts KV loads
by outcome ("ok", "failed_recomputed" under the recompute policy, "failed"), which vLLM has
no metric for. Everything is read from the engine at scrape time (no polling thread).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from prefill_node.decode.decode_engine import DecodeEngine

_LABELS = ["model_name", "engine"]


class DecodeCollector(Collector):
    def __init__(self, engine: DecodeEngine, model_name: str) -> None:
        self._engine = engine
        self._values = [model_name, "0"]

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        load = self._engine.load()
        c = self._engine.counters
        v = self._values
        yield self._gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.",
            load.running,
        )  # fmt: skip
        yield self._gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
            load.waiting,
        )  # fmt: skip
        yield self._gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
            load.used_blocks / load.num_blocks,
        )  # fmt: skip
        prompt = CounterMetricFamily(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels=_LABELS
        )
        prompt.add_metric(v, sum(c.prompt_tokens.values()))
        yield prompt
        by_source = CounterMetricFamily(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            labels=[*_LABELS, "source"],
        )
        for source, count in c.prompt_tokens.items():
            by_source.add_metric([*v, source], count)
        yield by_source
        generation = CounterMetricFamily(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels=_LABELS
        )
        generation.add_metric(v, c.generation_tokens)
        yield generation
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*_LABELS, "finished_reason"],
        )
        for reason, count in c.finished.items():
            success.add_metric([*v, reason], count)
        yield success
        loads = CounterMetricFamily(
            "wavepp_decode_kv_loads",
            "KV loads asked by kv_transfer_params, by outcome (failed_recomputed: the "
            "prompt was computed here instead, under --kv-load-failure-policy recompute)",
            labels=[*_LABELS, "outcome"],
        )
        for outcome, count in c.kv_loads.items():
            loads.add_metric([*v, outcome], count)
        yield loads

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        gauge = GaugeMetricFamily(name, doc, labels=_LABELS)
        gauge.add_metric(self._values, value)
        return gauge


def decode_registry(engine: DecodeEngine, model_name: str) -> CollectorRegistry:
    """A registry of its own (never the global one) holding the decode server's metrics."""
    registry = CollectorRegistry()
    registry.register(DecodeCollector(engine, model_name))
    return registry
