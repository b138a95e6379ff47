"""Roofline of a P-stage pipeline: per-stage wave time, activation transfer, cache capacity.

Per stage and wave, ``time = max(flops / (peak * eff), bytes / (bw * eff)) + layers *
(overhead + chunk_overhead * chunks)``:

- FLOPs: ``2 * active parameters * tokens`` for the projections and experts (at the weights'
  precision), plus attention over the attended context (at the attention precision): a
  chunk of ``l`` tokens at offset ``s`` attends ``l * (s + l/2)`` query-key pairs
  (causal). With DeepSeek-style sparse attention each query attends ``min(topk, context)``
  keys and the indexer scores all ``l * (s + l/2)`` pairs.
- Bytes: the stage's dense weights, the experts the wave's tokens touch (expected count
  ``E * (1 - (1 - k/E)^T)`` per MoE layer), and the cached KV each chunk reads once.
- Layers are split evenly; the first ``L mod P`` stages take one layer more. Stage 0 also
  holds the embedding, the last stage the LM head.
- Cache capacity per stage: ``(memory * usable - weights - workspace) / (block_size *
  kv bytes per token of the stage's layers)`` blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prefill_node.core.cost_model import ChunkCostModel
from prefill_node.core.wave import ScheduledChunk
from prefill_node.sim.specs import GPUSpec, InvalidSpecError, LinkSpec, ModelSpec


@dataclass(frozen=True)
class StageSlice:
    """One stage's share of the model and of its GPU's memory."""

    stage: int
    layer_start: int
    layer_end: int
    weight_bytes: float
    kv_bytes_per_token: float  # all of the stage's layers
    capacity_blocks: int

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start


class PipelineRoofline:
    """Stage times for waves on one pipeline of ``num_stages`` identical GPUs."""

    def __init__(
        self, model: ModelSpec, gpu: GPUSpec, link: LinkSpec, num_stages: int, block_size: int
    ) -> None:
        if not 1 <= num_stages <= model.num_layers:
            raise InvalidSpecError(f"num_stages must be in [1, {model.num_layers}]")
        self.model, self.gpu, self.link = model, gpu, link
        self.num_stages, self.block_size = num_stages, block_size
        base, extra = divmod(model.num_layers, num_stages)
        bounds = [0]
        for s in range(num_stages):
            bounds.append(bounds[-1] + base + (1 if s < extra else 0))
        self._active: list[float] = []  # active params per token, per stage
        self._dense_bytes: list[float] = []  # weights read whatever the routing
        self._moe_layers: list[int] = []
        slices = []
        expert_params = 3 * model.hidden * model.moe_intermediate
        for s in range(num_stages):
            a, b = bounds[s], bounds[s + 1]
            total = active = dense = 0.0
            moe_layers = 0
            for layer in range(a, b):
                mlp_total, mlp_active = model.mlp_params(layer)
                attn = model.attention_params()
                total += attn + mlp_total
                active += attn + mlp_active
                is_moe = mlp_total != mlp_active
                moe_layers += is_moe
                dense += attn + (
                    mlp_total - expert_params * model.num_experts if is_moe else mlp_total
                )
            weights = total * model.weight_bytes
            embed = model.vocab * model.hidden * model.act_bytes
            weights += embed * ((s == 0) + (s == num_stages - 1))
            kv_per_token = (b - a) * model.kv_bytes_per_token_layer()
            free = gpu.memory_bytes * gpu.usable_memory_fraction - weights - gpu.workspace_bytes
            capacity = int(free // (kv_per_token * block_size))
            if capacity <= 0:
                raise InvalidSpecError(
                    f"{model.name} stage {s} does not fit on {gpu.name}: "
                    f"{weights / 1e9:.1f} GB of weights leave no room for KV"
                )
            slices.append(StageSlice(s, a, b, weights, kv_per_token, capacity))
            self._active.append(active)
            self._dense_bytes.append(dense * model.weight_bytes)
            self._moe_layers.append(moe_layers)
        self.stages: tuple[StageSlice, ...] = tuple(slices)
        self._expert_bytes = expert_params * model.weight_bytes

    def stage_time(self, stage: int, chunks: Sequence[ScheduledChunk]) -> float:
        """Seconds stage ``stage`` spends on a wave made of ``chunks``."""
        m, g, sl = self.model, self.gpu, self.stages[stage]
        tokens = sum(c.length for c in chunks)
        if tokens == 0:
            return 0.0
        pairs = sum(c.length * (c.start + c.length / 2) for c in chunks)
        if m.index_topk:
            attended = sum(c.length * min(m.index_topk, c.start + c.length / 2) for c in chunks)
        else:
            attended = pairs
        layers = sl.num_layers
        lin_flops = 2.0 * self._active[stage] * tokens
        attn_flops = layers * (m.pair_flops() * attended + m.index_pair_flops() * pairs)
        compute = lin_flops / (g.linear_flops_per_s * g.flops_efficiency)
        compute += attn_flops / (g.attention_flops_per_s * g.flops_efficiency)
        weights = self._dense_bytes[stage]
        if m.num_experts:
            touched = m.num_experts * (1 - (1 - m.active_experts / m.num_experts) ** tokens)
            weights += self._moe_layers[stage] * (touched + m.shared_experts) * self._expert_bytes
        kv_read = sl.kv_bytes_per_token * sum(c.end for c in chunks)
        memory = (weights + kv_read) / (g.hbm_bytes_per_s * g.bandwidth_efficiency)
        overhead = layers * (g.layer_overhead_s + g.chunk_overhead_s * len(chunks))
        return max(compute, memory) + overhead

    def transfer_time(self, tokens: int) -> float:
        """Seconds to send a wave's activations of ``tokens`` tokens to the next stage."""
        return self.link.transfer_s(tokens * self.model.hidden * self.model.act_bytes)

    def chunk_cost_model(self) -> ChunkCostModel:
        """``a`` and ``c`` of the compute-bound cost of the stage with the most layers."""
        m, g = self.model, self.gpu
        s = max(range(self.num_stages), key=lambda i: self.stages[i].num_layers)
        layers = self.stages[s].num_layers
        lin = g.linear_flops_per_s * g.flops_efficiency
        att = g.attention_flops_per_s * g.flops_efficiency
        a = 2.0 * self._active[s] / lin
        c = layers * m.index_pair_flops() / att
        if m.index_topk:
            a += layers * m.pair_flops() * m.index_topk / att  # sparse: bounded per token
        else:
            c += layers * m.pair_flops() / att
        return ChunkCostModel(per_token_s=a, per_token_context_s=c)
