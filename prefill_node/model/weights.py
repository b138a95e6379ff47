"""Hugging Face tensor names of a model (or of one stage's slice) and seeded random weights.

Names are the transformers ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` state-dict keys, so a
random model can be loaded into transformers unchanged for parity tests. Each tensor is
drawn from its own generator seeded by (seed, name): a stage generating only its slice gets
exactly the tensors a whole-model generation would, so multi-process pipelines built from
the same seed agree with a single-process reference.
"""

from __future__ import annotations

import zlib

import torch

from prefill_node.model.config import ModelConfig
from prefill_node.model.partition import LayerRange

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


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
        p + "mlp.gate_proj.weight": (i, h),
        p + "mlp.up_proj.weight": (i, h),
        p + "mlp.down_proj.weight": (h, i),
    }
    if config.qk_norm:
        shapes[p + "self_attn.q_norm.weight"] = (config.head_dim,)
        shapes[p + "self_attn.k_norm.weight"] = (config.head_dim,)
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
    N(0, 1), norm weights 1 + N(0, 0.1^2).
    """
    out = {}
    for name, shape in weight_shapes(config, layer_range).items():
        g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
        t = torch.randn(shape, generator=g, dtype=torch.float32)
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * t
        elif name != EMBED:
            t = t / shape[-1] ** 0.5
        out[name] = t.to(dtype)
    return out
