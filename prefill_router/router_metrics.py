"""RouterMetrics: the router's own Prometheus counters (decisions, cache-hit accuracy, churn).

Register ``collector()`` in the serving PrefillServer's registry; per-pipeline load gauges
(ready, in flight, indexed blocks) come from the server's load collector. Updates may come
from more than one thread (the serving loop, a router's own loop thread, scrapes), so one
lock guards them.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from prefill_router.transfer import TransferModel


class RouterMetrics:
    """Counters; every method is thread-safe and O(1)."""

    def __init__(
        self,
        policy: str,
        prediction_ratios: Callable[[], Mapping[str, float]] = dict,
        transfer_model: Callable[[], TransferModel | None] = lambda: None,
    ) -> None:
        """``prediction_ratios``: each pipeline's measured / predicted time ratio, read at
        scrape time (it drifts between answers); ``transfer_model``: the fetch policy's
        model now (None: another policy)."""
        self.policy = policy
        self.prediction_ratios = prediction_ratios
        self.transfer_model = transfer_model
        self._lock = threading.Lock()
        self.decisions: Counter[str] = Counter()  # by reason
        self.predicted_cached: Counter[str] = Counter()  # by pipeline, answered requests
        self.actual_cached: Counter[str] = Counter()
        self.answered_requests: Counter[str] = Counter()
        self.resyncs: Counter[str] = Counter()
        self.failovers: Counter[tuple[str, str]] = Counter()  # by (failed pipeline, reason)
        self.lost: Counter[str] = Counter()  # by pipeline: left the candidate set
        self.refused: Counter[str] = Counter()  # by pipeline: wrong model / block size
        # flow control, by outcome: admit, wait, queue_full, deadline, wait_limit (rejected
        # at once),
        # dequeued (a waiter got its slot), withdrawn (a waiter gave up)
        self.admission: Counter[str] = Counter()
        self.fetches: Counter[tuple[str, str]] = Counter()  # by (pipeline, copied / none)
        self.fetch_seconds: Counter[str] = Counter()  # by pipeline, as the pipelines report
        self.waiting = 0  # requests waiting in the router's queue now
        self.queue_wait_s = 0.0  # summed over the waiters that got a slot

    def decision(self, reason: str) -> None:
        with self._lock:
            self.decisions[reason] += 1

    def answered(self, pid: str, predicted_cached: int, actual_cached: int) -> None:
        with self._lock:
            self.answered_requests[pid] += 1
            self.predicted_cached[pid] += predicted_cached
            self.actual_cached[pid] += actual_cached

    def fetched(self, pid: str, copied: bool, seconds: float) -> None:
        """A request sent to ``pid`` with a prefix to fetch was answered: whether the copy
        happened (else it computed the prefix) and what the fetch took there."""
        with self._lock:
            self.fetches[pid, "copied" if copied else "none"] += 1
            self.fetch_seconds[pid] += seconds

    def resync(self, pid: str) -> None:
        with self._lock:
            self.resyncs[pid] += 1

    def failover(self, pid: str, reason: str) -> None:
        with self._lock:
            self.failovers[pid, reason] += 1

    def offered(self, outcome: str, waiting: int, n: int = 1) -> None:
        with self._lock:
            self.admission[outcome] += n
            self.waiting = waiting

    def queue_wait(self, seconds: float) -> None:
        with self._lock:
            self.queue_wait_s += seconds

    def pipeline_lost(self, pid: str) -> None:
        with self._lock:
            self.lost[pid] += 1

    def pipeline_refused(self, pid: str) -> None:
        with self._lock:
            self.refused[pid] += 1

    def collector(self) -> Collector:
        return _RouterCollector(self)


class _RouterCollector(Collector):
    def __init__(self, metrics: RouterMetrics) -> None:
        self._m = metrics

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        m = self._m
        with m._lock:
            snapshot = {
                name: dict(getattr(m, name))
                for name in ("decisions", "predicted_cached", "actual_cached",
                             "answered_requests", "resyncs", "failovers", "lost", "refused",
                             "admission", "fetches", "fetch_seconds")
            }  # fmt: skip
            waiting, queue_wait_s = m.waiting, m.queue_wait_s
        ratios = GaugeMetricFamily(
            "wavepp_router_prediction_ratio",
            "Per pipeline: measured / predicted seconds to answer (EWMA over answered "
            "requests); the router scales its cost model's predictions by it",
            labels=["pipeline"],
        )
        for pid, ratio in sorted(m.prediction_ratios().items()):
            ratios.add_metric([pid], ratio)
        yield ratios
        admission = CounterMetricFamily(
            "wavepp_router_admission",
            "Flow control outcomes: admit, wait, queue_full, deadline and wait_limit (rejected "
            "at once with RESOURCE_EXHAUSTED), dequeued, withdrawn",
            labels=["outcome"],
        )
        for outcome, n in snapshot["admission"].items():
            admission.add_metric([outcome], n)
        yield admission
        yield GaugeMetricFamily(
            "wavepp_router_queued_requests", "Requests waiting in the router's queue",
            value=waiting)  # fmt: skip
        yield CounterMetricFamily(
            "wavepp_router_queue_wait_seconds",
            "Seconds waited in the router's queue, summed over the requests that got a slot",
            value=queue_wait_s)  # fmt: skip
        decisions = CounterMetricFamily(
            "wavepp_router_decisions",
            "Routing decisions by policy and reason",
            labels=["policy", "reason"],
        )
        for reason, n in snapshot["decisions"].items():
            decisions.add_metric([m.policy, reason], n)
        yield decisions
        cached = CounterMetricFamily(
            "wavepp_router_cached_tokens",
            "Cached prompt tokens of answered requests: predicted at routing vs reported",
            labels=["pipeline", "kind"],
        )
        for pid, n in snapshot["predicted_cached"].items():
            cached.add_metric([pid, "predicted"], n)
            cached.add_metric([pid, "actual"], snapshot["actual_cached"].get(pid, 0))
        yield cached
        yield _per_pipeline_and(
            "wavepp_router_failovers",
            "Requests run on another pipeline after this one failed them before answering, "
            "by reason",
            "reason",
            snapshot["failovers"],
        )
        yield _per_pipeline_and(
            "wavepp_router_fetches",
            "Requests sent with a prefix to fetch from another pipeline (fetch policy), by "
            "the pipeline that fetched and outcome (copied; none: nothing copied - the copy "
            "failed, or the source held too little, or the pipeline held it or had no room - "
            "so it computed what it lacked)",
            "outcome",
            snapshot["fetches"],
        )
        transfer = m.transfer_model()
        if transfer is not None:
            model = GaugeMetricFamily(
                "wavepp_router_transfer_model",
                "The fetch policy's transfer model now (seconds): fixed per fetch and per "
                "block, refitted from the fetches the pipelines report",
                labels=["term"],
            )
            model.add_metric(["fixed"], transfer.fixed_s)
            model.add_metric(["per_block"], transfer.per_block_s)
            yield model
        per_pipeline = (
            ("fetch_seconds", "wavepp_router_fetch_seconds",
             "Seconds the pipelines report fetching prefixes (asking the source, copying)"),
            ("answered_requests", "wavepp_router_answered", "Requests answered per pipeline"),
            ("resyncs", "wavepp_router_resyncs", "KV-event snapshots (re)applied per pipeline"),
            ("lost", "wavepp_router_pipeline_lost", "Times a pipeline left the candidate set"),
            ("refused", "wavepp_router_pipeline_refused",
             "Times a pipeline was refused (another model or block size)"),
        )  # fmt: skip
        for attr, name, doc in per_pipeline:
            family = CounterMetricFamily(name, doc, labels=["pipeline"])
            for pid, n in snapshot[attr].items():
                family.add_metric([pid], n)
            yield family


def _per_pipeline_and(
    name: str, doc: str, label: str, counts: Mapping[tuple[str, str], int]
) -> CounterMetricFamily:
    """A counter family by pipeline and one more label."""
    family = CounterMetricFamily(name, doc, labels=["pipeline", label])
    for (pid, value), n in counts.items():
        family.add_metric([pid, value], n)
    return family
