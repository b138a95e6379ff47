"""Causal attention of a chunk batch over the paged KV cache (chunked prefill at any offset).

``AttentionPlan.build`` turns a ChunkBatch into device tensors once per forward (write slots,
block tables, and for the masked path offset-causal masks); every layer of the stage reuses
it. Per layer, ``paged_attention`` first writes the batch's new K/V into the cache, then each
chunk [s, e) attends to its sequence's positions [0, e). Writing before reading is what lets
two chunks of one sequence share a batch. Two paths compute the same thing
(``AttentionPath``):

- SPLIT (the default on CPU): the chunk's queries attend (a) to the cached context [0, s),
  read from its blocks, with no mask, and (b) to the chunk's own fresh K/V with
  ``is_causal`` (square, so top-left and bottom-right alignment agree). Each part is one call
  of torch's fused CPU flash kernel, which also returns every row's log-sum-exp; the two
  partial outputs are merged exactly: ``o = o_b + sigmoid(lse_a - lse_b) * (o_a - o_b)``.
  GQA shares a K/V head among a group of query heads without copying it: queries are viewed
  as ``[kv_heads, group, L, head_dim]`` and K/V expanded over the group with stride 0.
  Consecutive chunks whose contexts are the same blocks up to the same start (requests
  sharing a cached prefix) form one ``ContextRun``: the context is gathered once and part
  (a) is one kernel call over all their queries, which runs its larger query tiles.
- MASKED (the reference, and every other device): one SDPA over [0, e) gathered from the
  cache with a bottom-right-aligned additive mask (query row i sits at position s + i and
  sees keys 0..s + i); a chunk starting at 0 uses the fresh K/V with ``is_causal``. GQA goes
  through SDPA's ``enable_gqa``. Torch 2.13 runs this through the same fused kernel on
  CPU; what SPLIT saves is the per-forward masks, adding a mask to every score, and
  re-reading the chunk's own K/V from the cache (docs/models.md has the measurements).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from prefill_node.errors import InvariantError
from prefill_node.model.batch import ChunkBatch
from prefill_node.model.paged_kv import PagedKVCache

if TYPE_CHECKING:
    from prefill_node.model.latent_cache import StageCache


class AttentionPath(enum.Enum):
    """How ``paged_attention`` computes a chunk (see the module docstring)."""

    SPLIT = "split"
    MASKED = "masked"

    @classmethod
    def default_for(cls, device: torch.device, gqa: bool = True) -> AttentionPath:
        """SPLIT where torch's fused flash kernel with log-sum-exp exists (CPU) and the
        attention is GQA over a ``PagedKVCache``; else MASKED (MLA layers compute their own
        attention from the plan's masks)."""
        return cls.SPLIT if gqa and device.type == "cpu" else cls.MASKED


@dataclass(frozen=True)
class ChunkPlan:
    """Rows [row_start, row_end) of the batch are positions [start, end) of one sequence."""

    row_start: int
    row_end: int
    start: int
    end: int
    table: torch.Tensor | None  # LongTensor of the blocks covering [0, end); None if start == 0
    mask: torch.Tensor | None  # MASKED path only: additive [end - start, end], 0 or -inf


@dataclass(frozen=True)
class ContextRun:
    """SPLIT path: consecutive chunks (batch rows [row_start, row_end)) that attend to the
    same cached context, positions [0, start) in the blocks ``table``; ``table`` is None and
    there is one chunk when start == 0."""

    row_start: int
    row_end: int
    start: int
    table: torch.Tensor | None
    chunks: tuple[ChunkPlan, ...]


@dataclass(frozen=True)
class AttentionPlan:
    """Everything the layers of one forward need about the batch, built once."""

    k_slots: torch.Tensor  # LongTensor [T]: flat K slot of every row (see PagedKVCache)
    chunks: tuple[ChunkPlan, ...]
    batch: ChunkBatch  # what the plan was built from (recurrent layers read its block tables)
    path: AttentionPath = AttentionPath.MASKED
    runs: tuple[ContextRun, ...] = ()  # SPLIT path only: ``chunks`` grouped by context

    @classmethod
    def build(
        cls,
        batch: ChunkBatch,
        kv: StageCache,
        dtype: torch.dtype,
        path: AttentionPath | None = None,
    ) -> AttentionPlan:
        """``path`` None: ``AttentionPath.default_for`` the cache. Masks (MASKED path only)
        are additive in ``dtype`` (the activations'), so SDPA need not convert a boolean mask
        in every layer. InvariantError if a table does not cover its chunk
        (``check_block_tables``), or SPLIT is asked for off the CPU or for an MLA cache."""
        gqa = isinstance(kv, PagedKVCache)
        path = AttentionPath.default_for(kv.device, gqa) if path is None else path
        if path is AttentionPath.SPLIT and kv.device.type != "cpu":
            raise InvariantError(f"the SPLIT attention path runs on CPU only, not {kv.device}")
        if path is AttentionPath.SPLIT and not gqa:
            raise InvariantError("the SPLIT attention path is for GQA caches, not MLA latents")
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
                continue
            mask = (
                causal_mask(c.start, c.end, dtype, device) if path is AttentionPath.MASKED else None
            )
            plans.append(ChunkPlan(offsets[i], offsets[i + 1], c.start, c.end, table, mask))
        k_slots = slots[0] if len(slots) == 1 else torch.cat(slots)
        runs = _context_runs(batch, plans, kv.block_size) if path is AttentionPath.SPLIT else ()
        return cls(k_slots=k_slots, chunks=tuple(plans), batch=batch, path=path, runs=runs)


def _context_runs(
    batch: ChunkBatch, plans: list[ChunkPlan], block_size: int
) -> tuple[ContextRun, ...]:
    """Group consecutive chunks with cached context [0, start) in the same blocks. The
    positions read are below ``start`` in every chunk of a run, so they hold the same K/V
    whatever the chunks write (writes go to [start, end))."""
    runs: list[ContextRun] = []
    key_of_last = None
    for spec, cp in zip(batch.chunks, plans, strict=True):
        key = (spec.start, spec.block_table[: -(-spec.start // block_size)])
        if cp.table is not None and key == key_of_last:
            last = runs[-1]
            runs[-1] = ContextRun(
                last.row_start, cp.row_end, last.start, last.table, (*last.chunks, cp)
            )
            continue
        table = None if cp.table is None else cp.table[: len(key[1])]
        runs.append(ContextRun(cp.row_start, cp.row_end, cp.start, table, (cp,)))
        key_of_last = key if cp.table is not None else None
    return tuple(runs)


def causal_hidden(start: int, end: int, device: torch.device) -> torch.Tensor:
    """Bool [end - start, end]: True where query position p (start <= p < end) may not look
    (keys after p)."""
    pos = torch.arange(start, end, device=device)
    return torch.arange(end, device=device)[None, :] > pos[:, None]


def causal_mask(start: int, end: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive [end - start, end] mask: query position p sees keys 0..p (0), not later (-inf)."""
    mask = torch.zeros(end - start, end, dtype=dtype, device=device)
    return mask.masked_fill_(causal_hidden(start, end, device), float("-inf"))


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
    split = plan.path is AttentionPath.SPLIT
    attend = _split_attention if split else _masked_attention
    units: tuple[ContextRun, ...] | tuple[ChunkPlan, ...] = plan.runs if split else plan.chunks
    num_rows, num_heads, head_dim = q.shape
    if len(units) == 1:
        return attend(q, k, v, units[0], kv, global_layer).reshape(num_rows, num_heads * head_dim)
    out = torch.empty(num_rows, num_heads, head_dim, dtype=q.dtype, device=q.device)
    for unit in units:
        rows = slice(unit.row_start, unit.row_end)
        out[rows] = attend(q[rows], k[rows], v[rows], unit, kv, global_layer)
    return out.view(num_rows, num_heads * head_dim)


def _masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp: ChunkPlan,
    kv: PagedKVCache,
    global_layer: int,
) -> torch.Tensor:
    """One chunk's attention output [L, heads, head_dim], MASKED path."""
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


def _split_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    run: ContextRun,
    kv: PagedKVCache,
    global_layer: int,
) -> torch.Tensor:
    """One run's attention output [L, heads, head_dim] (its rows), SPLIT path (CPU)."""
    rows, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    grouped_q = q.transpose(0, 1).unflatten(0, (kv_heads, group))  # [kv_heads, group, L, d]
    out_ctx = lse_ctx = None
    if run.table is not None:
        keys, values = kv.gather(global_layer, run.table, run.start)
        out_ctx, lse_ctx = _flash(
            grouped_q, keys.to(q.dtype), values.to(q.dtype), group, causal=False
        )
    result = torch.empty(rows, kv_heads, group, head_dim, dtype=q.dtype, device=q.device)
    for cp in run.chunks:
        own = slice(cp.row_start - run.row_start, cp.row_end - run.row_start)
        out, lse = _flash(grouped_q[:, :, own], k[own], v[own], group, causal=True)
        if out_ctx is not None and lse_ctx is not None:
            weight = torch.sigmoid(lse_ctx[:, :, own] - lse).unsqueeze(-1)  # the context's share
            out = torch.lerp(out.float(), out_ctx[:, :, own].float(), weight).to(q.dtype)
        result[own] = out.permute(2, 0, 1, 3)  # [kv_heads, group, L, d] -> [L, kv_heads, group, d]
    return result.view(rows, heads, head_dim)


def _flash(
    grouped_q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused attention of queries [kv_heads, group, L, d] over k/v [S, kv_heads, d] -> output
    [kv_heads, group, L, d] and fp32 log-sum-exp [kv_heads, group, L]. ``causal`` needs
    S == L. The kernel reads K/V through strides, so the group expansion copies nothing."""

    def expand(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(0, 1).unsqueeze(1).expand(-1, group, -1, -1)

    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        grouped_q, expand(k), expand(v), 0.0, causal
    )
    return out, lse
