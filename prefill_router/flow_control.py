"""FlowControl: the router's bounded cluster queue (who goes on now, who waits, who is turned
away at once); sans-IO, driven by RouterEngine and by tests.

Contract. At most ``max_inflight_per_pipeline`` x (ready pipelines) requests are forwarded at
once; the rest wait here, at most ``max_queue`` of them. Waiting requests go on by priority
(higher first), and among equal priorities tenant by tenant in turn (one request per tenant per
turn), each tenant's own in arrival order: a tenant with a burst does not starve the others.

An offered request carries the router's own prediction of the seconds until its result on the
best pipeline now (the Scorer's queued work + its prefill cost there, ``pipeline_s``). Waiting
adds the predicted cost of the requests that would go before it (same or higher priority),
spread over the ready pipelines. A request is rejected at once, with a retry-after hint, when
that prediction exceeds its deadline, when its predicted wait (the prediction less its own
prefill cost: the work queued on the pipeline and ahead of it here) exceeds ``max_wait_s``, or
when it would have to wait and the queue is full: an overloaded tier says "busy, retry" in
microseconds instead of answering late. The deadline is each caller's; ``max_wait_s`` is the
operator's bound on latency added by queueing, for every request, deadline or not.

Whoever gets ADMIT (from ``offer`` or ``release``/``drain``) holds a slot and must ``release``
it exactly once; a WAIT that gives up (cancelled, deadline) is ``withdraw``n.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple

from prefill_node.errors import InvariantError


@dataclass(frozen=True)
class FlowConfig:
    """``max_inflight_per_pipeline``: requests forwarded at once per ready pipeline, 0 for no
    bound (nothing waits; only the deadline and wait checks turn requests away); ``max_queue``:
    requests waiting at the router at most, beyond which a request that would wait is
    rejected; ``max_wait_s``: the longest predicted wait admitted (0: no bound)."""

    max_inflight_per_pipeline: int = 32
    max_queue: int = 1024
    max_wait_s: float = 0.0

    def __post_init__(self) -> None:
        if self.max_inflight_per_pipeline < 0 or self.max_queue < 0 or self.max_wait_s < 0:
            raise ValueError("max_inflight_per_pipeline, max_queue and max_wait_s must be >= 0")


class Verdict(Enum):
    ADMIT = "admit"  # go on now (holds a slot)
    WAIT = "wait"  # queued; ``release`` / ``drain`` hands it a slot later
    QUEUE_FULL = "queue_full"  # rejected: it would wait and the queue is full
    DEADLINE = "deadline"  # rejected: predicted to finish after its deadline
    WAIT_LIMIT = "wait_limit"  # rejected: predicted to wait longer than max_wait_s


class Offer(NamedTuple):
    verdict: Verdict
    predicted_s: float  # seconds until its result, as predicted at the offer
    retry_after_s: float  # rejections: when a retry is predicted to fare better (else 0)


@dataclass(eq=False, slots=True)
class Waiter:
    """One offered request. ``cost_s``: its predicted prefill cost (what it adds to the
    queue); ``handle``: the driver's own (RouterEngine: the future that wakes it)."""

    request_id: str
    priority: int
    tenant: str
    cost_s: float
    handle: Any = None


