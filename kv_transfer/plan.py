"""Transfer planning: which token runs move between two paged pools, as NIXL descriptors.

Pure numpy, no I/O. A run is a maximal range of tokens that is contiguous in both the
source and the destination block, so pools with different block sizes map onto each
other exactly, with no staging copy, as long as the dtype is the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kv_transfer.errors import InvalidTransferRequest, LayoutMismatch
from kv_transfer.layout import KVLayout


@dataclass(frozen=True)
class PageMap:
    """Where a request's tokens live in one pool.

    Token ``t`` (absolute position in the prompt) is in block
    ``block_ids[(t - origin) // block_size]`` at offset ``(t - origin) % block_size``.
    ``origin`` is the first token the map covers: 0 for prefill's full block table, the
    decode side's cached-prefix length for the destination blocks it allocated.
    """

    block_ids: tuple[int, ...]
    block_size: int
    origin: int = 0

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.origin < 0:
            raise InvalidTransferRequest("page map needs block_size > 0 and origin >= 0")
        if any(b < 0 for b in self.block_ids):
            raise InvalidTransferRequest("block ids must be non-negative")

    @property
    def end(self) -> int:
        """One past the last token position this map can hold."""
        return self.origin + len(self.block_ids) * self.block_size

    def block_of(self, token: int) -> int:
        """The block holding ``token`` (one this map covers)."""
        return self.block_ids[(token - self.origin) // self.block_size]

    def check_range(self, start: int, end: int, side: str) -> None:
        if not (self.origin <= start <= end <= self.end):
            raise InvalidTransferRequest(
                f"{side} blocks hold tokens [{self.origin}, {self.end}), cannot serve "
                f"[{start}, {end}); send enough block ids"
            )


def token_runs(src: PageMap, dst: PageMap, start: int, end: int) -> np.ndarray:
    """Runs covering tokens ``[start, end)``: int64 rows (src_block, src_off, dst_block,
    dst_off, num_tokens), in token order."""
    src.check_range(start, end, "source")
    dst.check_range(start, end, "destination")
    if start == end:
        return np.zeros((0, 5), dtype=np.int64)
    cuts = [np.array([start, end], dtype=np.int64)]
    for pages in (src, dst):
        first = (start - pages.origin) // pages.block_size + 1
        last = (end - 1 - pages.origin) // pages.block_size
        cuts.append(pages.origin + np.arange(first, last + 1, dtype=np.int64) * pages.block_size)
    bounds = np.unique(np.concatenate(cuts))
    lo, hi = bounds[:-1], bounds[1:]
    runs = np.empty((len(lo), 5), dtype=np.int64)
    for col, pages in ((0, src), (2, dst)):
        rel = lo - pages.origin
        runs[:, col] = np.asarray(pages.block_ids, dtype=np.int64)[rel // pages.block_size]
        runs[:, col + 1] = rel % pages.block_size
    runs[:, 4] = hi - lo
    return runs


def _layer_bases(layout: KVLayout, layers: Sequence[int]) -> np.ndarray:
    if not layout.regions and layout.paged:
        raise InvalidTransferRequest("layout has no memory regions to address")
    paged = set(layout.paged)
    missing = [x for x in layers if x not in paged]
    if missing:
        raise LayoutMismatch(
            f"layers {missing} have no paged tensor in pool [{layout.layer_start}, "
            f"{layout.layer_end}) (paged: {list(layout.paged)})"
        )
    return np.array([layout.region_of(x).base_addr for x in layers], dtype=np.uint64)


def _addresses(
    layout: KVLayout, layers: Sequence[int], blocks: np.ndarray, offs: np.ndarray
) -> np.ndarray:
    """Byte addresses shaped [layer, run, plane] (K page then V page of each run)."""
    base = _layer_bases(layout, layers)[:, None, None]
    in_layer = (
        blocks.astype(np.uint64)[None, :, None] * np.uint64(layout.block_bytes)
        + np.arange(layout.planes, dtype=np.uint64)[None, None, :] * np.uint64(layout.page_bytes)
        + offs.astype(np.uint64)[None, :, None] * np.uint64(layout.token_bytes)
    )
    return base + in_layer


@dataclass(frozen=True)
class Descriptors:
    """Matched NIXL descriptor lists: rows (addr, length, device_id), same length per row."""

    local: np.ndarray
    remote: np.ndarray

    @property
    def num_bytes(self) -> int:
        return int(self.local[:, 1].sum()) if len(self.local) else 0


def build_descriptors(
    runs: np.ndarray, src: KVLayout, dst: KVLayout, layers: Sequence[int], src_is_local: bool
) -> Descriptors:
    """Descriptors moving ``runs`` of ``layers`` from ``src`` to ``dst`` (same dtype).

    Adjacent pieces that are contiguous on both sides are merged, so a full-block copy
    between equal layouts becomes one descriptor per run of consecutive blocks.
    """
    if src.dtype != dst.dtype:
        raise LayoutMismatch("direct descriptors need equal dtypes; stage and convert first")
    src.check_compatible(dst)
    s = _addresses(src, layers, runs[:, 0], runs[:, 1]).ravel()
    d = _addresses(dst, layers, runs[:, 2], runs[:, 3]).ravel()
    n = np.broadcast_to(
        (runs[:, 4].astype(np.uint64) * np.uint64(src.token_bytes))[None, :, None],
        (len(layers), len(runs), src.planes),
    ).ravel()
    if len(n) == 0:
        empty = np.zeros((0, 3), dtype=np.uint64)
        return Descriptors(empty, empty)
    head = np.ones(len(n), dtype=bool)
    head[1:] = (s[1:] != s[:-1] + n[:-1]) | (d[1:] != d[:-1] + n[:-1])
    idx = np.flatnonzero(head)
    lengths = np.add.reduceat(n, idx)
    src_rows = np.stack([s[idx], lengths, np.full(len(idx), _device(src), np.uint64)], axis=1)
    dst_rows = np.stack([d[idx], lengths, np.full(len(idx), _device(dst), np.uint64)], axis=1)
    if src_is_local:
        return Descriptors(src_rows, dst_rows)
    return Descriptors(dst_rows, src_rows)


def state_descriptors(
    src: KVLayout, dst: KVLayout, layers: range, src_slot: int, dst_slot: int, src_is_local: bool
) -> Descriptors:
    """Descriptors moving slot ``src_slot`` of every recurrent-state tensor of ``layers`` in
    ``src`` to slot ``dst_slot`` of the same layer's tensor in ``dst`` (one per tensor)."""
    mine, theirs = (
        src.states_of(layers.start, layers.stop),
        dst.states_of(layers.start, layers.stop),
    )
    if [(s.layer, s.part, s.slot_bytes) for s in mine] != [
        (s.layer, s.part, s.slot_bytes) for s in theirs
    ]:
        raise LayoutMismatch(
            f"recurrent-state slots of layers [{layers.start}, {layers.stop}) differ between "
            "the pools; the decode model must match prefill's"
        )
    if not mine:
        empty = np.zeros((0, 3), dtype=np.uint64)
        return Descriptors(empty, empty)
    for layout, slot in ((src, src_slot), (dst, dst_slot)):
        if not 0 <= slot < layout.num_blocks:
            raise InvalidTransferRequest(f"state slot {slot} out of range [0, {layout.num_blocks})")
    rows = []
    for states, slot in ((mine, src_slot), (theirs, dst_slot)):
        rows.append(
            np.array(
                [
                    (s.region.base_addr + slot * s.slot_bytes, s.slot_bytes, s.region.device_id)
                    for s in states
                ],
                dtype=np.uint64,
            )
        )
    return Descriptors(rows[0], rows[1]) if src_is_local else Descriptors(rows[1], rows[0])


def last_token_blocks(stage: PageMap, other: PageMap, num_tokens: int) -> tuple[int, int]:
    """(stage block, other side's block) holding token ``num_tokens - 1``: a recurrent
    layer's state after the prompt lives in those blocks' state slots."""
    last = num_tokens - 1
    other.check_range(last, num_tokens, "destination")
    return stage.block_of(last), other.block_of(last)


def concat(*parts: Descriptors) -> Descriptors:
    """One descriptor list of several (a transfer posts them as one request)."""
    return Descriptors(
        np.concatenate([p.local for p in parts]), np.concatenate([p.remote for p in parts])
    )


def _device(layout: KVLayout) -> int:
    return layout.regions[0].device_id if layout.regions else 0


def staging_page_map(start: int, end: int) -> PageMap:
    """Page map of a staging buffer holding tokens [start, end) as one block (convert.py)."""
    return PageMap(block_ids=(0,), block_size=max(end - start, 1), origin=start)
