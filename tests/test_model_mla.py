"""GLM-5 (glm_moe_dsa: MLA + DSA indexer + grouped MoE with a shared expert) == transformers.

Our stages over a paged latent cache against transformers' eager forward from the same
checkpoint directory, over 1/2/3-stage slicings: every position's logits, and every layer's
cached latent, rotated key and indexer key. The 40-token prompt is longer than the indexer's
top-k (8), so late queries really attend to a subset; guards below check that the subset is
strict and that it changes the numerics, and that the MoE spreads tokens over experts.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from prefill_node.errors import UnsupportedArchitectureError
from prefill_node.model.attention import AttentionPlan, causal_hidden
from prefill_node.model.batch import ChunkBatch, ChunkSpec
from prefill_node.model.config import ModelConfig
from prefill_node.model.latent_cache import PagedLatentCache, stage_cache
from prefill_node.model.loader_hf import load_hf_config, save_hf_checkpoint
from prefill_node.model.mla import attend_cpu
from prefill_node.model.partition import LayerRange, split_layers
from prefill_node.model.reference import reference_forward
from prefill_node.model.stage_model import StageModel
from prefill_node.model.weights import random_weights
from tests.tiny_models import TINY_GLM5_HF, tiny_glm5

ATOL = 1e-4
BLOCK = 4
CONFIG = tiny_glm5()
TOKENS = torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm5")
    weights = random_weights(CONFIG, seed=3)
    save_hf_checkpoint(path, CONFIG, weights)
    return path, weights


@pytest.fixture(scope="module")
def hf_out(checkpoint):
    path, _ = checkpoint
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert type(model).__name__ == "GlmMoeDsaForCausalLM"
    with torch.no_grad():
        return model(torch.tensor([TOKENS]), use_cache=True)


def run_stages(config: ModelConfig, weights, num_stages: int):
    n = -(-len(TOKENS) // BLOCK)
    table = tuple(reversed(range(n)))  # not the identity: paging must matter
    batch = ChunkBatch((ChunkSpec(0, len(TOKENS), table),))
    x, caches, stages = torch.tensor(TOKENS), [], []
    for lr in split_layers(config.num_layers, num_stages):
        stage = StageModel(config, lr)
        stage.load_weights(weights)
        cache = stage_cache(config, lr, n, BLOCK)
        x = stage(x, batch, cache)
        caches.append(cache)
        stages.append(stage)
    return stages[-1].compute_logits(x), caches, table, stages


@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_stages_match_transformers_logits_and_latent_cache(checkpoint, hf_out, num_stages):
    _, weights = checkpoint
    logits, caches, table, _ = run_stages(CONFIG, weights, num_stages)
    torch.testing.assert_close(logits, hf_out.logits[0], atol=ATOL, rtol=0)
    hf_layers = hf_out.past_key_values.layers
    for cache in caches:
        assert isinstance(cache, PagedLatentCache)
        for layer in cache.layer_range:
            latent, k_rot, index_key = cache.split(cache.read(layer, table, len(TOKENS)))
            hf = hf_layers[layer]
            torch.testing.assert_close(latent, hf.keys[0, 0], atol=ATOL, rtol=0)
            torch.testing.assert_close(k_rot, hf.values[0, 0], atol=ATOL, rtol=0)
            torch.testing.assert_close(index_key, hf.indexer_keys[0], atol=ATOL, rtol=0)


def test_indexer_drops_tokens_and_that_changes_the_output(checkpoint):
    """Guard against a test that cannot fail: late queries see exactly index_topk (8) of
    their causal positions, and a wide-open indexer gives different logits."""
    _, weights = checkpoint
    logits, caches, table, stages = run_stages(CONFIG, weights, 1)
    attn = stages[0].layers[1].attn
    batch = ChunkBatch((ChunkSpec(0, len(TOKENS), table),))
    cp = AttentionPlan.build(batch, caches[0], torch.float32).chunks[0]
    _, _, index_keys = caches[0].split(caches[0].read(1, table, len(TOKENS)))
    iq = torch.randn(40, 16, 16, generator=torch.Generator().manual_seed(0))
    iw = torch.randn(40, 16, generator=torch.Generator().manual_seed(1))
    chosen = attn.selection(iq, iw, index_keys, cp)
    counts = chosen.sum(-1).tolist()
    assert counts == [min(i + 1, 8) for i in range(40)]
    assert not chosen.triu(1).any()  # causal
    wide = tiny_glm5(index_topk=64)
    wide_logits, _, _, _ = run_stages(wide, weights, 1)
    assert (wide_logits[:8] - logits[:8]).abs().max() < ATOL  # fewer than 8 keys: same
    assert (wide_logits[-1] - logits[-1]).abs().max() > 1e-3


def test_moe_routes_to_different_experts_within_the_best_group(checkpoint):
    _, weights = checkpoint
    stage = StageModel(CONFIG, LayerRange(0, 3))
    stage.load_weights(weights)
    assert stage.layers[0].moe is None and stage.layers[0].gate_up is not None  # dense first
    moe = stage.layers[1].moe
    h = torch.nn.functional.embedding(torch.tensor(TOKENS), stage.embed)
    experts, w = moe.route(h)
    assert len(set(experts.flatten().tolist())) >= 6
    assert ((experts // 4)[:, 0] == (experts // 4)[:, 1]).all()  # both from one group of 4
    torch.testing.assert_close(w.sum(-1), torch.full((40,), 2.5))  # routed_scaling_factor


def test_config_round_trip_and_typed_errors(tmp_path):
    assert ModelConfig.from_hf_config(CONFIG.to_hf_config(), name="tiny-glm5") == CONFIG
    assert CONFIG.kv_bytes_per_token(3, torch.float32) == 3 * (16 + 8 + 16) * 4
    for changes, match in (
        ({"indexer_types": ["full", "shared", "full"]}, "shared"),
        ({"index_topk_freq": 2}, "index_topk_freq"),
        ({"q_lora_rank": None}, "q_lora_rank"),
        ({"mlp_layer_types": ["sparse", "dense", "sparse"]}, "mlp_layer_types"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"norm_topk_prob": False}, "norm_topk_prob"),
    ):
        (tmp_path / "config.json").write_text(json.dumps({**TINY_GLM5_HF, **changes}))
        with pytest.raises(UnsupportedArchitectureError, match=match):
            load_hf_config(tmp_path)
    with pytest.raises(UnsupportedArchitectureError, match="transformers"):
        reference_forward(CONFIG, random_weights(CONFIG, seed=0), [1, 2])


def test_bf16_runs_close_to_fp32(checkpoint, hf_out):
    _, weights = checkpoint
    stage = StageModel(CONFIG, LayerRange(0, 3), dtype=torch.bfloat16)
    stage.load_weights(weights)
    cache = stage_cache(CONFIG, stage.layer_range, 12, BLOCK, dtype=torch.bfloat16)
    table = tuple(range(11, -1, -1))
    stage(torch.tensor(TOKENS[:17]), ChunkBatch((ChunkSpec(0, 17, table),)), cache)
    hidden = stage(torch.tensor(TOKENS[17:]), ChunkBatch((ChunkSpec(17, 23, table),)), cache)
    assert hidden.dtype == torch.bfloat16 and cache.tensors[0].dtype == torch.bfloat16
    logits = stage.compute_logits(hidden[-1:])[0]
    ref = hf_out.logits[0, -1]
    assert torch.isfinite(logits).all()
    assert torch.nn.functional.cosine_similarity(logits, ref, dim=0) > 0.99


@pytest.mark.parametrize(
    ("start", "end", "sparse"), [(0, 37, False), (21, 53, False), (21, 53, True)]
)
def test_cpu_attention_is_sdpa_bit_for_bit(start, end, sparse):
    """The CPU MLA attention (q/k head dim 24 != v head dim 16) gives exactly SDPA's bits,
    causal from position 0, offset-causal after a context, and with a sparse selection."""
    g = torch.Generator().manual_seed(end + sparse)
    q, k = torch.randn(4, end - start, 24, generator=g), torch.randn(4, end, 24, generator=g)
    v = torch.randn(4, end, 16, generator=g)
    hidden = causal_hidden(start, end, q.device)
    if sparse:
        hidden |= torch.rand(hidden.shape, generator=g) < 0.5
        hidden[:, 0] = False  # every query keeps a position
    mask = torch.zeros(hidden.shape).masked_fill_(hidden, float("-inf"))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.2)
    assert torch.equal(attend_cpu(q, k, v, hidden, 0.2), ref)
    if start == 0:
        causal = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=0.2
        )
        assert torch.equal(attend_cpu(q, k, v, hidden, 0.2), causal)
