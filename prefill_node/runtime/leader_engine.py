"""LeaderEngine: the Engine protocol on stage 0 of a pipeline, whatever carries its planes.

Both engines are this class plus a transport: ``PipelineEngine`` (one process per stage,
torch.distributed planes, a launcher and heartbeats) and ``LocalEngine`` (P stages as threads
of one process, in-process planes). The transport builds stage 0's compute and planes and
calls ``_start_leader``; everything a request meets after ``submit`` is here and shared.

State: one ``LeaderRequest`` per request in one ``RequestTable`` (leader_request.py), from
``submit`` until its future settles; whoever removes it settles the future. The core's
queue entry and token position (``LeaderCore``) are reached only through ``Leader``'s
methods. A transport subclass starts and stops the threads (``_start_leader``,
``_close``, ``_stop_leader``) and reads ``_dead``; it takes no lock of this class or of
the leader and never touches the records or the core.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from kv_transfer.allowlist import AllowList
from kv_transfer.errors import KVTransferError
from prefill_node.core.hashing import model_cache_id
from prefill_node.core.kv_event_aggregator import StageEvents
from prefill_node.engine.types import (
    CacheIdentity,
    EngineHealth,
    EngineLoad,
    PrefillOptions,
    PrefillResult,
    PrefixFetchResult,
    StageKVManifest,
    StageLoad,
)
from prefill_node.errors import (
    DeadlineExceededError,
    InvalidKVDestinationError,
    InvalidPromptError,
    InvalidRequestError,
    InvariantError,
    KVHandoffError,
    RequestAbortedError,
    StageStateError,
    UnavailableError,
    WaveppError,
)
from prefill_node.runtime.kv_event_feed import KVEventFeed, KVEventSink
from prefill_node.runtime.leader import (
    AdmissionVerdict,
    Leader,
    LeaderConfig,
    pipeline_leader_core,
)
from prefill_node.runtime.leader_handoff import LeaderHandoffs
from prefill_node.runtime.leader_request import (
    LeaderRequest,
    RequestTable,
    settle_future,
    trace_request,
)
from prefill_node.runtime.messages import (
    FetchOrder,
    FetchReply,
    LendOrder,
    RequestOptions,
    RoundKind,
    RoundMessage,
    StageStats,
    WaveResult,
)
from prefill_node.runtime.planes import Planes
from prefill_node.runtime.spec import PipelineSpec
from prefill_node.runtime.stage_worker import StageCompute, StageWorker
from prefill_node.wire.kv_handoff import wire_manifest

if TYPE_CHECKING:
    from prefill_node.kv_handoff.config import KVHandoffConfig

log = logging.getLogger(__name__)
_LEASED_KEPT = 4096  # answered pull-mode requests whose leases abort can still revoke


class LeaderEngine:
    """Stage 0 of a P-stage pipeline and the Engine API on top of it. Thread-safe.

    A dead stage (a transport error, or whatever the transport reports through
    ``_on_dead``) turns the engine not ready and not live and fails every unfinished request
    with UnavailableError at once; the engine never hangs a caller.

    KV hand-off (``kv_handoff`` given): every stage ships its layers of a request with a
    ``kv_destination`` as soon as the request's last chunk left it (push streamed chunk by
    chunk before that when ``KVHandoffConfig.stream``, stage_handoff.py); the answer
    waits for every stage's outcome (leader_handoff.py). KV events (``kv_events`` given):
    every stage drains its pool once per wave, the batches ride the wave to the leader and a
    ``KVEventFeed`` publishes the pipeline-level events to the sink (collector thread).
    Deadlines (``PrefillOptions.deadline_s``): a request still unanswered then is aborted on
    every stage and fails with DeadlineExceededError.
    """

    # the most alternatives a request may ask for; None: the whole vocabulary (the reference
    # tests compare full distributions); the gRPC API caps requests at MAX_TOP_LOGPROBS
    max_top_logprobs: int | None = None

    def __init__(
        self,
        spec: PipelineSpec,
        kv_handoff: KVHandoffConfig | None = None,
        kv_events: KVEventSink | None = None,
    ):
        self.spec = spec
        self._kv_handoff = kv_handoff
        self._feed = KVEventFeed(spec.num_stages, kv_events) if kv_events is not None else None
        self._handoffs: LeaderHandoffs | None = None
        self._state_lock = threading.Lock()  # _dead, _closed and _leased
        # answered pull-mode requests, newest last: abort revokes their leases
        self._leased: OrderedDict[str, bool] = OrderedDict()
        self._requests = RequestTable()
        self._dead: str | None = None
        self._closed = False
        self._leader: Leader | None = None
        self._worker: StageWorker | None = None
        self._compute: Any = None  # stage 0's PipelineStageCompute (its KV agent fetches)
        self._last_stats: list[StageStats] = []
        self.model_config: Any = None

    def _start_leader(self, planes: Planes, compute: StageCompute, world_size: int) -> None:
        """Build and start the leader's threads over stage 0's ``planes`` and ``compute``
        (``self.model_config`` must be set): the rounds, stage 0's loop, the
        result collector and the KV hand-off / deadline thread."""
        self._leader = Leader(
            LeaderConfig(
                self.spec.scheduling_policy.kind,
                world_size,
                model_cache_id(self.model_config.name, self.spec.dtype),
                self.spec.tick_s,
            ),
            planes,
            pipeline_leader_core(self.spec),
            answer_local=lambda m: self._worker.answer(m),  # type: ignore[union-attr]
            on_result=self._on_result,
            on_verdicts=self._on_verdicts,
            on_dead=self._on_dead,
            on_started=self._on_started,
        )
        wait_limit = self._kv_handoff.wait_limit_s + 2.0 if self._kv_handoff else 60.0
        self._handoffs = LeaderHandoffs(
            world_size,
            self._requests,
            wait_limit,
            cancel=self._cancel_handoffs,
            settle=self._settle_handoff,
            on_deadline=self._expire,
            receive=planes.reports.recv,
        )
        self._compute = compute
        self._worker = StageWorker(
            0,
            world_size,
            planes,
            compute,
            admission_on_loop=self.spec.scheduling_policy.admission_on_loop,
            wave_source=self._leader.next_wave,
            result_sink=self._leader.handle_result,
            on_error=self._on_dead,
            report_sink=self._handoffs.deliver,
        )
        self._leader.start()
        self._worker.start()
        self._handoffs.start()

    def _stop_leader(self, graceful: bool) -> None:
        """Stop the hand-off thread, then drain the ring: a STOP wave and a STOP round go
        out once the waves in flight are back (``graceful``: wait for them)."""
        if self._handoffs is not None:
            self._handoffs.stop()
        if self._leader is not None:
            self._leader.stop()
        if graceful and self._worker is not None and self._leader is not None:
            self._worker.join(timeout=10.0)
            self._leader.join(timeout=10.0)

    # -- failure -------------------------------------------------------------------------------
    def _dead_reason(self, reason: str) -> str:
        """The transport's fuller account of a failure (e.g. which process exited)."""
        return reason

    def _on_dead(self, reason: str) -> None:
        if not (self._dead or self._closed):
            reason = self._dead_reason(reason)
        with self._state_lock:
            if self._dead is not None or self._closed:
                return
            self._dead = reason
        log.error("pipeline unavailable: %s", reason)
        if self._leader is not None:
            self._leader.mark_dead()
        self._fail_all(UnavailableError(f"pipeline unavailable: {reason}"))

    def _close(self, reason: str) -> bool:
        """Begin a shutdown: unfinished requests fail with UnavailableError(``reason``).
        False when the engine was closed already (``shutdown`` is idempotent)."""
        with self._state_lock:
            if self._closed:
                return False
            self._closed = True
        self._fail_all(UnavailableError(reason))
        return True

    def _fail_all(self, error: WaveppError) -> None:
        """Close the table for good (later submits fail at once) and fail every record."""
        for req in self._requests.close():
            settle_future(req.future, error=error)

    # -- Engine API ----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return int(self.model_config.vocab_size)

    @property
    def max_model_len(self) -> int:
        limit = int(self.model_config.max_position_embeddings)
        return limit if self.spec.max_model_len is None else min(limit, self.spec.max_model_len)

    @property
    def kv_allow(self) -> AllowList | None:
        """Hosts and agents this pipeline's stages exchange KV with (None: no KV agents)."""
        return self._kv_handoff.allow if self._kv_handoff is not None else None

    @property
    def cache_identity(self) -> CacheIdentity:
        return CacheIdentity(
            model_cache_id(self.model_config.name, self.spec.dtype),
            self.spec.block_size,
            self.model_config.snapshot_interval_blocks,
        )

    def submit(self, token_ids: Sequence[int], options: PrefillOptions) -> Future[PrefillResult]:
        """Validate (raising InvalidRequestError / NeverFitsError) and queue the request; the
        future settles with its result or its typed error."""
        return self._submit(token_ids, options)[0]

    def _submit(
        self, token_ids: Sequence[int], options: PrefillOptions, keep_logits: bool = False
    ) -> tuple[Future[PrefillResult], LeaderRequest | None]:
        """``submit``, also returning the request's record (None: settled at once)."""
        tokens = self.validate(token_ids, options)
        rid = options.request_id or uuid.uuid4().hex
        fut: Future[PrefillResult] = Future()
        fut.set_running_or_notify_cancel()
        if options.deadline_s is not None and time.monotonic() >= options.deadline_s:
            settle_future(
                fut, error=DeadlineExceededError(f"request {rid!r}: deadline already passed")
            )
            return fut, None
        req = LeaderRequest(rid, tokens, options, fut, time.monotonic(), keep_logits)
        if self._dead is not None or self._closed or not self._requests.add(req):
            reason = self._dead or "the pipeline is shut down"
            settle_future(fut, error=UnavailableError(f"pipeline unavailable: {reason}"))
            return fut, None
        try:
            self._running_leader().enqueue(
                rid,
                tokens,
                options.cache_salt,
                (RequestOptions(req.top_k, req.destination), options.traceparent),
            )
        except BaseException:
            self._requests.pop(rid)
            raise
        return fut, req

    def validate(self, token_ids: Sequence[int], options: PrefillOptions) -> tuple[int, ...]:
        """The prompt as a tuple of ints; InvalidRequestError / NeverFitsError saying why not."""
        try:
            ids = tuple(operator.index(t) for t in token_ids)
        except TypeError as exc:
            raise InvalidPromptError(f"token ids must be integers: {exc}") from None
        if not ids:
            raise InvalidPromptError("the prompt is empty; send at least one token")
        for pos, tok in enumerate(ids):
            if not 0 <= tok < self.vocab_size:
                raise InvalidPromptError(
                    f"token id {tok} at position {pos} is outside the vocabulary "
                    f"[0, {self.vocab_size})"
                )
        if len(ids) > self.max_model_len:
            raise InvalidPromptError(
                f"the prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len}"
            )
        limit = self.max_top_logprobs or self.vocab_size
        if not 0 <= options.top_logprobs <= limit:
            raise InvalidRequestError(
                f"top_logprobs must be in [0, {limit}], got {options.top_logprobs}"
            )
        if options.kv_destination is not None and self._kv_handoff is None:
            raise InvalidKVDestinationError(
                "this engine has no KV hand-off configured; omit kv_destination or start it "
                "with a KVHandoffConfig"
            )
        self._check_fits(len(ids))
        return ids

    def _check_fits(self, num_tokens: int) -> None:
        """NeverFitsError if a prompt of ``num_tokens`` exceeds some stage's whole cache."""
        self._running_leader().check_fits(num_tokens)

    def _running_leader(self) -> Leader:
        if self._leader is None:
            raise UnavailableError("the pipeline has not started")
        return self._leader

    def abort(self, request_id: str) -> bool:
        """Stop ``request_id``: its future fails with RequestAbortedError at once and every
        stage drops it once none of its chunks is in flight. A pull-mode request already
        answered, whose leases decode may not have used: every stage revokes them now
        instead of at their TTL (a caller whose decode never pulled). False: no such
        request, live or leased."""
        if self._abort(request_id, None):
            return True
        with self._state_lock:
            leased = self._leased.pop(request_id, False)
        if leased:
            self._cancel_handoffs((request_id,))
        return leased

    def _expire(self, request_id: str) -> None:
        error = DeadlineExceededError(
            f"request {request_id!r} missed its deadline and was aborted; raise the deadline "
            "or send a shorter prompt"
        )
        self._abort(request_id, error)

    def _abort(self, request_id: str, error: WaveppError | None) -> bool:
        """Take the record out (this settles it), stop its scheduling and any hand-off."""
        req = self._requests.pop(request_id)
        if req is None:
            return False
        admitted = self._running_leader().abort(request_id)
        if error is None:
            where = "after admission" if admitted else "before it started"
            error = RequestAbortedError(f"request {request_id!r} was aborted {where}")
        settle_future(req.future, error=error)
        if req.ships:  # its hand-off was pending: every stage gives it up
            self._cancel_handoffs((request_id,))
        return True

    def health(self) -> EngineHealth:
        if self._closed:
            return EngineHealth(live=False, ready=False, detail="engine shut down")
        if self._dead is not None:  # no way back (its planes are broken): not live,
            # so a supervisor (kubelet's liveness probe) restarts the pipeline
            return EngineHealth(live=False, ready=False, detail=self._dead)
        return EngineHealth(live=True, ready=True)

    def load(self) -> EngineLoad:
        c = self._running_leader().counts()
        stages = self._stage_loads()
        return EngineLoad(c.queue_depth, c.inflight_requests, c.inflight_tokens, stages)

    def _stage_loads(self) -> tuple[StageLoad, ...]:
        """Every stage's ``StageStats.load()``, from a STATS round (stale figures if it
        times out)."""
        with contextlib.suppress(WaveppError, TimeoutError):
            self._last_stats = self.stage_stats(timeout_s=2.0)
        return tuple(s.load() for s in self._last_stats)

    # -- debug / stats rounds --------------------------------------------------------------
    def _control(self, kind: RoundKind, payload: Any = None, timeout_s: float = 30.0) -> list[Any]:
        if self._dead is not None or self._closed or self._leader is None:
            raise UnavailableError(f"pipeline unavailable: {self._dead or 'shut down'}")
        return self._leader.control(RoundMessage(kind, payload)).result(timeout=timeout_s)

    def lend_prefix(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None,
        lease_ttl_s: float | None = None,
        timeout_s: float = 30.0,
    ) -> tuple[StageKVManifest, ...]:
        """The source side of a prefix fetch: every stage leases the longest run of the
        prompt's full blocks it holds cached (pull leases, as decode's), in one control
        round: nothing waits in the request queue. Empty when a stage holds none of them
        (every lease granted is released then); otherwise one manifest per stage, whose
        ``num_tokens`` may differ: a fetch copies the shortest."""
        tokens = tuple(int(t) for t in token_ids)
        if not 0 < len(tokens) <= self.max_model_len:
            raise InvalidRequestError(
                f"a prefix to lend needs 1 to {self.max_model_len} tokens, got {len(tokens)}"
            )
        if lease_ttl_s is not None and lease_ttl_s <= 0:
            raise InvalidRequestError(f"lease_ttl_s must be positive, got {lease_ttl_s}")
        spec = self._running_leader().request_spec(f"lend-{uuid.uuid4().hex}", tokens, cache_salt)
        replies = self._control(RoundKind.LEND, LendOrder(spec, lease_ttl_s), timeout_s)
        manifests = tuple(sorted((m for m in replies if m is not None), key=lambda m: m.stage))
        if len(manifests) < len(replies):
            if manifests:  # revoke what the other stages leased
                self._control(RoundKind.KV_CANCEL, (spec.request_id,), timeout_s)
            return ()
        return manifests

    def release_sources(self, manifests: Sequence[StageKVManifest]) -> None:
        """Release another pipeline's pull leases (``manifests``) from stage 0's KV agent;
        best effort (an unsent release ends in the lease's expiry)."""
        try:
            wire = [wire_manifest(m, "release", len(manifests)) for m in manifests]
        except KVTransferError:
            return
        self._release(wire)

    def _release(self, wire: Sequence[Any]) -> None:
        """``release_sources`` of manifests already in wire form."""
        if wire and self._compute is not None and self._compute.handoff is not None:
            self._compute.handoff.release_sources(wire)

    def fetch_prefix(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None,
        manifests: Sequence[StageKVManifest],
        timeout_s: float = 60.0,
    ) -> PrefixFetchResult:
        """Copy the prefix ``token_ids`` (whole blocks) from another pipeline, whose stages
        hold it under pull leases (``manifests``: what its ``lend_prefix`` / LeasePrefix
        gave, each holding at least these tokens, same model and ``cache_salt``). Every
        stage READs its layers of the blocks it lacks from the stages there holding them,
        at once, and caches them as if computed; a stage whose copy fails gives its blocks
        back (the request then computes what it lacks). Admission rounds wait while it
        runs; waves go on. The leases there are released at the end, unless the round did
        not answer in ``timeout_s`` (stages may still be reading: the leases then end by
        expiry, never under a READ)."""
        if not manifests:
            raise InvalidRequestError("a prefix fetch needs the source's stage manifests")
        try:
            wire = [wire_manifest(m, "fetch", len(manifests)) for m in manifests]
        except KVTransferError as exc:
            raise InvalidRequestError(f"bad source manifests: {exc}") from exc
        sent = answered = False
        try:
            tokens = tuple(int(t) for t in token_ids)
            size = self.spec.block_size
            if not tokens or len(tokens) % size:
                raise InvalidRequestError(
                    f"a fetched prefix is whole {size}-token blocks, got {len(tokens)} tokens"
                )
            if any(m.num_tokens < len(tokens) for m in wire):
                raise InvalidRequestError(
                    "the source's manifests hold fewer tokens than the prefix"
                )
            leader = self._running_leader()
            spec = leader.request_spec(f"fetch-{uuid.uuid4().hex}", tokens, cache_salt)
            expiry = min(m.lease_expiry_unix_s for m in manifests)
            sent = True
            replies: list[FetchReply] = self._control(
                RoundKind.FETCH, FetchOrder(spec, tuple(wire), expiry), timeout_s
            )
            answered = True
        finally:  # the leases there end now, unless a stage may still be reading them
            if answered or not sent:
                self._release(wire)
        replies.sort(key=operator.attrgetter("stage"))
        return PrefixFetchResult(
            tuple(r.cached_blocks for r in replies),
            sum(r.bytes_read for r in replies),
            max(r.read_s for r in replies),
            tuple(f"stage {r.stage}: {r.error}" for r in replies if r.error),
            tuple(r.skipped for r in replies),
        )

    def stage_stats(self, timeout_s: float = 30.0) -> list[StageStats]:
        """Busy time, wave count and cache occupancy of every stage."""
        return list(self._control(RoundKind.STATS, timeout_s=timeout_s))

    def debug_check_integrity(self) -> None:
        """Run check_integrity() on every stage; InvariantError names each failing stage."""
        errors = [e for e in self._control(RoundKind.CHECK) if e is not None]
        if errors:
            raise InvariantError("; ".join(errors))

    def debug_dump_kv(self, request_id: str) -> list[Any]:
        """Per stage, the KV captured when ``request_id`` completed (spec.capture_kv only)."""
        return self._control(RoundKind.DUMP_KV, request_id)

    # -- callbacks from the leader threads -----------------------------------------------------
    def _on_verdicts(self, verdicts: list[AdmissionVerdict], round_s: float) -> None:
        """Admission results: refusals fail at once; admitted requests record their round."""
        now = time.monotonic()
        refused = []
        with self._requests.cond:
            for out in verdicts:
                if out.error is not None:
                    refused.append((self._requests.remove(out.request_id), out.error))
                elif (req := self._requests.get(out.request_id)) is not None:
                    req.t_admitted = now
                    req.admission_s = round_s
                    if not req.started:  # else its first chunk said where it starts
                        req.cached_tokens = out.cached_tokens
        for req, error in refused:
            if req is not None:
                settle_future(req.future, error=error)

    def _on_started(self, starts: list[tuple[str, int]]) -> None:
        """Requests whose first chunk went into a wave, with where it starts: the tokens they
        reuse (their admission's figure, unless a promised prefix fell back to the lease)."""
        with self._requests.cond:
            for rid, start in starts:
                if (req := self._requests.get(rid)) is not None:
                    req.cached_tokens, req.started = start, True

    def _on_result(self, result: WaveResult) -> None:
        now = time.monotonic()
        if self._feed is not None and result.kv_events:
            self._feed.publish(StageEvents(s, ev) for s, ev in result.kv_events)
        table = self._requests
        with table.cond:
            for rid, manifest in result.manifests:
                req = table.get(rid)
                if req is not None:
                    req.manifests[manifest.stage] = manifest
            finished = []
            for o in result.outputs:
                req = table.get(o.request_id)
                if req is not None and req.keep_logits:
                    req.logits = o.logits
                if req is not None and req.ships:
                    req.output = o  # answered once every stage shipped
                    req.t_last_chunk = now - result.held_s  # the last chunk's end there
                    req.logits_at = now
                    table.logits_seen += 1
                    table.cond.notify_all()
                else:
                    finished.append((o, table.remove(o.request_id)))
            failed = [(m, table.remove(rid)) for rid, m in result.failed]
        for msg, req in failed:
            if req is not None:
                if req.ships:
                    self._cancel_handoffs((req.request_id,))
                if req.options.traceparent:
                    trace_request(req, now, msg)
                settle_future(req.future, error=StageStateError(msg))
        for out, req in finished:
            if req is None and self._handoffs is not None:  # aborted or failed meanwhile
                self._handoffs.late_output(out.request_id)
            if req is not None:
                manifests = tuple(req.manifests[s] for s in sorted(req.manifests))
                if req.options.traceparent:
                    trace_request(req, now)
                settle_future(req.future, result=req.result(out, now, manifests))

    # -- KV hand-off callbacks (LeaderHandoffs' thread) ----------------------------------------
    def _settle_handoff(
        self,
        req: LeaderRequest,
        manifests: tuple[StageKVManifest, ...] | None,
        error: WaveppError | None,
    ) -> None:
        """The hand-off thread took ``req`` out of the table: answer it."""
        if error is not None or manifests is None or req.output is None:
            error = error or KVHandoffError(
                f"{req.request_id}: no KV hand-off", decode_saw_bytes=req.pushes
            )
            if req.options.traceparent:
                trace_request(req, time.monotonic(), error)
            settle_future(req.future, error=error)
            leader = self._leader
            if leader is not None:  # stop scheduling its remaining chunks
                leader.abort(req.request_id)
            return
        if any(m.lease_id for m in manifests):  # pull mode: abort may still revoke them
            with self._state_lock:
                self._leased[req.request_id] = True
                while len(self._leased) > _LEASED_KEPT:
                    self._leased.popitem(last=False)
        now = time.monotonic()
        if req.options.traceparent:
            trace_request(req, now)
        settle_future(req.future, result=req.result(req.output, now, manifests))

    def _cancel_handoffs(self, request_ids: tuple[str, ...]) -> None:
        """Every stage gives these requests' hand-offs up (fire and forget)."""
        leader = self._leader
        if leader is not None and self._dead is None and not self._closed:
            leader.control(RoundMessage(RoundKind.KV_CANCEL, request_ids))
