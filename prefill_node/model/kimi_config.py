"""Kimi Linear (``kimi_linear``) config parts: the KDA layers (a ``RecurrentConfig``) and the
config.json parsing and checks of the family (its MLA and MoE reuse ``MlaConfig`` /
``MoeConfig``).

Torch-free, like ``config``. Kimi Linear interleaves Kimi Delta Attention layers (linear
attention with a per-channel gated delta rule, short convolutions on q/k/v) with MLA layers
that have no q LoRA, no sparse-attention indexer and no RoPE at all, and uses a sigmoid
grouped-routing MoE with shared experts after ``first_k_dense_replace`` dense layers. The
released ``config.json`` spells several fields its own way (``num_experts``,
``moe_renormalize``, ``model_max_length``, ``linear_attn_config``...); transformers'
``KimiLinearConfig`` maps them, and so do we. Variants whose numerics transformers'
``kimi_linear`` does not compute (Kimi-K3's output gates, gate lower bound, latent MoE...)
raise ``UnsupportedArchitectureError`` naming the option.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prefill_node.errors import InvalidModelConfigError, UnsupportedArchitectureError
from prefill_node.model.family_config import MlaConfig, MoeConfig, reject_mlp_pattern
from prefill_node.model.hybrid_config import RecurrentConfig


def kda_active_params(r: RecurrentConfig, hidden: int) -> int:
    """Weights one token multiplies through in a KDA layer: q/k/v/o, beta, and the low-rank
    forget and output gates (hidden -> head_dim -> all heads)."""
    return (
        4 * hidden * r.key_dim
        + hidden * r.num_value_heads
        + 2 * (hidden + r.key_dim) * r.key_head_dim
    )


# Options of Kimi-family configs whose presence (with a value other than the one given)
# asks for numerics transformers' kimi_linear does not compute.
_KIMI_FIXED: dict[str, Any] = {
    "mla_use_nope": True,
    "mla_use_output_gate": False,
    "moe_router_activation_func": "sigmoid",
    "moe_layer_freq": 1,
    "moe_renormalize": True,
    "norm_topk_prob": True,
    "latent_moe_use_norm": False,
    "routed_expert_hidden_size": None,
    "attn_res_block_size": None,
}
_LINEAR_ATTN_KEYS = ("num_heads", "head_dim", "short_conv_kernel_size", "kda_layers")
_LINEAR_ATTN_KEYS += ("full_attn_layers",)


def reject_unsupported_kimi(d: Mapping[str, Any]) -> None:
    for option, supported in _KIMI_FIXED.items():
        if option in d and d[option] != supported:
            raise UnsupportedArchitectureError(
                f"Kimi Linear config option {option}={d[option]!r} is not implemented "
                f"(supported: {supported!r})"
            )
    for option in sorted(set(d.get("linear_attn_config") or {}) - set(_LINEAR_ATTN_KEYS)):
        raise UnsupportedArchitectureError(
            f"Kimi Linear linear_attn_config option {option!r} is not implemented "
            f"(supported: {', '.join(_LINEAR_ATTN_KEYS)})"
        )
    groups = int(d.get("num_expert_group", d.get("n_group", 1)))
    if d.get("use_grouped_topk") is False and groups > 1:
        raise UnsupportedArchitectureError(
            "Kimi Linear use_grouped_topk=false with num_expert_group > 1 is not implemented"
        )
    reject_mlp_pattern(d, int(d.get("first_k_dense_replace", 1)))


def _first(d: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    """The value of the first of ``names`` present in ``d`` (the released config's spelling
    first, then transformers' attribute names)."""
    for name in names:
        if d.get(name) is not None:
            return d[name]
    if default is None:
        raise KeyError(names[0])
    return default


def kimi_recurrent_of(d: Mapping[str, Any]) -> RecurrentConfig:
    """The KDA layers: ``num_heads`` heads of ``head_dim`` for q, k and v alike (so key and
    value heads coincide), a conv of ``short_conv_kernel_size`` on each of q, k and v.
    ``layer_types`` wins over ``linear_attn_config``'s 1-based ``kda_layers`` /
    ``full_attn_layers``; with neither, transformers' default (every 4th layer from layer 4
    is MLA)."""
    lin = d.get("linear_attn_config") or {}
    num_layers = int(d["num_hidden_layers"])
    if d.get("layer_types"):
        types = list(d["layer_types"])
        if len(types) != num_layers:
            raise InvalidModelConfigError(
                f"layer_types has {len(types)} entries for {num_layers} layers"
            )
        layers = tuple(i for i, t in enumerate(types) if t == "linear_attention")
    elif "kda_layers" in lin and "full_attn_layers" in lin:
        kda = sorted(int(i) - 1 for i in lin["kda_layers"])
        full = sorted(int(i) - 1 for i in lin["full_attn_layers"])
        if sorted(kda + full) != list(range(num_layers)):
            raise InvalidModelConfigError(
                "linear_attn_config kda_layers and full_attn_layers (1-based) must together "
                f"name each of the {num_layers} layers once"
            )
        layers = tuple(kda)
    else:
        layers = tuple(i for i in range(num_layers) if not (i and i % 4 == 0))
    heads = int(_first(lin, "num_heads", default=d.get("linear_num_heads", 32)))
    head_dim = int(_first(lin, "head_dim", default=d.get("linear_head_dim", 128)))
    return RecurrentConfig(
        layers=layers,
        num_key_heads=heads,
        num_value_heads=heads,
        key_head_dim=head_dim,
        value_head_dim=head_dim,
        conv_kernel=int(
            _first(lin, "short_conv_kernel_size", default=d.get("linear_conv_kernel_dim", 4))
        ),
    )


def kimi_moe_of(d: Mapping[str, Any], num_layers: int) -> MoeConfig:
    return MoeConfig(
        num_experts=int(_first(d, "num_experts", "num_local_experts")),
        top_k=int(_first(d, "num_experts_per_token", "num_experts_per_tok")),
        expert_intermediate_size=int(d["moe_intermediate_size"]),
        num_groups=int(_first(d, "num_expert_group", "n_group", default=1)),
        topk_groups=int(_first(d, "topk_group", default=1)),
        routed_scaling_factor=float(_first(d, "routed_scaling_factor", default=1.0)),
        num_shared_experts=int(_first(d, "num_shared_experts", "n_shared_experts", default=1)),
        first_dense_layers=min(int(d.get("first_k_dense_replace", 1)), num_layers),
    )


def kimi_mla_of(d: Mapping[str, Any]) -> MlaConfig:
    q_lora = d.get("q_lora_rank")
    return MlaConfig(
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(d["kv_lora_rank"]),
        qk_nope_head_dim=int(d["qk_nope_head_dim"]),
        qk_rope_head_dim=int(d["qk_rope_head_dim"]),
        v_head_dim=int(d["v_head_dim"]),
        rotary=False,
    )


def kimi_to_hf(
    moe: MoeConfig, mla: MlaConfig, kda: RecurrentConfig, num_layers: int
) -> dict[str, Any]:
    """The family's config.json fields, spelled as the released checkpoint spells them."""
    return {
        "num_experts": moe.num_experts,
        "num_experts_per_token": moe.top_k,
        "moe_intermediate_size": moe.expert_intermediate_size,
        "num_expert_group": moe.num_groups,
        "topk_group": moe.topk_groups,
        "use_grouped_topk": True,
        "routed_scaling_factor": moe.routed_scaling_factor,
        "num_shared_experts": moe.num_shared_experts,
        "first_k_dense_replace": moe.first_dense_layers,
        "moe_layer_freq": 1,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "mla_use_nope": True,
        "pad_token_id": None,  # transformers' default (163839) is outside a small vocabulary
        "linear_attn_config": {
            "num_heads": kda.num_value_heads,
            "head_dim": kda.value_head_dim,
            "short_conv_kernel_size": kda.conv_kernel,
            "kda_layers": [i + 1 for i in kda.layers],
            "full_attn_layers": [i + 1 for i in range(num_layers) if not kda.is_linear(i)],
        },
    }
