"""Hugging Face tensor names of a model (or of one stage's slice) and seeded random weights.

Names are the checkpoint-file keys (``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` state-dict
keys; MiniMax-M2's released per-expert ``block_sparse_moe.experts.E.w1/w2/w3`` layout, which
transformers fuses on load; Kimi Linear's released layout likewise, with separate q/k/v short
convolutions and the KDA forget gate's tensors directly under ``self_attn``), so a random
model saved as a checkpoint loads into transformers unchanged for parity tests. Each tensor is
drawn from its own generator seeded by (seed, name): a stage generating only its slice gets
exactly the tensors a whole-model generation would, so multi-process pipelines built from
the same seed agree with a single-process reference.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from prefill_node.errors import InvariantError
from prefill_node.model.config import MlaConfig, ModelConfig, ModelFamily, QkNorm
from prefill_node.model.partition import LayerRange

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class MoeNames:
    """Checkpoint names (within a layer) of a family's MoE block."""

    router: str
    bias: str
    expert: str  # format with expert=e, then append gate/up/down below
    gate: str
    up: str
    down: str
    shared: str = ""  # prefix of the shared experts' gate_proj/up_proj/down_proj
    shared_gate: str = ""  # the shared expert's sigmoid gate [1, hidden] (Qwen3-Next)

    def expert_tensor(self, expert: int, proj: str) -> str:
        return self.expert.format(expert=expert) + proj + ".weight"


# MiniMax-M2's released per-expert layout (w1 gate, w3 up, w2 down); GLM-5's Qwen2-MoE-like one.
MINIMAX_MOE = MoeNames(
    router="block_sparse_moe.gate.weight",
    bias="block_sparse_moe.e_score_correction_bias",
    expert="block_sparse_moe.experts.{expert}.",
    gate="w1",
    up="w3",
    down="w2",
)
GLM_MOE = MoeNames(
    router="mlp.gate.weight",
    bias="mlp.gate.e_score_correction_bias",
    expert="mlp.experts.{expert}.",
    gate="gate_proj",
    up="up_proj",
    down="down_proj",
    shared="mlp.shared_experts.",
)
QWEN3_NEXT_MOE = MoeNames(
    router="mlp.gate.weight",
    bias="",  # softmax routing has no correction bias
    expert="mlp.experts.{expert}.",
    gate="gate_proj",
    up="up_proj",
    down="down_proj",
    shared="mlp.shared_expert.",
    shared_gate="mlp.shared_expert_gate.weight",
)
# Kimi Linear's released layout: MiniMax-M2's per-expert names plus shared experts.
KIMI_MOE = MoeNames(
    router="block_sparse_moe.gate.weight",
    bias="block_sparse_moe.gate.e_score_correction_bias",
    expert="block_sparse_moe.experts.{expert}.",
    gate="w1",
    up="w3",
    down="w2",
    shared="block_sparse_moe.shared_experts.",
)
# A KDA layer's three short convolutions (transformers stacks them into one conv1d on load).
KDA_CONVS = ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")


def moe_names(config: ModelConfig) -> MoeNames:
    return {
        ModelFamily.GLM_MOE_DSA: GLM_MOE,
        ModelFamily.QWEN3_NEXT: QWEN3_NEXT_MOE,
        ModelFamily.KIMI_LINEAR: KIMI_MOE,
    }.get(config.family, MINIMAX_MOE)


