"""Hybrid models with recurrent-state layers (Qwen3-Next): which layers are linear attention,
their shapes, the per-block snapshot bytes they add, and Qwen3-Next's config.json parsing.

Torch-free, like ``config``. ``RecurrentConfig`` describes any gated-delta-rule layer (Qwen3-
Next's GatedDeltaNet; Kimi Linear's KDA has the same state shape with equal key and value
heads), so cache sizing, escrow and the KV hand-off read one description.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prefill_node.errors import InvalidModelConfigError, UnsupportedArchitectureError
from prefill_node.model.family_config import MoeConfig, MoeScoring

STATE_BYTES = 4  # recurrent matrices are kept in fp32 whatever the weights' dtype


@dataclass(frozen=True)
class RecurrentConfig:
    """The linear-attention layers of a hybrid model.

    Layer ``l`` is linear attention iff ``l in layers`` (the others are full attention). Each
    keeps, per sequence, a recurrent matrix per value head ``[key_head_dim, value_head_dim]``
    (fp32) and the short convolution's last ``conv_kernel - 1`` inputs of ``conv_width``
    channels (q, k and v before the conv). Query/key heads are shared by
    ``num_value_heads // num_key_heads`` value heads."""

    layers: tuple[int, ...]
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        for name in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise InvalidModelConfigError(f"{name} must be a positive int, got {value!r}")
        if self.num_value_heads % self.num_key_heads:
            raise InvalidModelConfigError(
                f"linear_num_value_heads ({self.num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.num_key_heads})"
            )
        if self.conv_kernel < 2:
            raise InvalidModelConfigError(
                f"linear_conv_kernel_dim must be >= 2, got {self.conv_kernel}"
            )
        if list(self.layers) != sorted(set(self.layers)) or any(layer < 0 for layer in self.layers):
            raise InvalidModelConfigError(f"linear layers {self.layers} must be distinct, sorted")

    def is_linear(self, layer: int) -> bool:
        return layer in self.layers

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_width(self) -> int:
        """Channels of the short convolution: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    @property
    def state_numbers(self) -> int:
        """Numbers of one layer's recurrent matrix (all value heads)."""
        return self.num_value_heads * self.key_head_dim * self.value_head_dim

    def snapshot_bytes(self, dtype_bytes: int) -> int:
        """Bytes of one snapshot of one layer: the fp32 matrix plus the conv tail stored in
        the cache dtype (``dtype_bytes`` per number)."""
        tail = (self.conv_kernel - 1) * self.conv_width * dtype_bytes
        return self.state_numbers * STATE_BYTES + tail


_QWEN3_NEXT_FIXED = {"decoder_sparse_step": 1, "norm_topk_prob": True}


def reject_unsupported_qwen3_next(d: Mapping[str, Any]) -> None:
    for option, supported in _QWEN3_NEXT_FIXED.items():
        if option in d and d[option] != supported:
            raise UnsupportedArchitectureError(
                f"Qwen3-Next config option {option}={d[option]!r} is not implemented "
                f"(supported: {supported!r})"
            )
    if d.get("mlp_only_layers"):
        raise UnsupportedArchitectureError(
            f"Qwen3-Next mlp_only_layers={d['mlp_only_layers']} is not implemented (every "
            "layer must be a MoE layer)"
        )
    if int(d.get("num_experts", 512)) <= 0:
        raise UnsupportedArchitectureError(
            "Qwen3-Next without experts (num_experts 0) is not implemented"
        )


def qwen3_next_layer_types(d: Mapping[str, Any]) -> list[str]:
    """``layer_types``, or transformers' default: every ``full_attention_interval``-th layer
    (default 4) is full attention, the others linear."""
    layers = int(d["num_hidden_layers"])
    types = d.get("layer_types")
    if types is None:
        every = int(d.get("full_attention_interval", 4))
        types = [
            "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)
        ]
    if len(types) != layers:
        raise InvalidModelConfigError(
            f"layer_types lists {len(types)} layers, the model has {layers}"
        )
    return list(types)


def qwen3_next_recurrent_of(d: Mapping[str, Any]) -> RecurrentConfig:
    types = qwen3_next_layer_types(d)
    return RecurrentConfig(
        layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        num_key_heads=int(d.get("linear_num_key_heads", 16)),
        num_value_heads=int(d.get("linear_num_value_heads", 32)),
        key_head_dim=int(d.get("linear_key_head_dim", 128)),
        value_head_dim=int(d.get("linear_value_head_dim", 128)),
        conv_kernel=int(d.get("linear_conv_kernel_dim", 4)),
    )


def qwen3_next_moe_of(d: Mapping[str, Any]) -> MoeConfig:
    return MoeConfig(
        num_experts=int(d.get("num_experts", 512)),
        top_k=int(d.get("num_experts_per_tok", 10)),
        expert_intermediate_size=int(d.get("moe_intermediate_size", 512)),
        scoring=MoeScoring.SOFTMAX,
        shared_intermediate_size=int(d.get("shared_expert_intermediate_size", 512)),
    )


def qwen3_next_to_hf(recurrent: RecurrentConfig, moe: MoeConfig, num_layers: int) -> dict[str, Any]:
    return {
        "layer_types": [
            "linear_attention" if recurrent.is_linear(i) else "full_attention"
            for i in range(num_layers)
        ],
        "linear_num_key_heads": recurrent.num_key_heads,
        "linear_num_value_heads": recurrent.num_value_heads,
        "linear_key_head_dim": recurrent.key_head_dim,
        "linear_value_head_dim": recurrent.value_head_dim,
        "linear_conv_kernel_dim": recurrent.conv_kernel,
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.expert_intermediate_size,
        "shared_expert_intermediate_size": moe.shared_width,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    }
