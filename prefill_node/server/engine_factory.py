"""Builds the Engine a ``wavepp serve`` process fronts: the one switch between engine kinds.

``engine="pipeline"`` (default, stages > 1) starts the multi-process pipeline of
prefill_node/runtime/ (this process becomes stage 0, the leader). ``engine="local"`` (or one
stage) builds the in-process ``LocalEngine`` (the same leader and stages as threads of this
process). Both sit behind the same Engine protocol, and both only enqueue in ``submit``, so
the server calls it inline.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from prefill_node.core.planner import check_min_wave_tokens, wave_budget
from prefill_node.core.policy import POLICY_NAMES
from prefill_node.engine.types import Engine
from prefill_node.errors import InvalidRequestError
from prefill_node.runtime.kv_event_feed import KVEventSink

if TYPE_CHECKING:
    from prefill_node.kv_handoff.config import KVHandoffConfig


ENGINES = ("pipeline", "local")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineSpec:
    """What to serve. ``model_dir``: a Hugging Face checkpoint directory (config.json +
    safetensors); ``num_blocks``: KV blocks per stage, one value or one per stage;
    ``kv_handoff``: each stage gets a NIXL agent and ships KV to the decode destinations
    requests carry (None: requests with a ``kv_destination`` are rejected)."""

    model_dir: Path
    stages: int = 2
    policy: str = "wave"
    num_blocks: tuple[int, ...] = (1024,)
    block_size: int = 16
    max_wave_tokens: int = 512
    min_wave_tokens: int | None = None  # b_min (None: half of max_wave_tokens)
    max_model_len: int | None = None
    dtype: str = "float32"
    device: str = "cpu"
    kv_handoff: KVHandoffConfig | None = None
    engine: str = "pipeline"  # pipeline: one process per stage; local: stages in-process
    debug_wave_delay_s: float = 0.0  # testing: every stage sleeps this long per wave
    core_share: bool = True  # local CPU stages lend idle cores (runtime/core_share.py)
    stage_wait_s: float = 600.0  # the leader waits this long for every stage to join

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise InvalidRequestError(f"--engine must be one of {ENGINES}, got {self.engine!r}")
        if self.stages < 1:
            raise InvalidRequestError(f"--stages must be >= 1, got {self.stages}")
        if self.policy not in POLICY_NAMES:
            raise InvalidRequestError(
                f"--policy must be one of {POLICY_NAMES}, got {self.policy!r}"
            )
        if len(self.num_blocks) not in (1, self.stages) or min(self.num_blocks) < 2:
            raise InvalidRequestError(
                f"--num-blocks: give one value or one per stage ({self.stages}), each >= 2"
            )
        budget = wave_budget(self.max_wave_tokens, self.block_size)
        object.__setattr__(self, "max_wave_tokens", budget)
        check_min_wave_tokens(self.min_wave_tokens, budget, self.block_size)
        if self.stage_wait_s <= 0:
            raise InvalidRequestError(f"--stage-wait must be > 0, got {self.stage_wait_s}")
        if self.dtype not in DTYPES:
            raise InvalidRequestError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")


def engine_defaults() -> dict[str, object]:
    """``EngineSpec``'s field defaults by name: the one source of the defaults the CLI shows."""
    return {f.name: f.default for f in fields(EngineSpec) if f.default is not MISSING}


class ServedEngine(NamedTuple):
    """A started engine and how the server must call it."""

    engine: Engine
    blocking_submit: bool  # True: submit may compute inline; see ServerConfig


def build_engine(spec: EngineSpec, kv_events: KVEventSink | None = None) -> ServedEngine:
    """A started engine for ``spec``; the caller owns it and must call ``shutdown``.
    ``kv_events``: receives the pipeline's aggregated KV events (``KVEventHub.publish``)."""
    if spec.engine == "pipeline" and spec.stages > 1:
        from prefill_node.runtime.factory import start_pipeline_engine

        engine = start_pipeline_engine(
            spec.model_dir,
            spec.stages,
            spec.policy,
            num_blocks=spec.num_blocks[0] if len(spec.num_blocks) == 1 else spec.num_blocks,
            block_size=spec.block_size,
            max_wave_tokens=spec.max_wave_tokens,
            min_wave_tokens=spec.min_wave_tokens,
            max_model_len=spec.max_model_len,
            dtype=spec.dtype,
            device=spec.device,
            kv_handoff=spec.kv_handoff,
            kv_events=kv_events,
            debug_wave_delay_s=spec.debug_wave_delay_s,
            core_share=spec.core_share,
            startup_timeout_s=spec.stage_wait_s,
        )
        return ServedEngine(engine, blocking_submit=False)
    import torch

    from prefill_node.runtime.local_engine import LocalEngine, LocalEngineConfig

    config = LocalEngineConfig(
        num_stages=spec.stages,
        num_blocks=spec.num_blocks[0] if len(spec.num_blocks) == 1 else spec.num_blocks,
        block_size=spec.block_size,
        max_wave_tokens=spec.max_wave_tokens,
        min_wave_tokens=spec.min_wave_tokens,
        max_model_len=spec.max_model_len,
        dtype=getattr(torch, spec.dtype),
        device=spec.device,
        policy=spec.policy,
        debug_wave_delay_s=spec.debug_wave_delay_s,
    )
    engine = LocalEngine.from_model_dir(
        spec.model_dir, config, spec.kv_handoff, kv_events=kv_events
    )
    return ServedEngine(engine, blocking_submit=False)
