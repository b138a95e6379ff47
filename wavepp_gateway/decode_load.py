"""A decode instance's load from its Prometheus ``/metrics`` text, under vLLM's own names."""

from __future__ import annotations

from dataclasses import dataclass

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"  # a fraction in [0, 1], despite the name


@dataclass(frozen=True, slots=True)
class DecodeLoad:
    """Requests running and waiting on the instance, and its KV cache in use (0-1)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0


def parse_load(text: str) -> DecodeLoad:
    """Sum each gauge over its label sets (one per engine / model); missing gauges read 0.
    Raises ValueError when the text is not Prometheus exposition format."""
    from prometheus_client.parser import text_string_to_metric_families

    sums = {RUNNING: 0.0, WAITING: 0.0, KV_USAGE: 0.0}
    counts = dict.fromkeys(sums, 0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in sums:
                sums[sample.name] += sample.value
                counts[sample.name] += 1
    usage = sums[KV_USAGE] / counts[KV_USAGE] if counts[KV_USAGE] else 0.0
    return DecodeLoad(round(sums[RUNNING]), round(sums[WAITING]), usage)
