"""Prometheus metrics of one prefill server: request outcomes and latencies, engine load.

Everything lives in the server's own CollectorRegistry (never the global one), so several
servers in one process (tests) do not collide. Load gauges are read from ``engine.load()`` at
scrape time by a collector, so there is no polling thread and no stale value.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from prefill_node.engine.types import EngineLoad, PrefillResult

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
        for s in load.stages:
            stage = str(s.stage)
            blocks.add_metric([stage, "free"], s.free_blocks)
            blocks.add_metric([stage, "cached"], s.cached_blocks)
            blocks.add_metric([stage, "used"], s.used_blocks)
            busy.add_metric([stage], s.busy_fraction)
        yield blocks
        yield busy
        conflicts = CounterMetricFamily(
            "wavepp_admission_conflicts",
            "Lease boundaries that shrank on re-check / escrow victims replaced at commit",
            labels=["kind"],
        )
        conflicts.add_metric(["lease"], load.lease_conflicts)
        conflicts.add_metric(["escrow"], load.escrow_conflicts)
        yield conflicts


class ServerMetrics:
    """The server's metrics. ``observe_*`` are cheap and safe to call from the event loop."""

    def __init__(self, load: Callable[[], EngineLoad] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "wavepp_requests",
            "Prefill requests by outcome (a gRPC status, lower case)",
            ["outcome"],
            registry=self.registry,
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.tokens = Counter(
            "wavepp_prompt_tokens",
            "Prompt tokens of successful requests, cached (reused) or computed",
            ["kind"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "wavepp_ttft_seconds",
            "Request received -> first token ready, in the server",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.admission = Histogram(
            "wavepp_admission_seconds",
            "Time in admission rounds (lookup, lease, escrow) per request",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.queue = Histogram(
            "wavepp_queue_seconds",
            "Submit -> admitted per request",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        if load is not None:
            self.registry.register(_EngineLoadCollector(load))
        self._http_server = None
        # labelled children resolved once: the success path runs per request
        self._ok = self.requests.labels("ok")
        self._cached = self.tokens.labels("cached")
        self._computed = self.tokens.labels("computed")

    def observe_success(self, result: PrefillResult, server_s: float) -> None:
        self._ok.inc()
        self._cached.inc(result.cached_tokens)
        self._computed.inc(result.computed_tokens)
        self.ttft.observe(server_s)
        self.admission.observe(result.timings.admission_s)
        self.queue.observe(result.timings.queue_s)

    def observe_failure(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

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
