"""The leader's scheduling threads: admission rounds, wave feeding, result collection (stage 0)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from prefill_node.core.admission_messages import Admitted, Rejected, RoundResult
from prefill_node.core.coordinator import AdmissionCoordinator, CoordinatorConfig
from prefill_node.core.hashing import ExtraKeys
from prefill_node.core.leader import LeaderCore, LeaderCounts
from prefill_node.core.planner import WavePlanner
from prefill_node.core.policy import PolicyKind
from prefill_node.core.request import RequestSpec
from prefill_node.core.wave_scheduler import WaveScheduler
from prefill_node.errors import NeverFitsError, WaveppError
from prefill_node.runtime.messages import (
    RequestOptions,
    RoundKind,
    RoundMessage,
    WaveChunk,
    WaveHeader,
    WaveResult,
)
from prefill_node.runtime.planes import PlaneClosedError, Planes
from prefill_node.runtime.spec import PipelineSpec

log = logging.getLogger(__name__)

# what a request's chunks carry: its RequestOptions (with the first chunk only) and its
# W3C traceparent ("" untraced; with every chunk)
ChunkOptions = tuple[RequestOptions, str]
_NO_OPTIONS: ChunkOptions = (RequestOptions(), "")  # the core dropped them (aborted)


@dataclass(frozen=True)
class AdmissionVerdict:
    """A request left the admission queue: admitted with ``cached_tokens`` reused on every
    stage, or refused with ``error`` (e.g. NeverFitsError)."""

    request_id: str
    cached_tokens: int = 0
    error: WaveppError | None = None


@dataclass(frozen=True)
class LeaderConfig:
    policy: PolicyKind  # wave: rounds on their own thread; else on stage 0's loop
    world_size: int
    model_id: str  # ``hashing.model_cache_id``: the cache namespace of every prompt
    tick_s: float = 2.0  # idle rounds-plane keep-alive (the plane never times out: 1 h)


def pipeline_leader_core(spec: PipelineSpec) -> LeaderCore[ChunkOptions]:
    """The pipeline's sans-IO leader. Under ``trtllm`` (``Policy.rank0_decides``) the
    coordinator knows stage 0 alone, so a round is rank 0's decision from its own cache,
    and the waves carry each admitted prompt and each cleanup to the stages that follow."""
    policy = spec.scheduling_policy
    rank0 = policy.rank0_decides
    coordinator = AdmissionCoordinator(
        CoordinatorConfig(
            spec.block_size,
            spec.stage_blocks[:1] if rank0 else spec.stage_blocks,
            policy.max_round_requests,
            share_inflight_prefix=policy.share_inflight_prefix,
        )
    )
    planner = WavePlanner(
        policy.planner_config(
            max_wave_tokens=spec.max_wave_tokens,
            min_wave_tokens=spec.min_wave_tokens,
            block_size=spec.block_size,
            max_wave_requests=spec.max_batch,
            wave_overhead_tokens=spec.wave_overhead_tokens,
        )
    )
    return LeaderCore(coordinator, WaveScheduler(policy, planner), follow_waves=rank0)


def _verdicts(result: RoundResult) -> list[AdmissionVerdict]:
    """The requests that left the queue in a round (a Wait stays queued)."""
    verdicts: list[AdmissionVerdict] = []
    for out in result.outcomes:
        if isinstance(out, Admitted):
            verdicts.append(AdmissionVerdict(out.request_id, out.cached_len))
        elif isinstance(out, Rejected):
            verdicts.append(AdmissionVerdict(out.request_id, error=NeverFitsError(out.reason)))
    return verdicts


def wave_header(core: LeaderCore[ChunkOptions]) -> WaveHeader | None:
    """The core's next wave in wire form, or None. A request's ``RequestOptions`` go once,
    with its first chunk (the stages keep them for its later chunks), or the defaults once
    the core dropped them (the request was aborted); its traceparent goes with every chunk."""
    wave = core.next_wave()
    if wave is None:
        return None
    chunks = []
    for c in wave.chunks:
        options, traceparent = core.options(c.request_id) or _NO_OPTIONS
        first = options if core.is_first(c) else None
        chunks.append(
            WaveChunk(c.request_id, c.start, c.length, core.is_last(c), first, traceparent)
        )
    new_requests, forgets = core.take_follow()
    return WaveHeader(wave.wave_id, tuple(chunks), new_requests=new_requests, forgets=forgets)


class Leader:
    """Drives the pipeline from stage 0; the only owner of its ``LeaderCore`` and its lock.

    Transport-agnostic: ``planes`` are torch.distributed groups (``PipelineEngine``) or
    in-process queues (``LocalEngine``, local_planes.py); both engines run this class.

    Threads: the WAVE thread (policy ``wave``) runs admission rounds whenever the core has
    round work; stage 0's LOOP pulls waves through ``next_wave`` (the core bounds them by
    the policy's ring) and, under ``trtllm`` and ``sync-admission``, runs the rounds itself
    first. Under ``trtllm`` an admission round never leaves stage 0: the core's coordinator
    knows stage 0 alone (``pipeline_leader_core``), so rank 0 decides from its own cache
    and each wave carries the decision to the other stages, which follow it or fail the
    request (``StageAdmission.follow``). The collector receives each wave's result from the
    last stage. All core calls happen under ``self._lock``; no collective is ever made
    while holding it.

    The engine reaches the core only through ``enqueue`` / ``abort`` / ``check_fits`` /
    ``counts``, which take the lock and wake the threads. ``on_result`` / ``on_verdicts`` /
    ``on_started`` (each first chunk's start: the tokens really reused) / ``on_dead`` are the
    engine's callbacks (called without the lock held); ``answer_local``
    is stage 0's own reply to a round. A request's top-k, KV destination and traceparent
    are handed over once, at ``enqueue``; the core keeps them for the wave headers (the
    first two go to the stages once, with the first chunk: ``wave_header``), so this lock
    takes no other lock inside it.
    """

    def __init__(
        self,
        config: LeaderConfig,
        planes: Planes,
        core: LeaderCore[ChunkOptions],
        answer_local: Callable[[RoundMessage], Any],
        on_result: Callable[[WaveResult], None],
        on_verdicts: Callable[[list[AdmissionVerdict], float], None],
        on_dead: Callable[[str], None],
        on_started: Callable[[list[tuple[str, int]]], None],
    ):
        self.config = config
        self._core = core
        self._lock = threading.Condition()
        self._planes = planes
        self._answer_local = answer_local
        self._on_result = on_result
        self._on_verdicts = on_verdicts
        self._on_dead = on_dead
        self._on_started = on_started
        self._controls: queue.SimpleQueue[tuple[RoundMessage, Future[list[Any]]]] = (
            queue.SimpleQueue()
        )
        self._stopping = False
        self._dead = False
        self._wave_thread = threading.Thread(
            target=self._wave_loop, name="leader-wave", daemon=True
        )
        self._collector = threading.Thread(target=self._collect, name="leader-collect", daemon=True)

    def start(self) -> None:
        if self.config.policy is PolicyKind.WAVE:
            self._wave_thread.start()
        if self.config.world_size > 1:
            self._collector.start()

    def wake(self) -> None:
        """Something changed (new request, abort, capacity): re-check round and wave work."""
        with self._lock:
            self._lock.notify_all()

    # -- the engine's calls (any thread) -------------------------------------------------------
    def enqueue(
        self,
        request_id: str,
        token_ids: tuple[int, ...],
        salt: str | None,
        options: ChunkOptions = _NO_OPTIONS,
    ) -> None:
        """Queue a request for admission with what its chunks carry (NeverFitsError or
        DuplicateRequestError raise here)."""
        spec = self.request_spec(request_id, token_ids, salt)
        with self._lock:
            rejected = self._core.enqueue(spec, options)
            if rejected is not None:
                raise NeverFitsError(f"the prompt can never fit: {rejected.reason}")
            self._lock.notify_all()

    def request_spec(
        self, request_id: str, token_ids: tuple[int, ...], salt: str | None
    ) -> RequestSpec:
        """The stages' view of a prompt: its tokens and what it may share blocks with."""
        return RequestSpec(request_id, token_ids, ExtraKeys(self.config.model_id, salt))

    def abort(self, request_id: str) -> bool:
        """Drop the request from the schedule (deferred while a chunk of it is in flight);
        True when it had been admitted, False when it was still queued."""
        with self._lock:
            admitted = self._core.abort(request_id)
            self._lock.notify_all()
        return admitted

    def check_fits(self, num_tokens: int) -> None:
        """NeverFitsError if a prompt of ``num_tokens`` exceeds some stage's whole cache."""
        with self._lock:
            rejected = self._core.check_fits(num_tokens)
        if rejected is not None:
            raise NeverFitsError(f"the prompt can never fit: {rejected.reason}")

    def counts(self) -> LeaderCounts:
        with self._lock:
            return self._core.counts()

    def control(self, message: RoundMessage) -> Future[list[Any]]:
        """Run a non-admission round (stats, integrity, KV dump) on every stage; all replies."""
        fut: Future[list[Any]] = Future()
        self._controls.put((message, fut))
        self.wake()
        return fut

    def stop(self) -> None:
        """Ask the threads to finish: a STOP wave and a STOP round go out once the ring drains."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()

    def join(self, timeout: float) -> None:
        for t in (self._wave_thread, self._collector):
            if t.is_alive():
                t.join(timeout)

    # -- rounds (WAVE thread, or stage 0's LOOP when admission is on the loop) ---------------
    def _round(self, message: RoundMessage) -> list[Any]:
        return self._planes.rounds.lead(message, self._answer_local)

    def _serve_controls(self) -> None:
        while True:
            try:
                message, fut = self._controls.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(self._round(message))
                except BaseException as exc:
                    fut.set_exception(exc)
                    raise

    def _admission_round(self) -> bool:
        """One admission round (all its phases) if the core has work; True when one ran."""
        with self._lock:
            message = self._core.begin_round() if self._core.has_round_work() else None
        if message is None:
            return False
        t0 = time.monotonic()
        while True:
            envelope = RoundMessage(RoundKind.ADMIT, message)
            if self.config.policy is PolicyKind.TRTLLM:  # rank 0's own cache view alone
                replies = [self._answer_local(envelope)]
            else:
                replies = self._round(envelope)
            with self._lock:
                step = self._core.finish_phase(replies)
            if isinstance(step, RoundResult):
                break
            message = step
        verdicts = _verdicts(step)
        with self._lock:
            self._lock.notify_all()
        if verdicts:
            self._on_verdicts(verdicts, time.monotonic() - t0)
        return True

    def _wait_for_round_work(self) -> bool:
        """Block until there is round work or the tick elapses; False when stopping."""
        with self._lock:
            self._lock.wait_for(
                lambda: self._stopping or self._core.has_round_work() or not self._controls.empty(),
                timeout=self.config.tick_s,
            )
            return not self._stopping

    def _wave_loop(self) -> None:
        try:
            while self._wait_for_round_work():
                self._serve_controls()
                if not self._admission_round():
                    self._round(RoundMessage(RoundKind.TICK))
            if not self._dead:
                self._serve_controls()
                self._round(RoundMessage(RoundKind.STOP))
        except PlaneClosedError as exc:
            self._on_dead(str(exc))
        except Exception as exc:
            log.exception("leader WAVE thread crashed")
            self._on_dead(f"leader admission thread crashed: {exc!r}")

    # -- waves (stage 0's LOOP) ---------------------------------------------------------------
    def next_wave(self) -> WaveHeader:
        """Stage 0's wave source: the next wave (at most ``ring`` in flight), or the STOP
        sentinel once stopping and drained. Under ``trtllm`` and ``sync-admission`` it first
        runs one admission round itself, so admission and execution alternate on this thread."""
        on_loop = self.config.policy is not PolicyKind.WAVE
        last_round = time.monotonic()
        header = None
        while True:
            if on_loop:
                self._serve_controls()
                if self._admission_round():
                    last_round = time.monotonic()
                elif time.monotonic() - last_round >= self.config.tick_s:
                    self._round(RoundMessage(RoundKind.TICK))
                    last_round = time.monotonic()
            with self._lock:
                if self._stopping and (self._core.waves_in_flight == 0 or self._dead):
                    break
                if not self._stopping:  # the core keeps the ring (policy.ring_size)
                    header = wave_header(self._core)
                    if header is not None:
                        break
                if on_loop and self._core.has_round_work():
                    continue
                self._lock.wait(timeout=0.05 if on_loop else self.config.tick_s)
        if header is not None:
            starts = [(c.request_id, c.start) for c in header.chunks if c.options is not None]
            if starts:  # where each request really starts (a promise may have fallen back)
                self._on_started(starts)
            return header
        if on_loop and not self._dead:
            self._serve_controls()
            self._round(RoundMessage(RoundKind.STOP))
        return WaveHeader(wave_id=-1, chunks=(), stop=True)

    def mark_dead(self) -> None:
        """The pipeline is broken: stop waiting for in-flight waves."""
        with self._lock:
            self._dead = True
            self._stopping = True
            self._lock.notify_all()

    # -- results (collector thread, or stage 0's LOOP when P = 1) ----------------------------
    def handle_result(self, result: WaveResult) -> None:
        if result.stop:
            return
        with self._lock:
            self._core.wave_done(result.wave_id, (rid for rid, _ in result.failed))
            self._lock.notify_all()
        self._on_result(result)

    def _collect(self) -> None:
        try:
            while True:
                result: WaveResult = self._planes.data.recv_result().header
                if result.stop:
                    return
                self.handle_result(result)
        except PlaneClosedError as exc:
            self._on_dead(str(exc))
        except Exception as exc:
            log.exception("leader collector crashed")
            self._on_dead(f"leader collector crashed: {exc!r}")
