"""One pre-norm decoder layer (RMSNorm, GQA attention with RoPE, SwiGLU MLP or MoE), fused weights.

Weights arrive under Hugging Face names and are fused at load time: q/k/v into one
``[q + 2 kv, hidden]`` matrix and gate/up into one ``[2 * intermediate, hidden]`` matrix,
so a dense layer runs four matmuls instead of seven; a MoE family's MLP is a ``SparseMoe``.
RMSNorm follows transformers: normalise in fp32, cast back, then scale by the weight. q/k
norm is per head (Qwen3) or over the whole projection (MiniMax-M2), before RoPE.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from prefill_node.errors import InvalidModelConfigError
from prefill_node.model.attention import AttentionPlan, paged_attention
from prefill_node.model.config import ModelConfig, QkNorm
from prefill_node.model.moe import SparseMoe
from prefill_node.model.paged_kv import PagedKVCache
from prefill_node.model.rope import apply_rotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    normed = F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def take(weights: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """``weights[name]`` after checking its shape (the caller checked presence)."""
    t = weights[name]
    if tuple(t.shape) != shape:
        raise InvalidModelConfigError(
            f"checkpoint tensor {name} has shape {tuple(t.shape)}, the config implies {shape}"
        )
    return t


class DecoderLayer(nn.Module):
    """Global layer ``layer``; parameters are uninitialised until ``load``."""

    def __init__(
        self, config: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.layer = layer
        self.eps = config.rms_norm_eps
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.intermediate = config.intermediate_size
        h = config.hidden_size
        self.input_norm = _param((h,), dtype, device)
        self.qkv = _param((self.q_size + 2 * self.kv_size, h), dtype, device)
        self.o = _param((h, self.q_size), dtype, device)
        self.post_norm = _param((h,), dtype, device)
        self.moe = None if config.moe is None else SparseMoe(config.moe, h, dtype, device)
        dense = self.moe is None
        self.gate_up = _param((2 * self.intermediate, h), dtype, device) if dense else None
        self.down = _param((h, self.intermediate), dtype, device) if dense else None
        self.qk_norm = config.qk_norm
        q_w, k_w = (
            (self.q_size, self.kv_size)
            if self.qk_norm is QkNorm.PER_LAYER
            else (self.head_dim, self.head_dim)
        )
        has_norm = self.qk_norm is not QkNorm.NONE
        self.q_norm = _param((q_w,), dtype, device) if has_norm else None
        self.k_norm = _param((k_w,), dtype, device) if has_norm else None

    @torch.no_grad()
    def load(self, weights: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple]) -> None:
        """Copy (and fuse) this layer's HF-named tensors; ``shapes`` gives the expected ones."""
        p = f"model.layers.{self.layer}."

        def get(suffix: str) -> torch.Tensor:
            return take(weights, p + suffix, shapes[p + suffix])

        self.input_norm.copy_(get("input_layernorm.weight"))
        attn = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
        self.qkv.copy_(torch.cat([get(s).to(self.qkv.dtype) for s in attn]))
        self.o.copy_(get("self_attn.o_proj.weight"))
        self.post_norm.copy_(get("post_attention_layernorm.weight"))
        if self.moe is not None:
            self.moe.load(get)
        elif self.gate_up is not None and self.down is not None:
            mlp = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
            self.gate_up.copy_(torch.cat([get(s).to(self.gate_up.dtype) for s in mlp]))
            self.down.copy_(get("mlp.down_proj.weight"))
        if self.q_norm is not None and self.k_norm is not None:
            self.q_norm.copy_(get("self_attn.q_norm.weight"))
            self.k_norm.copy_(get("self_attn.k_norm.weight"))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: AttentionPlan,
        kv: PagedKVCache,
    ) -> torch.Tensor:
        """Residual stream x [T, hidden] -> [T, hidden]; stores this layer's K/V in ``kv``."""
        rows = x.shape[0]
        qkv = F.linear(rms_norm(x, self.input_norm, self.eps), self.qkv)
        q = qkv[:, : self.q_size]
        k = qkv[:, self.q_size : self.q_size + self.kv_size]
        v = qkv[:, self.q_size + self.kv_size :].view(rows, self.num_kv_heads, self.head_dim)
        if self.qk_norm is QkNorm.PER_LAYER and self.q_norm is not None and self.k_norm is not None:
            q = rms_norm(q, self.q_norm, self.eps)
            k = rms_norm(k, self.k_norm, self.eps)
        q = q.reshape(rows, self.num_heads, self.head_dim)
        k = k.reshape(rows, self.num_kv_heads, self.head_dim)
        if self.qk_norm is QkNorm.PER_HEAD and self.q_norm is not None and self.k_norm is not None:
            q = rms_norm(q, self.q_norm, self.eps)
            k = rms_norm(k, self.k_norm, self.eps)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        attn = paged_attention(q, k, v, plan, kv, self.layer)
        x = x + F.linear(attn, self.o)
        h = rms_norm(x, self.post_norm, self.eps)
        if self.moe is not None:
            return x + self.moe(h)
        gate_up = F.linear(h, self.gate_up)
        act = F.silu(gate_up[:, : self.intermediate]).mul_(gate_up[:, self.intermediate :])
        return x + F.linear(act, self.down)
