"""Runs a real PrefillServer on loopback in a background event-loop thread, for the tests."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

from prefill_node.engine.types import Engine
from prefill_node.model.tokenizer import PromptTokenizer
from prefill_node.model.weights import random_weights
from prefill_node.runtime.dist_env import DistEnv, free_local_port
from prefill_node.runtime.engine_config import EngineConfig
from prefill_node.runtime.local_engine import LocalEngine
from prefill_node.runtime.pipeline_engine import PipelineEngine
from prefill_node.runtime.spec import ModelSource, PipelineSpec
from prefill_node.server.kv_event_hub import KVEventHub
from prefill_node.server.server import PrefillServer, ServerConfig
from tests.tiny_models import tiny_llama_hf, tiny_qwen3


class ServerThread:
    """``with ServerThread(engine) as srv:`` -> a serving server at ``srv.target``."""

    def __init__(
        self,
        engine: Engine,
        config: ServerConfig | None = None,
        *,
        tokenizer: PromptTokenizer | None = None,
        kv_events: KVEventHub | None = None,
    ) -> None:
        self.config = config or ServerConfig(host="127.0.0.1", port=0, health_poll_s=0.05)
        self._engine = engine
        self._tokenizer = tokenizer
        self._kv_events = kv_events
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.server: PrefillServer | None = None

    def __enter__(self) -> ServerThread:
        self._thread.start()
        self.server = self.call(self._start)
        return self

    def __exit__(self, *exc: object) -> None:
        self.call(lambda: self.server.stop(0.5))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    @property
    def target(self) -> str:
        return f"{self.config.host}:{self.server.port}"

    def call(self, coro_fn: Callable):
        """Run ``coro_fn()`` on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro_fn(), self._loop).result(30)

    async def _start(self) -> PrefillServer:
        server = PrefillServer(
            self._engine, self.config, tokenizer=self._tokenizer, kv_events=self._kv_events
        )
        await server.start()
        return server


def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what or predicate}")
        time.sleep(0.01)


TINY_CONFIG = tiny_qwen3("tiny-grpc", max_position_embeddings=64)


def tiny_local_engine(num_blocks: int = 256, stage_delay_s: float = 0.0) -> LocalEngine:
    """A 2-stage LocalEngine on a random 3-layer model (block size 4, waves of 16 tokens);
    ``stage_delay_s`` > 0 makes every stage sleep that long per wave (real caches, slow)."""
    config = EngineConfig(
        stages=2,
        num_blocks=num_blocks,
        block_size=4,
        max_wave_tokens=16,
        debug_wave_delay_s=stage_delay_s,
    )
    return LocalEngine.from_weights(TINY_CONFIG, random_weights(TINY_CONFIG, seed=5), config)


def stage_used_blocks(engine: Engine) -> list[int]:
    return [s.used_blocks for s in engine.load().stages]


PIPELINE_HF = tiny_llama_hf(max_position_embeddings=256)  # vocab 64, 4 layers


def start_tiny_pipeline(**spec_fields) -> PipelineEngine:
    """A real 2-stage PipelineEngine (this process = stage 0, one spawned stage process, gloo
    on loopback) on the random tiny Llama: layers 2 + 2, block size 4. ``spec_fields``
    override PipelineSpec fields (stage_blocks, max_wave_tokens, debug_wave_delay_s, ...).
    Only one pipeline may run per process at a time (torch.distributed's default group)."""
    fields = {
        "stage_blocks": (256, 256),
        "block_size": 4,
        "max_wave_tokens": 32,
        "min_wave_tokens": 8,
        "dead_after_s": 3.0,
        **spec_fields,
    }
    spec = PipelineSpec(
        model=ModelSource(config=PIPELINE_HF, seed=11, name="tiny-grpc-pipeline"),
        layer_ranges=((0, 2), (2, 4)),
        **fields,
    )
    env = DistEnv(0, spec.num_stages, "127.0.0.1", free_local_port())
    return PipelineEngine.start(spec, env, startup_timeout_s=60)


def pipeline_server_config(**overrides) -> ServerConfig:
    """Loopback, any port, fast health polling; submit inline (the pipeline only enqueues)."""
    fields = {"host": "127.0.0.1", "port": 0, "health_poll_s": 0.05, "blocking_submit": False}
    return ServerConfig(**{**fields, **overrides})


def wait_mid_flight(engine: Engine, prompt_tokens: int, timeout_s: float = 10.0) -> None:
    """Until a ``prompt_tokens`` request is part-way through: admitted, partly computed, and
    holding blocks on every stage."""

    def mid_flight() -> bool:
        load = engine.load()
        started = 0 < load.inflight_tokens < prompt_tokens
        return started and all(s.used_blocks > 0 for s in load.stages)

    wait_until(mid_flight, timeout_s, "a request part-way through the pipeline")


def assert_same_result(remote, direct) -> None:
    """A result over gRPC equals the in-process engine's: first token, top-k ids (logprobs
    within 1e-4), token counts, and per-stage manifests (stage, layers, block count/size)."""
    import pytest

    assert remote.first_token_id == direct.first_token_id
    assert [t for t, _ in remote.top_logprobs] == [t for t, _ in direct.top_logprobs]
    for (_, got), (_, want) in zip(remote.top_logprobs, direct.top_logprobs, strict=True):
        assert got == pytest.approx(want, abs=1e-4)
    assert (remote.prompt_tokens, remote.cached_tokens, remote.computed_tokens) == (
        direct.prompt_tokens,
        direct.cached_tokens,
        direct.computed_tokens,
    )
    assert [
        (m.stage, m.layer_start, m.layer_end, m.block_size, len(m.block_ids))
        for m in remote.stage_manifests
    ] == [
        (m.stage, m.layer_start, m.layer_end, m.block_size, len(m.block_ids))
        for m in direct.stage_manifests
    ]
