"""Transfer planning: which token runs move between two paged pools, as NIXL descriptors.

Pure numpy, no I/O. A run is a maximal range of tokens that is contiguous in both the
source and the destination block, so pools with different block sizes map onto each
other exactly, with no staging copy, as long as the dtype is the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

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

    @cached_property
    def ids(self) -> np.ndarray:
        """``block_ids`` as an int64 array (built once per map)."""
        return np.asarray(self.block_ids, dtype=np.int64)

    def inner_starts(self, start: int, end: int) -> np.ndarray:
        """First tokens of this map's blocks strictly inside ``(start, end)``."""
        first = (start - self.origin) // self.block_size + 1
        last = (end - 1 - self.origin) // self.block_size
        return self.origin + np.arange(first, last + 1, dtype=np.int64) * self.block_size

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
    fine, coarse = (src, dst) if src.block_size <= dst.block_size else (dst, src)
    if (
        coarse.block_size % fine.block_size == 0
        and (coarse.origin - fine.origin) % fine.block_size == 0
    ):  # every block start of the coarser map is one of the finer map's (equal sizes too)
        inner = fine.inner_starts(start, end)
    else:
        inner = np.union1d(src.inner_starts(start, end), dst.inner_starts(start, end))
    lo = np.empty(len(inner) + 1, dtype=np.int64)
    lo[0], lo[1:] = start, inner
    runs = np.empty((len(lo), 5), dtype=np.int64)
    for col, pages in ((0, src), (2, dst)):
        block, off = np.divmod(lo - pages.origin, pages.block_size)
        runs[:, col] = pages.ids[block]
        runs[:, col + 1] = off
    runs[:-1, 4] = np.diff(lo)
    runs[-1, 4] = end - lo[-1]
    return runs


def _layer_bases(layout: KVLayout, layers: Sequence[int]) -> np.ndarray:
    if not layout.regions and layout.paged:
        raise InvalidTransferRequest("layout has no memory regions to address")
    contiguous = isinstance(layers, range) and layers.step == 1 and not layout.hybrid
    if contiguous and (layout.covers(layers.start, layers.stop) or not layers):
        first = layers.start - layout.layer_start  # the common case: a slice, no lookups
        return layout.paged_bases[first : first + len(layers)]
    paged = {x: i for i, x in enumerate(layout.paged)}
    missing = [x for x in layers if x not in paged]
    if missing:
        raise LayoutMismatch(
            f"layers {missing} have no paged tensor in pool [{layout.layer_start}, "
            f"{layout.layer_end}) (paged: {list(layout.paged)})"
        )
    return layout.paged_bases[[paged[x] for x in layers]]


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
    token_bytes, planes, num_layers = src.token_bytes, src.planes, len(layers)
    if num_layers == 0 or len(runs) == 0:
        empty = np.zeros((0, 3), dtype=np.uint64)
        return Descriptors(empty, empty)
    # [layer, run, plane, side] byte addresses, side 0 the source, 1 the destination; int64
    # arithmetic wraps like uint64, so the bits are the same
    bases = np.stack([_layer_bases(src, layers), _layer_bases(dst, layers)], axis=1)
    in_layer = runs[:, 0:4:2] * np.array([src.block_bytes, dst.block_bytes], dtype=np.int64)
    in_layer += runs[:, 1:4:2] * token_bytes
    addr = bases.view(np.int64)[:, None, None, :] + in_layer[None, :, None, :]
    if planes == 2:
        addr = addr + np.array([[0, 0], [src.page_bytes, dst.page_bytes]], dtype=np.int64)
    addr = addr.reshape(-1, 2)
    n = np.broadcast_to(
        (runs[:, 4] * token_bytes)[None, :, None], (num_layers, len(runs), planes)
    ).ravel()
    head = np.ones(len(n), dtype=bool)  # a piece that does not continue the one before
    head[1:] = (addr[1:] != addr[:-1] + n[:-1, None]).any(axis=1)
    idx = np.flatnonzero(head)
    if len(idx) < len(n):
        addr, n = addr[idx], np.add.reduceat(n, idx)
    rows = np.empty((2, len(idx), 3), dtype=np.int64)
    rows[:, :, 0] = addr.T
    rows[:, :, 1] = n
    rows[0, :, 2], rows[1, :, 2] = _device(src), _device(dst)
    src_rows, dst_rows = rows.view(np.uint64)
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
