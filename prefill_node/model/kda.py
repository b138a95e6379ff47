"""Kimi Delta Attention (Kimi Linear's linear-attention layer) over one sequence's explicit state.

A KDA layer keeps no per-token cache: per sequence its state is ``KdaState`` - the delta
rule's ``[heads, head_dim, head_dim]`` fp32 matrix and the last ``conv_kernel - 1`` projected
q/k/v rows the short convolutions still need. ``KdaAttention.run_sequence`` takes a chunk of one
sequence and the state before it and returns the output and the state after it (plus the
states after any offsets asked for, which is what block-boundary snapshots need); where states
live is the stage cache's business: ``forward`` (the token mixers' common signature) runs a
batch's chunks over a ``RecurrentStateCache``, resuming each from its block's snapshot.

Numerics follow transformers' ``KimiLinearDeltaAttention``: q/k/v projections through depthwise
causal convolutions (one per projection, fused here into one ``[3 * qkv, K]`` weight) and SiLU;
per-channel log-decay ``g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)`` in fp32;
``beta = sigmoid(b_proj(x))``; q and k L2-normalised in fp32; the gated delta rule
(``recurrent.gated_delta_rule``); then a gated RMSNorm per head (``o_norm(out) * sigmoid(
g_b(g_a(x)))``, in fp32) and ``o_proj``. The six projections of x are one fused matmul.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from prefill_node.errors import InvariantError
from prefill_node.model.attention import AttentionPlan
from prefill_node.model.config import ModelConfig, ModelFamily
from prefill_node.model.recurrent import (
    causal_conv1d,
    conv_tails,
    gated_delta_rule_states,
    l2_normalize,
)
from prefill_node.model.recurrent_cache import RecurrentStateCache, snapshot_ends
from prefill_node.model.tensor_ops import Getter, linear, param
from prefill_node.model.weights import KDA_CONVS

_SOFTPLUS_LINEAR_ABOVE = 20.0  # transformers' softplus is x itself above 20


class KdaState(NamedTuple):
    """One sequence's state in one KDA layer, after some prefix of it."""

    recurrent: torch.Tensor  # fp32 [heads, head_dim, head_dim]
    conv_tail: torch.Tensor  # [conv_kernel - 1, 3 * qkv]: the last projected q/k/v rows


class KdaResult(NamedTuple):
    out: torch.Tensor  # [L, hidden]
    state: KdaState  # after the chunk's last row
    snapshots: tuple[KdaState, ...]  # after each of the offsets asked for, in their order


