"""Starting an engine from its ``EngineConfig``: as a pipeline of processes or in one process."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from prefill_node.errors import InvalidRequestError
from prefill_node.runtime.dist_env import DistEnv, free_local_port
from prefill_node.runtime.engine_config import TRANSPORTS, EngineConfig
from prefill_node.runtime.pipeline_engine import PipelineEngine
from prefill_node.runtime.spec import ModelSource

if TYPE_CHECKING:
    from prefill_node.engine.types import Engine
    from prefill_node.runtime.kv_event_feed import KVEventSink


def build_engine(
    config: EngineConfig, transport: str = "pipeline", kv_events: KVEventSink | None = None
) -> Engine:
    """A started engine for ``config`` (its ``model_dir`` is required); the caller owns it
    and must call ``shutdown``. ``transport``: ``pipeline`` runs one process per stage
    (``start_pipeline_engine``; one stage is run in-process anyway), ``local`` every stage
    in this process (``LocalEngine``). Both sit behind the same ``Engine`` protocol and
    only enqueue in ``submit``. ``kv_events``: receives the pipeline's KV events (e.g.
    ``KVEventHub.publish``)."""
    if transport not in TRANSPORTS:
        raise InvalidRequestError(f"--engine must be one of {TRANSPORTS}, got {transport!r}")
    if transport == "pipeline" and config.stages > 1:
        return start_pipeline_engine(config, kv_events=kv_events)
    from prefill_node.runtime.local_engine import LocalEngine

    return LocalEngine.from_model_dir(config, kv_events=kv_events)


def start_pipeline_engine(
    config: EngineConfig,
    *,
    kv_events: KVEventSink | None = None,
    from_env: bool | None = None,
) -> PipelineEngine:
    """Start a ``config.stages``-stage pipeline on the checkpoint ``config.model_dir``; this
    process becomes stage 0 (the leader) and the returned engine serves requests. Call
    ``shutdown``.

    Launch: when RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT are set (``from_env`` None
    means: if RANK is in the environment), this process must be RANK 0 and the other stages
    are started elsewhere with ``wavepp stage`` (one pod per stage); otherwise the stages are
    spawned locally as child processes on a free loopback port. ``kv_events``: a sink for
    the pipeline's KV events, e.g. ``KVEventHub.publish``.
    """
    from prefill_node.model.loader_hf import load_hf_config

    if config.model_dir is None:
        raise InvalidRequestError("a pipeline of processes needs a model directory (--model)")
    model_config = load_hf_config(config.model_dir)
    source = ModelSource(path=str(Path(config.model_dir).resolve()), name=model_config.name)
    layers = config.stage_layers(model_config.num_layers)
    spec = config.pipeline_spec(layers, source, kv_events=kv_events is not None)
    use_env = "RANK" in os.environ if from_env is None else from_env
    if use_env:
        env = DistEnv.from_env()
        if not env.is_leader or env.world_size != config.stages:
            raise InvalidRequestError(
                f"this process is RANK {env.rank} of WORLD_SIZE {env.world_size}; the leader "
                f"must be RANK 0 of {config.stages} (other ranks run `wavepp stage`)"
            )
        launch = False
    else:
        env = DistEnv(0, config.stages, "127.0.0.1", free_local_port())
        launch = True
    return PipelineEngine.start(
        spec,
        env,
        launch,
        config.stage_wait_s,
        kv_handoff=config.kv_handoff,
        kv_events=kv_events,
        core_share=config.core_share,
        core_board=config.core_board,
    )
