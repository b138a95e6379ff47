"""Sparse MoE block (MiniMax-M2, GLM-5, Qwen3-Next): a router, top-k SwiGLU experts, a shared one.

Routing follows transformers' ``minimax_m2`` / ``glm_moe_dsa`` exactly: router logits (in
the weights' dtype for MiniMax-M2, fp32 for GLM-5), sigmoid scores in fp32, experts chosen
by score + ``e_score_correction_bias`` (the bias only steers the choice) within the best
expert groups, weights = the chosen raw scores renormalised to sum to 1, times the routed
scaling factor; GLM-5 adds an always-on shared SwiGLU. Qwen3-Next (``MoeScoring.SOFTMAX``)
follows ``qwen3_next``: softmax over the router logits in fp32, the top-k renormalised, plus a
shared SwiGLU scaled by ``sigmoid(shared_expert_gate . x)``. Per-expert gate / up checkpoint
tensors are fused at load time into one ``[experts, 2 * width, hidden]`` tensor, the downs
stacked into ``[experts, hidden, width]`` (both stored transposed: see ``__init__``). The
forward groups rows by expert (one sort and one gather), so each expert that any row chose
runs two matmuls over exactly its contiguous rows; experts no row chose cost nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from prefill_node.model.config import MoeConfig
from prefill_node.model.family_config import MoeScoring
from prefill_node.model.tensor_ops import linear
from prefill_node.model.weights import MoeNames


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """SwiGLU MLP with fused ``gate_up`` [2 * width, hidden] and ``down`` [hidden, width]."""
    h = linear(x, gate_up)
    width = down.shape[1]
    return linear(F.silu(h[:, :width]).mul_(h[:, width:]), down)


class SparseMoe(nn.Module):
    """The MoE block of one layer; parameters are uninitialised until ``load``."""

    def __init__(
        self,
        moe: MoeConfig,
        names: MoeNames,
        hidden: int,
        dtype: torch.dtype,
        device: torch.device,
        fp32_router: bool,
    ) -> None:
        super().__init__()
        self.moe, self.names = moe, names
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.width = moe.expert_intermediate_size
        e, w = moe.num_experts, moe.expert_intermediate_size

        def param(shape: tuple[int, ...], dt: torch.dtype = dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, dtype=dt, device=device), False)

        self.router = param((e, hidden), torch.float32 if fp32_router else dtype)
        # routing stays fp32 whatever the weights' dtype
        self.bias = param((e,), torch.float32) if names.bias else None
        # logically [e, 2w, hidden] / [e, hidden, w] (checkpoint layout), stored transposed so
        # each expert's ``x @ weight.T`` is a plain matmul over a contiguous weight: with the
        # experts' weights streaming from memory, MKL ran it ~1.5x faster than a transposed one
        self.gate_up = nn.Parameter(param((e, hidden, 2 * w)).transpose(1, 2), False)
        self.down = nn.Parameter(param((e, w, hidden)).transpose(1, 2), False)
        shared = moe.shared_width
        self.shared_gate_up = param((2 * shared, hidden)) if shared else None
        self.shared_down = param((hidden, shared)) if shared else None
        self.shared_gate = param((1, hidden)) if moe.gated_shared else None

    @torch.no_grad()
    def load(self, get: Callable[[str], torch.Tensor]) -> None:
        """``get(suffix)`` returns the layer's checkpoint tensor (shape already checked)."""
        n = self.names
        self.router.copy_(get(n.router))
        if self.bias is not None:
            self.bias.copy_(get(n.bias))
        if self.shared_gate is not None:
            self.shared_gate.copy_(get(n.shared_gate))
        for e in range(self.num_experts):
            self.gate_up[e, : self.width].copy_(get(n.expert_tensor(e, n.gate)))
            self.gate_up[e, self.width :].copy_(get(n.expert_tensor(e, n.up)))
            self.down[e].copy_(get(n.expert_tensor(e, n.down)))
        if self.shared_gate_up is not None and self.shared_down is not None:
            mlp = (n.shared + "gate_proj.weight", n.shared + "up_proj.weight")
            self.shared_gate_up.copy_(torch.cat([get(s) for s in mlp]))
            self.shared_down.copy_(get(n.shared + "down_proj.weight"))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows x [T, hidden] -> (expert ids LongTensor [T, top_k], fp32 weights [T, top_k])."""
        moe = self.moe
        logits = linear(x.to(self.router.dtype), self.router).float()
        if moe.scoring is MoeScoring.SOFTMAX or self.bias is None:
            probs = torch.softmax(logits, dim=-1)
            weights, experts = torch.topk(probs, self.top_k, dim=-1)
            return experts, weights / weights.sum(dim=-1, keepdim=True)
        scores = torch.sigmoid(logits)
        choice = scores + self.bias
        if moe.num_groups > 1:
            grouped = choice.view(x.shape[0], moe.num_groups, -1)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            best = torch.topk(group_scores, moe.topk_groups, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view_as(scores)
        _, experts = torch.topk(choice, self.top_k, dim=-1, sorted=False)
        weights = scores.gather(1, experts)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        if moe.routed_scaling_factor != 1.0:
            weights = weights * moe.routed_scaling_factor
        return experts, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] (already post-attention-normed) -> the block's output [T, hidden]."""
        out = self._routed(x)
        if self.shared_gate_up is not None and self.shared_down is not None:
            shared = swiglu(x, self.shared_gate_up, self.shared_down)
            if self.shared_gate is not None:
                shared = torch.sigmoid(linear(x, self.shared_gate)) * shared
            out = out + shared
        return out

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        """Rows gathered once in expert order, so each chosen expert's matmuls run on one
        contiguous slice and write straight into shared buffers (no per-expert gather,
        allocation or scatter); the activation runs once over all slices, and the weighted
        outputs are summed into their rows in one pass at the end."""
        experts, weights = self.route(x)
        k, width = self.top_k, self.width
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = order // k
        xs = x.index_select(0, rows)
        h = x.new_empty(xs.shape[0], 2 * width)
        ys = torch.empty_like(xs)
        gate_up_t, down_t = self.gate_up.transpose(1, 2), self.down.transpose(1, 2)
        spans = []
        start = 0
        for e, count in enumerate(counts):
            if count:
                end = start + count
                torch.mm(xs[start:end], gate_up_t[e], out=h[start:end])
                spans.append((e, start, end))
                start = end
        act = F.silu(h[:, :width]).mul_(h[:, width:])
        for e, start, end in spans:
            torch.mm(act[start:end], down_t[e], out=ys[start:end])
        # one index_add over the expert-ordered rows adds each row's expert outputs in expert
        # order, as transformers does (the order matters: a near-tie in GLM-5's indexer top-k
        # can flip on the last bit of the sum)
        ys.mul_(weights.reshape(-1).index_select(0, order)[:, None])
        return torch.zeros_like(x).index_add_(0, rows, ys)
