"""Hugging Face tensor names of a model (or of one stage's slice) and seeded random weights.

Names are the checkpoint-file keys (``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` state-dict
keys; MiniMax-M2's released per-expert ``block_sparse_moe.experts.E.w1/w2/w3`` layout, which
transformers fuses on load), so a random model saved as a checkpoint loads into transformers
unchanged for parity tests. Each tensor is
drawn from its own generator seeded by (seed, name): a stage generating only its slice gets
exactly the tensors a whole-model generation would, so multi-process pipelines built from
the same seed agree with a single-process reference.
"""

from __future__ import annotations

import zlib

import torch

from prefill_node.model.config import ModelConfig, QkNorm
from prefill_node.model.partition import LayerRange

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


MOE = "block_sparse_moe."
ROUTER = MOE + "gate.weight"
ROUTER_BIAS = MOE + "e_score_correction_bias"


def expert_prefix(expert: int) -> str:
    """Name prefix (within a layer) of one routed expert's ``w1`` (gate), ``w2`` (down) and
    ``w3`` (up) projections."""
    return f"{MOE}experts.{expert}."


def layer_weight_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor of decoder layer ``layer``."""
    p = f"model.layers.{layer}."
    h, i = config.hidden_size, config.intermediate_size
    shapes = {
        p + "input_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (config.q_size, h),
        p + "self_attn.k_proj.weight": (config.kv_size, h),
        p + "self_attn.v_proj.weight": (config.kv_size, h),
        p + "self_attn.o_proj.weight": (h, config.q_size),
        p + "post_attention_layernorm.weight": (h,),
    }
    if config.moe is None:
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
    else:
        moe, ei = config.moe, config.moe.expert_intermediate_size
        shapes[p + ROUTER] = (moe.num_experts, h)
        shapes[p + ROUTER_BIAS] = (moe.num_experts,)
        for e in range(moe.num_experts):
            shapes[p + expert_prefix(e) + "w1.weight"] = (ei, h)
            shapes[p + expert_prefix(e) + "w2.weight"] = (h, ei)
            shapes[p + expert_prefix(e) + "w3.weight"] = (ei, h)
    norm_width = {
        QkNorm.PER_HEAD: (config.head_dim,) * 2,
        QkNorm.PER_LAYER: (config.q_size, config.kv_size),
    }
    if config.qk_norm in norm_width:
        q_width, k_width = norm_width[config.qk_norm]
        shapes[p + "self_attn.q_norm.weight"] = (q_width,)
        shapes[p + "self_attn.k_norm.weight"] = (k_width,)
    return shapes


def weight_shapes(
    config: ModelConfig, layer_range: LayerRange | None = None
) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor a stage holding ``layer_range`` (default: all
    layers) needs. With tied embeddings the last stage needs ``model.embed_tokens.weight``
    as its LM head and there is no ``lm_head.weight``."""
    lr = layer_range or LayerRange(0, config.num_layers)
    shapes: dict[str, tuple[int, ...]] = {}
    embed_shape = (config.vocab_size, config.hidden_size)
    if lr.is_first():
        shapes[EMBED] = embed_shape
    for layer in lr:
        shapes.update(layer_weight_shapes(config, layer))
    if lr.is_last(config.num_layers):
        shapes[FINAL_NORM] = (config.hidden_size,)
        if config.tie_word_embeddings:
            shapes[EMBED] = embed_shape
        else:
            shapes[LM_HEAD] = embed_shape
    return shapes


def weight_names(config: ModelConfig, layer_range: LayerRange | None = None) -> list[str]:
    return list(weight_shapes(config, layer_range))


def random_weights(
    config: ModelConfig,
    seed: int,
    layer_range: LayerRange | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Random HF-named weights for ``layer_range`` (default: the whole model).

    Scales keep activations O(1) through the stack and attention non-uniform (so masking
    and position errors show in the output): linear layers N(0, 1/fan_in), embeddings
    N(0, 1), norm weights 1 + N(0, 0.1^2). A MoE router's correction bias is N(0, 0.1^2),
    large enough next to the sigmoid scores to change some tokens' expert choices.
    """
    out = {}
    for name, shape in weight_shapes(config, layer_range).items():
        g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
        t = torch.randn(shape, generator=g, dtype=torch.float32)
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * t
        elif name.endswith(ROUTER_BIAS):
            t = 0.1 * t
        elif name != EMBED:
            t = t / shape[-1] ** 0.5
        out[name] = t.to(dtype)
    return out
