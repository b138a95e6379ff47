"""Multi-head latent attention, with a sparse-attention indexer (GLM-5 / DeepSeek-V3.2 DSA) or
without (Kimi Linear: no indexer, no q LoRA, no RoPE).

Per token the layer caches only ``[latent | rotated key | indexer key]`` (see
``PagedLatentCache``): the normalised KV latent (``kv_lora_rank``), the rotated key part
shared by all heads, and the indexer's key. Each chunk's attention expands the latents of
its sequence's positions [0, end) through ``kv_b_proj`` into per-head K (with the shared
rotated part) and V, so the cache never holds expanded K/V. The indexer scores every
(query, earlier position) pair - ``sum_h w_h(x) * relu(q_h . k)`` - and each query attends
only to its ``index_topk`` best-scoring causal positions (all of them while there are fewer),
which is exactly transformers' ``glm_moe_dsa`` selection: a row's choice depends only on its
own causal keys, so chunk boundaries cannot change it. Without an indexer every query attends
to all its causal positions, and the entry has no indexer key. Without RoPE (``rotary``
False) the "rope" parts of q and the shared key are used as projected.

Numerics follow transformers: q/kv latents RMS-normalised with eps 1e-6, interleaved RoPE
on the rotated parts (the indexer's rotated part leads its head, attention's trails), the
indexer's key LayerNorm'd with bias, index scores in fp32, softmax scale qk_head_dim^-0.5.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from prefill_node.errors import InvariantError
from prefill_node.model.attention import AttentionPlan, ChunkPlan, causal_hidden
from prefill_node.model.config import ModelConfig
from prefill_node.model.latent_cache import PagedLatentCache
from prefill_node.model.rope import apply_rotary_interleaved
from prefill_node.model.tensor_ops import Getter, linear, param, rms_norm

LATENT_EPS = 1e-6  # transformers builds q_a / kv_a norms with their default eps, not the config's


def attend_cpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention [heads, L, v_dim] of q [heads, L, d] over k [heads, S, d], v [heads, S, v_dim],
    not looking where ``hidden`` [L, S] is True. On CPU, SDPA has no fused kernel for MLA's
    (q/k head dim != v head dim) and its fallback ran 1.3-3x slower than these steps, which
    are that fallback's own (q and k each scaled by sqrt(scale), fp32, -inf where hidden):
    the same bits, so GLM-5's indexer top-k sees the same values either way."""
    dtype, s = q.dtype, math.sqrt(scale)
    q, k, v = q.float(), k.float(), v.float()
    scores = torch.matmul(q * s, (k * s).transpose(-2, -1))
    scores.masked_fill_(hidden, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v).to(dtype)


