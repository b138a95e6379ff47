"""The model configuration: one frozen, validated description of a decoder-only LLM.

Torch-free on purpose, so the sans-IO core and the planner can size caches from it.
``ModelConfig.from_hf_config`` is the one place a Hugging Face ``config.json`` is parsed;
it accepts both the transformers 4.x layout (``rope_theta`` + ``rope_scaling``) and the 5.x
layout (``rope_parameters``), and rejects options this backend does not implement with a
typed error naming the option, rather than computing something subtly different.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prefill_node.errors import InvalidModelConfigError, UnsupportedArchitectureError
from prefill_node.model.family_config import (
    MlaConfig,
    MoeConfig,
    glm_mla_of,
    glm_moe_of,
    minimax_moe_of,
    mla_to_hf,
    moe_to_hf,
    reject_unsupported_glm,
    reject_unsupported_minimax,
)
from prefill_node.model.hybrid_config import (
    RecurrentConfig,
    qwen3_next_moe_of,
    qwen3_next_recurrent_of,
    qwen3_next_to_hf,
    reject_unsupported_qwen3_next,
)
from prefill_node.model.kimi_config import (
    kda_active_params,
    kimi_mla_of,
    kimi_moe_of,
    kimi_recurrent_of,
    kimi_to_hf,
    reject_unsupported_kimi,
)
from prefill_node.model.quantization import Fp8BlockQuantization, quantization_of

__all__ = [
    "MlaConfig",
    "ModelConfig",
    "ModelFamily",
    "MoeConfig",
    "QkNorm",
    "RecurrentConfig",
    "RopeScaling",
]


class ModelFamily(enum.Enum):
    """Decoder families this backend implements. QWEN3 adds per-head RMSNorm on q and k;
    MINIMAX_M2 (MiniMax-M2) has RMSNorm over the whole q and k projections, partial RoPE
    and a sigmoid-routed MoE in place of the MLP (``ModelConfig.moe``); GLM_MOE_DSA (GLM-5)
    has MLA with a sparse-attention indexer (``ModelConfig.mla``), interleaved RoPE, and a
    grouped-routing MoE with a shared expert after a few dense layers. QWEN3_NEXT
    (Qwen3-Next) interleaves gated-delta-rule linear-attention layers (``ModelConfig.
    recurrent``) with gated full attention (an output gate, per-head q/k norm, partial RoPE),
    zero-centred RMSNorm weights, and a softmax-routed MoE with a sigmoid-gated shared expert.
    KIMI_LINEAR interleaves KDA layers (``recurrent``, per-key-channel decay) with MLA without
    indexer, q LoRA or RoPE, and has GLM-5's kind of MoE."""

    LLAMA = "llama"
    QWEN3 = "qwen3"
    MINIMAX_M2 = "minimax_m2"
    GLM_MOE_DSA = "glm_moe_dsa"
    QWEN3_NEXT = "qwen3_next"
    KIMI_LINEAR = "kimi_linear"


class QkNorm(enum.Enum):
    """Where attention RMS-normalises q and k before RoPE: not at all, over each head
    (Qwen3), or over the whole projection of all heads at once (MiniMax-M2)."""

    NONE = "none"
    PER_HEAD = "per_head"
    PER_LAYER = "per_layer"


