"""Prometheus metrics of one prefill server: request outcomes and latencies, engine load.

Everything lives in the server's own CollectorRegistry (never the global one), so several
servers in one process (tests) do not collide. Load gauges are read from ``engine.load()`` at
scrape time by a collector, so there is no polling thread and no stale value. Per-request
figures are plain counters owned by the event loop (the only writer: no lock per update, as
prometheus_client's own metrics take) and exported by a collector at scrape time.
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from prefill_node.engine.types import EngineLoad, PrefillResult
from wavepp_proto.prefill.v1 import prefill_pb2

log = logging.getLogger(__name__)

OUTCOMES = (
    "ok",
    "invalid_argument",
    "resource_exhausted",
    "unavailable",
    "deadline_exceeded",
    "cancelled",
    "internal",
)
FETCH_OUTCOMES = ("copied", "held", "no_room", "failed")
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


class _EngineLoadCollector(Collector):
    """Queue, in-flight and per-stage block gauges, read from the engine on every scrape."""

    def __init__(self, load: Callable[[], EngineLoad]) -> None:
        self._load = load

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        try:
            load = self._load()
        except Exception:  # a dying engine must not break /metrics; health reports it
            log.warning("engine.load() failed during a metrics scrape", exc_info=True)
            return
        yield GaugeMetricFamily(
            "wavepp_queue_depth", "Requests submitted, not yet admitted", value=load.queue_depth
        )
        yield GaugeMetricFamily(
            "wavepp_inflight_requests", "Requests queued or running", value=load.inflight_requests
        )
        yield GaugeMetricFamily(
            "wavepp_inflight_tokens", "Tokens still to compute", value=load.inflight_tokens
        )
        blocks = GaugeMetricFamily(
            "wavepp_stage_blocks", "KV blocks per stage by state", labels=["stage", "state"]
        )
        busy = GaugeMetricFamily(
            "wavepp_stage_busy_fraction", "Share of recent time spent computing", labels=["stage"]
        )
        wide = CounterMetricFamily(
            "wavepp_stage_wide_layers",
            "Layers a stage ran with idle neighbours' cores (core sharing)",
            labels=["stage"],
        )
        for s in load.stages:
            stage = str(s.stage)
            blocks.add_metric([stage, "free"], s.free_blocks)
            blocks.add_metric([stage, "cached"], s.cached_blocks)
            blocks.add_metric([stage, "used"], s.used_blocks)
            busy.add_metric([stage], s.busy_fraction)
            wide.add_metric([stage], s.wide_layers)
        yield blocks
        yield busy
        yield wide
        conflicts = CounterMetricFamily(
            "wavepp_admission_conflicts",
            "Lease boundaries that shrank on re-check / escrow victims replaced at commit",
            labels=["kind"],
        )
        conflicts.add_metric(["lease"], load.lease_conflicts)
        conflicts.add_metric(["escrow"], load.escrow_conflicts)
        yield conflicts
        if load.pipelines:  # a router: one series per pipeline behind it
            ready = GaugeMetricFamily(
                "wavepp_pipeline_ready", "1 while the pipeline is a candidate", labels=["pipeline"]
            )
            inflight = GaugeMetricFamily(
                "wavepp_pipeline_inflight_requests",
                "Requests routed to the pipeline, not answered yet",
                labels=["pipeline"],
            )
            indexed = GaugeMetricFamily(
                "wavepp_pipeline_indexed_blocks",
                "Prefix blocks the router's index holds for the pipeline",
                labels=["pipeline"],
            )
            for p in load.pipelines:
                ready.add_metric([p.pipeline_id], float(p.ready))
                inflight.add_metric([p.pipeline_id], p.inflight_requests)
                indexed.add_metric([p.pipeline_id], p.indexed_blocks)
            yield ready
            yield inflight
            yield indexed


class _Histogram:
    """Cumulative-bucket histogram with one writer thread; a scrape reads a snapshot."""

    def __init__(self, name: str, doc: str, bounds: tuple[float, ...]) -> None:
        self.name, self.doc, self.bounds = name, doc, bounds
        self._labels = tuple(floatToGoString(b) for b in bounds)
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # le: bound >= value
        self.sum += value

    def family(self) -> HistogramMetricFamily:
        counts, total, buckets = list(self.counts), 0, []
        for label, count in zip(self._labels, counts, strict=False):
            total += count
            buckets.append((label, total))
        buckets.append(("+Inf", total + counts[-1]))
        return HistogramMetricFamily(self.name, self.doc, buckets=buckets, sum_value=self.sum)


def _by_outcome(name: str, doc: str, counts: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=["outcome"])
    for outcome, count in list(counts.items()):
        family.add_metric([outcome], count)
    return family


class _RequestCollector(Collector):
    """Exports the per-request figures ServerMetrics accumulates."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._m = metrics

    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        m = self._m
        yield _by_outcome(
            "wavepp_requests", "Prefill requests by outcome (a gRPC status, lower case)",
            m.outcomes,
        )  # fmt: skip
        tokens = CounterMetricFamily(
            "wavepp_prompt_tokens",
            "Prompt tokens of successful requests, cached (reused) or computed",
            labels=["kind"],
        )
        tokens.add_metric(["cached"], m.cached_tokens)
        tokens.add_metric(["computed"], m.computed_tokens)
        yield tokens
        yield _by_outcome(
            "wavepp_prefix_fetches",
            "Prefixes asked to be copied from another pipeline (prefix_source), by outcome: "
            "copied, held (every stage held it already), no_room (a stage could not make "
            "room), failed (the copy failed: what is missing is computed)",
            m.fetches,
        )
        fetched = CounterMetricFamily(
            "wavepp_prefix_fetch_bytes", "KV bytes the stages READ from other pipelines"
        )
        fetched.add_metric([], m.fetch_bytes)
        yield fetched
        for histogram in (m.ttft, m.admission, m.queue, m.fetch):
            yield histogram.family()


