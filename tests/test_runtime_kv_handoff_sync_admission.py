"""The KV hand-off under the sync-admission policy, with uneven stages (one pipeline per process:
torch.distributed has one default group, so it cannot share test_runtime_kv_handoff's)."""

from __future__ import annotations

import pytest

from prefill_node.decode.worker_process import DecodeWorkerProcess, DecodeWorkerSpec
from prefill_node.engine.types import KVPullDestination, PrefillOptions
from prefill_node.runtime.dist_env import DistEnv, free_local_port
from prefill_node.runtime.pipeline_engine import PipelineEngine
from prefill_node.runtime.spec import ModelSource, PipelineSpec
from tests.test_runtime_kv_handoff import (
    BS,
    CONFIG,
    HF_CONFIG,
    NEW_TOKENS,
    SHIPPING,
    prompt_of,
    reference_greedy,
    wait_idle,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def decode():
    spec = DecodeWorkerSpec(model_config=CONFIG, seed=0, num_blocks=32, block_size=8, timeout_s=5)
    with DecodeWorkerProcess(spec) as worker:
        yield worker
        assert worker.stats().used_blocks == 0


def test_sync_admission_pipeline_ships_push_and_pull(decode):
    """Under sync-admission (rounds on stage 0's loop) the hand-offs' outcomes still reach the
    leader as they happen, for push and pull."""
    spec = PipelineSpec(
        model=ModelSource(config=HF_CONFIG, seed=0, name="tiny-llama"),
        layer_ranges=((0, 1), (1, 4)),  # uneven: each stage ships its own layer count
        stage_blocks=(24, 24),
        block_size=BS,
        policy="sync-admission",
        max_wave_tokens=8,
        min_wave_tokens=8,
    )
    env = DistEnv(0, 2, "127.0.0.1", free_local_port())
    engine = PipelineEngine.start(spec, env, startup_timeout_s=60, kv_handoff=SHIPPING)
    try:
        prompt = prompt_of(15, seed=9)
        dest = decode.expect_push("lock-push", prompt)
        result = engine.submit(prompt, PrefillOptions("lock-push", kv_destination=dest)).result(30)
        assert [(m.layer_start, m.layer_end, m.pushed) for m in result.stage_manifests] == [
            (0, 1, True),
            (1, 4, True),
        ]
        tokens = list(decode.generate("lock-push", result.first_token_id, NEW_TOKENS))
        assert tokens == reference_greedy(prompt)
        pull = engine.submit(
            prompt, PrefillOptions("lock-pull", kv_destination=KVPullDestination())
        )
        manifests = pull.result(30).stage_manifests
        decode.pull("lock-pull", prompt, manifests)
        tokens = list(decode.generate("lock-pull", result.first_token_id, NEW_TOKENS))
        assert tokens == reference_greedy(prompt)
        wait_idle(engine)
    finally:
        engine.shutdown()
