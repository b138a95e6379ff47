"""One call that starts a multi-process pipeline on a model and returns its leader Engine."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from prefill_node.errors import InvalidRequestError
from prefill_node.runtime.dist_env import DistEnv, free_local_port
from prefill_node.runtime.pipeline_engine import PipelineEngine
from prefill_node.runtime.spec import ModelSource, PipelineSpec

if TYPE_CHECKING:
    from prefill_node.kv_handoff.config import KVHandoffConfig
    from prefill_node.runtime.kv_event_feed import KVEventSink


def start_pipeline_engine(
    model_dir: str | Path,
    num_stages: int,
    policy: str = "wave",
    *,
    num_blocks: int | Sequence[int] = 1024,
    block_size: int = 16,
    max_wave_tokens: int = 512,
    min_wave_tokens: int | None = None,
    layer_ranges: Sequence[tuple[int, int]] | None = None,
    max_model_len: int | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    from_env: bool | None = None,
    startup_timeout_s: float = 600.0,
    kv_handoff: KVHandoffConfig | None = None,
    kv_events: KVEventSink | None = None,
    debug_wave_delay_s: float = 0.0,
    core_share: bool = True,
) -> PipelineEngine:
    """Start a ``num_stages``-stage pipeline on the HF checkpoint ``model_dir``; this process
    becomes stage 0 (the leader) and the returned engine serves requests. Call ``shutdown``.

    Launch: when RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT are set (``from_env`` None
    means: if RANK is in the environment), this process must be RANK 0 and the other stages
    are started elsewhere with ``wavepp stage`` (one pod per stage); otherwise the stages are
    spawned locally as child processes on a free loopback port. ``num_blocks``: KV blocks per
    stage, one value or one per stage. ``layer_ranges`` defaults to an even split.
    ``max_wave_tokens`` is the wave budget M (the fixed chunk budget under ``trtllm`` and
    ``sync-admission``) and must be a multiple of ``block_size``; ``min_wave_tokens`` (b_min)
    defaults to M/2 as in the paper.
    ``kv_handoff``: ship each request's KV to its ``kv_destination`` over NIXL (None: off).
    ``kv_events``: a sink for the pipeline's KV events, e.g. ``KVEventHub.publish``.
    ``debug_wave_delay_s``: every stage sleeps this long per wave (tests: requests that stay
    in flight long enough to act on them). ``core_share``: locally launched CPU stages lend
    their cores to the stages computing while they idle (runtime/core_share.py).
    """
    from prefill_node.core.planner import default_min_wave_tokens
    from prefill_node.model.loader_hf import load_hf_config
    from prefill_node.model.partition import split_layers

    config = load_hf_config(model_dir)
    blocks = (num_blocks,) * num_stages if isinstance(num_blocks, int) else tuple(num_blocks)
    if layer_ranges is None:
        layer_ranges = [(r.start, r.end) for r in split_layers(config.num_layers, num_stages)]
    if len(layer_ranges) != num_stages or layer_ranges[-1][1] != config.num_layers:
        raise InvalidRequestError(
            f"layer ranges {list(layer_ranges)} must give {num_stages} stages covering "
            f"all {config.num_layers} layers"
        )
    spec = PipelineSpec(
        model=ModelSource(path=str(Path(model_dir).resolve()), name=config.name),
        layer_ranges=tuple(tuple(r) for r in layer_ranges),
        stage_blocks=blocks,
        block_size=block_size,
        policy=policy,
        max_wave_tokens=max_wave_tokens,
        min_wave_tokens=min_wave_tokens or default_min_wave_tokens(max_wave_tokens, block_size),
        max_model_len=max_model_len,
        dtype=dtype,
        device=device,
        kv_events=kv_events is not None,
        debug_wave_delay_s=debug_wave_delay_s,
    )
    use_env = "RANK" in os.environ if from_env is None else from_env
    if use_env:
        env = DistEnv.from_env()
        if not env.is_leader or env.world_size != num_stages:
            raise InvalidRequestError(
                f"this process is RANK {env.rank} of WORLD_SIZE {env.world_size}; the leader "
                f"must be RANK 0 of {num_stages} (other ranks run `wavepp stage`)"
            )
        return PipelineEngine.start(
            spec, env, False, startup_timeout_s, kv_handoff=kv_handoff, kv_events=kv_events
        )
    env = DistEnv(0, num_stages, "127.0.0.1", free_local_port())
    return PipelineEngine.start(
        spec,
        env,
        True,
        startup_timeout_s,
        kv_handoff=kv_handoff,
        kv_events=kv_events,
        core_share=core_share,
    )
