"""Qwen3-Next's linear-attention layer (GatedDeltaNet) over a hybrid stage cache.

Per token: project q, k, v (grouped by key head in the checkpoint, regrouped at load time so
the projection is [q | k | v | z]), a depthwise causal conv + SiLU over q, k, v, then the gated
delta rule (``recurrent.gated_delta_rule_states``) with beta = sigmoid(b) and log-decay
g = -exp(A_log) * softplus(a + dt_bias); the output goes through an RMSNorm gated by SiLU(z)
and the output projection. Numerics follow transformers' torch path (q/k L2-normalised in
fp32, the delta rule in fp32).

Each chunk of a batch resumes from the state its cache holds for its start
(``HybridKVCache.state_before``) and stores the state after every block boundary it crosses
and after its end (``snapshot_ends``). Chunks run in row order, so two chunks of one sequence
may share a batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from prefill_node.errors import InvariantError
from prefill_node.model.attention import AttentionPlan
from prefill_node.model.config import ModelConfig
from prefill_node.model.recurrent import (
    causal_conv1d,
    conv_tails,
    gated_delta_rule_states,
    l2_normalize,
)
from prefill_node.model.recurrent_cache import HybridKVCache, snapshot_ends
from prefill_node.model.tensor_ops import Getter, linear, param


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """RMSNorm of x (fp32), scaled by ``weight``, times SiLU(gate) in fp32; x's dtype out."""
    x32 = x.to(torch.float32)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    out = (weight * normed.to(x.dtype)) * F.silu(gate.to(torch.float32))
    return out.to(x.dtype)


class GatedDeltaNet(nn.Module):
    """The token mixer of one linear-attention layer; uninitialised until ``load``."""

    def __init__(
        self, config: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        r = config.recurrent
        if r is None or not r.is_linear(layer):
            raise InvariantError(f"layer {layer} is not a linear-attention layer")
        self.r, self.layer, self.eps = r, layer, config.rms_norm_eps
        h = config.hidden_size
        self.qkvz = param((2 * r.key_dim + 2 * r.value_dim, h), dtype, device)
        self.ba = param((2 * r.num_value_heads, h), dtype, device)
        self.conv = param((r.conv_width, r.conv_kernel), dtype, device)
        self.dt_bias = param((r.num_value_heads,), torch.float32, device)
        self.a_log = param((r.num_value_heads,), torch.float32, device)
        self.norm = param((r.value_head_dim,), dtype, device)
        self.out = param((h, r.value_dim), dtype, device)

    @torch.no_grad()
    def load(self, get: Getter) -> None:
        """``get(suffix)``: this layer's ``linear_attn.<suffix>`` tensor, shape checked.
        The checkpoint groups q, k, v, z (and b, a) per key head; regroup to [q | k | v | z]
        and [b | a] so the forward splits contiguous column ranges."""
        r = self.r
        per = r.num_value_heads // r.num_key_heads
        grouped = get("in_proj_qkvz.weight").view(r.num_key_heads, -1, self.qkvz.shape[1])
        widths = [r.key_head_dim, r.key_head_dim, per * r.value_head_dim, per * r.value_head_dim]
        parts = grouped.split(widths, dim=1)
        self.qkvz.copy_(torch.cat([p.reshape(-1, p.shape[-1]) for p in parts]))
        ba = get("in_proj_ba.weight").view(r.num_key_heads, 2 * per, -1).split([per, per], dim=1)
        self.ba.copy_(torch.cat([p.reshape(-1, p.shape[-1]) for p in ba]))
        self.conv.copy_(get("conv1d.weight").squeeze(1))
        self.dt_bias.copy_(get("dt_bias"))
        self.a_log.copy_(get("A_log"))
        self.norm.copy_(get("norm.weight"))
        self.out.copy_(get("out_proj.weight"))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: AttentionPlan,
        kv: HybridKVCache,
    ) -> torch.Tensor:
        """Normed rows x [T, hidden] -> [T, hidden]; stores each chunk's snapshots in ``kv``.
        (cos / sin: the token mixers' common signature; no RoPE here.)"""
        r = self.r
        rows = x.shape[0]
        proj = linear(x, self.qkvz)
        mixed, z = proj[:, : r.conv_width], proj[:, r.conv_width :]
        b, a = linear(x, self.ba).split(r.num_value_heads, dim=-1)
        beta = torch.sigmoid(b)
        g = -self.a_log.exp() * F.softplus(a.to(torch.float32) + self.dt_bias)
        core = torch.empty(
            rows, r.num_value_heads, r.value_head_dim, dtype=x.dtype, device=x.device
        )
        for cp, chunk in zip(plan.chunks, plan.batch.chunks, strict=True):
            sl = slice(cp.row_start, cp.row_end)
            core[sl] = self._chunk(mixed[sl], g[sl], beta[sl], chunk.start, chunk.block_table, kv)
        normed = gated_rms_norm(core, z.view(rows, r.num_value_heads, -1), self.norm, self.eps)
        return linear(normed.reshape(rows, r.value_dim), self.out)

    def _chunk(
        self,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        start: int,
        table: tuple[int, ...],
        kv: HybridKVCache,
    ) -> torch.Tensor:
        r, length = self.r, mixed.shape[0]
        state, tail = kv.state_before(self.layer, table, start)
        conv, _ = causal_conv1d(mixed, self.conv, tail)
        q, k, v = F.silu(conv).split([r.key_dim, r.key_dim, r.value_dim], dim=-1)
        per = r.num_value_heads // r.num_key_heads
        q, k = (
            l2_normalize(
                t.reshape(length, r.num_key_heads, r.key_head_dim).to(torch.float32)
            ).repeat_interleave(per, dim=1)
            for t in (q, k)
        )
        v = v.reshape(length, r.num_value_heads, r.value_head_dim)
        ends = snapshot_ends(start, start + length, kv.block_size)
        offsets = [e - start for e in ends]
        out, states = gated_delta_rule_states(q, k, v, g, beta, state, offsets)
        kv.store_states(self.layer, table, ends, states, conv_tails(mixed, tail, offsets))
        return out
