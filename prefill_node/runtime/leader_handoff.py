"""LeaderHandoffs: the leader's thread that settles KV hand-offs and enforces deadlines.

Where stage results travel (decision): on the ROUNDS plane. A stage's WRITE can end while no
wave is flowing (an idle pipeline sends none), so piggy-backing on wave results could leave a
push unanswered; instead, while any hand-off is pending, this thread runs a KV_COLLECT round
every ``poll_interval_s`` and every stage replies with the ``StageHandoff`` outcomes its
shipping thread recorded since the previous round (every ``slow_poll_s`` until some pending
request's logits are back - its early stages may have shipped already, but nothing can be
answered before the logits, and each round takes the stages' time from their waves - then
every ``poll_interval_s``). A request resolves when its logits came
back AND (push) every stage confirmed its WRITE / (pull) every stage published its lease.
Any stage failing, or the outcome not arriving within ``wait_limit_s`` after the logits,
fails the request and sends KV_CANCEL to every stage (WRITEs aborted, leases revoked, pins
dropped). A request that failed before its logits came back is cancelled once more when
they do (``late_output``): its later stages may have shipped meanwhile. Outcomes of requests
no longer pending (late, duplicate, aborted) are ignored.

Deadlines: ``watch(request_id, deadline_s)``; when the monotonic deadline passes first,
``on_deadline`` runs on a thread of its own (the engine aborts the request with
DeadlineExceededError), so a KV_COLLECT round stuck on a hung stage never delays it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prefill_node.engine.types import StageKVManifest
from prefill_node.errors import InvalidKVDestinationError, KVHandoffError, WaveppError
from prefill_node.kv_shipping.stage_shipping import StageHandoff

log = logging.getLogger(__name__)

Settle = Callable[[str, tuple[StageKVManifest, ...] | None, WaveppError | None], None]


@dataclass
class _Pending:
    outcomes: dict[int, StageHandoff] = field(default_factory=dict)
    logits_at: float | None = None  # when the last stage's output reached the leader


class LeaderHandoffs:
    """Pending hand-offs and deadlines of one pipeline; thread-safe.

    ``collect``: run a KV_COLLECT round, one tuple of outcomes per stage. ``cancel``: send a
    KV_CANCEL round (fire and forget). ``settle(rid, manifests, error)``: resolve the
    request (exactly one of manifests / error). Callbacks run on this object's thread,
    without its lock.
    """

    def __init__(
        self,
        num_stages: int,
        wait_limit_s: float,
        collect: Callable[[], Sequence[Sequence[StageHandoff]]],
        cancel: Callable[[tuple[str, ...]], None],
        settle: Settle,
        on_deadline: Callable[[str], None],
        poll_interval_s: float = 0.003,
        slow_poll_s: float = 0.25,
    ) -> None:
        self._num_stages = num_stages
        self._wait_limit_s = wait_limit_s
        self._collect = collect
        self._cancel = cancel
        self._settle = settle
        self._on_deadline = on_deadline
        self._poll_interval_s = poll_interval_s
        self._slow_poll_s = slow_poll_s
        self._cond = threading.Condition()
        self._pending: dict[str, _Pending] = {}
        self._deadlines: dict[str, float] = {}
        self._failed_early: OrderedDict[str, None] = OrderedDict()  # capped, oldest dropped
        self._stop = False
        self._logits_seen = 0  # logits_ready calls so far (wakes the slow wait)
        self._thread = threading.Thread(target=self._run, name="leader-kv", daemon=True)
        # deadlines on their own thread: a KV_COLLECT round blocks for as long as a stage
        # does not answer (a hung stage: until the heartbeat declares it dead)
        self._timer = threading.Thread(target=self._run_deadlines, name="leader-deadlines",
                                       daemon=True)  # fmt: skip

    def start(self) -> None:
        self._thread.start()
        self._timer.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for thread in (self._thread, self._timer):
            if thread.is_alive():
                thread.join(timeout=5.0)

    # -- engine side -----------------------------------------------------------------------
    def expect(self, request_id: str) -> None:
        """The request ships its KV: hold its answer until every stage reported."""
        with self._cond:
            self._pending[request_id] = _Pending()
            self._cond.notify_all()

    def logits_ready(self, request_id: str) -> None:
        """The request's output arrived; its stages' outcomes are due within the limit."""
        with self._cond:
            p = self._pending.get(request_id)
            if p is not None:
                p.logits_at = time.monotonic()
                self._logits_seen += 1
            self._cond.notify_all()

    def watch(self, request_id: str, deadline_s: float) -> None:
        with self._cond:
            self._deadlines[request_id] = deadline_s
            self._cond.notify_all()

    def forget(self, request_id: str, cancel: bool = True) -> None:
        """The request ended otherwise (aborted, failed): stop tracking, cancel on stages."""
        with self._cond:
            shipping = self._pending.pop(request_id, None) is not None
            self._deadlines.pop(request_id, None)
        if shipping and cancel:
            self._cancel((request_id,))

    def late_output(self, request_id: str) -> None:
        """Logits arrived for a request no longer tracked: if its hand-off failed early,
        cancel again on every stage (a later stage may have published a lease since)."""
        with self._cond:
            early = request_id in self._failed_early
            self._failed_early.pop(request_id, None)
        if early:
            self._cancel((request_id,))

    def clear(self) -> None:
        with self._cond:
            self._pending.clear()
            self._deadlines.clear()

    # -- the thread --------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                if self._stop:
                    return
                if not self._pending:
                    self._cond.wait(timeout=self._next_wait())
                busy = bool(self._pending)
                due = any(p.logits_at is not None for p in self._pending.values())
                seen = self._logits_seen
            try:
                if busy:
                    self._ingest(self._collect())
                self._resolve()
            except Exception:  # a dead pipeline fails its requests elsewhere; keep ticking
                log.debug("KV hand-off poll failed", exc_info=True)
                time.sleep(0.05)
            if busy:  # a request's logits coming back ends the slow wait at once
                with self._cond:
                    wait = (
                        self._poll_interval_s if due else min(self._slow_poll_s, self._next_wait())
                    )
                    self._cond.wait_for(lambda s=seen: self._stop or self._logits_seen != s, wait)

    def _next_wait(self) -> float:
        if not self._pending:
            return 1.0  # nothing to collect; expect notifies at once
        return self._slow_poll_s

    def _run_deadlines(self) -> None:
        while True:
            with self._cond:
                if self._stop:
                    return
                soonest = min(self._deadlines.values(), default=None)
                wait = 1.0 if soonest is None else soonest - time.monotonic()
                if wait > 0:  # watch / forget notify: the soonest deadline may change
                    self._cond.wait(timeout=min(wait, 1.0))
                    continue
            try:
                self._expire()
            except Exception:  # noqa: BLE001 - keep enforcing the others' deadlines
                log.warning("deadline expiry failed", exc_info=True)

    def _ingest(self, replies: Sequence[Sequence[StageHandoff]]) -> None:
        with self._cond:
            for reply in replies:
                for h in reply or ():
                    p = self._pending.get(h.request_id)
                    if p is not None and h.stage not in p.outcomes:
                        p.outcomes[h.stage] = h

    def _resolve(self) -> None:
        done: list[tuple[str, tuple[StageKVManifest, ...] | None, WaveppError | None]] = []
        now = time.monotonic()
        with self._cond:
            for rid, p in list(self._pending.items()):
                failed = [h for h in p.outcomes.values() if not h.ok]
                if failed:
                    done.append((rid, None, handoff_error(rid, failed[0])))
                elif p.logits_at is not None and len(p.outcomes) == self._num_stages:
                    ordered = tuple(p.outcomes[s].manifest for s in range(self._num_stages))
                    done.append((rid, ordered, None))  # type: ignore[arg-type]
                elif p.logits_at is not None and now - p.logits_at > self._wait_limit_s:
                    missing = sorted(set(range(self._num_stages)) - set(p.outcomes))
                    err = KVHandoffError(
                        f"KV hand-off of {rid} timed out: stages {missing} did not report "
                        f"within {self._wait_limit_s:.1f}s"
                    )
                    done.append((rid, None, err))
                else:
                    continue
                if p.logits_at is None:
                    self._failed_early[rid] = None
                    while len(self._failed_early) > 4096:
                        self._failed_early.popitem(last=False)
                del self._pending[rid]
                self._deadlines.pop(rid, None)
        for rid, manifests, error in done:
            if error is not None:
                self._cancel((rid,))
            self._settle(rid, manifests, error)

    def _expire(self) -> None:
        now = time.monotonic()
        with self._cond:
            expired = [rid for rid, d in self._deadlines.items() if now >= d]
            for rid in expired:
                del self._deadlines[rid]
        for rid in expired:
            self._on_deadline(rid)


def handoff_error(request_id: str, outcome: StageHandoff) -> WaveppError:
    """The typed error of a failed stage: a rejected destination is the caller's fault."""
    if outcome.invalid_destination:
        return InvalidKVDestinationError(
            f"KV destination of {request_id} rejected by stage {outcome.stage}: {outcome.error}"
        )
    return KVHandoffError(
        f"KV hand-off of {request_id} failed on stage {outcome.stage}: {outcome.error}"
    )
