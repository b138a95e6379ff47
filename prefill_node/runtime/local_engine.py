"""LocalEngine: the pipeline with its P stages as threads of ONE process (in-process planes).

It is the multi-process pipeline with another transport: the same ``LeaderEngine`` (the
core's ``LeaderCore``: coordinator, ``WaveScheduler``, planner and ``Policy``), the same
``StageWorker`` threads and ``PipelineStageCompute`` per stage, wired by
``local_planes.py`` instead of torch.distributed. So admission rounds, waves (ring,
chunks in flight per request, planner mode), prefix reuse, lease / escrow headroom, the
KV hand-off, KV events, deadlines and aborts behave exactly as in a pipeline of processes,
and concurrent requests share waves.

What it adds: building the stages from weights in this process (``from_weights``,
``from_model_dir``, ``from_stage_models``), a fit check whose message names the stage at
fault, ``prefill`` (synchronous, with the last position's full
logits), and direct reads of the stages it holds (``load``'s stage figures without a
STATS round, ``check_integrity``, ``kv_held_blocks``, ``stages``).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from prefill_node.core.hashing import model_cache_id
from prefill_node.engine.types import MAX_TOP_LOGPROBS, PrefillOptions, PrefillResult, StageLoad
from prefill_node.errors import (
    InvalidRequestError,
    InvariantError,
    NeverFitsError,
)
from prefill_node.model.stage_model import StageModel
from prefill_node.runtime.core_share import CoreBoard, CoreShare
from prefill_node.runtime.engine_config import EngineConfig
from prefill_node.runtime.leader_engine import LeaderEngine
from prefill_node.runtime.local_planes import local_planes
from prefill_node.runtime.stage_compute import TORCH_DTYPES, PipelineStageCompute
from prefill_node.runtime.stage_worker import StageWorker

if TYPE_CHECKING:
    from prefill_node.model.config import ModelConfig
    from prefill_node.runtime.kv_event_feed import KVEventSink


@dataclass(frozen=True)
class LocalPrefill:
    """A finished prefill plus the fp32 logits [vocab] of the last prompt token."""

    result: PrefillResult
    logits: torch.Tensor


class LocalEngine(LeaderEngine):
    """An in-process pipeline of ``PipelineStageCompute``s implementing ``Engine``. Thread-safe.

    Threads: the leader's (rounds, stage 0's loop, result collector, KV hand-off) and, per
    stage s > 0, a loop and a rounds thread, all started by the constructor and stopped by
    ``shutdown``.
    """

    max_top_logprobs = MAX_TOP_LOGPROBS

    def __init__(
        self,
        stages: Sequence[PipelineStageCompute],
        config: EngineConfig,
        *,
        kv_events: KVEventSink | None = None,
        board: CoreBoard | None = None,
    ) -> None:
        """``stages``: built on one spec (``config.pipeline_spec``), stage s at index s;
        the last one keeps its logits. They hand each request's KV to its
        ``PrefillOptions.kv_destination`` when ``config.kv_handoff`` is set. ``kv_events``:
        receives the pipeline's KV events (the spec must have ``kv_events``). ``board``: the
        core board stage 0's ``cores`` use, closed by ``shutdown``."""
        if len(stages) != config.stages or not stages:
            raise InvariantError(f"{len(stages)} stage computes for {config.stages} stages")
        spec = stages[0].spec
        if kv_events is not None and not spec.kv_events:
            raise InvariantError("KV events need stages whose pools buffer them (spec.kv_events)")
        super().__init__(spec, config.kv_handoff, kv_events)
        self.stages = tuple(stages)
        self.config = config
        self._board = board
        self.model_config = stages[0].model_config
        self.model_id = model_cache_id(self.model_config.name, spec.dtype)
        planes = local_planes(config.stages)
        self._followers = [
            StageWorker(s, config.stages, planes[s], stages[s],
                        admission_on_loop=spec.scheduling_policy.admission_on_loop,
                        on_error=self._on_dead)
            for s in range(1, config.stages)
        ]  # fmt: skip
        for worker in self._followers:
            worker.start()
        self._start_leader(planes[0], stages[0], config.stages)

    @classmethod
    def from_stage_models(
        cls,
        models: Sequence[StageModel],
        config: EngineConfig,
        *,
        kv_events: KVEventSink | None = None,
    ) -> LocalEngine:
        """From the stages' models, stage s at index s (their layer ranges are the split).
        With ``config.core_board`` (one stage only: torch's threads are the process's) the
        stage joins the host's core board and borrows the cores other pipelines leave idle."""
        layers = tuple(m.layer_range for m in models)
        spec = config.pipeline_spec(layers, kv_events=kv_events is not None)
        board = None
        if config.core_board is not None and config.device == "cpu":
            if len(models) != 1:
                raise InvalidRequestError(
                    "--core-board with every stage in one process (--engine local) needs "
                    "--stages 1: the stages would share one process's torch threads"
                )
            board = CoreBoard.host(config.core_board, 1)
        try:
            cores = CoreShare(board, board.slots[0]) if board is not None else None
            stages = [
                PipelineStageCompute(spec, s, m, config.kv_handoff, keep_logits=m.is_last,
                                     cores=cores if s == 0 else None)
                for s, m in enumerate(models)
            ]  # fmt: skip
            return cls(stages, config, kv_events=kv_events, board=board)
        except BaseException:
            if board is not None:
                board.close()
            raise

    @classmethod
    def from_weights(
        cls,
        model_config: ModelConfig,
        weights: dict[str, torch.Tensor],
        config: EngineConfig,
        *,
        kv_events: KVEventSink | None = None,
    ) -> LocalEngine:
        """Build from one HF-named weight dict (e.g. ``random_weights`` in tests)."""
        models = []
        dtype = TORCH_DTYPES[config.dtype]
        for layer_range in config.stage_layers(model_config.num_layers):
            model = StageModel(model_config, layer_range, dtype, config.device)
            model.load_weights(weights)
            models.append(model)
        return cls.from_stage_models(models, config, kv_events=kv_events)

    @classmethod
    def from_model_dir(
        cls,
        config: EngineConfig,
        *,
        kv_events: KVEventSink | None = None,
    ) -> LocalEngine:
        """Build from the Hugging Face checkpoint directory ``config.model_dir``; each stage
        loads only its slice."""
        from prefill_node.model.loader_hf import load_hf_config, load_stage_model

        path = config.model_dir
        if path is None:
            raise InvalidRequestError("the engine needs a model directory (--model)")
        model_config = load_hf_config(path)
        dtype = TORCH_DTYPES[config.dtype]
        models = [
            load_stage_model(path, layer_range, dtype, config.device)
            for layer_range in config.stage_layers(model_config.num_layers)
        ]
        return cls.from_stage_models(models, config, kv_events=kv_events)

    # ---- reads of the in-process stages -----------------------------------------------

    def kv_held_blocks(self) -> tuple[int, ...]:
        """Per stage: block references its hand-off holds now (in-flight WRITEs, live leases)."""
        return tuple(stage.kv_held().blocks for stage in self.stages)

    def _stage_loads(self) -> tuple[StageLoad, ...]:
        """What a STATS round would bring back (``StageStats.load``), read from the stage
        workers directly."""
        workers = [self._worker, *self._followers] if self._worker is not None else []
        return tuple(w.stats().load() for w in workers)

    def check_integrity(self) -> None:
        """Every stage's block pool, admission state and KV hand-off are consistent (raises
        otherwise); callable after ``shutdown`` too."""
        for stage in self.stages:
            stage.check()

    def shutdown(self) -> None:
        """Drain the ring and stop every thread; unfinished requests fail with
        UnavailableError. Stops the KV hand-off (WRITEs aborted, leases revoked). Idempotent."""
        if not self._close("the engine has been shut down"):
            return
        graceful = self._dead is None
        self._stop_leader(graceful)
        for worker in self._followers:  # a broken pipeline's threads may never return
            worker.join(timeout=10.0 if graceful else 0.5)
        for stage in self.stages:
            stage.close()
        for worker in self._followers:  # after the last outcome: the leader's receivers end
            worker.close_reports()
        if self._board is not None:
            self._board.close()

    # ---- the prefill ---------------------------------------------------------------

    def _check_fits(self, num_tokens: int) -> None:
        bs = self.spec.block_size
        need = -(-num_tokens // bs)
        for s, num_blocks in enumerate(self.spec.stage_blocks):
            if need > num_blocks:
                raise NeverFitsError(
                    f"the prompt needs {need} blocks of {bs} tokens; stage {s} has only "
                    f"{num_blocks}"
                )

    def prefill(self, token_ids: Sequence[int], options: PrefillOptions) -> LocalPrefill:
        """``submit`` and wait: the result and the last prompt token's fp32 logits."""
        request_id = options.request_id or uuid.uuid4().hex
        options = replace(options, request_id=request_id)
        future, req = self._submit(token_ids, options, keep_logits=True)
        result = future.result()
        if req is None or req.logits is None:
            raise InvariantError(f"the last stage kept no logits for {request_id!r}")
        return LocalPrefill(result, req.logits)
