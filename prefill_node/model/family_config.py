"""Family-specific parts of a model config: MoE routing (MiniMax-M2, GLM-5, Kimi Linear) and
MLA with or without a sparse-attention indexer (GLM-5, Kimi Linear), plus the config.json
parsing and checks of those families (Kimi Linear's own parsing is in ``kimi_config``).

Torch-free, like ``config``. Each ``*_of`` parser reads only the keys of its family; the
``reject_unsupported_*`` checks name the option (and the value we implement) whenever a
checkpoint asks for numerics this backend does not compute.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prefill_node.errors import InvalidModelConfigError, UnsupportedArchitectureError


def _positive(owner: object, *names: str) -> None:
    for name in names:
        value = getattr(owner, name)
        if not isinstance(value, int) or value <= 0:
            raise InvalidModelConfigError(f"{name} must be a positive int, got {value!r}")


class MoeScoring(enum.Enum):
    """How a MoE router scores experts. SIGMOID_BIAS (MiniMax-M2, GLM-5): sigmoid scores, the
    choice steered by a correction bias within expert groups. SOFTMAX (Qwen3-Next): softmax
    over the router logits, the top-k renormalised."""

    SIGMOID_BIAS = "sigmoid_bias"
    SOFTMAX = "softmax"


@dataclass(frozen=True)
class MoeConfig:
    """A sparse MoE block replacing the MLP of layers ``first_dense_layers`` onwards:
    ``num_experts`` SwiGLU experts of width ``expert_intermediate_size``, each token routed
    to ``top_k`` of them, plus an always-on shared SwiGLU of width ``shared_width``
    (``num_shared_experts`` experts' worth, or ``shared_intermediate_size`` when set; with
    SOFTMAX scoring its output is scaled by a sigmoid gate, as in Qwen3-Next).

    SIGMOID_BIAS routing: sigmoid scores in fp32; the choice uses score +
    ``e_score_correction_bias`` (a per-expert checkpoint tensor), restricted to the
    ``topk_groups`` best of ``num_groups`` expert groups (a group's score: the sum of its two
    best); the weights are the chosen raw scores renormalised to sum to 1, times
    ``routed_scaling_factor``. SOFTMAX routing: softmax in fp32, the top-k probabilities
    renormalised to sum to 1."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    num_shared_experts: int = 0
    first_dense_layers: int = 0
    scoring: MoeScoring = MoeScoring.SIGMOID_BIAS
    shared_intermediate_size: int = 0

    def __post_init__(self) -> None:
        _positive(self, "num_experts", "top_k", "expert_intermediate_size", "num_groups")
        _positive(self, "topk_groups")
        if self.top_k > self.num_experts:
            raise InvalidModelConfigError(
                f"top_k ({self.top_k}) exceeds num_experts ({self.num_experts})"
            )
        if self.num_experts % self.num_groups or self.topk_groups > self.num_groups:
            raise InvalidModelConfigError(
                f"{self.num_experts} experts cannot form {self.num_groups} groups with "
                f"{self.topk_groups} chosen"
            )
        if min(self.num_shared_experts, self.first_dense_layers, self.shared_intermediate_size) < 0:
            raise InvalidModelConfigError(
                "num_shared_experts, first_dense_layers and shared_intermediate_size are >= 0"
            )

    @property
    def shared_width(self) -> int:
        """Width of the always-on shared SwiGLU (0: none)."""
        return (
            self.shared_intermediate_size or self.expert_intermediate_size * self.num_shared_experts
        )

    @property
    def gated_shared(self) -> bool:
        """Whether a sigmoid gate (``shared_expert_gate``) scales the shared expert's output."""
        return self.scoring is MoeScoring.SOFTMAX and self.shared_width > 0

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has the MoE block (else a dense MLP)."""
        return layer >= self.first_dense_layers


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention, optionally with a DeepSeek-style sparse-attention indexer
    (GLM-5 has one; Kimi Linear has none, no q LoRA and no RoPE).

    Per token and layer the cache holds the normalised KV latent (``kv_lora_rank``), the
    shared "rope" key part (``qk_rope_head_dim``; rotated unless ``rotary`` is False) and
    the indexer's key (``index_head_dim``, 0 without an indexer): ``entry_width`` numbers,
    never the expanded per-head K/V. With an indexer a query attends to the ``index_topk``
    earlier positions it scores highest (all of them while there are fewer); without one,
    to every earlier position. ``q_lora_rank`` None: queries come from one ``q_proj``."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    rotary: bool = True

    def __post_init__(self) -> None:
        _positive(self, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if self.q_lora_rank is not None:
            _positive(self, "q_lora_rank")
        if self.has_indexer:
            _positive(self, "index_n_heads", "index_head_dim", "index_topk")
            if self.q_lora_rank is None:
                raise InvalidModelConfigError("the sparse-attention indexer needs a q LoRA")
            if self.index_head_dim < self.qk_rope_head_dim:
                raise InvalidModelConfigError(
                    f"index_head_dim ({self.index_head_dim}) must be at least "
                    f"qk_rope_head_dim ({self.qk_rope_head_dim})"
                )
        elif self.index_head_dim or self.index_topk:
            raise InvalidModelConfigError("an indexer needs index_n_heads > 0")
        if self.qk_rope_head_dim % 2:
            raise InvalidModelConfigError(
                f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even"
            )

    @property
    def has_indexer(self) -> bool:
        return self.index_n_heads > 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def active_params(self, hidden: int, heads: int) -> int:
        """Weights one token multiplies through in the attention projections: q (LoRA or
        not), the KV latent and its expansion, the output, and the indexer's."""
        h, q_lora = hidden, self.q_lora_rank
        q = (
            h * heads * self.qk_head_dim
            if q_lora is None
            else (h + heads * self.qk_head_dim) * q_lora
        )
        return (
            q
            + h * (self.kv_lora_rank + self.qk_rope_head_dim)
            + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
            + heads * self.v_head_dim * h
            + (q_lora or 0) * self.index_n_heads * self.index_head_dim
            + h * (self.index_head_dim + self.index_n_heads)
        )

    @property
    def entry_width(self) -> int:
        """Numbers cached per token and layer: latent, rope key part, indexer key."""
        return self.kv_lora_rank + self.qk_rope_head_dim + self.index_head_dim


