"""Sparse MoE block (MiniMax-M2 style): sigmoid router with correction bias, top-k SwiGLU experts.

Routing follows transformers' ``minimax_m2`` exactly: router logits in the weights' dtype,
sigmoid scores in fp32, experts chosen by score + ``e_score_correction_bias`` (the bias only
steers the choice), weights = the chosen raw scores renormalised to sum to 1. The experts'
per-expert ``w1`` (gate) / ``w3`` (up) checkpoint tensors are fused at load time into one
``[experts, 2 * width, hidden]`` tensor, ``w2`` (down) stacked into ``[experts, hidden,
width]``. The forward groups rows by expert (one sort), so each expert that any row chose
runs two matmuls over exactly its rows; experts no row chose cost nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from prefill_node.model.config import MoeConfig
from prefill_node.model.weights import ROUTER, ROUTER_BIAS, expert_prefix


class SparseMoe(nn.Module):
    """The MoE block of one layer; parameters are uninitialised until ``load``."""

    def __init__(
        self, moe: MoeConfig, hidden: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.width = moe.expert_intermediate_size
        e, w = moe.num_experts, moe.expert_intermediate_size

        def param(shape: tuple[int, ...], dt: torch.dtype = dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, dtype=dt, device=device), False)

        self.router = param((e, hidden))
        self.bias = param((e,), torch.float32)  # routing stays fp32 whatever the weights' dtype
        self.gate_up = param((e, 2 * w, hidden))
        self.down = param((e, hidden, w))

    @torch.no_grad()
    def load(self, get: Callable[[str], torch.Tensor]) -> None:
        """``get(suffix)`` returns the layer's checkpoint tensor (shape already checked)."""
        self.router.copy_(get(ROUTER))
        self.bias.copy_(get(ROUTER_BIAS))
        for e in range(self.num_experts):
            p = expert_prefix(e)
            self.gate_up[e, : self.width].copy_(get(p + "w1.weight"))
            self.gate_up[e, self.width :].copy_(get(p + "w3.weight"))
            self.down[e].copy_(get(p + "w2.weight"))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows x [T, hidden] -> (expert ids LongTensor [T, top_k], fp32 weights [T, top_k])."""
        scores = torch.sigmoid(F.linear(x, self.router).float())
        _, experts = torch.topk(scores + self.bias, self.top_k, dim=-1, sorted=False)
        weights = scores.gather(1, experts)
        return experts, weights / weights.sum(dim=-1, keepdim=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] (already post-attention-normed) -> the block's output [T, hidden]."""
        experts, weights = self.route(x)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        rows = order // self.top_k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for e, count in enumerate(counts):
            if not count:
                continue
            idx = rows[start : start + count]
            w = weights.reshape(-1)[order[start : start + count]]
            start += count
            gate_up = F.linear(x[idx], self.gate_up[e])
            act = F.silu(gate_up[:, : self.width]).mul_(gate_up[:, self.width :])
            y = F.linear(act, self.down[e]) * w[:, None]
            out.index_add_(0, idx, y.to(out.dtype))
        return out
