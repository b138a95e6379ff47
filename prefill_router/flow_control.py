"""FlowControl: the router's bounded cluster queue (who goes on now, who waits, who is turned
away at once); sans-IO, driven by RouterEngine and by tests.

Contract. At most ``max_inflight_per_pipeline`` x (ready pipelines) requests are forwarded at
once; the rest wait here, at most ``max_queue`` of them. Waiting requests go on by priority
(higher first), and among equal priorities tenant by tenant in turn (one request per tenant per
turn), each tenant's own in arrival order: a tenant with a burst does not starve the others.

An offered request carries the router's own prediction of the seconds until its result on the
best pipeline now (the Scorer's queued work + its prefill cost there, ``pipeline_s``). Waiting
adds the predicted cost of the requests that would go before it, spread over the ready
pipelines: every waiter of a higher priority; at its own priority, its tenant's waiters ahead
of it and, for each of the turns until its own, one request of every other tenant waiting now
(a tenant waiting now is taken to keep a request waiting for each of those turns: its clients
send the next as one is served, and a request that arrives later still goes before a waiter
of a tenant with a longer queue). Not the queue's total: a busy tenant's request waits for
its own backlog times the tenants taking turns, however few of theirs wait at the offer; a
quiet tenant's goes after one request of each. A request is rejected at once, with a
retry-after hint, when that prediction exceeds its deadline, when its predicted wait (the
prediction less its own prefill cost: the work queued on the pipeline and ahead of it here)
exceeds ``max_wait_s``, or when it would have to wait and the queue is full: an overloaded
tier says "busy, retry" in microseconds instead of answering late. The deadline is each
caller's; ``max_wait_s`` is the operator's bound on latency added by queueing, for every
request, deadline or not.

Whoever gets ADMIT (from ``offer`` or ``release``/``drain``) holds a slot and must ``release``
it exactly once; a WAIT that gives up (cancelled, deadline) is ``withdraw``n.
"""

from __future__ import annotations

import math
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
        # priority -> tenant -> predicted cost of that tenant's waiters
        self._tenant_cost: dict[int, dict[str, float]] = {}
        # priority -> one turn: every tenant's mean waiter cost there, summed
        self._turn: dict[int, float] = {}
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
            predicted += self._ahead_s(waiter) / max(1, ready_pipelines)
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
        priority, tenant = waiter.priority, waiter.tenant
        queue = self._waiting.setdefault(priority, OrderedDict()).setdefault(tenant, deque())
        costs = self._tenant_cost.setdefault(priority, {})
        before, n = costs.get(tenant, 0.0), len(queue)
        queue.append(waiter)
        costs[tenant] = before + waiter.cost_s
        turn = self._turn.get(priority, 0.0) - (before / n if n else 0.0)
        self._turn[priority] = turn + costs[tenant] / (n + 1)
        self._cost[priority] = self._cost.get(priority, 0.0) + waiter.cost_s
        self.num_waiting += 1
        return Offer(Verdict.WAIT, predicted, 0.0)

    def _ahead_s(self, waiter: Waiter) -> float:
        """Predicted cost of what would go before ``waiter`` were it queued now (module
        contract): the higher priorities' waiters; at its own, its tenant's waiters and one
        request of each other tenant per turn until its own (its tenant's queue + 1 turns)."""
        ahead = sum(c for p, c in self._cost.items() if p > waiter.priority)
        tenants = self._waiting.get(waiter.priority)
        if tenants is None:
            return ahead
        own = tenants.get(waiter.tenant)
        own_cost = self._tenant_cost[waiter.priority].get(waiter.tenant, 0.0)
        own_mean = own_cost / len(own) if own else 0.0
        others = max(0.0, self._turn[waiter.priority] - own_mean)  # one turn of the others
        turns = (len(own) if own else 0) + 1
        return ahead + own_cost + turns * others

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
        self._took(waiter, len(queue))
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
        self._took(waiter, len(queue))
        return waiter

    def _took(self, waiter: Waiter, left: int) -> None:
        """``waiter`` left its tenant's queue, which holds ``left`` waiters now."""
        priority, tenant = waiter.priority, waiter.tenant
        self.num_waiting -= 1
        costs = self._tenant_cost[priority]
        before = costs.pop(tenant)
        turn = self._turn[priority] - before / (left + 1)
        if left:  # float sums drift: never below 0
            costs[tenant] = max(0.0, before - waiter.cost_s)
            turn += costs[tenant] / left
        cost = self._cost[priority] - waiter.cost_s
        if self._waiting[priority]:
            self._cost[priority] = max(0.0, cost)
            self._turn[priority] = max(0.0, turn)
        else:
            del self._waiting[priority], self._cost[priority]
            del self._tenant_cost[priority], self._turn[priority]

    def check_integrity(self) -> None:
        """The counts agree with the queues; InvariantError if not."""
        counted = sum(len(q) for t in self._waiting.values() for q in t.values())
        empty = [p for p, t in self._waiting.items() if not t or any(not q for q in t.values())]
        if counted != self.num_waiting or empty or self.inflight < 0:
            raise InvariantError(
                f"flow control: {counted} waiting in queues, counted {self.num_waiting}; "
                f"empty entries at priorities {empty}; inflight {self.inflight}"
            )
        if not set(self._cost) == set(self._tenant_cost) == set(self._turn) == set(self._waiting):
            raise InvariantError("flow control: cost sums and queues disagree on priorities")
        for priority, tenants in self._waiting.items():
            costs = self._tenant_cost[priority]
            if set(costs) != set(tenants):
                raise InvariantError(f"flow control: tenant costs and queues differ at {priority}")
            turn = sum(costs[t] / len(q) for t, q in tenants.items())
            if not math.isclose(turn, self._turn[priority], rel_tol=1e-6, abs_tol=1e-9):
                raise InvariantError(
                    f"flow control: a turn at priority {priority} costs {self._turn[priority]}, "
                    f"its tenants' means sum to {turn}"
                )
