"""The router's chunk cost model from a model's shape (compute-bound FLOP counts)."""

from __future__ import annotations

from prefill_node.core.cost_model import ChunkCostModel
from prefill_node.model.config import ModelConfig

# Only the ratio of the two terms moves routing decisions among pipelines of one model; the
# scale (a mid-range accelerator's dense rate) just makes the seconds plausible.
FLOPS_PER_S = 1e14


def cost_model_for(config: ModelConfig, flops_per_s: float = FLOPS_PER_S) -> ChunkCostModel:
    """Per token: 2 FLOPs per weight a token multiplies through in every layer (attention
    projections and the MLP, or a MoE layer's active experts: ``active_params_per_token``);
    per (query, key) pair: QK^T and PV in every attention layer (``attention_flops_per_pair``;
    a hybrid model's recurrent layers have no per-pair cost, their state update is per token
    and small next to their projections, which ``active_params_per_token`` counts)."""
    layers = range(config.num_layers)
    linear = 2.0 * sum(config.active_params_per_token(layer) for layer in layers)
    attention_layers = sum(1 for layer in layers if not config.is_linear_layer(layer))
    attention = float(attention_layers * config.attention_flops_per_pair())
    return ChunkCostModel.from_flops(linear, attention, flops_per_s)