def _linear_attention_shapes(config: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """Qwen3-Next GatedDeltaNet: q/k/v/z and b/a projections grouped by key head, the depthwise
    conv over q, k, v, per-value-head decay parameters, the gated norm, the output. Kimi
    Linear's KDA: see ``kda_shapes``."""
    r, h, a = config.recurrent, config.hidden_size, p + "linear_attn."
    if r is None:
        raise InvariantError(f"{p} is not a linear-attention layer of {config.family.value}")
    if config.family is ModelFamily.KIMI_LINEAR:
        return {p + "self_attn." + suffix: shape for suffix, shape in kda_shapes(config).items()}
    return {
        a + "in_proj_qkvz.weight": (2 * r.key_dim + 2 * r.value_dim, h),
        a + "in_proj_ba.weight": (2 * r.num_value_heads, h),
        a + "conv1d.weight": (r.conv_width, 1, r.conv_kernel),
        a + "dt_bias": (r.num_value_heads,),
        a + "A_log": (r.num_value_heads,),
        a + "norm.weight": (r.value_head_dim,),
        a + "out_proj.weight": (h, r.value_dim),
    }


def _mlp_shapes(prefix: str, width: int, hidden: int) -> dict[str, tuple[int, ...]]:
    return {
        prefix + "gate_proj.weight": (width, hidden),
        prefix + "up_proj.weight": (width, hidden),
        prefix + "down_proj.weight": (hidden, width),
    }


def kda_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Suffix (under ``self_attn.``) -> shape of every tensor of a KDA layer."""
    h, k = config.hidden_size, config.recurrent
    if k is None:
        raise InvariantError(f"{config.family.value} has no KDA layers")
    d, heads, qkv = k.key_head_dim, k.num_value_heads, k.key_dim
    shapes = {s: (qkv, h) for s in ("q_proj.weight", "k_proj.weight", "v_proj.weight")}
    shapes.update({s: (qkv, 1, k.conv_kernel) for s in KDA_CONVS})
    shapes.update(
        {
            "f_a_proj.weight": (d, h),
            "f_b_proj.weight": (qkv, d),
            "A_log": (1, 1, heads, 1),
            "dt_bias": (qkv,),
            "b_proj.weight": (heads, h),
            "g_a_proj.weight": (d, h),
            "g_b_proj.weight": (qkv, d),
            "o_norm.weight": (d,),
            "o_proj.weight": (h, qkv),
        }
    )
    return shapes


def _mla_shapes(m: MlaConfig, heads: int, h: int, a: str) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    if m.q_lora_rank is None:
        shapes[a + "q_proj.weight"] = (heads * m.qk_head_dim, h)
    else:
        shapes[a + "q_a_proj.weight"] = (m.q_lora_rank, h)
        shapes[a + "q_a_layernorm.weight"] = (m.q_lora_rank,)
        shapes[a + "q_b_proj.weight"] = (heads * m.qk_head_dim, m.q_lora_rank)
    shapes.update(
        {
            a + "kv_a_proj_with_mqa.weight": (m.kv_lora_rank + m.qk_rope_head_dim, h),
            a + "kv_a_layernorm.weight": (m.kv_lora_rank,),
            a + "kv_b_proj.weight": (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
            a + "o_proj.weight": (h, heads * m.v_head_dim),
        }
    )
    if m.has_indexer:
        shapes.update(
            {
                a + "indexer.wq_b.weight": (m.index_n_heads * m.index_head_dim, m.q_lora_rank or 0),
                a + "indexer.wk.weight": (m.index_head_dim, h),
                a + "indexer.k_norm.weight": (m.index_head_dim,),
                a + "indexer.k_norm.bias": (m.index_head_dim,),
                a + "indexer.weights_proj.weight": (m.index_n_heads, h),
            }
        )
    return shapes


def _attention_shapes(config: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    h, a = config.hidden_size, p + "self_attn."
    if config.mla is not None:
        return _mla_shapes(config.mla, config.num_heads, h, a)
    gate = config.q_size if config.attention_output_gate else 0
    shapes = {
        a + "q_proj.weight": (config.q_size + gate, h),
        a + "k_proj.weight": (config.kv_size, h),
        a + "v_proj.weight": (config.kv_size, h),
        a + "o_proj.weight": (h, config.q_size),
    }
    norm_width = {
        QkNorm.PER_HEAD: (config.head_dim,) * 2,
        QkNorm.PER_LAYER: (config.q_size, config.kv_size),
    }
    if config.qk_norm in norm_width:
        q_width, k_width = norm_width[config.qk_norm]
        shapes[a + "q_norm.weight"] = (q_width,)
        shapes[a + "k_norm.weight"] = (k_width,)
    return shapes


def layer_weight_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor of decoder layer ``layer``."""
    p = f"model.layers.{layer}."
    h = config.hidden_size
    shapes = {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    if config.is_linear_layer(layer):
        shapes.update(_linear_attention_shapes(config, p))
    else:
        shapes.update(_attention_shapes(config, p))
    moe = config.moe
    if moe is None or not moe.is_sparse(layer):
        shapes.update(_mlp_shapes(p + "mlp.", config.intermediate_size, h))
        return shapes
    names, ei = moe_names(config), moe.expert_intermediate_size
    shapes[p + names.router] = (moe.num_experts, h)
    if names.bias:
        shapes[p + names.bias] = (moe.num_experts,)
    for e in range(moe.num_experts):
        shapes[p + names.expert_tensor(e, names.gate)] = (ei, h)
        shapes[p + names.expert_tensor(e, names.down)] = (h, ei)
        shapes[p + names.expert_tensor(e, names.up)] = (ei, h)
    if moe.shared_width:
        shapes.update(_mlp_shapes(p + names.shared, moe.shared_width, h))
    if moe.gated_shared:
        shapes[p + names.shared_gate] = (1, h)
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
    Zero-centred norm weights (``ModelConfig.norm_weight_offset``) are drawn as N(0, 0.1^2),
    so the scale is the same 1 + N(0, 0.1^2). A KDA layer's ``A_log`` is N(0, 0.5^2) and its
    ``dt_bias`` -2 + N(0, 0.5^2), so its per-channel decays span slow and fast forgetting.
    """
    out = {}
    centre = 1.0 - config.norm_weight_offset
    for name, shape in weight_shapes(config, layer_range).items():
        g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
        t = torch.randn(shape, generator=g, dtype=torch.float32)
        if name.endswith("linear_attn.norm.weight"):  # the gated norm is not zero-centred
            t = 1.0 + 0.1 * t
        elif name.endswith("norm.weight"):
            t = centre + 0.1 * t
        elif name.endswith("e_score_correction_bias"):
            t = 0.1 * t
        elif name.endswith("self_attn.A_log"):  # KDA's (Qwen3-Next's live under linear_attn)
            t = 0.5 * t
        elif name.endswith("self_attn.dt_bias"):
            t = 0.5 * t - 2.0
        elif name != EMBED:
            t = t / shape[-1] ** 0.5
        out[name] = t.to(dtype)
    return out
