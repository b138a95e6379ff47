"""The leader's Engine: the multi-process pipeline behind submit / abort / load / health."""

from __future__ import annotations

import contextlib
import datetime
import logging
import pickle
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from prefill_node.core.hashing import model_cache_id
from prefill_node.core.kv_event_aggregator import StageEvents
from prefill_node.engine.types import (
    CacheIdentity,
    EngineHealth,
    EngineLoad,
    PrefillOptions,
    PrefillResult,
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
from prefill_node.runtime.dist_env import DistEnv
from prefill_node.runtime.heartbeat import Heartbeat
from prefill_node.runtime.kv_event_feed import KVEventFeed, KVEventSink
from prefill_node.runtime.launcher import LocalLauncher
from prefill_node.runtime.leader import Leader, LeaderConfig
from prefill_node.runtime.leader_core import AdmissionVerdict, LeaderCore
from prefill_node.runtime.leader_handoff import LeaderHandoffs
from prefill_node.runtime.leader_request import LeaderRequest, settle_future
from prefill_node.runtime.messages import (
    RoundKind,
    RoundMessage,
    StageStats,
    WaveResult,
)
from prefill_node.runtime.planes import Planes
from prefill_node.runtime.spec import PipelineSpec
from prefill_node.runtime.stage_compute import build_stage_compute
from prefill_node.runtime.stage_main import KV_SHIPPING_KEY, SPEC_KEY, ready_key
from prefill_node.runtime.stage_worker import StageWorker

if TYPE_CHECKING:
    from prefill_node.kv_shipping.shipper import KVShippingConfig
    from prefill_node.runtime.stage_compute import PipelineStageCompute

log = logging.getLogger(__name__)


class PipelineEngine:
    """Stage 0 of a P-stage pipeline and the Engine API on top of it.

    Lifecycle: ``PipelineEngine.start`` publishes the spec in the rendezvous store it hosts,
    (optionally) launches stages 1..P-1 locally, waits until every stage has loaded its slice,
    joins the planes and starts the threads. ``shutdown`` drains the ring and stops every
    stage. A dead stage (process exit, heartbeat silence, or a plane error) turns the engine not
    ready and not live (only a restart recovers it) and fails every unfinished request with
    UnavailableError at once; the engine never hangs a caller. Every method is thread-safe.

    KV hand-off (``kv_shipping`` given): every stage process ships its layers of a request
    with a ``kv_destination`` as soon as the request's last chunk left it, push streamed chunk
    by chunk before that when ``KVShippingConfig.stream`` (stage_shipping.py);
    the answer waits for every stage's outcome (leader_handoff.py). KV events (``kv_events``
    given): every stage drains its pool once per wave, the batches ride the wave to the leader
    and a ``KVEventFeed`` publishes the pipeline-level events to the sink (collector thread).
    Deadlines (``PrefillOptions.deadline_s``): a request still unanswered then is aborted on
    every stage and fails with DeadlineExceededError.
    """

    def __init__(
        self,
        spec: PipelineSpec,
        env: DistEnv,
        launch: bool,
        kv_shipping: KVShippingConfig | None = None,
        kv_events: KVEventSink | None = None,
    ):
        if kv_events is not None and not spec.kv_events:
            spec = replace(spec, kv_events=True)
        self.spec = spec
        self._kv_shipping = kv_shipping
        self._feed = KVEventFeed(spec.num_stages, kv_events) if kv_events is not None else None
        self._handoffs: LeaderHandoffs | None = None
        self._compute: PipelineStageCompute | None = None
        self._env = env
        self._lock = threading.Lock()
        self._requests: dict[str, LeaderRequest] = {}
        self._dead: str | None = None
        self._closed = False
        self._launcher = LocalLauncher(env, self._on_stage_exit) if launch else None
        self._store: dist.TCPStore | None = None
        self._leader: Leader | None = None
        self._worker: StageWorker | None = None
        self._heartbeat: Heartbeat | None = None
        self._last_stats: list[StageStats] = []
        self.config: Any = None

    # -- lifecycle ---------------------------------------------------------------------------
    @classmethod
    def start(
        cls,
        spec: PipelineSpec,
        env: DistEnv,
        launch: bool = True,
        startup_timeout_s: float = 600,
        kv_shipping: KVShippingConfig | None = None,
        kv_events: KVEventSink | None = None,
    ) -> PipelineEngine:
        engine = cls(spec, env, launch, kv_shipping, kv_events)
        try:
            engine._start(startup_timeout_s)
        except BaseException:
            engine._teardown(graceful=False)
            raise
        return engine

    def _start(self, startup_timeout_s: float) -> None:
        torch.set_num_threads(1)
        env = self._env
        self._store = dist.TCPStore(
            env.master_addr,
            env.master_port,
            world_size=env.world_size,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=startup_timeout_s),
        )
        self._store.set(KV_SHIPPING_KEY, pickle.dumps(self._kv_shipping))
        self._store.set(SPEC_KEY, self.spec.to_json())
        if self._launcher is not None:
            self._launcher.start()
        self._compute = compute = build_stage_compute(self.spec, 0, self._kv_shipping)
        self.config = compute.model_config
        self._wait_ready(startup_timeout_s)
        planes = Planes.join_stage(
            0, env.world_size, self._store, compute.model, self.spec.max_wave_tokens
        )
        lockstep = self.spec.policy == "lockstep"
        core = LeaderCore(self.spec, self.config)
        self._leader = Leader(
            LeaderConfig(self.spec.scheduling_policy.kind, env.world_size, self.spec.tick_s),
            planes,
            core,
            answer_local=lambda m: self._worker.answer(m),  # type: ignore[union-attr]
            on_result=self._on_result,
            on_verdicts=self._on_verdicts,
            on_dead=self._on_dead,
        )
        self._worker = StageWorker(
            0,
            env.world_size,
            planes,
            compute,
            lockstep=lockstep,
            wave_source=self._leader.next_wave,
            result_sink=self._leader.handle_result,
            on_error=self._on_dead,
        )
        self._heartbeat = Heartbeat(
            env, self._on_dead, self.spec.heartbeat_s, self.spec.dead_after_s
        )
        wait_limit = self._kv_shipping.wait_limit_s + 2.0 if self._kv_shipping else 60.0
        self._handoffs = LeaderHandoffs(
            env.world_size,
            wait_limit,
            collect=lambda: self._control(RoundKind.KV_COLLECT, timeout_s=10.0),
            cancel=self._cancel_shipping,
            settle=self._settle_handoff,
            on_deadline=self._expire,
        )
        self._heartbeat.start()
        self._leader.start()
        self._worker.start()
        self._handoffs.start()

    def _wait_ready(self, timeout_s: float) -> None:
        store = self._store
        if store is None:
            raise InvariantError("wait for readiness before the store exists")
        deadline = time.monotonic() + timeout_s
        keys = [ready_key(r) for r in range(1, self._env.world_size)]
        while keys:
            if self._dead is not None:
                raise UnavailableError(f"pipeline failed to start: {self._dead}")
            if time.monotonic() > deadline:
                raise UnavailableError(f"stages not ready after {timeout_s:.0f}s: {keys}")
            keys = [k for k in keys if not store.check([k])]
            time.sleep(0.05)

    def shutdown(self) -> None:
        """Stop every stage: unfinished requests fail with UnavailableError. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._fail_all(UnavailableError("the pipeline is shutting down"))
        self._teardown(graceful=self._dead is None)

    def _teardown(self, graceful: bool) -> None:
        """Drain and stop the threads and the stages; the heartbeat stops last so that the
        stages never mistake a slow, orderly shutdown for a lost leader."""
        t0 = time.monotonic()
        if self._handoffs is not None:
            self._handoffs.stop()
        if self._leader is not None:
            self._leader.stop()
        if graceful and self._worker is not None and self._leader is not None:
            self._worker.join(timeout=10.0)
            self._leader.join(timeout=10.0)
        t1 = time.monotonic()
        if self._launcher is not None:
            self._launcher.stop(grace_s=10.0 if graceful else 0.0)
        t2 = time.monotonic()
        if self._worker is not None:
            self._worker.join(timeout=5.0)
        if self._leader is not None:
            self._leader.join(timeout=5.0)
        if self._compute is not None:
            self._compute.close()  # stage 0's shipper: WRITEs aborted, leases revoked
        if self._heartbeat is not None:
            self._heartbeat.stop()
        Planes.close()
        self._store = None
        log.info(
            "pipeline stopped in %.2fs (drain %.2fs, stages %.2fs)",
            time.monotonic() - t0,
            t1 - t0,
            t2 - t1,
        )

    # -- failure -------------------------------------------------------------------------------
    def _on_stage_exit(self, rank: int, code: int) -> None:
        self._on_dead(f"stage {rank} process exited with code {code}")

    def _on_dead(self, reason: str) -> None:
        if not (self._dead or self._closed or self._launcher is None or "exited" in reason):
            summary = self._launcher.exit_summary()  # a plane error often beats its poll
            reason = f"{summary} ({reason})" if summary else reason
        with self._lock:
            if self._dead is not None or self._closed:
                return
            self._dead = reason
        log.error("pipeline unavailable: %s", reason)
        if self._leader is not None:
            self._leader.mark_dead()
        self._fail_all(UnavailableError(f"pipeline unavailable: {reason}"))

    def _fail_all(self, error: WaveppError) -> None:
        with self._lock:
            pending = list(self._requests.values())
            self._requests.clear()
        if self._handoffs is not None:
            self._handoffs.clear()
        for req in pending:
            settle_future(req.future, error=error)

    # -- Engine API ----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def max_model_len(self) -> int:
        limit = int(self.config.max_position_embeddings)
        return limit if self.spec.max_model_len is None else min(limit, self.spec.max_model_len)

    @property
    def cache_identity(self) -> CacheIdentity:
        return CacheIdentity(
            model_cache_id(self.config.name, self.spec.dtype),
            self.spec.block_size,
            self.config.snapshot_interval_blocks,
        )

    def submit(self, token_ids: Sequence[int], options: PrefillOptions) -> Future[PrefillResult]:
        tokens = tuple(int(t) for t in token_ids)
        self._validate(tokens, options)
        rid = options.request_id or uuid.uuid4().hex
        fut: Future[PrefillResult] = Future()
        fut.set_running_or_notify_cancel()
        if options.deadline_s is not None and time.monotonic() >= options.deadline_s:
            settle_future(
                fut, error=DeadlineExceededError(f"request {rid!r}: deadline already passed")
            )
            return fut
        with self._lock:
            if self._dead is not None or self._closed:
                reason = self._dead or "the pipeline is shut down"
                settle_future(fut, error=UnavailableError(f"pipeline unavailable: {reason}"))
                return fut
            if rid in self._requests:
                raise InvalidRequestError(f"request id {rid!r} is already in flight; use a new id")
            self._requests[rid] = LeaderRequest(rid, tokens, options, fut, time.monotonic())
        handoffs = self._handoffs
        if handoffs is not None:
            if options.kv_destination is not None:
                handoffs.expect(rid)
            if options.deadline_s is not None:
                handoffs.watch(rid, options.deadline_s)
        top_k = max(1, options.top_logprobs)
        self._running_leader().submit(
            rid, tokens, options.cache_salt, top_k, options.kv_destination
        )
        return fut

    def _validate(self, tokens: tuple[int, ...], options: PrefillOptions) -> None:
        if not tokens:
            raise InvalidPromptError("the prompt is empty: send at least one token id")
        if len(tokens) > self.max_model_len:
            raise InvalidPromptError(
                f"the prompt has {len(tokens)} tokens, the model's context is {self.max_model_len}"
            )
        bad = next((t for t in tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidPromptError(
                f"token id {bad} is outside the vocabulary [0, {self.vocab_size})"
            )
        if options.top_logprobs < 0:
            raise InvalidRequestError(f"top_logprobs must be >= 0, got {options.top_logprobs}")
        if options.kv_destination is not None and self._kv_shipping is None:
            raise InvalidKVDestinationError(
                "this pipeline has no KV shipping configured; omit kv_destination or start "
                "it with a KVShippingConfig"
            )
        self._running_leader().check_fits(len(tokens))

    def _running_leader(self) -> Leader:
        if self._leader is None:
            raise UnavailableError("the pipeline has not started")
        return self._leader

    def abort(self, request_id: str) -> bool:
        return self._abort(request_id, RequestAbortedError(f"request {request_id!r} was aborted"))

    def _expire(self, request_id: str) -> None:
        error = DeadlineExceededError(
            f"request {request_id!r} missed its deadline and was aborted; raise the deadline "
            "or send a shorter prompt"
        )
        self._abort(request_id, error)

    def _abort(self, request_id: str, error: WaveppError) -> bool:
        with self._lock:
            req = self._requests.pop(request_id, None)
        if req is None:
            return False
        settle_future(req.future, error=error)
        if self._handoffs is not None:
            self._handoffs.forget(request_id)
        self._running_leader().abort(request_id)
        return True

    def health(self) -> EngineHealth:
        if self._closed:
            return EngineHealth(live=False, ready=False, detail="shut down")
        if self._dead is not None:  # no way back (its process groups are broken): not live,
            # so a supervisor (kubelet's liveness probe) restarts the pipeline
            return EngineHealth(live=False, ready=False, detail=self._dead)
        return EngineHealth(live=True, ready=True)

    def load(self) -> EngineLoad:
        counts = self._running_leader().counts()
        # stale stage figures are better than no answer
        with contextlib.suppress(WaveppError, TimeoutError):
            self._last_stats = self.stage_stats(timeout_s=2.0)
        stages = tuple(
            StageLoad(s.stage, s.pool.free, s.pool.cached, s.pool.in_use, s.pool.total,
                      busy_fraction=s.busy_s / s.uptime_s if s.uptime_s > 0 else 0.0)
            for s in self._last_stats
        )  # fmt: skip
        c = counts
        return EngineLoad(c.queue_depth, c.inflight_requests, c.inflight_tokens, stages)

    # -- debug / stats rounds --------------------------------------------------------------
    def _control(self, kind: RoundKind, payload: Any = None, timeout_s: float = 30.0) -> list[Any]:
        if self._dead is not None or self._closed or self._leader is None:
            raise UnavailableError(f"pipeline unavailable: {self._dead or 'shut down'}")
        return self._leader.control(RoundMessage(kind, payload)).result(timeout=timeout_s)

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

    @property
    def stage_pids(self) -> dict[int, int]:
        return self._launcher.pids if self._launcher is not None else {}

    # -- callbacks from the leader threads -----------------------------------------------------
    def _on_verdicts(self, verdicts: list[AdmissionVerdict], round_s: float) -> None:
        """Admission results: refusals fail at once; admitted requests record their round."""
        now = time.monotonic()
        for out in verdicts:
            with self._lock:
                req = self._requests.get(out.request_id)
                if req is not None and out.error is not None:
                    del self._requests[out.request_id]
            if req is None:
                continue
            if out.error is not None:
                settle_future(req.future, error=out.error)
            else:
                req.t_admitted = now
                req.admission_s = round_s
                req.cached_tokens = out.cached_tokens

    def _on_result(self, result: WaveResult) -> None:
        now = time.monotonic()
        if self._feed is not None and result.kv_events:
            self._feed.publish(StageEvents(s, ev) for s, ev in result.kv_events)
        shipping: list[str] = []
        with self._lock:
            for rid, manifest in result.manifests:
                req = self._requests.get(rid)
                if req is not None:
                    req.manifests[manifest.stage] = manifest
            finished = []
            for o in result.outputs:
                req = self._requests.get(o.request_id)
                if req is not None and req.options.kv_destination is not None:
                    req.output = o  # answered once every stage shipped
                    req.t_logits = now
                    shipping.append(o.request_id)
                else:
                    finished.append((o, self._requests.pop(o.request_id, None)))
            failed = [(m, self._requests.pop(rid, None)) for rid, m in result.failed]
        for rid in shipping:
            if self._handoffs is not None:
                self._handoffs.logits_ready(rid)
        for msg, req in failed:
            if req is not None:
                if self._handoffs is not None:
                    self._handoffs.forget(req.request_id)
                settle_future(req.future, error=StageStateError(msg))
        for out, req in finished:
            if req is None and self._handoffs is not None:  # aborted or failed meanwhile
                self._handoffs.late_output(out.request_id)
            if req is not None:
                manifests = tuple(req.manifests[s] for s in sorted(req.manifests))
                settle_future(req.future, result=req.result(out, now, manifests))

    # -- KV hand-off callbacks (LeaderHandoffs' thread) ----------------------------------------
    def _settle_handoff(
        self,
        request_id: str,
        manifests: tuple[StageKVManifest, ...] | None,
        error: WaveppError | None,
    ) -> None:
        with self._lock:
            req = self._requests.pop(request_id, None)
        if req is None:
            return  # aborted or failed meanwhile
        if error is not None or manifests is None or req.output is None:
            settle_future(
                req.future, error=error or KVHandoffError(f"{request_id}: no KV hand-off")
            )
            leader = self._leader
            if leader is not None:  # stop scheduling its remaining chunks
                leader.abort(request_id)
            return
        settle_future(req.future, result=req.result(req.output, time.monotonic(), manifests))

    def _cancel_shipping(self, request_ids: tuple[str, ...]) -> None:
        """Every stage gives these requests' hand-offs up (fire and forget)."""
        leader = self._leader
        if leader is not None and self._dead is None and not self._closed:
            leader.control(RoundMessage(RoundKind.KV_CANCEL, request_ids))
