"""Qwen3-Next (gated-delta-rule linear attention + gated full attention + softmax MoE with a
gated shared expert) == transformers, and its recurrent-state snapshots.

Our stages over a hybrid cache (paged K/V for the attention layer, a recurrent-state snapshot
per block for the linear layers) against transformers' eager forward from the same
checkpoint directory, over 1/2/3-stage slicings: every position's logits, the attention
layer's K/V, and every linear layer's final recurrent matrix and conv tail, plus a snapshot
mid-prompt against transformers on that prefix. Chunked prefill at random boundaries equals
one shot, and a prompt resuming from a reused block's snapshot equals a full recompute.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from prefill_node.errors import UnsupportedArchitectureError
from prefill_node.model.batch import ChunkBatch, ChunkSpec
from prefill_node.model.config import ModelConfig
from prefill_node.model.latent_cache import stage_cache
from prefill_node.model.loader_hf import load_hf_config, save_hf_checkpoint
from prefill_node.model.partition import LayerRange, split_layers
from prefill_node.model.recurrent_cache import HybridKVCache
from prefill_node.model.stage_model import StageModel
from prefill_node.model.weights import random_weights, weight_shapes
from prefill_node.runtime.engine_config import EngineConfig
from prefill_node.runtime.local_engine import LocalEngine
from tests.hybrid_checks import check_eviction_shrinks_reuse, check_reuse_up_to_a_snapshot
from tests.tiny_models import TINY_QWEN3_NEXT_HF, tiny_qwen3_next

ATOL = 1e-4
BLOCK = 8
CONFIG = tiny_qwen3_next()
TOKENS = torch.randint(0, 64, (70,), generator=torch.Generator().manual_seed(1)).tolist()
NUM_BLOCKS = 24
WEIGHTS = random_weights(CONFIG, seed=3)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_next")
    save_hf_checkpoint(path, CONFIG, WEIGHTS)
    return path


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert type(model).__name__ == "Qwen3NextForCausalLM"
    return model


def hf_run(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens]), use_cache=True)


def make_stages(num_stages: int, config: ModelConfig = CONFIG):
    out = []
    for lr in split_layers(config.num_layers, num_stages):
        stage = StageModel(config, lr)
        stage.load_weights(WEIGHTS)
        out.append((stage, stage_cache(config, lr, NUM_BLOCKS, BLOCK)))
    return out


def run(stages, batch: ChunkBatch, tokens: list[int]):
    """One forward of ``batch`` through every stage; the last stage's residual stream."""
    x = torch.tensor(tokens)
    for stage, cache in stages:
        x = stage(x, batch, cache)
    return x


