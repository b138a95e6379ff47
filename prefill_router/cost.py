"""The router's chunk cost model from a model's shape (compute-bound FLOP counts)."""

from __future__ import annotations

from prefill_node.core.cost_model import ChunkCostModel
from prefill_node.model.config import ModelConfig

# Only the ratio of the two terms moves routing decisions among pipelines of one model; the
# scale (a mid-range accelerator's dense rate) just makes the seconds plausible.
FLOPS_PER_S = 1e14


def cost_model_for(config: ModelConfig, flops_per_s: float = FLOPS_PER_S) -> ChunkCostModel:
    """Per token: 2 FLOPs per weight of the attention projections and the MLP of every layer;
    per (query, key) pair: QK^T and PV, 2 FLOPs per head dimension each, in every layer."""
    d, q, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads
    projections = d * q + 2 * d * kv * config.head_dim + q * d
    mlp = 3 * d * config.intermediate_size
    linear = 2.0 * config.num_layers * (projections + mlp)
    attention = 4.0 * config.num_layers * q
    return ChunkCostModel.from_flops(linear, attention, flops_per_s)
