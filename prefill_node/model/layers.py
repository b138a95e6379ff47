"""One pre-norm decoder layer: RMSNorm, a token mixer (GQA, MLA or a linear-attention
GatedDeltaNet / KDA), RMSNorm, SwiGLU MLP or MoE.

Weights arrive under Hugging Face names and are fused at load time: q/k/v into one
``[q + 2 kv, hidden]`` matrix and gate/up into one ``[2 * intermediate, hidden]`` matrix,
so a dense GQA layer runs four matmuls instead of seven; a MoE layer's MLP is a
``SparseMoe``, an MLA layer's attention an ``MlaAttention``. RMSNorm follows transformers:
normalise in fp32, cast back, then scale by the weight. GQA q/k norm is per head (Qwen3) or
over the whole projection (MiniMax-M2), before RoPE. Qwen3-Next's full attention also
projects a per-head output gate with q and multiplies the attention output by its sigmoid;
its zero-centred norm weights get ``norm_weight_offset`` added once at load time.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from prefill_node.model.attention import AttentionPlan, paged_attention
from prefill_node.model.config import ModelConfig, ModelFamily, QkNorm
from prefill_node.model.gated_deltanet import GatedDeltaNet
from prefill_node.model.kda import KdaAttention
from prefill_node.model.latent_cache import StageCache
from prefill_node.model.mla import MlaAttention
from prefill_node.model.moe import SparseMoe, swiglu
from prefill_node.model.paged_kv import PagedKVCache
from prefill_node.model.rope import apply_rotary
from prefill_node.model.tensor_ops import Getter, linear, param, rms_norm, take
from prefill_node.model.weights import moe_names

__all__ = ["DecoderLayer", "GqaAttention", "rms_norm", "take"]


class GqaAttention(nn.Module):
    """Grouped-query attention with RoPE over a paged K/V cache (Llama, Qwen3, MiniMax-M2)."""

    def __init__(
        self, config: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.layer, self.eps = layer, config.rms_norm_eps
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.output_gate = config.attention_output_gate
        self.norm_offset = config.norm_weight_offset
        self.q_width = 2 * self.q_size if self.output_gate else self.q_size  # q (+ gate)
        h = config.hidden_size
        self.qkv = param((self.q_width + 2 * self.kv_size, h), dtype, device)
        self.o = param((h, self.q_size), dtype, device)
        self.qk_norm = config.qk_norm
        q_w, k_w = (
            (self.q_size, self.kv_size)
            if self.qk_norm is QkNorm.PER_LAYER
            else (self.head_dim, self.head_dim)
        )
        has_norm = self.qk_norm is not QkNorm.NONE
        self.q_norm = param((q_w,), dtype, device) if has_norm else None
        self.k_norm = param((k_w,), dtype, device) if has_norm else None

    @torch.no_grad()
    def load(self, get: Getter) -> None:
        """``get(suffix)``: this layer's ``self_attn.<suffix>`` tensor, shape checked."""
        attn = ("q_proj.weight", "k_proj.weight", "v_proj.weight")
        self.qkv.copy_(torch.cat([get(s).to(self.qkv.dtype) for s in attn]))
        self.o.copy_(get("o_proj.weight"))
        if self.q_norm is not None and self.k_norm is not None:
            self.q_norm.copy_(get("q_norm.weight").float() + self.norm_offset)
            self.k_norm.copy_(get("k_norm.weight").float() + self.norm_offset)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: AttentionPlan,
        kv: PagedKVCache,
    ) -> torch.Tensor:
        """Normed rows x [T, hidden] -> attention output [T, hidden]; stores K/V in ``kv``."""
        rows = x.shape[0]
        qkv = linear(x, self.qkv)
        q = qkv[:, : self.q_width]
        gate = None
        if self.output_gate:  # per head: q then gate
            q, gate = q.view(rows, self.num_heads, 2 * self.head_dim).split(self.head_dim, -1)
            gate = gate.reshape(rows, self.q_size)
        k = qkv[:, self.q_width : self.q_width + self.kv_size]
        v = qkv[:, self.q_width + self.kv_size :].view(rows, self.num_kv_heads, self.head_dim)
        norms = self.q_norm is not None and self.k_norm is not None
        if norms and self.qk_norm is QkNorm.PER_LAYER:
            q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
        q = q.reshape(rows, self.num_heads, self.head_dim)
        k = k.reshape(rows, self.num_kv_heads, self.head_dim)
        if norms and self.qk_norm is QkNorm.PER_HEAD:
            q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        out = paged_attention(q, k, v, plan, kv, self.layer)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return linear(out, self.o)


class DecoderLayer(nn.Module):
    """Global layer ``layer``; parameters are uninitialised until ``load``."""

    def __init__(
        self, config: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.layer = layer
        self.eps = config.rms_norm_eps
        h = config.hidden_size
        self.norm_offset = config.norm_weight_offset
        self.input_norm = param((h,), dtype, device)
        self.post_norm = param((h,), dtype, device)
        self.linear = config.is_linear_layer(layer)
        kimi = config.family is ModelFamily.KIMI_LINEAR
        self.mixer_prefix = "linear_attn." if self.linear and not kimi else "self_attn."
        self.attn: nn.Module
        if self.linear and kimi:
            self.attn = KdaAttention(config, layer, dtype, device)
        elif self.linear:
            self.attn = GatedDeltaNet(config, layer, dtype, device)
        elif config.mla is None:
            self.attn = GqaAttention(config, layer, dtype, device)
        else:
            self.attn = MlaAttention(config, layer, dtype, device)
        moe = config.moe
        fp32_router = config.family in (ModelFamily.GLM_MOE_DSA, ModelFamily.KIMI_LINEAR)
        self.moe = (
            SparseMoe(moe, moe_names(config), h, dtype, device, fp32_router=fp32_router)
            if moe is not None and moe.is_sparse(layer)
            else None
        )
        width = config.intermediate_size
        dense = self.moe is None
        self.gate_up = param((2 * width, h), dtype, device) if dense else None
        self.down = param((h, width), dtype, device) if dense else None

    @torch.no_grad()
    def load(self, weights: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple]) -> None:
        """Copy (and fuse) this layer's HF-named tensors; ``shapes`` gives the expected ones."""
        p = f"model.layers.{self.layer}."

        def get(suffix: str) -> torch.Tensor:
            return take(weights, p + suffix, shapes[p + suffix])

        self.input_norm.copy_(get("input_layernorm.weight").float() + self.norm_offset)
        self.attn.load(lambda suffix: get(self.mixer_prefix + suffix))
        self.post_norm.copy_(get("post_attention_layernorm.weight").float() + self.norm_offset)
        if self.moe is not None:
            self.moe.load(get)
        elif self.gate_up is not None and self.down is not None:
            mlp = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
            self.gate_up.copy_(torch.cat([get(s).to(self.gate_up.dtype) for s in mlp]))
            self.down.copy_(get("mlp.down_proj.weight"))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: AttentionPlan,
        kv: StageCache,
    ) -> torch.Tensor:
        """Residual stream x [T, hidden] -> [T, hidden]; stores this layer's cache entries."""
        x = x + self.attn(rms_norm(x, self.input_norm, self.eps), cos, sin, plan, kv)
        h = rms_norm(x, self.post_norm, self.eps)
        if self.moe is not None:
            return x + self.moe(h)
        return x + swiglu(h, self.gate_up, self.down)