TABLE = tuple(reversed(range(-(-len(TOKENS) // BLOCK))))  # not the identity: paging matters


def hf_linear_state(hf_layer):
    """(recurrent matrix [H, Dk, Dv], conv tail [K - 1, C]) from a transformers cache layer."""
    return hf_layer.recurrent_states[0][0], hf_layer.conv_states[0][0, :, 1:].T


@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_stages_match_transformers_logits_kv_and_states(hf_model, num_stages):
    hf = hf_run(hf_model, TOKENS)
    stages = make_stages(num_stages)
    hidden = run(stages, ChunkBatch((ChunkSpec(0, len(TOKENS), TABLE),)), TOKENS)
    logits = stages[-1][0].compute_logits(hidden)
    torch.testing.assert_close(logits, hf.logits[0], atol=ATOL, rtol=0)
    hf_layers = hf.past_key_values.layers
    checked = set()
    for _, cache in stages:
        assert isinstance(cache, HybridKVCache)
        for layer in cache.layer_range:
            if CONFIG.is_linear_layer(layer):
                state, tail = cache.read_state(layer, TABLE, len(TOKENS))
                ref_state, ref_tail = hf_linear_state(hf_layers[layer])
                torch.testing.assert_close(state, ref_state, atol=ATOL, rtol=0)
                torch.testing.assert_close(tail, ref_tail, atol=ATOL, rtol=0)
            else:
                k, v = cache.read(layer, TABLE, len(TOKENS))
                torch.testing.assert_close(
                    k, hf_layers[layer].keys[0].transpose(0, 1), atol=ATOL, rtol=0
                )
                torch.testing.assert_close(
                    v, hf_layers[layer].values[0].transpose(0, 1), atol=ATOL, rtol=0
                )
            checked.add(layer)
    assert checked == set(range(CONFIG.num_layers))


def test_block_snapshots_equal_transformers_on_the_prefix(hf_model):
    """The snapshot in the block ending at 32 is the state after 32 tokens, as transformers
    computes it on that prefix alone (and differs from the final state)."""
    stages = make_stages(1)
    run(stages, ChunkBatch((ChunkSpec(0, len(TOKENS), TABLE),)), TOKENS)
    cache = stages[0][1]
    hf = hf_run(hf_model, TOKENS[:32])
    for layer in CONFIG.recurrent.layers:
        state, tail = cache.recurrent.read(layer, TABLE[3])
        ref_state, ref_tail = hf_linear_state(hf.past_key_values.layers[layer])
        torch.testing.assert_close(state, ref_state, atol=ATOL, rtol=0)
        torch.testing.assert_close(tail, ref_tail, atol=ATOL, rtol=0)
        final, _ = cache.read_state(layer, TABLE, len(TOKENS))
        assert (final - state).abs().max() > 1e-3


def _all_state(stages, table, num_tokens):
    out = []
    for _, cache in stages:
        for layer in cache.layer_range:
            if CONFIG.is_linear_layer(layer):
                out.extend(cache.read_state(layer, table, num_tokens))
            else:
                out.extend(cache.read(layer, table, num_tokens))
    return out


@settings(max_examples=6, deadline=None)
@given(
    cuts=st.lists(st.integers(1, len(TOKENS) - 1), max_size=4, unique=True),
    num_stages=st.sampled_from([1, 2, 3]),
    same_batch=st.booleans(),
)
def test_chunked_prefill_at_random_boundaries_equals_one_shot(cuts, num_stages, same_batch):
    whole = make_stages(num_stages)
    one_shot = run(whole, ChunkBatch((ChunkSpec(0, len(TOKENS), TABLE),)), TOKENS)
    chunked = make_stages(num_stages)
    bounds = [0, *sorted(cuts), len(TOKENS)]
    specs = [ChunkSpec(a, b - a, TABLE) for a, b in zip(bounds, bounds[1:], strict=False)]
    if same_batch:  # chunks of one sequence in one batch run in row order
        hidden = run(chunked, ChunkBatch(tuple(specs)), TOKENS)
    else:
        hidden = torch.cat([run(chunked, ChunkBatch((s,)), TOKENS[s.start : s.end]) for s in specs])
    torch.testing.assert_close(hidden, one_shot, atol=ATOL, rtol=0)
    for got, want in zip(
        _all_state(chunked, TABLE, len(TOKENS)), _all_state(whole, TABLE, len(TOKENS)), strict=True
    ):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("num_stages", [1, 3])
def test_prefix_reuse_from_a_snapshot_equals_full_recompute(num_stages):
    """Prompt B shares A's first 3 blocks: B resumes at 24 from A's block-3 snapshot (and K/V),
    writing only its own blocks. A prompt wholly inside A's cached blocks recomputes only its
    last token, resuming from the snapshot of its last full block."""
    stages = make_stages(num_stages)
    a_table = tuple(range(5))
    prompt_a = TOKENS[:40]
    run(stages, ChunkBatch((ChunkSpec(0, 40, a_table),)), prompt_a)
    shared = 24
    prompt_b = TOKENS[:shared] + TOKENS[50:70]
    b_table = a_table[:3] + (10, 11, 12)
    reused = run(stages, ChunkBatch((ChunkSpec(shared, 20, b_table),)), prompt_b[shared:])
    fresh = make_stages(num_stages)
    full = run(fresh, ChunkBatch((ChunkSpec(0, 44, b_table),)), prompt_b)
    head = stages[-1][0]
    torch.testing.assert_close(
        head.compute_logits(reused), head.compute_logits(full[shared:]), atol=ATOL, rtol=0
    )
    for got, want in zip(
        _all_state(stages, b_table, 44), _all_state(fresh, b_table, 44), strict=True
    ):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    # wholly cached prompt of 33 tokens: reuse (33 - 1) // 8 = 4 blocks, recompute token 32
    prompt_c = TOKENS[:33]
    c_table = a_table[:4] + (13,)
    last = run(stages, ChunkBatch((ChunkSpec(32, 1, c_table),)), prompt_c[32:])
    full_c = run(make_stages(num_stages), ChunkBatch((ChunkSpec(0, 33, c_table),)), prompt_c)
    torch.testing.assert_close(
        head.compute_logits(last), head.compute_logits(full_c[-1:]), atol=ATOL, rtol=0
    )


def test_engine_reuses_prefixes_up_to_a_snapshot_and_matches_transformers(hf_model):
    def want(prompt):
        return hf_run(hf_model, prompt).logits[0, -1]

    check_reuse_up_to_a_snapshot(CONFIG, WEIGHTS, TOKENS, BLOCK, want, ATOL)


def test_evicted_blocks_shrink_the_reused_prefix_and_never_give_a_wrong_state(hf_model):
    def want(prompt):
        return hf_run(hf_model, prompt).logits[0, -1]

    check_eviction_shrinks_reuse(CONFIG, WEIGHTS, TOKENS, BLOCK, want, ATOL)


def test_the_server_reports_the_snapshot_interval_to_routers():
    from prefill_node.client.remote_engine import RemoteEngine
    from tests.grpc_harness import ServerThread

    config = EngineConfig(stages=2, num_blocks=8, block_size=BLOCK)
    with ServerThread(LocalEngine.from_weights(CONFIG, WEIGHTS, config)) as srv:
        remote = RemoteEngine(srv.target)
        try:
            assert remote.info.snapshot_interval_blocks == 1
            assert remote.cache_identity.snapshot_interval_blocks == 1
        finally:
            remote.shutdown()


def test_one_token_steps_from_the_cache_continue_like_transformers_generate(hf_model):
    """Decode-style continuation: single-token chunks resuming from the live state in the
    partial last block give transformers' greedy tokens (its own single-token recurrent path)."""
    prompt, steps = TOKENS[:21], 6
    with torch.no_grad():
        ids = torch.tensor([prompt])
        gen = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            pad_token_id=0,
        )
    stages = make_stages(2)
    table = tuple(range(NUM_BLOCKS - 1, -1, -1))
    x = run(stages, ChunkBatch((ChunkSpec(0, len(prompt), table),)), prompt)
    tokens = []
    for step in range(steps):
        tokens.append(int(stages[-1][0].compute_logits(x[-1:])[0].argmax()))
        x = run(stages, ChunkBatch((ChunkSpec(len(prompt) + step, 1, table),)), tokens[-1:])
    assert tokens == gen[0, len(prompt) :].tolist()


def test_moe_routes_tokens_to_many_experts():
    stage = StageModel(CONFIG, LayerRange(0, 4))
    stage.load_weights(WEIGHTS)
    moe = stage.layers[0].moe
    h = torch.nn.functional.embedding(torch.tensor(TOKENS), stage.embed)
    experts, weights = moe.route(h)
    assert len(set(experts.flatten().tolist())) >= 6
    torch.testing.assert_close(weights.sum(-1), torch.ones(len(TOKENS)))
    assert moe.shared_gate is not None


def test_cache_bytes_per_block_include_snapshots():
    for lr in split_layers(CONFIG.num_layers, 3):
        cache = stage_cache(CONFIG, lr, 3, BLOCK)
        held = sum(t[0].numel() * t.element_size() for t in cache.tensors)
        snaps = cache.recurrent
        held += sum(t[0].numel() * t.element_size() for t in (*snaps.states, *snaps.tails))
        assert CONFIG.cache_bytes_per_block(lr, BLOCK, torch.float32) == cache.block_bytes == held
    r = CONFIG.recurrent
    snapshot = 4 * 8 * 6 * 4 + 3 * (2 * 16 + 24) * 4
    assert r.snapshot_bytes(4) == snapshot
    assert CONFIG.cache_bytes_per_block(range(4), BLOCK, torch.float32) == (
        3 * snapshot + BLOCK * 2 * 2 * 8 * 4
    )


def test_config_round_trip_and_typed_errors(tmp_path):
    assert ModelConfig.from_hf_config(CONFIG.to_hf_config(), name=CONFIG.name) == CONFIG
    names = weight_shapes(CONFIG, LayerRange(0, 1))
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in names
    assert "model.layers.0.self_attn.q_proj.weight" not in names
    for changes, match in (
        ({"mlp_only_layers": [1]}, "mlp_only_layers"),
        ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
        ({"norm_topk_prob": False}, "norm_topk_prob"),
        ({"num_experts": 0}, "num_experts"),
        ({"layer_types": ["linear_attention", "sliding_attention"] * 2}, "layer_types"),
        ({"attention_bias": True}, "attention_bias"),
    ):
        (tmp_path / "config.json").write_text(json.dumps({**TINY_QWEN3_NEXT_HF, **changes}))
        with pytest.raises(UnsupportedArchitectureError, match=match):
            load_hf_config(tmp_path)
