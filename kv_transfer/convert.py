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
from kv_transfer.layout import KVLayout
from kv_transfer.plan import PageMap, staging_page_map, token_runs

KVLayer = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""One layer of a pool: a tensor ``[num_blocks, planes, block_size, H, D]`` (K at 0, V at 1;
or one plane of whole per-token entries, an MLA latent pool), or
its K and V as two tensors ``[num_blocks, block_size, H, D]`` with any strides (an engine's
cache whose K and V blocks are laid out differently; see vllm_decode/cache.py)."""


def kv_parts(layer: KVLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``layer`` as ``[num_blocks, block_size, H, D]`` views."""
    if isinstance(layer, torch.Tensor):
        if layer.shape[1] != 2:
            raise InvalidTransferRequest(
                f"a one-plane pool (whole per-token entries, shape {tuple(layer.shape)}) has "
                "no separate K and V; it can only be copied to another one-plane pool"
            )
        return layer[:, 0], layer[:, 1]
    return layer


def layer_device(layer: KVLayer) -> torch.device:
    return layer.device if isinstance(layer, torch.Tensor) else layer[0].device


def layout_of_views(layer_start: int, layers: Sequence[KVLayer]) -> KVLayout:
    """Geometry-only layout (no memory regions) of per-layer views with any strides. NIXL
    cannot address such a pool directly: transfers into it go through staging."""
    if not layers:
        raise InvalidTransferRequest("need at least one layer")
    parts = [kv_parts(layer) for layer in layers]
    first = parts[0][0]
    shape = tuple(first.shape)
    if len(shape) != 4 or any(
        tuple(t.shape) != shape or t.dtype != first.dtype for kv in parts for t in kv
    ):
        raise InvalidTransferRequest(
            "KV views must all be [num_blocks, 2, block_size, kv_heads, head_dim] or (K, V) "
            "pairs of [num_blocks, block_size, kv_heads, head_dim], of one shape and dtype"
        )
    return KVLayout(
        layer_start=layer_start,
        layer_end=layer_start + len(layers),
        num_blocks=shape[0],
        block_size=shape[1],
        num_kv_heads=shape[2],
        head_dim=shape[3],
        dtype=str(first.dtype).removeprefix("torch."),
    )


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


def gather_tokens(kv: KVLayer, pages: PageMap, start: int, end: int) -> torch.Tensor:
    """Tokens ``[start, end)`` of one layer as ``[2, T, H, D]``.

    Per-token indexing, independent of the run-based copies below (tests use it as the
    reference); the transfer path itself uses ``copy_tokens``.
    """
    blocks, offs = _token_index(pages, start, end, layer_device(kv))
    if isinstance(kv, torch.Tensor):
        return kv[blocks, :, offs].transpose(0, 1)
    return torch.stack([part[blocks, offs] for part in kv])


def copy_tokens(
    src: KVLayer,
    src_pages: PageMap,
    dst: KVLayer,
    dst_pages: PageMap,
    start: int,
    end: int,
) -> None:
    """Copy tokens ``[start, end)`` of one layer between pools, casting to ``dst``'s dtype.

    One strided copy per token run (about one per block; K and V apart when either side
    keeps them apart): no gathered intermediate.
    """
    if isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor):
        if src.shape[1] != dst.shape[1] or src.shape[3:] != dst.shape[3:]:
            raise InvalidTransferRequest(
                f"planes / KV heads x head dim differ: {tuple(src.shape)} vs {tuple(dst.shape)}"
            )
        for sb, so, db, do, n in token_runs(src_pages, dst_pages, start, end).tolist():
            dst[db, :, do : do + n].copy_(src[sb, :, so : so + n])
        return
    src_kv, dst_kv = kv_parts(src), kv_parts(dst)
    if src_kv[0].shape[2:] != dst_kv[0].shape[2:]:
        raise InvalidTransferRequest(
            f"KV heads x head dim differ: {tuple(src_kv[0].shape[2:])} vs "
            f"{tuple(dst_kv[0].shape[2:])}"
        )
    for sb, so, db, do, n in token_runs(src_pages, dst_pages, start, end).tolist():
        for s, d in zip(src_kv, dst_kv, strict=True):
            d[db, do : do + n].copy_(s[sb, so : so + n])


def convert_kv(
    src_layers: Sequence[KVLayer],
    src_pages: PageMap,
    dst_layers: Sequence[KVLayer],
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
    src_layers: Sequence[KVLayer], pages: PageMap, start: int, end: int, out: torch.Tensor
) -> None:
    """Fill ``out`` ``[layers, 1, 2, T, H, D]`` with tokens ``[start, end)``, cast to its dtype.

    Each ``out[i]`` is a one-block pool, so plan.staging_page_map addresses it.
    """
    staged = staging_page_map(start, end)
    for i, src in enumerate(src_layers):
        copy_tokens(src, pages, out[i], staged, start, end)


def unpack_staging(
    staging: torch.Tensor, dst_layers: Sequence[KVLayer], pages: PageMap, start: int, end: int
) -> None:
    """Inverse of pack_staging: scatter ``staging`` into ``dst_layers`` (cast to their dtype)."""
    staged = staging_page_map(start, end)
    for i, dst in enumerate(dst_layers):
        copy_tokens(staging[i], staged, dst, pages, start, end)
