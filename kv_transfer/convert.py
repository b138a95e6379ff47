"""Exact KV layout conversion between paged pools of different block size and/or dtype.

Used when a transfer cannot be a plain byte copy: the sender packs tokens into a staging
tensor in the destination dtype (push), or the receiver unpacks a staging tensor read in
the source dtype into its pool (pull). A dtype change is ``Tensor.to(dtype)`` (round to
nearest even), so a widening round trip (bf16 -> f32 -> bf16) is bit-exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kv_transfer.errors import InvalidTransferRequest
from kv_transfer.plan import PageMap, staging_page_map, token_runs


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidTransferRequest(f"unknown torch dtype {name!r}")
    return dtype


def _token_index(pages: PageMap, start: int, end: int, device: torch.device):
    pages.check_range(start, end, "page map")
    rel = torch.arange(start - pages.origin, end - pages.origin, device=device)
    ids = torch.tensor(pages.block_ids, dtype=torch.long, device=device)
    return ids[rel // pages.block_size], rel % pages.block_size


def gather_tokens(kv: torch.Tensor, pages: PageMap, start: int, end: int) -> torch.Tensor:
    """Tokens ``[start, end)`` of one layer ``[blocks, 2, bs, H, D]`` as ``[2, T, H, D]``.

    Per-token indexing, independent of the run-based copies below (tests use it as the
    reference); the transfer path itself uses ``copy_tokens``.
    """
    blocks, offs = _token_index(pages, start, end, kv.device)
    return kv[blocks, :, offs].transpose(0, 1)


def copy_tokens(
    src: torch.Tensor,
    src_pages: PageMap,
    dst: torch.Tensor,
    dst_pages: PageMap,
    start: int,
    end: int,
) -> None:
    """Copy tokens ``[start, end)`` of one layer between pools, casting to ``dst``'s dtype.

    One strided copy per token run (about one per block): no gathered intermediate.
    """
    if src.shape[3:] != dst.shape[3:]:
        raise InvalidTransferRequest(
            f"KV heads x head dim differ: {tuple(src.shape[3:])} vs {tuple(dst.shape[3:])}"
        )
    for sb, so, db, do, n in token_runs(src_pages, dst_pages, start, end).tolist():
        dst[db, :, do : do + n].copy_(src[sb, :, so : so + n])


def convert_kv(
    src_layers: Sequence[torch.Tensor],
    src_pages: PageMap,
    dst_layers: Sequence[torch.Tensor],
    dst_pages: PageMap,
    start: int,
    end: int,
) -> None:
    """Copy tokens ``[start, end)`` of every layer from one paged pool into another.

    Block sizes and dtypes may differ; head count and head dim must match.
    """
    if len(src_layers) != len(dst_layers):
        raise InvalidTransferRequest(
            f"layer count differs: {len(src_layers)} source vs {len(dst_layers)} destination"
        )
    for src, dst in zip(src_layers, dst_layers, strict=True):
        copy_tokens(src, src_pages, dst, dst_pages, start, end)


def pack_staging(
    src_layers: Sequence[torch.Tensor], pages: PageMap, start: int, end: int, out: torch.Tensor
) -> None:
    """Fill ``out`` ``[layers, 1, 2, T, H, D]`` with tokens ``[start, end)``, cast to its dtype.

    Each ``out[i]`` is a one-block pool, so plan.staging_page_map addresses it.
    """
    staged = staging_page_map(start, end)
    for i, src in enumerate(src_layers):
        copy_tokens(src, pages, out[i], staged, start, end)


def unpack_staging(
    staging: torch.Tensor, dst_layers: Sequence[torch.Tensor], pages: PageMap, start: int, end: int
) -> None:
    """Inverse of pack_staging: scatter ``staging`` into ``dst_layers`` (cast to their dtype)."""
    staged = staging_page_map(start, end)
    for i, dst in enumerate(dst_layers):
        copy_tokens(staging[i], staged, dst, pages, start, end)
