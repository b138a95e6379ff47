"""Hybrid families' hand-off: 2-stage multi-process PipelineEngine -> NIXL -> decode worker.

Qwen3-Next (gated-delta-rule layers 0, 1, 3 + a GQA layer 2) and Kimi Linear (KDA layers
0, 1, 3 + an MLA layer 2), sliced [0, 2) | [2, 4): stage 0 holds recurrent layers only (it
ships state slots and no paged block), stage 1 an attention layer's blocks plus layer 3's
state. Prefill blocks hold 4 tokens, decode's 8, and both prompts end mid-block on both
sides, so the state slot shipped is a partial block's live state. Per family one prompt
goes by push (streamed while it runs) and a longer one sharing its first 3 blocks by pull
(the stages resume it from a reused snapshot); decode continues each from the shipped
state and blocks, and its greedy tokens must equal transformers' ``generate``. Afterwards no
stage and no decode block is held and every integrity check passes.
"""

from __future__ import annotations

import random

import pytest

from prefill_node.decode.worker_process import DecodeWorkerProcess, DecodeWorkerSpec
from prefill_node.engine.types import KVPullDestination, PrefillOptions
from prefill_node.kv_handoff.config import KVHandoffConfig
from prefill_node.model.config import ModelConfig
from prefill_node.model.loader_hf import save_hf_checkpoint
from prefill_node.model.weights import random_weights
from prefill_node.runtime.dist_env import DistEnv, free_local_port
from prefill_node.runtime.pipeline_engine import PipelineEngine
from prefill_node.runtime.spec import ModelSource, PipelineSpec
from tests.test_runtime_kv_handoff import wait_idle
from tests.tiny_models import TINY_KIMI_HF, TINY_QWEN3_NEXT_HF

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

FAMILIES = {"qwen3-next": TINY_QWEN3_NEXT_HF, "kimi-linear": TINY_KIMI_HF}
# debug_post_before_push: what stage 1 streams must not depend on when its hand-off thread
# gets a core (unposted ranges would ride the final push; test_runtime_kv_stream.py says why)
SHIPPING = KVHandoffConfig(
    transfer_timeout_s=5.0, handshake_timeout_s=1.0, lease_ttl_s=5.0, debug_post_before_push=True
)
NEW_TOKENS = 8


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(checkpoint directory, engine, decode worker) of one family; torn down clean."""
    config = ModelConfig.from_hf_config(FAMILIES[request.param], name=f"tiny-{request.param}")
    path = tmp_path_factory.mktemp(request.param)
    save_hf_checkpoint(path, config, random_weights(config, seed=5))
    spec = PipelineSpec(
        model=ModelSource(path=str(path)),
        layer_ranges=((0, 2), (2, 4)),
        stage_blocks=(24, 24),
        block_size=4,
        max_wave_tokens=8,  # several chunks: stage 1 streams its attention blocks
        min_wave_tokens=4,
        dead_after_s=5.0,
    )
    decode_spec = DecodeWorkerSpec(model_dir=str(path), num_blocks=16, block_size=8, timeout_s=5)
    env = DistEnv(0, 2, "127.0.0.1", free_local_port())
    with DecodeWorkerProcess(decode_spec) as decode:
        engine = PipelineEngine.start(spec, env, startup_timeout_s=60, kv_handoff=SHIPPING)
        try:
            yield path, engine, decode
            wait_idle(engine)
            assert decode.stats().used_blocks == 0
        finally:
            engine.shutdown()


def test_decode_continues_from_shipped_state_like_transformers_generate(family):
    from tests.hf_reference import transformers_greedy

    path, engine, decode = family
    rng = random.Random(11)
    first = [rng.randrange(64) for _ in range(13)]
    longer = first + [rng.randrange(64) for _ in range(6)]  # 19 tokens, 3 blocks reused
    want = transformers_greedy(path, [first, longer], NEW_TOKENS)

    dest = decode.expect_push("push", first)
    pushed = engine.submit(first, PrefillOptions("push", kv_destination=dest)).result(30)
    assert [m.pushed for m in pushed.stage_manifests] == [True, True]
    got = list(decode.generate("push", pushed.first_token_id, NEW_TOKENS))
    assert got == want[0]
    # stage 0 (no paged layer) streams nothing. Stage 1 streams its attention layer's blocks
    # of the earlier chunks (all its layers, whole blocks below the last one), then that
    # layer's group of the last chunk to the prompt's end; the final push carries layer 3's
    # state (and "done")
    parts = [p for p in decode.kv_log()[0] if p.request_id == "push"]
    assert {p.stage for p in parts} == {1}
    ends = sorted(p.end_token for p in parts if (p.layer_start, p.layer_end) == (2, 4))
    assert ends and all(end % 4 == 0 and end <= 12 for end in ends)
    groups = [(p.layer_start, p.layer_end, p.end_token) for p in parts if p.layer_end < 4]
    assert groups == [(2, 3, len(first))]
    wait_idle(engine)

    pull = PrefillOptions("pull", kv_destination=KVPullDestination())
    pulled = engine.submit(longer, pull).result(30)
    assert pulled.cached_tokens == 12
    stage0, stage1 = pulled.stage_manifests
    assert not stage0.regions and [s.layer for s in stage0.states] == [0, 0, 1, 1]
    assert [r.layer for r in stage1.regions] == [2] and {s.layer for s in stage1.states} == {3}
    decode.pull("pull", longer, pulled.stage_manifests)
    got = list(decode.generate("pull", pulled.first_token_id, NEW_TOKENS))
    assert got == want[1]
    wait_idle(engine)  # decode's release ended both stages' leases