class MlaAttention(nn.Module):
    """The attention of one MLA layer; parameters are uninitialised until ``load``."""

    def __init__(
        self, config: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        m = config.mla
        if m is None:
            raise InvariantError("MlaAttention needs ModelConfig.mla")
        self.m, self.layer, self.heads = m, layer, config.num_heads
        h, heads = config.hidden_size, config.num_heads
        q_lora = m.q_lora_rank
        self.q = param((heads * m.qk_head_dim, h), dtype, device) if q_lora is None else None
        self.q_a = None if q_lora is None else param((q_lora, h), dtype, device)
        self.q_a_norm = None if q_lora is None else param((q_lora,), dtype, device)
        self.q_b = None if q_lora is None else param((heads * m.qk_head_dim, q_lora), dtype, device)
        self.kv_a = param((m.kv_lora_rank + m.qk_rope_head_dim, h), dtype, device)
        self.kv_a_norm = param((m.kv_lora_rank,), dtype, device)
        self.kv_b = param(
            (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank), dtype, device
        )
        self.o = param((h, heads * m.v_head_dim), dtype, device)
        self.idx_q = self.idx_k = self.idx_k_norm = self.idx_k_bias = self.idx_w = None
        if m.has_indexer:
            self.idx_q = param((m.index_n_heads * m.index_head_dim, q_lora or 0), dtype, device)
            self.idx_k = param((m.index_head_dim, h), dtype, device)
            self.idx_k_norm = param((m.index_head_dim,), dtype, device)
            self.idx_k_bias = param((m.index_head_dim,), dtype, device)
            self.idx_w = param((m.index_n_heads, h), dtype, device)
        self.scale = m.qk_head_dim**-0.5

    @torch.no_grad()
    def load(self, get: Getter) -> None:
        """``get(suffix)``: this layer's ``self_attn.<suffix>`` tensor, shape checked."""
        for attr, name in (
            ("q", "q_proj.weight"),
            ("q_a", "q_a_proj.weight"),
            ("q_a_norm", "q_a_layernorm.weight"),
            ("q_b", "q_b_proj.weight"),
            ("kv_a", "kv_a_proj_with_mqa.weight"),
            ("kv_a_norm", "kv_a_layernorm.weight"),
            ("kv_b", "kv_b_proj.weight"),
            ("o", "o_proj.weight"),
            ("idx_q", "indexer.wq_b.weight"),
            ("idx_k", "indexer.wk.weight"),
            ("idx_k_norm", "indexer.k_norm.weight"),
            ("idx_k_bias", "indexer.k_norm.bias"),
            ("idx_w", "indexer.weights_proj.weight"),
        ):
            if getattr(self, attr) is not None:
                getattr(self, attr).copy_(get(name))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: AttentionPlan,
        cache: PagedLatentCache,
    ) -> torch.Tensor:
        """Normed rows x [T, hidden] -> attention output [T, hidden]; stores every row's
        cache entry (latent, rotated key, indexer key) in ``cache`` first."""
        m, rows = self.m, x.shape[0]
        if self.q is not None:
            q_resid, q = None, linear(x, self.q)
        else:
            q_resid = rms_norm(linear(x, self.q_a), self.q_a_norm, LATENT_EPS)
            q = linear(q_resid, self.q_b)
        q = q.view(rows, self.heads, m.qk_head_dim)
        latent, k_rot = linear(x, self.kv_a).split([m.kv_lora_rank, m.qk_rope_head_dim], -1)
        latent = rms_norm(latent, self.kv_a_norm, LATENT_EPS)
        if m.rotary:
            q_nope, q_rot = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
            q = torch.cat((q_nope, apply_rotary_interleaved(q_rot, cos, sin)), dim=-1)
            k_rot = apply_rotary_interleaved(k_rot[:, None, :], cos, sin)[:, 0]
        parts = [latent, k_rot]
        iq = iw = None
        if q_resid is not None and self.idx_w is not None:
            # the indexer's queries only matter for a chunk reaching past index_topk positions
            # (up to there its top-k is every position: plain causal attention)
            select = any(cp.end > m.index_topk for cp in plan.chunks)
            iq, ik = self._indexer_q_k(x, q_resid if select else None, cos, sin)
            parts.append(ik)
            if select:
                iw = linear(x, self.idx_w).float() * m.index_n_heads**-0.5
        entries = torch.cat(parts, dim=-1)
        cache.write_slots(self.layer, plan.k_slots, entries)
        out = torch.empty(rows, self.heads, m.v_head_dim, dtype=x.dtype, device=x.device)
        for cp in plan.chunks:
            r = slice(cp.row_start, cp.row_end)
            ent = entries[r] if cp.table is None else cache.gather(self.layer, cp.table, cp.end)
            allowed = None if iq is None or iw is None else (iq[r], iw[r])
            out[r] = self._chunk(q[r], allowed, cache.split(ent.to(x.dtype)), cp)
        return linear(out.view(rows, -1), self.o)

    def _indexer_q_k(
        self, x: torch.Tensor, q_resid: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Indexer queries [T, index_heads, index_dim] (None without ``q_resid``) and keys
        [T, index_dim], rotated."""
        m, rows = self.m, x.shape[0]
        if self.idx_q is None or self.idx_k is None:
            raise InvariantError("an MLA layer without an indexer has no indexer queries")
        rope, rest = m.qk_rope_head_dim, m.index_head_dim - m.qk_rope_head_dim
        iq = None
        if q_resid is not None:
            iq = linear(q_resid, self.idx_q).view(rows, m.index_n_heads, m.index_head_dim)
            iq_rot, iq_pass = iq.split([rope, rest], dim=-1)
            iq = torch.cat((apply_rotary_interleaved(iq_rot, cos, sin), iq_pass), dim=-1)
        ik = F.layer_norm(
            linear(x, self.idx_k), (m.index_head_dim,), self.idx_k_norm, self.idx_k_bias, 1e-6
        )
        ik_rot, ik_pass = ik[:, None, :].split([rope, rest], dim=-1)
        ik = torch.cat((apply_rotary_interleaved(ik_rot, cos, sin), ik_pass), dim=-1)[:, 0]
        return iq, ik

    def selection(
        self, iq: torch.Tensor, iw: torch.Tensor, index_keys: torch.Tensor, cp: ChunkPlan
    ) -> torch.Tensor:
        """Bool [L, end]: which positions each of the chunk's queries attends to (causal and
        among its ``index_topk`` best index scores)."""
        scores = torch.einsum("lhd,td->lht", iq.float(), index_keys.float())
        scores.mul_(self.m.index_head_dim**-0.5).relu_()  # in place: no fresh [L, H, T] pages
        index_scores = torch.einsum("lh,lht->lt", iw, scores)
        hidden = causal_hidden(cp.start, cp.end, iq.device)
        index_scores.masked_fill_(hidden, float("-inf"))
        k = min(self.m.index_topk, cp.end)
        chosen = torch.zeros_like(hidden).scatter_(1, index_scores.topk(k, dim=-1).indices, True)
        return chosen & ~hidden

    def _chunk(
        self,
        q: torch.Tensor,
        indexer: tuple[torch.Tensor, torch.Tensor] | None,
        parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        cp: ChunkPlan,
    ) -> torch.Tensor:
        """One chunk's attention output [L, heads, v_head_dim] over positions [0, end).
        ``indexer``: the chunk's indexer queries and head weights (None: no indexer); a chunk
        ending within ``index_topk`` positions attends to every causal position."""
        m = self.m
        latent, k_rot, index_keys = parts
        # hidden: True where a query may not look (None: plain causal from position 0)
        hidden = None
        if indexer is not None and cp.end > m.index_topk:
            hidden = ~self.selection(indexer[0], indexer[1], index_keys, cp)
        kv = linear(latent, self.kv_b).view(cp.end, self.heads, -1)
        k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_rot[:, None, :].expand(-1, self.heads, -1)), dim=-1)
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        if q.device.type != "cpu":
            mask = cp.mask
            if hidden is not None:
                mask = torch.zeros(hidden.shape, dtype=q.dtype, device=q.device)
                mask.masked_fill_(hidden, float("-inf"))
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale
            )
            return out.transpose(0, 1)
        if hidden is None:
            hidden = causal_hidden(cp.start, cp.end, q.device)
        out = attend_cpu(q, k, v, hidden, self.scale)
        return out.transpose(0, 1)