class ServerMetrics:
    """The server's metrics. ``observe_*`` must be called from one thread (the server's event
    loop): they update plain counters without a lock; scrapes from other threads are safe."""

    def __init__(self, load: Callable[[], EngineLoad] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.outcomes: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        self.cached_tokens = 0
        self.computed_tokens = 0
        self.ttft = _Histogram(
            "wavepp_ttft_seconds",
            "Request received -> first token ready, in the server",
            _LATENCY_BUCKETS,
        )
        self.admission = _Histogram(
            "wavepp_admission_seconds",
            "Time in admission rounds (lookup, lease, escrow) per request",
            _LATENCY_BUCKETS,
        )
        self.queue = _Histogram(
            "wavepp_queue_seconds", "Submit -> admitted per request", _LATENCY_BUCKETS
        )
        self.fetches: dict[str, int] = dict.fromkeys(FETCH_OUTCOMES, 0)
        self.fetch_bytes = 0
        self.fetch = _Histogram(
            "wavepp_prefix_fetch_seconds",
            "Per prefix_source: asking the source pipeline and copying its blocks",
            _LATENCY_BUCKETS,
        )
        self.registry.register(_RequestCollector(self))
        if load is not None:
            self.registry.register(_EngineLoadCollector(load))
        self._http_server = None

    def observe_success(self, result: PrefillResult, server_s: float) -> None:
        t = result.timings
        self._ok(result.cached_tokens, result.computed_tokens, server_s, t.admission_s, t.queue_s)

    def observe_response(self, resp: prefill_pb2.PrefillResponse, server_s: float) -> None:
        """``observe_success`` for a response passed on as received (a router)."""
        t = resp.timings
        self._ok(resp.cached_tokens, resp.computed_tokens, server_s, t.admission_seconds,
                 t.queue_seconds)  # fmt: skip

    def _ok(self, cached: int, computed: int, server_s: float, admission_s: float,
            queue_s: float) -> None:  # fmt: skip
        self.outcomes["ok"] += 1
        self.cached_tokens += cached
        self.computed_tokens += computed
        self.ttft.observe(server_s)
        self.admission.observe(admission_s)
        self.queue.observe(queue_s)

    def observe_fetch(self, outcome: str, bytes_read: int, seconds: float) -> None:
        self.fetches[outcome] = self.fetches.get(outcome, 0) + 1
        self.fetch_bytes += bytes_read
        self.fetch.observe(seconds)

    def observe_failure(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def serve_http(self, port: int, host: str = "0.0.0.0") -> int:
        """Serve /metrics on ``host:port`` (0 = any free port) in a daemon thread; the port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._http_server = server
        return int(server.server_address[1])

    def close(self) -> None:
        if self._http_server is not None:
            self._http_server.shutdown()
            self._http_server.server_close()
            self._http_server = None