class KdaAttention(nn.Module):
    """The attention of one KDA layer; parameters are uninitialised until ``load``."""

    def __init__(
        self, config: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        r = config.recurrent
        if r is None or not r.is_linear(layer) or config.family is not ModelFamily.KIMI_LINEAR:
            raise InvariantError(f"layer {layer} is not a KDA layer of this config")
        self.layer, self.eps = layer, config.rms_norm_eps
        self.heads, self.head_dim, self.qkv = r.num_value_heads, r.key_head_dim, r.key_dim
        self.kernel = r.conv_kernel
        h = config.hidden_size
        # fused rows: q, k, v (the conv's input), beta, forget-gate and output-gate LoRA-a
        self.splits = [3 * self.qkv, self.heads, self.head_dim, self.head_dim]
        self.in_proj = param((sum(self.splits), h), dtype, device)
        self.conv = param((3 * self.qkv, self.kernel), dtype, device)
        self.f_b = param((self.qkv, self.head_dim), dtype, device)
        self.g_b = param((self.qkv, self.head_dim), dtype, device)
        self.decay_rate = param((self.heads, 1), torch.float32, device)  # exp(A_log)
        self.dt_bias = param((self.qkv,), torch.float32, device)
        self.o_norm = param((self.head_dim,), dtype, device)
        self.o = param((h, self.qkv), dtype, device)

    @torch.no_grad()
    def load(self, get: Getter) -> None:
        """``get(suffix)``: this layer's ``self_attn.<suffix>`` tensor, shape checked."""
        rows = ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", "g_a_proj")
        self.in_proj.copy_(torch.cat([get(r + ".weight").to(self.in_proj.dtype) for r in rows]))
        self.conv.copy_(torch.cat([get(c)[:, 0, :].to(self.conv.dtype) for c in KDA_CONVS]))
        self.f_b.copy_(get("f_b_proj.weight"))
        self.g_b.copy_(get("g_b_proj.weight"))
        self.decay_rate.copy_(get("A_log").float().reshape(self.heads, 1).exp())
        self.dt_bias.copy_(get("dt_bias"))
        self.o_norm.copy_(get("o_norm.weight"))
        self.o.copy_(get("o_proj.weight"))

    def initial_state(self) -> KdaState:
        """The state before a sequence's first token."""
        device = self.in_proj.device
        return KdaState(
            torch.zeros(self.heads, self.head_dim, self.head_dim, device=device),
            torch.zeros(self.kernel - 1, 3 * self.qkv, dtype=self.in_proj.dtype, device=device),
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: AttentionPlan,
        kv: RecurrentStateCache,
    ) -> torch.Tensor:
        """Normed rows x [T, hidden] of a batch -> [T, hidden]. Each chunk resumes from the
        state its cache holds for its start and stores the states after every block boundary
        it crosses and after its end (``snapshot_ends``); chunks run in row order, so two
        chunks of one sequence may share a batch. (cos / sin: the token mixers' common
        signature; KDA has no RoPE.)"""
        out = torch.empty_like(x)
        for cp, chunk in zip(plan.chunks, plan.batch.chunks, strict=True):
            rows = slice(cp.row_start, cp.row_end)
            state = KdaState(*kv.state_before(self.layer, chunk.block_table, chunk.start))
            ends = snapshot_ends(chunk.start, chunk.end, kv.block_size)
            offsets = [e - chunk.start for e in ends[:-1]]
            result = self.run_sequence(x[rows], state, offsets)
            snaps = [*result.snapshots, result.state]
            states = torch.stack([s.recurrent for s in snaps])
            tails = torch.stack([s.conv_tail for s in snaps])
            kv.store_states(self.layer, chunk.block_table, ends, states, tails)
            out[rows] = result.out
        return out

    def run_sequence(
        self, x: torch.Tensor, state: KdaState, offsets: Sequence[int] = ()
    ) -> KdaResult:
        """Normed rows x [L, hidden] of ONE sequence, continuing from ``state`` -> the output
        and the state after the chunk; ``offsets`` (in [0, L]) ask for the states after that
        many of the chunk's rows too (e.g. at block boundaries)."""
        rows = x.shape[0]
        mixed, beta, f_a, g_a = linear(x, self.in_proj).split(self.splits, dim=-1)
        conv_in = mixed
        mixed, tail = causal_conv1d(mixed, self.conv, state.conv_tail)
        shape = (rows, self.heads, self.head_dim)
        q, k, v = (t.reshape(shape) for t in F.silu(mixed).split(self.qkv, dim=-1))
        g = linear(f_a, self.f_b).float() + self.dt_bias
        g = -self.decay_rate * _softplus(g.view(shape))
        q, k = l2_normalize(q.float()), l2_normalize(k.float())
        marks = [*offsets, rows]
        core, states = gated_delta_rule_states(
            q, k, v, g, torch.sigmoid(beta), state.recurrent, marks
        )
        gate = linear(g_a, self.g_b).view(shape)
        normed = F.rms_norm(core.float(), (self.head_dim,), eps=self.eps) * self.o_norm.float()
        out = (normed * torch.sigmoid(gate.float())).to(x.dtype)
        tails = conv_tails(conv_in, state.conv_tail, offsets) if offsets else ()
        snapshots = tuple(KdaState(s, t) for s, t in zip(states[:-1], tails, strict=True))
        return KdaResult(linear(out.view(rows, -1), self.o), KdaState(states[-1], tail), snapshots)


def _softplus(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x > _SOFTPLUS_LINEAR_ABOVE, x, torch.log1p(torch.exp(x)))
