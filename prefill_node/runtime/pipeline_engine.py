"""PipelineEngine: the leader's Engine over a multi-process pipeline (one process per stage)."""

from __future__ import annotations

import datetime
import logging
import pickle
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from prefill_node.errors import (
    InvariantError,
    UnavailableError,
)
from prefill_node.runtime.core_share import CoreBoard, CoreShare
from prefill_node.runtime.dist_env import DistEnv
from prefill_node.runtime.heartbeat import Heartbeat
from prefill_node.runtime.kv_event_feed import KVEventSink
from prefill_node.runtime.launcher import LocalLauncher
from prefill_node.runtime.leader_engine import LeaderEngine
from prefill_node.runtime.planes import Planes
from prefill_node.runtime.spec import PipelineSpec
from prefill_node.runtime.stage_compute import build_stage_compute
from prefill_node.runtime.stage_main import KV_HANDOFF_KEY, REVISION_KEY, SPEC_KEY, ready_key

if TYPE_CHECKING:
    from prefill_node.kv_handoff.config import KVHandoffConfig
    from prefill_node.runtime.stage_compute import PipelineStageCompute

log = logging.getLogger(__name__)


class PipelineEngine(LeaderEngine):
    """Stage 0 of a P-stage pipeline of processes; the Engine API is ``LeaderEngine``'s.

    Lifecycle: ``PipelineEngine.start`` publishes the spec in the rendezvous store it hosts,
    (optionally) launches stages 1..P-1 locally, waits until every stage has loaded its slice,
    joins the planes and starts the threads. ``shutdown`` drains the ring and stops every
    stage. A dead stage (process exit, heartbeat silence, or a plane error) turns the engine
    not ready and not live (only a restart recovers it).
    """

    def __init__(
        self,
        spec: PipelineSpec,
        env: DistEnv,
        launch: bool,
        kv_handoff: KVHandoffConfig | None = None,
        kv_events: KVEventSink | None = None,
        core_share: bool = True,
        core_board: Path | None = None,
    ):
        if kv_events is not None and not spec.kv_events:
            spec = replace(spec, kv_events=True)
        super().__init__(spec, kv_handoff, kv_events)
        self._compute: PipelineStageCompute | None = None
        self._env = env
        self._board: CoreBoard | None = None
        if launch and core_share and spec.device == "cpu":
            if core_board is not None:  # shared with the host's other pipelines
                self._board = CoreBoard.host(core_board, spec.num_stages)
            elif spec.num_stages > 1:
                self._board = CoreBoard.create(spec.num_stages)
        self._launcher = (
            LocalLauncher(env, self._on_stage_exit, board=self._board) if launch else None
        )
        self._store: dist.TCPStore | None = None
        self._heartbeat: Heartbeat | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    @classmethod
    def start(
        cls,
        spec: PipelineSpec,
        env: DistEnv,
        launch: bool = True,
        startup_timeout_s: float = 600,
        kv_handoff: KVHandoffConfig | None = None,
        kv_events: KVEventSink | None = None,
        core_share: bool = True,
        core_board: Path | None = None,
    ) -> PipelineEngine:
        engine = cls(spec, env, launch, kv_handoff, kv_events, core_share, core_board)
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
        self._store.set(REVISION_KEY, env.revision)
        self._store.set(KV_HANDOFF_KEY, pickle.dumps(self._kv_handoff))
        self._store.set(SPEC_KEY, self.spec.to_json())
        if self._launcher is not None:
            self._launcher.start()
        cores = CoreShare(self._board, self._board.slots[0]) if self._board is not None else None
        self._compute = compute = build_stage_compute(self.spec, 0, self._kv_handoff, cores)
        self.model_config = compute.model_config
        self._wait_ready(startup_timeout_s)
        planes = Planes.join_stage(
            0, env.world_size, self._store, compute.model, self.spec.max_wave_tokens
        )
        self._heartbeat = Heartbeat(
            env, self._on_dead, self.spec.heartbeat_s, self.spec.dead_after_s
        )
        self._heartbeat.start()
        self._start_leader(planes, compute, env.world_size)

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
        if not self._close("the pipeline is shutting down"):
            return
        self._teardown(graceful=self._dead is None)

    def _teardown(self, graceful: bool) -> None:
        """Drain and stop the threads and the stages; the heartbeat stops last so that the
        stages never mistake a slow, orderly shutdown for a lost leader."""
        t0 = time.monotonic()
        self._stop_leader(graceful)
        t1 = time.monotonic()
        if self._launcher is not None:
            self._launcher.stop(grace_s=10.0 if graceful else 0.0)
        t2 = time.monotonic()
        if self._worker is not None:
            self._worker.join(timeout=5.0)
        if self._leader is not None:
            self._leader.join(timeout=5.0)
        if self._compute is not None:
            self._compute.close()  # stage 0's hand-off: WRITEs aborted, leases revoked
        if self._board is not None:
            self._board.close()
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self._handoffs is not None:  # no receiver may wait on a group being destroyed
            self._handoffs.join_receivers(5.0 if graceful else 1.0)
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

    def _dead_reason(self, reason: str) -> str:
        if self._launcher is None or "exited" in reason:
            return reason
        summary = self._launcher.exit_summary()  # a plane error often beats its poll
        return f"{summary} ({reason})" if summary else reason

    @property
    def stage_pids(self) -> dict[int, int]:
        return self._launcher.pids if self._launcher is not None else {}
