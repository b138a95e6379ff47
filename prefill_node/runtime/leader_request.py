"""The leader's one record per request (``LeaderRequest``) and the one map holding them.

A request's record lives in ``RequestTable`` from ``submit`` until its future settles, and
carries everything the leader knows about it: the options (so its top-k, KV destination
and deadline), the future, the admission verdict (cached tokens, when), the stages'
manifests, the output held while a KV hand-off is pending, each stage's hand-off outcome
and, for the in-process engine's ``prefill``, the last position's logits. Whoever removes
the record from the table settles its future, exactly once, so an abort, a deadline, a
failure and a result race harmlessly.

What is not here is the core's own bookkeeping, which has a different lifetime: the
coordinator's queue entry (until admission) and the ``WaveScheduler``'s token position
(until the request's last chunk in flight returns, which for an aborted request is after
its record is gone). Both are keyed by the same id and reached through ``Leader``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from prefill_node import tracing
from prefill_node.engine.types import (
    KVPullDestination,
    KVPushDestination,
    PrefillOptions,
    PrefillResult,
    PrefillTimings,
    StageKVManifest,
)
from prefill_node.errors import InvalidRequestError
from prefill_node.kv_handoff.stage_handoff import HandoffOutcome
from prefill_node.runtime.messages import RequestOutput


@dataclass
class LeaderRequest:
    """One request on the leader; mutable fields change only under ``RequestTable.cond``.

    ``manifests``: the stages' local manifests as the waves reported them. ``output``: set
    when the logits arrived but the answer still waits for the KV hand-off (requests with a
    ``kv_destination``); ``logits_at`` is when, ``outcomes`` each stage's hand-off report.
    ``keep_logits``: keep the last position's logits in ``logits`` (in-process engines).
    """

    request_id: str
    token_ids: tuple[int, ...]
    options: PrefillOptions
    future: Future[PrefillResult]
    t_submit: float
    keep_logits: bool = False
    # admission
    t_admitted: float = 0.0
    admission_s: float = 0.0
    cached_tokens: int = 0
    started: bool = False  # its first chunk is in a wave (``cached_tokens`` is final)
    # what the waves brought back
    manifests: dict[int, StageKVManifest] = field(default_factory=dict)
    output: RequestOutput | None = None
    logits: Any = None
    # requests with a KV hand-off: when the last chunk's forward ended on the last stage
    # (``output``'s arrival less the stage's ``WaveResult.held_s``), when the leader saw
    # it, and each stage's outcome
    t_last_chunk: float = 0.0
    logits_at: float | None = None
    outcomes: dict[int, HandoffOutcome] = field(default_factory=dict)
    deadline_fired: bool = False

    @property
    def top_k(self) -> int:
        """Alternatives the last stage returns (at least the first token)."""
        return max(1, self.options.top_logprobs)

    @property
    def destination(self) -> KVPushDestination | KVPullDestination | None:
        return self.options.kv_destination

    @property
    def pushes(self) -> bool:
        """Its KV is WRITTEN into decode's blocks as it is computed (push), so decode may
        see bytes before the answer; pull: decode reads only after it."""
        return isinstance(self.options.kv_destination, KVPushDestination)

    @property
    def ships(self) -> bool:
        """Its answer waits for every stage's KV hand-off."""
        return self.options.kv_destination is not None

    @property
    def deadline_s(self) -> float | None:
        return self.options.deadline_s

    def result(
        self, out: RequestOutput, now: float, manifests: tuple[StageKVManifest, ...]
    ) -> PrefillResult:
        """The answer: the last position's top logprobs, counts, timings, ``manifests``."""
        timings = PrefillTimings(
            queue_s=self.t_admitted - self.t_submit,
            admission_s=self.admission_s,
            compute_s=now - self.t_admitted,
            total_s=now - self.t_submit,
            handoff_s=now - self.t_last_chunk if self.t_last_chunk else 0.0,
        )
        return PrefillResult(
            request_id=self.request_id,
            first_token_id=out.top_logprobs[0][0],
            top_logprobs=tuple(out.top_logprobs[: self.options.top_logprobs]),
            prompt_tokens=len(self.token_ids),
            cached_tokens=self.cached_tokens,
            computed_tokens=len(self.token_ids) - self.cached_tokens,
            timings=timings,
            stage_manifests=manifests,
        )