_ARCHITECTURES = {
    "LlamaForCausalLM": ModelFamily.LLAMA,
    "Qwen3ForCausalLM": ModelFamily.QWEN3,
    "MiniMaxM2ForCausalLM": ModelFamily.MINIMAX_M2,
    "GlmMoeDsaForCausalLM": ModelFamily.GLM_MOE_DSA,
    "Qwen3NextForCausalLM": ModelFamily.QWEN3_NEXT,
    "KimiLinearForCausalLM": ModelFamily.KIMI_LINEAR,
}
_MLA_FAMILIES = (ModelFamily.GLM_MOE_DSA, ModelFamily.KIMI_LINEAR)
_MOE_FAMILIES = (ModelFamily.MINIMAX_M2, ModelFamily.QWEN3_NEXT, *_MLA_FAMILIES)
_PARTIAL_ROPE_FAMILIES = (ModelFamily.MINIMAX_M2, ModelFamily.QWEN3_NEXT)
_RECURRENT_OF = {
    ModelFamily.QWEN3_NEXT: qwen3_next_recurrent_of,
    ModelFamily.KIMI_LINEAR: kimi_recurrent_of,
}
_RECURRENT_FAMILIES = tuple(_RECURRENT_OF)
_HF_ARCHITECTURE = {family: arch for arch, family in _ARCHITECTURES.items()}
_SUPPORTED_ROPE_TYPES = ("llama3", "linear")
# The per-layer attention kinds (``layer_types``) each family implements; sliding-window or
# any other kind is refused. transformers names GLM-5's indexer attention
# deepseek_sparse_attention (5.17) or indexed_attention (later releases).
_LAYER_TYPES: dict[ModelFamily, tuple[str, ...]] = {
    ModelFamily.LLAMA: ("full_attention",),
    ModelFamily.QWEN3: ("full_attention",),
    ModelFamily.MINIMAX_M2: ("full_attention",),
    ModelFamily.GLM_MOE_DSA: ("indexed_attention", "deepseek_sparse_attention", "full_attention"),
    ModelFamily.QWEN3_NEXT: ("full_attention", "linear_attention"),
    ModelFamily.KIMI_LINEAR: ("full_attention", "linear_attention"),
}
# What transformers assumes for a field a config.json leaves out: its configuration class's
# default (transformers 5.x ``configuration_<model_type>.py``), where that differs from the
# generic fallback in ``from_hf_config`` (rms_norm_eps 1e-6, rope_theta 10000, head_dim
# hidden / heads, one KV head per head, 2048 positions). A config leaving them out means
# the same here as in transformers (tests/test_model_config_fields.py compares the two).
_OMITTED_FIELDS: dict[ModelFamily, dict[str, Any]] = {
    ModelFamily.QWEN3: {
        "head_dim": 128,
        "num_key_value_heads": 32,
        "max_position_embeddings": 32768,
    },
    ModelFamily.MINIMAX_M2: {
        "head_dim": 128,
        "num_key_value_heads": 8,
        "max_position_embeddings": 196608,
        "rope_theta": 5000000.0,
    },
    ModelFamily.GLM_MOE_DSA: {"rms_norm_eps": 1e-5, "max_position_embeddings": 202752},
    ModelFamily.QWEN3_NEXT: {
        "head_dim": 256,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
    },
    ModelFamily.KIMI_LINEAR: {"rms_norm_eps": 1e-5},
}


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``llama3``: Llama-3.1 band-wise scaling; ``linear``: divide by
    ``factor`` (the band parameters are then unused)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in _SUPPORTED_ROPE_TYPES:
            raise UnsupportedArchitectureError(
                f"rope_scaling type {self.rope_type!r} is not implemented; "
                f"supported: {', '.join(_SUPPORTED_ROPE_TYPES)} (or no scaling)"
            )
        if self.factor <= 0:
            raise InvalidModelConfigError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise InvalidModelConfigError(
                "llama3 rope_scaling needs high_freq_factor > low_freq_factor > 0, got "
                f"{self.high_freq_factor} and {self.low_freq_factor}"
            )

    def to_hf(self) -> dict[str, Any]:
        d: dict[str, Any] = {"rope_type": self.rope_type, "factor": self.factor}
        if self.rope_type == "llama3":
            d.update(
                low_freq_factor=self.low_freq_factor,
                high_freq_factor=self.high_freq_factor,
                original_max_position_embeddings=self.original_max_position_embeddings,
            )
        return d


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only model. ``name`` is the model identity that goes
    into block hashes (two models must never share cached KV), so give each checkpoint a
    distinct one. ``quantization`` says how the checkpoint stores its weights (None: plain
    floats); stages always compute in their serving dtype."""

    family: ModelFamily
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    moe: MoeConfig | None = None
    partial_rotary_factor: float = 1.0
    mla: MlaConfig | None = None
    recurrent: RecurrentConfig | None = None
    quantization: Fp8BlockQuantization | None = None  # how the checkpoint stores weights

    def __post_init__(self) -> None:
        for field_name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value <= 0:
                raise InvalidModelConfigError(f"{field_name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise InvalidModelConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise InvalidModelConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise InvalidModelConfigError("rms_norm_eps and rope_theta must be > 0")
        for part, families in (
            ("moe", _MOE_FAMILIES),
            ("mla", _MLA_FAMILIES),
            ("recurrent", _RECURRENT_FAMILIES),
        ):
            if (getattr(self, part) is None) is (self.family in families):
                raise InvalidModelConfigError(
                    f"family {self.family.value} "
                    f"{'needs' if self.family in families else 'has no'} {part} settings"
                )
        if self.mla is not None and self.head_dim != self.mla.qk_rope_head_dim:
            raise InvalidModelConfigError(
                "with MLA, head_dim is the rotated width qk_rope_head_dim"
            )
        if self.recurrent is not None and any(
            layer >= self.num_layers for layer in self.recurrent.layers
        ):
            raise InvalidModelConfigError(
                f"linear layers {self.recurrent.layers} exceed {self.num_layers} layers"
            )
        if self.partial_rotary_factor != 1.0 and self.family not in _PARTIAL_ROPE_FAMILIES:
            raise UnsupportedArchitectureError(
                f"partial_rotary_factor={self.partial_rotary_factor} is not supported for "
                f"{self.family.value} (only 1.0)"
            )
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise InvalidModelConfigError(
                f"partial_rotary_factor {self.partial_rotary_factor} x head_dim {self.head_dim} "
                "must give an even rotary width in (0, head_dim]"
            )

    @property
    def qk_norm(self) -> QkNorm:
        """Where attention RMS-normalises q and k before RoPE."""
        return {
            ModelFamily.QWEN3: QkNorm.PER_HEAD,
            ModelFamily.QWEN3_NEXT: QkNorm.PER_HEAD,
            ModelFamily.MINIMAX_M2: QkNorm.PER_LAYER,
        }.get(self.family, QkNorm.NONE)

    @property
    def attention_output_gate(self) -> bool:
        """Full attention multiplies its output by sigmoid(gate), the gate projected with q
        (``q_proj`` is twice as wide: per head, q then gate) (Qwen3-Next)."""
        return self.family is ModelFamily.QWEN3_NEXT

    @property
    def norm_weight_offset(self) -> float:
        """Added to stored RMSNorm weights: Qwen3-Next stores them zero-centred (scale by
        1 + w); its gated norm inside linear attention is not."""
        return 1.0 if self.family is ModelFamily.QWEN3_NEXT else 0.0

    @property
    def snapshot_interval_blocks(self) -> int | None:
        """For models with recurrent layers, 1: every block carries a state snapshot (see
        ``HybridKVCache``), so any full-block prefix whose blocks every stage holds is
        reusable; None for models without (the admission core's ``StageConfig`` field)."""
        return 1 if self.recurrent is not None else None

    def is_linear_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` is a recurrent (linear-attention) layer."""
        return self.recurrent is not None and self.recurrent.is_linear(layer)

    @property
    def rope_interleaved(self) -> bool:
        """RoPE on interleaved pairs (x0, x1), (x2, x3)... (GLM-5), not on halves."""
        return self.family is ModelFamily.GLM_MOE_DSA

    @property
    def rotary_dim(self) -> int:
        """Leading dimensions of each head that RoPE rotates (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, num_layers: int, dtype: Any) -> int:
        """Bytes of K plus V (with MLA: latent, rotated key part and indexer key) one token
        occupies in ``num_layers`` attention layers stored as ``dtype`` (a torch dtype, or
        anything with ``itemsize``). Recurrent layers hold no per-token entries: see
        ``cache_bytes_per_block``."""
        per_layer = 2 * self.kv_size if self.mla is None else self.mla.entry_width
        return num_layers * per_layer * int(dtype.itemsize)

    def cache_bytes_per_block(self, layers: Any, block_size: int, dtype: Any) -> int:
        """Bytes one cache block occupies across decoder ``layers`` (an iterable of layer
        indices, e.g. a stage's LayerRange): ``block_size`` tokens' entries per attention
        layer plus, per recurrent layer, the state snapshot each block carries. What a stage
        sizes its block count by, so escrow (which counts blocks) charges snapshots too."""
        layers = list(layers)
        linear = [layer for layer in layers if self.is_linear_layer(layer)]
        attention = len(layers) - len(linear)
        size = block_size * self.kv_bytes_per_token(attention, dtype)
        if self.recurrent is not None:
            size += len(linear) * self.recurrent.snapshot_bytes(int(dtype.itemsize))
        return size

    def active_params_per_token(self, layer: int) -> int:
        """Weights one token multiplies through in decoder layer ``layer``: the attention
        projections (MLA: q/kv LoRA, expansions and the indexer's) and the MLP, or a MoE
        layer's router, its ``top_k`` routed experts and its shared experts. The per-layer
        cost shape the router's and any simulator's FLOP counts should share."""
        h = self.hidden_size
        r = self.recurrent
        if r is not None and r.is_linear(layer) and self.family is ModelFamily.KIMI_LINEAR:
            attn = kda_active_params(r, h)
        elif r is not None and r.is_linear(layer):
            attn = h * (r.conv_width + r.value_dim + 2 * r.num_value_heads) + r.value_dim * h
        elif self.mla is None:
            gate = self.q_size if self.attention_output_gate else 0
            attn = h * (self.q_size + gate) + 2 * h * self.kv_size + self.q_size * h
        else:
            attn = self.mla.active_params(h, self.num_heads)
        moe = self.moe
        if moe is None or not moe.is_sparse(layer):
            return attn + 3 * h * self.intermediate_size
        widths = moe.top_k * moe.expert_intermediate_size + moe.shared_width
        return attn + h * (moe.num_experts + int(moe.gated_shared)) + 3 * h * widths

    def attention_flops_per_pair(self) -> int:
        """FLOPs of one (query, key) pair in one layer: QK^T and PV over every head (MLA:
        nope + rope query width, v width; plus the indexer's scoring), dense causal."""
        if self.mla is None:
            return 4 * self.q_size
        m = self.mla
        return 2 * self.num_heads * (m.qk_head_dim + m.v_head_dim) + 2 * m.index_n_heads * (
            m.index_head_dim
        )

    @classmethod
    def from_hf_config(cls, d: Mapping[str, Any], name: str = "") -> ModelConfig:
        """Parse a Hugging Face ``config.json`` dict. Raises UnsupportedArchitectureError
        naming the architecture or option we do not implement, InvalidModelConfigError for
        missing or inconsistent fields."""
        family = _family_of(d)
        _reject_unsupported_options(d, family)
        omitted = _OMITTED_FIELDS.get(family, {})
        glm = family is ModelFamily.GLM_MOE_DSA
        qwen3_next = family is ModelFamily.QWEN3_NEXT
        kimi = family is ModelFamily.KIMI_LINEAR
        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            layers = int(d["num_hidden_layers"])
            moe = None
            if family is ModelFamily.MINIMAX_M2:
                moe = minimax_moe_of(d)
            elif glm:
                moe = glm_moe_of(d, layers)
            elif qwen3_next:
                moe = qwen3_next_moe_of(d)
            elif kimi:
                moe = kimi_moe_of(d, layers)
            rope_params = dict(d.get("rope_parameters") or {})
            rope_theta = float(
                d.get("rope_theta", rope_params.get("rope_theta", omitted.get("rope_theta", 1e4)))
            )
            # Kimi Linear's MLA has no RoPE: its rope settings change nothing
            scaling_d = None if kimi else d.get("rope_scaling") or rope_params
            max_positions = int(
                d.get(
                    "max_position_embeddings",
                    d.get("model_max_length", omitted.get("max_position_embeddings", 2048)),
                )
            )
            eos = d.get("eos_token_id")
            eos_ids = (
                ()
                if eos is None
                else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
            )
            return cls(
                family=family,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=int(
                    d.get("num_key_value_heads", omitted.get("num_key_value_heads")) or heads
                ),
                head_dim=int(d["qk_rope_head_dim"])
                if glm or kimi
                else int(d.get("head_dim", omitted.get("head_dim")) or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", omitted.get("rms_norm_eps", 1e-6))),
                rope_theta=rope_theta,
                rope_scaling=_rope_scaling_of(scaling_d, max_positions),
                max_position_embeddings=max_positions,
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                bos_token_id=None if d.get("bos_token_id") is None else int(d["bos_token_id"]),
                eos_token_ids=eos_ids,
                name=name,
                moe=moe,
                partial_rotary_factor=_partial_rotary_of(d, 0.25 if qwen3_next else 1.0),
                mla=glm_mla_of(d) if glm else kimi_mla_of(d) if kimi else None,
                recurrent=_RECURRENT_OF[family](d) if family in _RECURRENT_OF else None,
                quantization=quantization_of(d),
            )
        except KeyError as e:
            raise InvalidModelConfigError(f"config.json lacks required field {e.args[0]!r}") from e
        except (TypeError, ValueError) as e:
            raise InvalidModelConfigError(f"config.json has a malformed field: {e}") from e

    def to_hf_config(self) -> dict[str, Any]:
        """A ``config.json`` dict that transformers (4.x and 5.x) loads as LlamaForCausalLM or
        Qwen3ForCausalLM with exactly this model's numerics."""
        d: dict[str, Any] = {
            "architectures": [_HF_ARCHITECTURE[self.family]],
            "model_type": self.family.value,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else self.rope_scaling.to_hf(),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids)
            if len(self.eos_token_ids) != 1
            else self.eos_token_ids[0],
        }
        if self.family is ModelFamily.QWEN3:
            d["use_sliding_window"] = False
        glm = self.family is ModelFamily.GLM_MOE_DSA
        kimi = self.family is ModelFamily.KIMI_LINEAR
        if kimi and self.recurrent is not None and self.moe is not None and self.mla is not None:
            d.update(kimi_to_hf(self.moe, self.mla, self.recurrent, self.num_layers))
        elif self.recurrent is not None and self.moe is not None:
            d.update(qwen3_next_to_hf(self.recurrent, self.moe, self.num_layers))
        elif self.moe is not None:
            d.update(moe_to_hf(self.moe, glm))
        if self.mla is not None and not kimi:
            d.update(mla_to_hf(self.mla))
        if self.partial_rotary_factor != 1.0 or self.family is ModelFamily.QWEN3_NEXT:
            d["rotary_dim"] = self.rotary_dim
            d["partial_rotary_factor"] = self.partial_rotary_factor
        if self.quantization is not None:
            d["quantization_config"] = self.quantization.to_hf()
        return d


def _family_of(d: Mapping[str, Any]) -> ModelFamily:
    archs = d.get("architectures") or []
    for arch in archs:
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch]
    if not archs:
        for family in ModelFamily:
            if d.get("model_type") == family.value:
                return family
    named = ", ".join(archs) if archs else f"model_type={d.get('model_type')!r}"
    raise UnsupportedArchitectureError(
        f"architecture {named} is not supported; supported: {', '.join(_ARCHITECTURES)}"
    )


def _reject_unsupported_options(d: Mapping[str, Any], family: ModelFamily) -> None:
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedArchitectureError(f"hidden_act {act!r} is not supported (only silu)")
    unknown = sorted(set(d.get("layer_types") or ()) - set(_LAYER_TYPES[family]))
    if unknown:
        raise UnsupportedArchitectureError(
            f"{family.value} layer_types {unknown} are not implemented "
            f"(supported: {', '.join(_LAYER_TYPES[family])})"
        )
    for option in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if d.get(option):
            raise UnsupportedArchitectureError(f"config option {option}=true is not supported")
    if family is ModelFamily.MINIMAX_M2:
        reject_unsupported_minimax(d)
    if family is ModelFamily.GLM_MOE_DSA:
        reject_unsupported_glm(d)
    if family is ModelFamily.QWEN3_NEXT:
        reject_unsupported_qwen3_next(d)
    if family is ModelFamily.KIMI_LINEAR:
        reject_unsupported_kimi(d)


def _partial_rotary_of(d: Mapping[str, Any], default: float) -> float:
    """``partial_rotary_factor`` (top level or in ``rope_parameters``), else MiniMax-M2's
    legacy ``rotary_dim`` over ``head_dim``, else the family's default."""
    rope_params = d.get("rope_parameters") or {}
    factor = d.get("partial_rotary_factor", rope_params.get("partial_rotary_factor"))
    if factor is not None:
        return float(factor)
    if d.get("rotary_dim") is not None:
        head_dim = int(d.get("head_dim") or int(d["hidden_size"]) // int(d["num_attention_heads"]))
        return int(d["rotary_dim"]) / head_dim
    return default


def _rope_scaling_of(s: Mapping[str, Any] | None, max_positions: int) -> RopeScaling | None:
    if not s:
        return None
    rope_type = s.get("rope_type", s.get("type", "default"))
    if rope_type == "default":
        return None
    return RopeScaling(
        rope_type=str(rope_type),
        factor=float(s.get("factor", 1.0)),
        low_freq_factor=float(s.get("low_freq_factor", 1.0)),
        high_freq_factor=float(s.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            s.get("original_max_position_embeddings", max_positions)
        ),
    )
