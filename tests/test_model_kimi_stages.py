"""Kimi Linear stages (KDA + MLA over a ``HybridLatentCache``) == transformers, whole model.

Our stages against transformers' eager ``KimiLinearForCausalLM`` from the same checkpoint
directory, over 1/2/3-stage slicings: every position's logits, the MLA layer's cached latent
and key part, and every KDA layer's final recurrent matrix and conv tail, plus a block
snapshot mid-prompt against transformers on that prefix. Chunked prefill at random
boundaries equals one shot, a prompt resuming from a reused block's snapshot equals a full
recompute, and the engine's prefix reuse stops at snapshot boundaries.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from prefill_node.model.batch import ChunkBatch, ChunkSpec
from prefill_node.model.latent_cache import HybridLatentCache, stage_cache
from prefill_node.model.loader_hf import save_hf_checkpoint
from prefill_node.model.partition import LayerRange, split_layers
from prefill_node.model.stage_model import StageModel
from prefill_node.model.weights import random_weights
from tests.hybrid_checks import check_eviction_shrinks_reuse, check_reuse_up_to_a_snapshot
from tests.tiny_models import tiny_kimi

ATOL = 1e-4
BLOCK = 8
CONFIG = tiny_kimi()
TOKENS = torch.randint(0, 64, (70,), generator=torch.Generator().manual_seed(1)).tolist()
NUM_BLOCKS = 24
WEIGHTS = random_weights(CONFIG, seed=3)
TABLE = tuple(reversed(range(-(-len(TOKENS) // BLOCK))))  # not the identity: paging matters


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi_linear")
    save_hf_checkpoint(path, CONFIG, WEIGHTS)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert type(model).__name__ == "KimiLinearForCausalLM"
    return model


def hf_run(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens]), use_cache=True)


def make_stages(num_stages: int):
    out = []
    for lr in split_layers(CONFIG.num_layers, num_stages):
        stage = StageModel(CONFIG, lr)
        stage.load_weights(WEIGHTS)
        out.append((stage, stage_cache(CONFIG, lr, NUM_BLOCKS, BLOCK)))
    return out


def run(stages, batch: ChunkBatch, tokens: list[int]):
    x = torch.tensor(tokens)
    for stage, cache in stages:
        x = stage(x, batch, cache)
    return x


def hf_kda_state(hf_layer):
    """(recurrent matrix, conv tail [K - 1, C]) from a transformers cache layer (it keeps K
    conv columns, we K - 1)."""
    return hf_layer.recurrent_states[0][0], hf_layer.conv_states[0][0, :, 1:].T


def all_state(stages, table, num_tokens):
    out = []
    for _, cache in stages:
        for layer in cache.layer_range:
            if CONFIG.is_linear_layer(layer):
                out.extend(cache.read_state(layer, table, num_tokens))
            else:
                out.append(cache.read(layer, table, num_tokens))
    return out


@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_stages_match_transformers_logits_latents_and_states(hf_model, num_stages):
    hf = hf_run(hf_model, TOKENS)
    stages = make_stages(num_stages)
    hidden = run(stages, ChunkBatch((ChunkSpec(0, len(TOKENS), TABLE),)), TOKENS)
    torch.testing.assert_close(
        stages[-1][0].compute_logits(hidden), hf.logits[0], atol=ATOL, rtol=0
    )
    hf_layers = hf.past_key_values.layers
    checked = set()
    for _, cache in stages:
        assert isinstance(cache, HybridLatentCache)
        for layer in cache.layer_range:
            if CONFIG.is_linear_layer(layer):
                got = cache.read_state(layer, TABLE, len(TOKENS))
                want = hf_kda_state(hf_layers[layer])
            else:
                latent, key_part, index_key = cache.split(cache.read(layer, TABLE, len(TOKENS)))
                assert index_key.shape[-1] == 0
                got = (latent, key_part)
                want = (hf_layers[layer].keys[0, 0], hf_layers[layer].values[0, 0])
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, atol=ATOL, rtol=0)
            checked.add(layer)
    assert checked == set(range(CONFIG.num_layers))


def test_block_snapshots_equal_transformers_on_the_prefix(hf_model):
    stages = make_stages(1)
    run(stages, ChunkBatch((ChunkSpec(0, len(TOKENS), TABLE),)), TOKENS)
    cache = stages[0][1]
    hf = hf_run(hf_model, TOKENS[:32])
    for layer in CONFIG.recurrent.layers:
        state, tail = cache.recurrent.read(layer, TABLE[3])  # the block ending at 32
        ref_state, ref_tail = hf_kda_state(hf.past_key_values.layers[layer])
        torch.testing.assert_close(state, ref_state, atol=ATOL, rtol=0)
        torch.testing.assert_close(tail, ref_tail, atol=ATOL, rtol=0)
        final, _ = cache.read_state(layer, TABLE, len(TOKENS))
        assert (final - state).abs().max() > 1e-3


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
    got, want = all_state(chunked, TABLE, len(TOKENS)), all_state(whole, TABLE, len(TOKENS))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)


@pytest.mark.parametrize("num_stages", [1, 3])
def test_prefix_reuse_from_a_snapshot_equals_full_recompute(num_stages):
    """Prompt B shares A's first 3 blocks: B resumes at 24 from A's block-3 snapshots (and
    latents), writing only its own blocks."""
    stages = make_stages(num_stages)
    a_table = tuple(range(5))
    run(stages, ChunkBatch((ChunkSpec(0, 40, a_table),)), TOKENS[:40])
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
    for g, w in zip(all_state(stages, b_table, 44), all_state(fresh, b_table, 44), strict=True):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)


def test_engine_reuses_prefixes_up_to_a_snapshot_and_matches_transformers(hf_model):
    def want(prompt):
        return hf_run(hf_model, prompt).logits[0, -1]

    check_reuse_up_to_a_snapshot(CONFIG, WEIGHTS, TOKENS, BLOCK, want, ATOL)


def test_evicted_blocks_shrink_the_reused_prefix_and_never_give_a_wrong_state(hf_model):
    def want(prompt):
        return hf_run(hf_model, prompt).logits[0, -1]

    check_eviction_shrinks_reuse(CONFIG, WEIGHTS, TOKENS, BLOCK, want, ATOL)


def test_moe_routes_within_the_best_group_in_fp32():
    stage = StageModel(CONFIG, LayerRange(0, 2))
    stage.load_weights(WEIGHTS)
    assert stage.layers[0].moe is None  # first_k_dense_replace = 1
    moe = stage.layers[1].moe
    # transformers keeps the router (gate.weight) in fp32 whatever the model's dtype
    assert StageModel(CONFIG, LayerRange(1, 2), torch.bfloat16).layers[0].moe.router.dtype == (
        torch.float32
    )
    h = torch.nn.functional.embedding(torch.tensor(TOKENS), stage.embed)
    experts, weights = moe.route(h)
    assert len(set(experts.flatten().tolist())) >= 6
    assert ((experts // 4)[:, 0] == (experts // 4)[:, 1]).all()  # both from one group of 4
    torch.testing.assert_close(weights.sum(-1), torch.full((len(TOKENS),), 2.5))


def test_cache_bytes_per_block_include_snapshots():
    for lr in split_layers(CONFIG.num_layers, 3):
        cache = stage_cache(CONFIG, lr, 3, BLOCK)
        held = sum(t[0].numel() * t.element_size() for t in cache.tensors)
        snaps = cache.recurrent
        held += sum(t[0].numel() * t.element_size() for t in (*snaps.states, *snaps.tails))
        assert CONFIG.cache_bytes_per_block(lr, BLOCK, torch.float32) == cache.block_bytes == held
    snapshot = 4 * 8 * 8 * 4 + 3 * (3 * 32) * 4  # 4 heads of 8x8 fp32, 3 rows of q/k/v tail
    assert CONFIG.recurrent.snapshot_bytes(4) == snapshot
    latent = BLOCK * (16 + 8) * 4
    assert CONFIG.cache_bytes_per_block(range(4), BLOCK, torch.float32) == 3 * snapshot + latent


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_bf16_runs_close_to_fp32(hf_model, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    stages = []
    for lr in split_layers(CONFIG.num_layers, 2):
        stage = StageModel(CONFIG, lr, dtype=torch.bfloat16, device=device)
        stage.load_weights(WEIGHTS)
        stages.append((stage, stage_cache(CONFIG, lr, NUM_BLOCKS, BLOCK, torch.bfloat16, device)))
    for start, end in ((0, 29), (29, len(TOKENS))):  # 29 is mid-block: the live state carries
        x = torch.tensor(TOKENS[start:end], device=device)
        for stage, cache in stages:
            x = stage(x, ChunkBatch((ChunkSpec(start, end - start, TABLE),)), cache)
    assert x.dtype == torch.bfloat16 and stages[0][1].recurrent.states[0].dtype == torch.float32
    logits = stages[-1][0].compute_logits(x[-1:])[0].cpu()
    ref = hf_run(hf_model, TOKENS).logits[0, -1]
    assert torch.isfinite(logits).all()
    assert torch.nn.functional.cosine_similarity(logits, ref, dim=0) > 0.99
