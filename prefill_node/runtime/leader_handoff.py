"""LeaderHandoffs: the leader's threads that settle KV hand-offs and enforce deadlines.

They keep no requests of their own: both act on the records of the engine's
``RequestTable`` (leader_request.py), where a request's hand-off outcomes, logits time and
deadline live.

Where stage results travel (decision): each stage's hand-off thread sends its
``HandoffOutcome`` outcomes to the leader as they happen, on the REPORTS plane (planes.py; stage
0's are handed over in-process). A stage's WRITE can end while no wave is flowing (an idle
pipeline sends none), so piggy-backing on wave results could leave a push unanswered, and
polling the stages with rounds cost every stage a round trip every few milliseconds while
a hand-off was pending (the design before 2026-12-07). Here one receiver thread per stage
s > 0 (``receive``) and stage 0's hand-off thread call ``deliver``; the hand-off thread
wakes when an outcome or a request's logits arrive, or when a wait limit runs out. A
request resolves when its logits came
back AND (push) every stage confirmed its WRITE / (pull) every stage published its lease.
Any stage failing, or the outcome not arriving within ``wait_limit_s`` after the logits,
fails the request and sends KV_CANCEL to every stage (WRITEs aborted, leases revoked, pins
dropped). A request that failed before its logits came back is cancelled once more when
they do (``late_output``): its later stages may have shipped meanwhile. Outcomes of requests
no longer in the table (late, duplicate, aborted) are ignored.

Deadlines (``LeaderRequest.deadline_s``): when one passes first, ``on_deadline`` runs on a
thread of its own (the engine aborts the request with DeadlineExceededError), once per
record, so a slow settle or cancel never delays it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from prefill_node.engine.types import StageKVManifest
from prefill_node.errors import InvalidKVDestinationError, KVHandoffError, WaveppError
from prefill_node.kv_handoff.stage_handoff import HandoffOutcome
from prefill_node.runtime.leader_request import LeaderRequest, RequestTable

log = logging.getLogger(__name__)

Settle = Callable[[LeaderRequest, tuple[StageKVManifest, ...] | None, WaveppError | None], None]


class LeaderHandoffs:
    """The hand-off and deadline threads of one pipeline, over its ``RequestTable``.

    ``deliver``: outcomes reported by a stage (any thread). ``receive(stage)``: the next
    batch a stage s > 0 reported, None once its stream ended (one thread each, started
    here; None: the caller delivers everything). ``cancel``: send a KV_CANCEL round (fire
    and forget). ``settle(request, manifests, error)``: resolve a
    request this object took out of the table (exactly one of manifests / error).
    ``on_deadline(request_id)``: the request's deadline passed. Callbacks run on this
    object's threads, without the table's lock.
    """

    def __init__(
        self,
        num_stages: int,
        table: RequestTable,
        wait_limit_s: float,
        cancel: Callable[[tuple[str, ...]], None],
        settle: Settle,
        on_deadline: Callable[[str], None],
        receive: Callable[[int], tuple[HandoffOutcome, ...] | None] | None = None,
    ) -> None:
        self._num_stages = num_stages
        self._table = table
        self._cond = table.cond
        self._wait_limit_s = wait_limit_s
        self._cancel = cancel
        self._settle = settle
        self._on_deadline = on_deadline
        self._failed_early: OrderedDict[str, None] = OrderedDict()  # capped, oldest dropped
        self._delivered = 0  # outcomes delivered so far (the hand-off thread's wake-up)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="leader-kv", daemon=True)
        # deadlines on their own thread: settling or cancelling a hand-off may take a while
        self._timer = threading.Thread(target=self._run_deadlines, name="leader-deadlines",
                                       daemon=True)  # fmt: skip
        self._receivers = [
            threading.Thread(
                target=self._receive, args=(receive, s), name=f"leader-kv-{s}", daemon=True
            )  # fmt: skip
            for s in range(1, num_stages if receive is not None else 1)
        ]

    def start(self) -> None:
        self._thread.start()
        self._timer.start()
        for thread in self._receivers:
            thread.start()

    def stop(self) -> None:
        """Stop the hand-off and deadline threads (a receiver ends with its stage's stream)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for thread in (self._thread, self._timer):
            if thread.is_alive():
                thread.join(timeout=5.0)

    def join_receivers(self, timeout_s: float) -> None:
        """Wait for every stage's report stream to end (before the planes are torn down: a
        receiver must not be waiting on a group that is being destroyed)."""
        deadline = time.monotonic() + timeout_s
        for thread in self._receivers:
            if thread.is_alive():
                thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def deliver(self, outcomes: Iterable[HandoffOutcome]) -> None:
        """Outcomes a stage reported: each request's first word per stage counts; outcomes
        of requests no longer in the table (late, duplicate, aborted) are ignored."""
        with self._cond:
            for h in outcomes:
                r = self._table.get(h.request_id)
                if r is not None and r.ships and h.stage not in r.outcomes:
                    r.outcomes[h.stage] = h
            self._delivered += 1
            self._cond.notify_all()

    def _receive(self, receive: Callable[[int], tuple[HandoffOutcome, ...] | None], stage: int):
        try:
            while (batch := receive(stage)) is not None:
                self.deliver(batch)
        except Exception:  # a dead pipeline fails its requests elsewhere
            log.debug("stage %d's hand-off reports ended", stage, exc_info=True)

    def late_output(self, request_id: str) -> None:
        """Logits arrived for a request no longer in the table: if its hand-off failed
        early, cancel again on every stage (a later stage may have published a lease since)."""
        with self._cond:
            early = request_id in self._failed_early
            self._failed_early.pop(request_id, None)
        if early:
            self._cancel((request_id,))

    # -- the hand-off thread ---------------------------------------------------------------
    def _handing_off(self) -> list[LeaderRequest]:
        """Records whose answer waits for a hand-off (under the lock)."""
        return [r for r in self._table if r.ships]

    def _run(self) -> None:
        seen = (-1, -1)
        while True:
            with self._cond:
                while not self._stop and (self._delivered, self._table.logits_seen) == seen:
                    wait = self._until_next_limit()
                    if wait is not None and wait <= 0:
                        break
                    self._cond.wait(timeout=1.0 if wait is None else min(wait, 1.0))
                if self._stop:
                    return
                seen = (self._delivered, self._table.logits_seen)
            try:
                self._resolve()
            except Exception:  # a dead pipeline fails its requests elsewhere; keep going
                log.debug("KV hand-off resolution failed", exc_info=True)
                time.sleep(0.05)

    def _until_next_limit(self) -> float | None:
        """Seconds until the first handing-off record whose logits are back runs out of its
        wait limit (None: none waits; under the lock)."""
        now = time.monotonic()
        limits = [r.logits_at + self._wait_limit_s - now for r in self._handing_off()
                  if r.logits_at is not None]  # fmt: skip
        return min(limits, default=None)

    def _resolve(self) -> None:
        done: list[tuple[LeaderRequest, tuple[StageKVManifest, ...] | None, WaveppError | None]]
        done = []
        now = time.monotonic()
        with self._cond:
            for r in self._handing_off():
                rid = r.request_id
                failed = [h for h in r.outcomes.values() if not h.ok]
                if failed:
                    done.append((r, None, handoff_error(rid, failed[0], r.pushes)))
                elif r.logits_at is not None and len(r.outcomes) == self._num_stages:
                    ordered = tuple(r.outcomes[s].manifest for s in range(self._num_stages))
                    done.append((r, ordered, None))  # type: ignore[arg-type]
                elif r.logits_at is not None and now - r.logits_at >= self._wait_limit_s:
                    missing = sorted(set(range(self._num_stages)) - set(r.outcomes))
                    err = KVHandoffError(
                        f"KV hand-off of {rid} timed out: stages {missing} did not report "
                        f"within {self._wait_limit_s:.1f}s",
                        decode_saw_bytes=r.pushes,
                    )
                    done.append((r, None, err))
                else:
                    continue
                if r.logits_at is None:
                    self._failed_early[rid] = None
                    while len(self._failed_early) > 4096:
                        self._failed_early.popitem(last=False)
                self._table.remove(rid)
        for r, manifests, error in done:
            if error is not None:
                self._cancel((r.request_id,))
            self._settle(r, manifests, error)

    # -- the deadline thread -----------------------------------------------------------------
    def _run_deadlines(self) -> None:
        while True:
            with self._cond:
                if self._stop:
                    return
                now = time.monotonic()
                live = [
                    (r.deadline_s, r.request_id)
                    for r in self._table
                    if r.deadline_s is not None and not r.deadline_fired
                ]
                expired = [rid for d, rid in live if now >= d]
                if not expired:  # a new or removed record notifies: the soonest may change
                    soonest = min((d for d, _ in live), default=now + 1.0)
                    self._cond.wait(timeout=min(soonest - now, 1.0))
                    continue
                for rid in expired:
                    self._table.get(rid).deadline_fired = True  # type: ignore[union-attr]
            for rid in expired:
                try:
                    self._on_deadline(rid)
                except Exception:  # noqa: BLE001 - keep enforcing the others' deadlines
                    log.warning("deadline expiry failed", exc_info=True)


def handoff_error(request_id: str, outcome: HandoffOutcome, pushed: bool) -> WaveppError:
    """The typed error of a failed stage: a rejected destination is the caller's fault.
    ``pushed``: the request's KV went by WRITEs, which may have reached decode."""
    if outcome.invalid_destination:
        return InvalidKVDestinationError(
            f"KV destination of {request_id} rejected by stage {outcome.stage}: {outcome.error}"
        )
    return KVHandoffError(
        f"KV hand-off of {request_id} failed on stage {outcome.stage}: {outcome.error}",
        decode_saw_bytes=pushed,
    )