class FlowControl:
    """See the module contract. Not thread-safe: the driver holds its lock around calls."""

    def __init__(self, config: FlowConfig) -> None:
        self.config = config
        self.inflight = 0  # slots held
        # priority -> tenant -> that tenant's waiters in arrival order (tenants in turn order)
        self._waiting: dict[int, OrderedDict[str, deque[Waiter]]] = {}
        self._cost: dict[int, float] = {}  # priority -> predicted cost of its waiters
        self.num_waiting = 0

    def capacity(self, ready_pipelines: int) -> int | None:
        """Slots with ``ready_pipelines`` ready (None: unbounded). With none ready nothing
        waits: the requests fail UNAVAILABLE at once instead of waiting blind."""
        per = self.config.max_inflight_per_pipeline
        return None if per == 0 or ready_pipelines == 0 else per * ready_pipelines

    def offer(
        self,
        waiter: Waiter,
        pipeline_s: float,
        deadline_left_s: float | None,
        ready_pipelines: int,
    ) -> Offer:
        """Admit, queue or reject ``waiter`` (module contract)."""
        cap = self.capacity(ready_pipelines)
        free = cap is None or (self.inflight < cap and not self.num_waiting)
        predicted = pipeline_s
        if not free:
            ahead = sum(c for p, c in self._cost.items() if p >= waiter.priority)
            predicted += ahead / max(1, ready_pipelines)
        if deadline_left_s is not None and predicted > deadline_left_s:
            return Offer(Verdict.DEADLINE, predicted, predicted - max(0.0, deadline_left_s))
        wait = predicted - waiter.cost_s
        if self.config.max_wait_s and wait > self.config.max_wait_s:
            return Offer(Verdict.WAIT_LIMIT, predicted, wait - self.config.max_wait_s)
        if free:
            self.inflight += 1
            return Offer(Verdict.ADMIT, predicted, 0.0)
        if self.num_waiting >= self.config.max_queue:
            return Offer(Verdict.QUEUE_FULL, predicted, predicted)
        tenants = self._waiting.setdefault(waiter.priority, OrderedDict())
        tenants.setdefault(waiter.tenant, deque()).append(waiter)
        self._cost[waiter.priority] = self._cost.get(waiter.priority, 0.0) + waiter.cost_s
        self.num_waiting += 1
        return Offer(Verdict.WAIT, predicted, 0.0)

    def release(self, ready_pipelines: int) -> list[Waiter]:
        """A slot's holder is done; the waiters admitted into the freed room (they hold
        slots now)."""
        if self.inflight <= 0:
            raise RuntimeError("FlowControl.release without a slot held")
        self.inflight -= 1
        return self.drain(ready_pipelines)

    def drain(self, ready_pipelines: int) -> list[Waiter]:
        """Admit waiters while there is room (after a release, or more pipelines ready)."""
        cap = self.capacity(ready_pipelines)
        admitted = []
        while self.num_waiting and (cap is None or self.inflight < cap):
            admitted.append(self._pop_next())
            self.inflight += 1
        return admitted

    def withdraw(self, waiter: Waiter) -> bool:
        """Take a waiter that gave up out of the queue; False if it was not waiting."""
        tenants = self._waiting.get(waiter.priority)
        queue = tenants.get(waiter.tenant) if tenants is not None else None
        if queue is None or waiter not in queue:
            return False
        queue.remove(waiter)
        if not queue:
            del tenants[waiter.tenant]
        self._took(waiter)
        return True

    def _pop_next(self) -> Waiter:
        priority = max(self._waiting)
        tenants = self._waiting[priority]
        tenant, queue = next(iter(tenants.items()))
        waiter = queue.popleft()
        if queue:
            tenants.move_to_end(tenant)  # the next turn goes to the next tenant
        else:
            del tenants[tenant]
        self._took(waiter)
        return waiter

    def _took(self, waiter: Waiter) -> None:
        self.num_waiting -= 1
        cost = self._cost[waiter.priority] - waiter.cost_s
        if self._waiting[waiter.priority]:
            self._cost[waiter.priority] = max(0.0, cost)
        else:
            del self._waiting[waiter.priority], self._cost[waiter.priority]

    def check_integrity(self) -> None:
        """The counts agree with the queues; InvariantError if not."""
        counted = sum(len(q) for t in self._waiting.values() for q in t.values())
        empty = [p for p, t in self._waiting.items() if not t or any(not q for q in t.values())]
        if counted != self.num_waiting or empty or self.inflight < 0:
            raise InvariantError(
                f"flow control: {counted} waiting in queues, counted {self.num_waiting}; "
                f"empty entries at priorities {empty}; inflight {self.inflight}"
            )
        if set(self._cost) != set(self._waiting):
            raise InvariantError("flow control: cost sums and queues disagree on priorities")
