"""MoE families from Hugging Face checkpoints: MiniMax-M2 config parsing, typed errors for
variants we do not implement, stage slices that read only their own experts, and the
per-layer cost shape (active parameters) the router counts from the same tensor shapes."""

from __future__ import annotations

import json
from math import prod

import pytest
import torch
import transformers

from prefill_node.errors import InvalidModelConfigError, UnsupportedArchitectureError
from prefill_node.model.batch import ChunkBatch, ChunkSpec
from prefill_node.model.config import ModelConfig, ModelFamily, MoeConfig, QkNorm
from prefill_node.model.loader_hf import (
    load_hf_config,
    load_hf_weights,
    load_stage_model,
    save_hf_checkpoint,
)
from prefill_node.model.paged_kv import PagedKVCache
from prefill_node.model.partition import LayerRange, split_layers
from prefill_node.model.weights import layer_weight_shapes, random_weights, weight_names
from prefill_router.cost import cost_model_for
from tests.tiny_models import (
    TINY_LLAMA_HF,
    TINY_MINIMAX_M2_HF,
    tiny_glm5,
    tiny_kimi,
    tiny_llama,
    tiny_minimax_m2,
    tiny_qwen3_next,
)

# The fields of the released MiniMax-M2 config.json that matter here (sizes shrunk).
RELEASE_STYLE = {
    **TINY_MINIMAX_M2_HF,
    "rotary_dim": 4,
    "rope_theta": 5000000,
    "qk_norm_type": "per_layer",
    "use_qk_norm": True,
    "shared_intermediate_size": 0,
    "attn_type_list": [1, 1, 1, 1],
    "use_mtp": True,
    "num_mtp_modules": 3,
}


def test_release_style_config_parses():
    config = ModelConfig.from_hf_config(RELEASE_STYLE, name="m2")
    assert config.family is ModelFamily.MINIMAX_M2
    assert config.moe == MoeConfig(num_experts=8, top_k=2, expert_intermediate_size=24)
    assert (config.rotary_dim, config.qk_norm) == (4, QkNorm.PER_LAYER)
    assert ModelConfig.from_hf_config(config.to_hf_config(), name="m2") == config


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"scoring_func": "softmax"}, UnsupportedArchitectureError, "scoring_func"),
        ({"shared_intermediate_size": 64}, UnsupportedArchitectureError, "shared_intermediate"),
        ({"qk_norm_type": "per_head"}, UnsupportedArchitectureError, "qk_norm_type"),
        ({"attn_type_list": [0, 1, 1, 1]}, UnsupportedArchitectureError, "linear-attention"),
        ({"num_experts_per_tok": 9}, InvalidModelConfigError, "top_k"),
        ({"num_local_experts": 0}, InvalidModelConfigError, "num_experts"),
        ({"rotary_dim": 3}, InvalidModelConfigError, "rotary"),
    ],
)
def test_unsupported_minimax_variants_raise_typed_errors(tmp_path, changes, error, match):
    (tmp_path / "config.json").write_text(json.dumps({**RELEASE_STYLE, **changes}))
    with pytest.raises(error, match=match):
        load_hf_config(tmp_path)


def test_partial_rope_is_rejected_for_dense_families():
    with pytest.raises(UnsupportedArchitectureError, match="partial_rotary_factor"):
        ModelConfig.from_hf_config({**TINY_LLAMA_HF, "partial_rotary_factor": 0.5})


def test_stage_slice_reads_only_its_layers_experts(tmp_path):
    config = tiny_minimax_m2("ckpt")
    weights = random_weights(config, seed=4)
    save_hf_checkpoint(tmp_path, config, weights, shard_max_bytes=8000)
    mid = LayerRange(1, 3)
    names = sorted(load_hf_weights(tmp_path, mid, config))
    assert names == sorted(weight_names(config, mid))
    assert {n.split(".")[2] for n in names} == {"1", "2"}
    assert sum(".experts." in n for n in names) == 2 * 8 * 3  # 2 layers x 8 experts x w1/w2/w3
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3  # really sharded


def test_checkpoint_saved_by_transformers_loads_and_matches(tmp_path):
    """transformers fuses the experts in memory and writes them back per expert on save."""
    config = tiny_minimax_m2("ckpt")
    save_hf_checkpoint(tmp_path / "ours", config, random_weights(config, seed=5))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    hf.save_pretrained(tmp_path / "theirs", max_shard_size="40KB")
    tokens = list(range(3, 30))
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0, -1]
    x = torch.tensor(tokens)
    batch = ChunkBatch((ChunkSpec(0, len(tokens), (6, 1, 4, 0, 2, 3, 5)),))
    for lr in split_layers(config.num_layers, 2):
        stage = load_stage_model(tmp_path / "theirs", lr)
        x = stage(x, batch, PagedKVCache.for_model(stage.config, lr, 7, 4))
    torch.testing.assert_close(stage.compute_logits(x[-1:])[0], expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["llama", "minimax-m2", "glm-5", "qwen3-next", "kimi-linear"])
def test_active_params_match_the_weights_a_token_touches(family):
    """The router's per-layer cost shape is counted from the same tensor shapes the backend
    loads: every matrix of a layer, except the experts a token is not routed to."""
    config = {
        "llama": tiny_llama,
        "minimax-m2": tiny_minimax_m2,
        "glm-5": tiny_glm5,
        "qwen3-next": tiny_qwen3_next,
        "kimi-linear": tiny_kimi,
    }[family]()
    for layer in range(config.num_layers):
        shapes = layer_weight_shapes(config, layer)
        matrices = {n: s for n, s in shapes.items() if len(s) == 2}
        routed = [n for n in matrices if ".experts." in n]
        total = sum(prod(s) for s in matrices.values())
        if routed:
            per_expert = sum(prod(matrices[n]) for n in routed) // config.moe.num_experts
            total -= per_expert * (config.moe.num_experts - config.moe.top_k)
        assert config.active_params_per_token(layer) == total
    model = cost_model_for(config)
    assert model.per_token_s > 0 and model.per_token_context_s > 0
