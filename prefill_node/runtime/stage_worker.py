"""One stage process's two activities: the LOOP (execute waves) and the WAVE (answer rounds)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from prefill_node import tracing
from prefill_node.core.block_pool import PoolStats
from prefill_node.engine.types import StageKVManifest
from prefill_node.errors import InvariantError
from prefill_node.kv_handoff.stage_handoff import HandoffOutcome, KVHeld
from prefill_node.runtime.messages import (
    RequestOutput,
    RoundKind,
    RoundMessage,
    StageEventBatch,
    StageStats,
    WaveHeader,
    WaveResult,
)
from prefill_node.runtime.planes import Frame, PlaneClosedError, Planes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepOutput:
    """What one stage produced for one wave.

    ``hidden``: activations for the next stage (None on the last stage). ``outputs``: finished
    requests' logprobs (last stage only). ``failed``: requests this stage could not run.
    ``kv_events``: this stage's KV event batch drained after the wave (empty when off).
    ``computed_at``: ``time.monotonic()`` when the wave's forward ended (0: not run).
    """

    hidden: torch.Tensor | None
    outputs: tuple[RequestOutput, ...] = ()
    failed: tuple[tuple[str, str], ...] = ()
    manifests: tuple[tuple[str, StageKVManifest], ...] = ()
    kv_events: tuple[StageEventBatch, ...] = ()
    computed_at: float = 0.0


class StageCompute(Protocol):
    """The model + cache side of a stage, driven by the two threads of ``StageWorker``.

    Thread contract: ``run_wave`` is called only by the LOOP thread; ``admit`` and
    ``dump_kv`` only by the WAVE thread, concurrently with ``run_wave``; ``check``,
    ``pool_stats`` and ``kv_held`` from any thread (the in-process engine reads its stages
    directly). The implementation serialises its own cache-core accesses (one lock, short
    sections).
    """

    def run_wave(self, header: WaveHeader, hidden: torch.Tensor | None) -> StepOutput: ...

    def admit(self, message: Any) -> Any: ...

    def check(self) -> None: ...

    def dump_kv(self, request_id: str) -> Any: ...

    def pool_stats(self) -> PoolStats: ...

    def report_handoffs(self, sink: Callable[[tuple[HandoffOutcome, ...]], object]) -> None: ...

    def kv_cancel(self, request_ids: tuple[str, ...]) -> None: ...

    def kv_held(self) -> KVHeld: ...

    def fetch(self, order: Any) -> Any: ...

    def lend(self, order: Any) -> Any: ...


class StageWorker:
    """Runs a stage's LOOP and WAVE threads over its planes until a STOP arrives.

    LOOP: take the next wave (from stage s-1 on the data plane, or from the leader's scheduler
    through ``wave_source`` on stage 0), run ``compute.run_wave``, pass the activations to s+1 -
    or, on the last stage, a ``WaveResult`` to the leader (``result_sink`` when P = 1).
    WAVE (non-leader only; the leader drives rounds itself): follow rounds and reply.
    The compute's KV hand-off outcomes go to ``report_sink`` as they happen (stage 0: the
    leader's, given by the engine) or, on stages s > 0, on the reports plane. The LOOP ends
    that stream when the STOP wave passes, before sending it on, so the leader has every
    stage's end of stream once the STOP comes back and may tear the planes down; outcomes
    after it (the compute's close aborting WRITEs) are dropped, the engine has failed its
    requests by then. ``close_reports`` (idempotent) ends it too, for a pipeline whose STOP
    never came.

    ``admission_on_loop=True`` (``trtllm``, ``sync-admission``): a round is only answered
    between waves (the WAVE handler takes the same lock the LOOP holds while it
    executes), as when admission runs on the executor loop.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        planes: Planes,
        compute: StageCompute,
        admission_on_loop: bool = False,
        wave_source: Callable[[], WaveHeader] | None = None,
        result_sink: Callable[[WaveResult], None] | None = None,
        on_error: Callable[[str], None] | None = None,
        report_sink: Callable[[tuple[HandoffOutcome, ...]], object] | None = None,
    ):
        self.rank = rank
        self.world_size = world_size
        self._planes = planes
        self._compute = compute
        self._admission_on_loop = admission_on_loop
        self._wave_source = wave_source
        self._result_sink = result_sink
        self._on_error = on_error
        self._exec_lock = threading.Lock()
        self._started = time.monotonic()
        self._busy_s = 0.0
        self._cpu_s = 0.0
        self._waves = 0
        self._tokens = 0
        self.error: BaseException | None = None
        self.loop_thread = threading.Thread(
            target=self._loop, name=f"stage{rank}-loop", daemon=True
        )
        self.wave_thread = threading.Thread(
            target=self._wave, name=f"stage{rank}-wave", daemon=True
        )
        if report_sink is None and rank > 0:
            report_sink = planes.reports.send
        if report_sink is not None:
            compute.report_handoffs(report_sink)

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1

    def start(self) -> None:
        self.loop_thread.start()
        if self.rank != 0:
            self.wave_thread.start()

    def join(self, timeout: float | None = None) -> None:
        self.loop_thread.join(timeout)
        if self.rank != 0:
            self.wave_thread.join(timeout)

    def close_reports(self) -> None:
        """End this stage's reports stream (after its compute stopped its hand-off)."""
        try:
            self._planes.reports.close()
        except PlaneClosedError as exc:  # the leader is gone already
            log.debug("stage %d reports: %s", self.rank, exc)

    # -- LOOP ------------------------------------------------------------------------------
    def _next_wave(self) -> Frame:
        if self.rank == 0:
            if self._wave_source is None:
                raise InvariantError("stage 0 needs a wave source")
            return Frame(self._wave_source())
        return self._planes.data.recv_prev()

    def _loop(self) -> None:
        try:
            while True:
                frame = self._next_wave()
                header: WaveHeader = frame.header
                if header.stop:  # the reports stream ends before the leader sees the STOP
                    self.close_reports()
                    self._emit(header, StepOutput(hidden=None))
                    return
                with self._exec_lock:
                    t0, c0 = time.perf_counter(), time.thread_time()
                    traced = tracing.enabled() and time.time_ns()
                    step = self._compute.run_wave(header, frame.tensor)
                    self._busy_s += time.perf_counter() - t0
                    self._cpu_s += time.thread_time() - c0
                if traced:
                    self._trace_wave(header, traced, step)
                self._waves += 1
                self._tokens += header.num_tokens
                self._emit(header, step)
        except PlaneClosedError as exc:
            self.error = exc
            log.warning("stage %d LOOP: %s", self.rank, exc)
        except Exception as exc:
            self.error = exc
            log.exception("stage %d LOOP crashed", self.rank)
        if self.error is not None and self._on_error is not None:
            self._on_error(f"stage {self.rank} execution loop stopped: {self.error}")

    def _trace_wave(self, header: WaveHeader, start_ns: int, step: StepOutput) -> None:
        """One span per traced chunk of the wave: this stage's compute of it (the wave's
        forward runs every chunk together, so they share its start and end)."""
        end_ns = time.time_ns()
        failed = dict(step.failed)
        for chunk in header.chunks:
            if chunk.traceparent:
                span = tracing.start_span("wavepp.stage.chunk", chunk.traceparent, {
                    tracing.REQUEST_ID: chunk.request_id, tracing.STAGE: self.rank,
                    tracing.WAVE_ID: header.wave_id, "wavepp.chunk_start": chunk.start,
                    "wavepp.chunk_tokens": chunk.length, "wavepp.chunk_last": chunk.is_last,
                    "wavepp.wave_tokens": header.num_tokens}, start_ns=start_ns)  # fmt: skip
                tracing.end(span, end_ns, failed.get(chunk.request_id))

    def _emit(self, header: WaveHeader, step: StepOutput) -> None:
        failed = header.failed + step.failed
        manifests = header.manifests + step.manifests
        events = header.kv_events + step.kv_events
        if not self.is_last:
            out = replace(header, failed=failed, manifests=manifests, kv_events=events)
            hidden = step.hidden
            if hidden is None and not header.stop:
                hidden = torch.zeros(0, 1)
            self._planes.data.send_next(Frame(out, None if header.stop else hidden))
            if header.stop:
                self._planes.data.drain()
            return
        held_s = time.monotonic() - step.computed_at if step.computed_at else 0.0
        result = WaveResult(
            header.wave_id, step.outputs, failed, manifests, header.stop, events, held_s
        )
        if self.rank == 0:
            if self._result_sink is None:
                raise InvariantError("a one-stage pipeline needs a result sink")
            self._result_sink(result)
        else:
            self._planes.data.send_result(Frame(result))
            if header.stop:
                self._planes.data.drain()

    # -- WAVE ------------------------------------------------------------------------------
    def _wave(self) -> None:
        try:
            while True:
                message, _ = self._planes.rounds.follow(self.answer)
                if message.kind is RoundKind.STOP:
                    return
        except PlaneClosedError as exc:
            self.error = exc
            log.warning("stage %d WAVE: %s", self.rank, exc)
        except Exception as exc:  # a bug in admission: this stage can no longer take part
            self.error = exc
            log.exception("stage %d WAVE crashed", self.rank)

    def answer(self, message: RoundMessage) -> Any:
        """This stage's reply to one round (the leader calls it for stage 0 as well)."""
        if self._admission_on_loop and message.kind is RoundKind.ADMIT:
            with self._exec_lock:
                return self._answer(message)
        return self._answer(message)

    def _answer(self, message: RoundMessage) -> Any:
        kind = message.kind
        if kind is RoundKind.ADMIT:
            return self._compute.admit(message.payload)
        if kind is RoundKind.STATS:
            return self.stats()
        if kind is RoundKind.CHECK:
            try:
                self._compute.check()
            except Exception as exc:  # reported to the leader, who raises it for the caller
                return f"stage {self.rank}: {type(exc).__name__}: {exc}"
            return None
        if kind is RoundKind.DUMP_KV:
            return self._compute.dump_kv(message.payload)
        if kind is RoundKind.FETCH:
            return self._compute.fetch(message.payload)
        if kind is RoundKind.LEND:
            return self._compute.lend(message.payload)
        if kind is RoundKind.KV_CANCEL:
            self._compute.kv_cancel(tuple(message.payload))
            return None
        return None  # TICK, STOP

    def stats(self) -> StageStats:
        held = self._compute.kv_held()
        cores = getattr(self._compute, "cores", None)  # PipelineStageCompute's core sharing
        return StageStats(
            stage=self.rank,
            busy_s=self._busy_s,
            cpu_s=self._cpu_s,
            waves=self._waves,
            tokens=self._tokens,
            uptime_s=time.monotonic() - self._started,
            pool=self._compute.pool_stats(),
            kv_held_blocks=held.blocks,
            kv_pushes=held.pushes,
            kv_leases=held.leases,
            wide_layers=cores.wide_layers if cores is not None else 0,
        )