# MiniMax-M2 config.json options whose other values change the numerics; transformers'
# minimax_m2 implements exactly these, and so do we.
_MINIMAX_FIXED = {
    "scoring_func": "sigmoid",
    "qk_norm_type": "per_layer",
    "use_qk_norm": True,
    "use_routing_bias": True,
    "shared_intermediate_size": 0,
}


def reject_unsupported_minimax(d: Mapping[str, Any]) -> None:
    for option, supported in _MINIMAX_FIXED.items():
        if option in d and d[option] != supported:
            raise UnsupportedArchitectureError(
                f"MiniMax-M2 config option {option}={d[option]!r} is not implemented "
                f"(supported: {supported!r})"
            )
    attn_types = d.get("attn_type_list")
    if attn_types and any(t != 1 for t in attn_types):
        raise UnsupportedArchitectureError(
            "MiniMax-M2 attn_type_list with linear-attention layers (type 0) is not "
            "implemented; every layer must be full attention (1)"
        )


def minimax_moe_of(d: Mapping[str, Any]) -> MoeConfig:
    return MoeConfig(
        num_experts=int(d.get("num_local_experts", d.get("num_experts", 0))),
        top_k=int(d["num_experts_per_tok"]),
        expert_intermediate_size=int(d["intermediate_size"]),
    )


def reject_unsupported_glm(d: Mapping[str, Any]) -> None:
    indexer_types = d.get("indexer_types")
    pattern = d.get("index_topk_pattern")
    shared = (
        (indexer_types and any(t != "full" for t in indexer_types))
        or (pattern and any(c not in ("F", "full") for c in pattern))
        or int(d.get("index_topk_freq", 1)) > 1
    )
    if shared:
        raise UnsupportedArchitectureError(
            "GLM-MoE-DSA cross-layer top-k sharing (indexer_types 'shared', index_topk_pattern "
            "or index_topk_freq > 1) is not implemented; every layer must run its own indexer"
        )
    if d.get("q_lora_rank") is None:
        raise UnsupportedArchitectureError(
            "MLA without a q LoRA (q_lora_rank null) is not implemented"
        )
    reject_mlp_pattern(d, int(d.get("first_k_dense_replace", 3)))
    if not d.get("norm_topk_prob", True):
        raise UnsupportedArchitectureError("norm_topk_prob=false is not implemented")


def reject_mlp_pattern(d: Mapping[str, Any], first_dense: int) -> None:
    """``mlp_layer_types``, when given, must be ``first_dense`` dense layers then sparse."""
    mlp_types = d.get("mlp_layer_types")
    if mlp_types is not None and list(mlp_types) != (
        ["dense"] * first_dense + ["sparse"] * (len(mlp_types) - first_dense)
    ):
        raise UnsupportedArchitectureError(
            f"mlp_layer_types {mlp_types} is not 'first_k_dense_replace dense layers, then "
            "sparse'; other patterns are not implemented"
        )


def glm_moe_of(d: Mapping[str, Any], num_layers: int) -> MoeConfig:
    return MoeConfig(
        num_experts=int(d.get("n_routed_experts", d.get("num_local_experts", 0))),
        top_k=int(d["num_experts_per_tok"]),
        expert_intermediate_size=int(d["moe_intermediate_size"]),
        num_groups=int(d.get("n_group", 1)),
        topk_groups=int(d.get("topk_group", 1)),
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
        num_shared_experts=int(d.get("n_shared_experts", 0)),
        first_dense_layers=min(int(d.get("first_k_dense_replace", 3)), num_layers),
    )


def glm_mla_of(d: Mapping[str, Any]) -> MlaConfig:
    return MlaConfig(
        q_lora_rank=int(d["q_lora_rank"]),
        kv_lora_rank=int(d["kv_lora_rank"]),
        qk_nope_head_dim=int(d["qk_nope_head_dim"]),
        qk_rope_head_dim=int(d["qk_rope_head_dim"]),
        v_head_dim=int(d["v_head_dim"]),
        index_n_heads=int(d["index_n_heads"]),
        index_head_dim=int(d["index_head_dim"]),
        index_topk=int(d["index_topk"]),
    )


def moe_to_hf(moe: MoeConfig, glm: bool) -> dict[str, Any]:
    if not glm:
        return {
            "num_local_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k,
            "intermediate_size": moe.expert_intermediate_size,
            "scoring_func": "sigmoid",
            "use_routing_bias": True,
        }
    return {
        "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.expert_intermediate_size,
        "n_group": moe.num_groups,
        "topk_group": moe.topk_groups,
        "routed_scaling_factor": moe.routed_scaling_factor,
        "n_shared_experts": moe.num_shared_experts,
        "first_k_dense_replace": moe.first_dense_layers,
        "norm_topk_prob": True,
    }


def mla_to_hf(mla: MlaConfig) -> dict[str, Any]:
    """GLM-5's MLA fields (with the indexer's)."""
    return {name: getattr(mla, name) for name in mla.__dataclass_fields__ if name != "rotary"}
