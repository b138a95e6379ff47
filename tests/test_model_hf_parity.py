"""Our stage models and reference forward == transformers (Llama, Qwen3, MiniMax-M2)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import transformers

from prefill_node.model.batch import ChunkBatch, ChunkSpec
from prefill_node.model.config import ModelConfig, ModelFamily, MoeConfig, RopeScaling
from prefill_node.model.loader_hf import save_hf_checkpoint
from prefill_node.model.paged_kv import PagedKVCache
from prefill_node.model.partition import split_layers
from prefill_node.model.reference import reference_forward
from prefill_node.model.stage_model import StageModel
from prefill_node.model.weights import MINIMAX_MOE, random_weights

ATOL = 1e-4


def make_config(family: ModelFamily, **overrides) -> ModelConfig:
    base = dict(
        family=family,
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        name="tiny",
    )
    base.update(overrides)
    return ModelConfig(**base)


CONFIGS = {
    "llama-gqa": make_config(ModelFamily.LLAMA),
    "llama-mha-tied": make_config(ModelFamily.LLAMA, num_kv_heads=4, tie_word_embeddings=True),
    "llama3-rope-scaling": make_config(
        ModelFamily.LLAMA,
        num_kv_heads=1,
        rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 16),
    ),
    "qwen3-qknorm-tied": make_config(
        ModelFamily.QWEN3, head_dim=32, tie_word_embeddings=True, rope_theta=1e6
    ),
    # 8 experts, 2 per token, partial RoPE over half of each head, whole-projection q/k norm
    "minimax-m2-moe": make_config(
        ModelFamily.MINIMAX_M2,
        intermediate_size=24,
        moe=MoeConfig(num_experts=8, top_k=2, expert_intermediate_size=24),
        partial_rotary_factor=0.5,
    ),
}


def hf_model(config: ModelConfig, weights: dict[str, torch.Tensor], tmp_path=None):
    if config.moe is not None:
        return hf_model_from_checkpoint(config, weights, tmp_path)
    hf_cfg = transformers.AutoConfig.for_model(**config.to_hf_config())
    hf_cfg._attn_implementation = "eager"
    cls = {
        ModelFamily.LLAMA: transformers.LlamaForCausalLM,
        ModelFamily.QWEN3: transformers.Qwen3ForCausalLM,
    }[config.family]
    model = cls(hf_cfg).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected
    assert set(missing) <= ({"lm_head.weight"} if config.tie_word_embeddings else set())
    if config.tie_word_embeddings:
        assert torch.equal(model.lm_head.weight, weights["model.embed_tokens.weight"])
    return model


def hf_model_from_checkpoint(config, weights, tmp_path):
    """Through a checkpoint directory: transformers fuses the per-expert tensors on load."""
    save_hf_checkpoint(tmp_path, config, weights)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(model).__name__ == "MiniMaxM2ForCausalLM"
    bias = model.model.layers[0].mlp.e_score_correction_bias
    assert torch.equal(bias, weights["model.layers.0." + MINIMAX_MOE.bias])  # loaded, not zeros
    return model.eval()


def hf_forward(config, weights, tokens, tmp_path=None):
    model = hf_model(config, weights, tmp_path)
    with torch.no_grad():
        out = model(torch.tensor([tokens]), use_cache=True)
    kv = [
        (layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1))
        for layer in out.past_key_values.layers
    ]
    return out.logits[0], kv


def run_pipeline(config, weights, tokens, num_stages, block_size=8):
    """All tokens as one chunk through ``num_stages`` stages, hidden handed stage to stage."""
    n_blocks = -(-len(tokens) // block_size)
    table = tuple(reversed(range(n_blocks)))  # not the identity: paging must matter
    batch = ChunkBatch((ChunkSpec(0, len(tokens), table),))
    x = torch.tensor(tokens)
    caches = []
    for lr in split_layers(config.num_layers, num_stages):
        stage = StageModel(config, lr)
        stage.load_weights(weights)
        kv = PagedKVCache.for_model(config, lr, n_blocks, block_size)
        x = stage(x, batch, kv)
        caches.append(kv)
    return stage.compute_logits(x), caches, table


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_stage_pipeline_matches_transformers(name, num_stages, tmp_path):
    config = CONFIGS[name]
    weights = random_weights(config, seed=7)
    tokens = torch.randint(
        0, config.vocab_size, (37,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    hf_logits, hf_kv = hf_forward(config, weights, tokens, tmp_path)
    logits, caches, table = run_pipeline(config, weights, tokens, num_stages)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hf_logits, atol=ATOL, rtol=0)
    for kv in caches:
        for layer in kv.layer_range:
            k, v = kv.read(layer, table, len(tokens))
            torch.testing.assert_close(k, hf_kv[layer][0], atol=ATOL, rtol=0)
            torch.testing.assert_close(v, hf_kv[layer][1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_reference_forward_matches_transformers(name, tmp_path):
    config = CONFIGS[name]
    weights = random_weights(config, seed=3)
    tokens = list(range(5, 5 + 29))
    hf_logits, hf_kv = hf_forward(config, weights, tokens, tmp_path)
    logits, kv = reference_forward(config, weights, tokens)
    torch.testing.assert_close(logits, hf_logits[-1], atol=ATOL, rtol=0)
    assert len(kv) == config.num_layers
    for (k, v), (hk, hv) in zip(kv, hf_kv, strict=True):
        torch.testing.assert_close(k, hk, atol=ATOL, rtol=0)
        torch.testing.assert_close(v, hv, atol=ATOL, rtol=0)


def test_rope_scaling_changes_logits():
    """Guard against a test that cannot fail: llama3 scaling really alters the numerics."""
    scaled = CONFIGS["llama3-rope-scaling"]
    plain = make_config(ModelFamily.LLAMA, num_kv_heads=1, rope_theta=500000.0)
    weights = random_weights(scaled, seed=7)
    tokens = list(range(40))
    a, _ = reference_forward(scaled, weights, tokens)
    b, _ = reference_forward(plain, weights, tokens)
    assert (a - b).abs().max() > 1e-3


def test_moe_routes_tokens_to_different_experts_and_the_bias_steers_the_choice():
    """Guard against a MoE parity test that cannot fail: the tokens of the parity prompt
    spread over the experts, and the correction bias changes some tokens' choices."""
    config = CONFIGS["minimax-m2-moe"]
    weights = random_weights(config, seed=7)
    tokens = torch.randint(0, config.vocab_size, (37,), generator=torch.Generator().manual_seed(1))
    stage = StageModel(config, split_layers(config.num_layers, 1)[0])
    stage.load_weights(weights)
    moe = stage.layers[0].moe
    h = torch.nn.functional.embedding(tokens, stage.embed)
    chosen, w = moe.route(h)
    assert len(set(chosen.flatten().tolist())) >= 6
    torch.testing.assert_close(w.sum(-1), torch.ones(37))
    bias = moe.bias.clone()
    moe.bias.zero_()
    unbiased, _ = moe.route(h)
    moe.bias.copy_(bias)
    differs = [set(a) != set(b) for a, b in zip(chosen.tolist(), unbiased.tolist(), strict=True)]
    assert any(differs) and not all(differs)
    partial = replace(config, partial_rotary_factor=1.0)
    a, _ = reference_forward(config, weights, tokens.tolist())
    b, _ = reference_forward(partial, weights, tokens.tolist())
    assert (a - b).abs().max() > 1e-3  # partial RoPE really alters the numerics


@pytest.mark.parametrize("name", ["llama-gqa", "qwen3-qknorm-tied", "minimax-m2-moe"])
def test_bf16_runs_close_to_fp32(name):
    config = CONFIGS[name]
    weights = random_weights(config, seed=5)
    tokens = list(range(3, 3 + 24))
    ref, _ = reference_forward(config, weights, tokens)
    stage = StageModel(config, split_layers(config.num_layers, 1)[0], dtype=torch.bfloat16)
    stage.load_weights(weights)
    kv = PagedKVCache.for_model(config, stage.layer_range, 4, 8, dtype=torch.bfloat16)
    table = (2, 0, 3)
    stage(torch.tensor(tokens[:10]), ChunkBatch((ChunkSpec(0, 10, table),)), kv)
    hidden = stage(torch.tensor(tokens[10:]), ChunkBatch((ChunkSpec(10, 14, table),)), kv)
    assert hidden.dtype == torch.bfloat16 and kv.tensors[0].dtype == torch.bfloat16
    logits = stage.compute_logits(hidden[-1:])[0]
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert (logits - ref).abs().max().item() < 0.05 * ref.abs().max().item()
    assert torch.nn.functional.cosine_similarity(logits, ref, dim=0) > 0.999
