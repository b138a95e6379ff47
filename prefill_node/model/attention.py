"""Causal attention of a chunk batch over the paged KV cache (chunked prefill at any offset).

``AttentionPlan.build`` turns a ChunkBatch into device tensors once per forward (write slots,
block tables, offset-causal masks); every layer of the stage reuses it. Per layer,
``paged_attention`` first writes the batch's new K/V into the cache, then each chunk
[s, e) attends to its sequence's positions [0, e): a chunk starting at 0 uses the fresh
K/V directly with ``is_causal`` (no cache read); a chunk with a cached prefix gathers
[0, e) from its blocks and uses a bottom-right-aligned causal mask (query row i sits at
position s + i and sees keys 0..s + i). Writing before reading is what lets two chunks of
one sequence share a batch. GQA goes through SDPA's ``enable_gqa`` (no repeated K/V).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from prefill_node.model.batch import ChunkBatch
from prefill_node.model.paged_kv import PagedKVCache

if TYPE_CHECKING:
    from prefill_node.model.latent_cache import StageCache


@dataclass(frozen=True)
class ChunkPlan:
    """Rows [row_start, row_end) of the batch are positions [start, end) of one sequence."""

    row_start: int
    row_end: int
    start: int
    end: int
    table: torch.Tensor | None  # LongTensor of the blocks covering [0, end); None if start == 0
    mask: torch.Tensor | None  # additive [end - start, end]: 0 = may attend, -inf = masked


@dataclass(frozen=True)
class AttentionPlan:
    """Everything the layers of one forward need about the batch, built once."""

    k_slots: torch.Tensor  # LongTensor [T]: flat K slot of every row (see PagedKVCache)
    chunks: tuple[ChunkPlan, ...]
    batch: ChunkBatch  # what the plan was built from (recurrent layers read its block tables)

    @classmethod
    def build(cls, batch: ChunkBatch, kv: StageCache, dtype: torch.dtype) -> AttentionPlan:
        """Masks are additive in ``dtype`` (the activations'), so SDPA need not convert a
        boolean mask in every layer. InvariantError (from ``check_block_tables``) if a table
        does not cover its chunk."""
        batch.check_block_tables(kv.block_size, kv.num_blocks)
        device = kv.device
        slots = []
        plans = []
        offsets = batch.row_offsets
        for i, c in enumerate(batch.chunks):
            need = c.blocks_needed(kv.block_size)
            table = torch.tensor(c.block_table[:need], dtype=torch.long, device=device)
            pos = torch.arange(c.start, c.end, device=device)
            slots.append(kv.slot_index(table, pos))
            if c.start == 0:
                plans.append(ChunkPlan(offsets[i], offsets[i + 1], 0, c.end, None, None))
            else:
                keys = torch.arange(c.end, device=device)
                mask = torch.zeros(c.length, c.end, dtype=dtype, device=device)
                mask.masked_fill_(keys[None, :] > pos[:, None], float("-inf"))
                plans.append(ChunkPlan(offsets[i], offsets[i + 1], c.start, c.end, table, mask))
        k_slots = slots[0] if len(slots) == 1 else torch.cat(slots)
        return cls(k_slots=k_slots, chunks=tuple(plans), batch=batch)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: AttentionPlan,
    kv: PagedKVCache,
    global_layer: int,
) -> torch.Tensor:
    """q [T, heads, head_dim], k/v [T, kv_heads, head_dim] (after RoPE) -> [T, heads * head_dim].

    Side effect: the rows' K/V are stored in ``kv`` for ``global_layer`` at the plan's slots.
    """
    kv.write_slots(global_layer, plan.k_slots, k, v)
    num_rows, num_heads, head_dim = q.shape
    if len(plan.chunks) == 1:
        return _chunk_attention(q, k, v, plan.chunks[0], kv, global_layer).reshape(
            num_rows, num_heads * head_dim
        )
    out = torch.empty(num_rows, num_heads, head_dim, dtype=q.dtype, device=q.device)
    for cp in plan.chunks:
        rows = slice(cp.row_start, cp.row_end)
        out[rows] = _chunk_attention(q[rows], k[rows], v[rows], cp, kv, global_layer)
    return out.view(num_rows, num_heads * head_dim)


def _chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp: ChunkPlan,
    kv: PagedKVCache,
    global_layer: int,
) -> torch.Tensor:
    """One chunk's attention output [L, heads, head_dim]."""
    if cp.table is None:
        keys, values, mask = k, v, None
    else:
        keys, values = kv.gather(global_layer, cp.table, cp.end)
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        mask = cp.mask
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None,
        enable_gqa=q.shape[1] != keys.shape[1],
    )
    return out.squeeze(0).transpose(0, 1)