class RequestTable:
    """The leader's requests by id; thread-safe. ``cond`` guards every record's mutable
    fields and is notified when a record that ships KV or has a deadline comes or goes,
    and when a handing-off record's logits arrive (the hand-off and deadline threads wait on
    it). Once ``close``d (the engine died or shut down) it refuses new records for good."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self._records: dict[str, LeaderRequest] = {}
        self._closed = False
        self.logits_seen = 0  # handing-off requests whose logits arrived so far

    def add(self, req: LeaderRequest) -> bool:
        """Insert ``req``; False once closed. InvalidRequestError if its id is in flight."""
        with self.cond:
            if self._closed:
                return False
            if req.request_id in self._records:
                raise InvalidRequestError(
                    f"request id {req.request_id!r} is already in flight; use a new id"
                )
            self._records[req.request_id] = req
            if req.ships or req.deadline_s is not None:  # the threads that watch these
                self.cond.notify_all()
            return True

    def pop(self, request_id: str) -> LeaderRequest | None:
        """Remove the record: the caller now settles its future."""
        with self.cond:
            req = self._records.pop(request_id, None)
            if req is not None and (req.ships or req.deadline_s is not None):
                self.cond.notify_all()
            return req

    def close(self) -> list[LeaderRequest]:
        """Refuse new records from now on; every record still held, removed."""
        with self.cond:
            self._closed = True
            records = list(self._records.values())
            self._records.clear()
            self.cond.notify_all()
            return records

    # -- under ``cond`` ------------------------------------------------------------------
    def get(self, request_id: str) -> LeaderRequest | None:
        return self._records.get(request_id)

    def remove(self, request_id: str) -> LeaderRequest | None:
        """``pop`` for a caller that holds ``cond`` already."""
        return self._records.pop(request_id, None)

    def __iter__(self) -> Iterator[LeaderRequest]:
        return iter(list(self._records.values()))


def trace_request(req: LeaderRequest, now: float, error: BaseException | str | None = None) -> None:
    """Record the request's time on the leader as spans under its server span (tracing on,
    ``req.options.traceparent`` set): queue wait, the admission round that admitted it, its
    compute (first chunk to last logits; the stages' chunk spans carry each wave) and, for a
    shipped request, the KV hand-off."""
    parent = req.options.traceparent
    attributes = {tracing.REQUEST_ID: req.request_id}
    admitted = req.t_admitted or now
    round_start = max(req.t_submit, admitted - req.admission_s)
    tracing.record("wavepp.leader.queue", parent, tracing.wall_ns(req.t_submit),
                   tracing.wall_ns(round_start), attributes)  # fmt: skip
    if req.t_admitted:
        tracing.record("wavepp.leader.admission", parent, tracing.wall_ns(round_start),
                       tracing.wall_ns(admitted),
                       {**attributes, tracing.CACHED_TOKENS: req.cached_tokens,
                        tracing.PROMPT_TOKENS: len(req.token_ids)})  # fmt: skip
    computed = req.t_last_chunk or now
    span = tracing.start_span("wavepp.leader.compute", parent, attributes,
                              start_ns=tracing.wall_ns(admitted))  # fmt: skip
    tracing.end(span, tracing.wall_ns(computed), None if req.ships else error)
    if req.ships:
        mode = "push" if req.pushes else "pull"
        span = tracing.start_span("wavepp.leader.kv_handoff", parent,
                                  {**attributes, "wavepp.kv_mode": mode},
                                  start_ns=tracing.wall_ns(computed))  # fmt: skip
        tracing.end(span, tracing.wall_ns(now), error)


def settle_future(fut: Future[Any], result: Any = None, error: BaseException | None = None) -> None:
    """Resolve ``fut`` once; later attempts (a race with abort or failure) are ignored."""
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except Exception:  # InvalidStateError: already settled
        pass
