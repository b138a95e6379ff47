"""KV layout descriptor: geometry and memory regions of one paged KV pool (one stage or decode).

A pool holds, for each of its layers ``[layer_start, layer_end)``, one contiguous tensor
shaped ``[num_blocks, planes, block_size, num_kv_heads, head_dim]``: ``planes = 2`` for K
(index 0) and V (index 1); ``planes = 1`` for a pool of whole per-token entries (an MLA
latent cache: latent, rotated key and indexer key as one "head" of ``head_dim`` numbers).
The descriptor is plain data so the gRPC manifest can carry it (``to_dict`` / ``from_dict``).

A hybrid pool (a model with recurrent linear-attention layers) has a paged tensor for its
attention layers only (``paged_layers``) and, per recurrent layer, ``states``: tensors
indexed by the same block ids whose slot b holds the layer's recurrent state after the last
token of block b written so far (``StateRegion``). Shipping a request moves its blocks in
the paged layers and, in each recurrent layer, the ONE slot of the block holding the
prompt's last token: the state decode continues from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import numpy as np

from kv_transfer.errors import InvalidTransferRequest, LayoutMismatch

DTYPE_SIZES: Mapping[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}
MEM_TYPES = ("DRAM", "VRAM")


@dataclass(frozen=True)
class MemoryRegion:
    """One registered tensor: ``length`` bytes from ``base_addr`` on ``device_id``."""

    base_addr: int
    length: int
    device_id: int = 0
    mem_type: str = "DRAM"

    def __post_init__(self) -> None:
        if self.base_addr <= 0 or self.length <= 0 or self.device_id < 0:
            raise InvalidTransferRequest(f"memory region needs positive address/length: {self}")
        if self.mem_type not in MEM_TYPES:
            raise InvalidTransferRequest(
                f"mem_type must be one of {MEM_TYPES}, got {self.mem_type}"
            )


@dataclass(frozen=True)
class StateRegion:
    """One registered recurrent-state tensor of layer ``layer``: ``region`` holds one
    ``slot_bytes`` slot per block id. ``part`` names what it holds ("matrix": the recurrent
    state, "conv": the short convolution's tail); ``dtype`` its element type."""

    layer: int
    part: str
    region: MemoryRegion
    slot_bytes: int
    dtype: str

    def __post_init__(self) -> None:
        if self.layer < 0 or self.slot_bytes <= 0 or self.region.length % self.slot_bytes:
            raise InvalidTransferRequest(
                f"state region of layer {self.layer} needs a whole number of positive slots"
            )
        if self.part not in STATE_PARTS or self.dtype not in DTYPE_SIZES:
            raise InvalidTransferRequest(
                f"state region part must be one of {STATE_PARTS} and dtype a known one, got "
                f"{self.part!r}, {self.dtype!r}"
            )

    @property
    def num_slots(self) -> int:
        return self.region.length // self.slot_bytes

    def to_list(self) -> list[Any]:
        r = self.region
        return [
            self.layer,
            self.part,
            r.base_addr,
            r.length,
            r.device_id,
            r.mem_type,
            self.slot_bytes,
            self.dtype,
        ]

    @classmethod
    def from_list(cls, data: Sequence[Any]) -> StateRegion:
        layer, part, addr, length, device, mem, slot, dtype = data
        region = MemoryRegion(int(addr), int(length), int(device), str(mem))
        return cls(int(layer), str(part), region, int(slot), str(dtype))


STATE_PARTS = ("matrix", "conv")


@dataclass(frozen=True)
class KVLayout:
    """Geometry of a paged KV pool and where each layer's tensor lives.

    ``regions[i]`` is the tensor of layer ``paged[i]``: ``layer_start + i`` unless
    ``paged_layers`` lists the layers that have one (a hybrid pool; ``()``: none do). Byte
    offsets inside a layer: block ``b``, plane ``kv`` (K/V), token ``t`` starts at
    ``b*block_bytes + kv*page_bytes + t*token_bytes``. ``regions`` may be empty for a
    geometry-only descriptor (planning). ``states``: a hybrid pool's recurrent layers'
    state tensors, in layer order, each layer's "matrix" before its "conv".
    """

    layer_start: int
    layer_end: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    regions: tuple[MemoryRegion, ...] = ()
    planes: int = 2
    paged_layers: tuple[int, ...] | None = None
    states: tuple[StateRegion, ...] = ()

    def __post_init__(self) -> None:
        if self.planes not in (1, 2):
            raise InvalidTransferRequest(f"planes must be 1 or 2, got {self.planes}")
        if not 0 <= self.layer_start < self.layer_end:
            raise InvalidTransferRequest(
                f"layer range must satisfy 0 <= start < end, got [{self.layer_start}, "
                f"{self.layer_end})"
            )
        for name in ("num_blocks", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise InvalidTransferRequest(f"{name} must be positive, got {getattr(self, name)}")
        if self.dtype not in DTYPE_SIZES:
            raise InvalidTransferRequest(f"dtype must be one of {sorted(DTYPE_SIZES)}")
        paged = self.paged
        if list(paged) != sorted(set(paged)) or not all(self.covers(x, x + 1) for x in paged):
            raise InvalidTransferRequest(
                f"paged layers {paged} must be ascending and in [{self.layer_start}, "
                f"{self.layer_end})"
            )
        if (self.regions or not paged) and len(self.regions) != len(paged):
            raise InvalidTransferRequest(
                f"need one memory region per paged layer ({len(paged)}), got {len(self.regions)}"
            )
        for state in self.states:
            if not self.covers(state.layer, state.layer + 1) or state.layer in paged:
                raise InvalidTransferRequest(
                    f"state region of layer {state.layer}: not a recurrent layer of "
                    f"[{self.layer_start}, {self.layer_end}) outside {paged}"
                )
            if state.num_slots != self.num_blocks:
                raise InvalidTransferRequest(
                    f"state region of layer {state.layer} has {state.num_slots} slots, the "
                    f"pool {self.num_blocks} blocks"
                )
        for region in self.regions:
            if region.length != self.layer_bytes:
                raise InvalidTransferRequest(
                    f"region of {region.length} bytes does not hold a layer of "
                    f"{self.layer_bytes} bytes"
                )

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def paged(self) -> tuple[int, ...]:
        """The global layers with a paged tensor (``regions[i]`` is ``paged[i]``'s)."""
        if self.paged_layers is None:
            return tuple(range(self.layer_start, self.layer_end))
        return self.paged_layers

    @property
    def hybrid(self) -> bool:
        """Some layers are not paged (recurrent layers, possibly with ``states``)."""
        return self.paged_layers is not None

    @cached_property
    def paged_bases(self) -> np.ndarray:
        """Base address of each paged layer's tensor (uint64, ``paged`` order), computed once
        per layout: every WRITE's descriptors start from it."""
        return np.array([r.base_addr for r in self.regions], dtype=np.uint64)

    def region_of(self, layer: int) -> MemoryRegion:
        """The paged tensor of global ``layer``."""
        if self.paged_layers is None:
            return self.regions[layer - self.layer_start]
        return self.regions[self.paged_layers.index(layer)]

    def restrict(self, layer_start: int, layer_end: int) -> KVLayout:
        """This pool's layers ``[layer_start, layer_end)`` only (a pool without recurrent
        layers): a transfer between pools whose layer ranges only overlap moves the
        overlap."""
        if self.hybrid:
            raise InvalidTransferRequest("a pool with recurrent layers cannot be restricted")
        if not self.covers(layer_start, layer_end) or layer_start >= layer_end:
            raise InvalidTransferRequest(
                f"[{layer_start}, {layer_end}) is not a layer range inside "
                f"[{self.layer_start}, {self.layer_end})"
            )
        first = layer_start - self.layer_start
        regions = self.regions[first : first + layer_end - layer_start] if self.regions else ()
        return replace(self, layer_start=layer_start, layer_end=layer_end, regions=regions)

    def states_of(self, layer_start: int, layer_end: int) -> tuple[StateRegion, ...]:
        return tuple(s for s in self.states if layer_start <= s.layer < layer_end)

    @property
    def elem_size(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's K (or V) for one layer."""
        return self.num_kv_heads * self.head_dim * self.elem_size

    @property
    def page_bytes(self) -> int:
        """Bytes of one block's K (or V) for one layer."""
        return self.block_size * self.token_bytes

    @property
    def block_bytes(self) -> int:
        return self.planes * self.page_bytes

    @property
    def layer_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def mem_type(self) -> str:
        if self.regions:
            return self.regions[0].mem_type
        return self.states[0].region.mem_type if self.states else "DRAM"

    def covers(self, layer_start: int, layer_end: int) -> bool:
        return self.layer_start <= layer_start and layer_end <= self.layer_end

    def check_compatible(self, other: KVLayout) -> None:
        """Raise LayoutMismatch unless ``other``'s KV can be converted into this layout.

        Block size and dtype may differ (convert.py handles them); planes, heads and head
        dim may not.
        """
        mine = (self.planes, self.num_kv_heads, self.head_dim)
        theirs = (other.planes, other.num_kv_heads, other.head_dim)
        if mine != theirs:
            raise LayoutMismatch(
                f"planes x KV heads x head dim differ: {'x'.join(map(str, mine))} vs "
                f"{'x'.join(map(str, theirs))}; the decode model must match prefill's"
            )
        if self.hybrid or other.hybrid:
            lo, hi = max(self.layer_start, other.layer_start), min(self.layer_end, other.layer_end)
            shared = [(s.layer, s.part, s.slot_bytes, s.dtype) for s in self.states_of(lo, hi)]
            theirs_s = [(s.layer, s.part, s.slot_bytes, s.dtype) for s in other.states_of(lo, hi)]
            paged = [x for x in self.paged if lo <= x < hi]
            if paged != [x for x in other.paged if lo <= x < hi] or shared != theirs_s:
                raise LayoutMismatch(
                    f"layers [{lo}, {hi}): paged layers or recurrent-state slots differ "
                    f"({paged} vs {other.paged}); the decode model must match prefill's"
                )

    def check_block_ids(self, block_ids: Sequence[int]) -> None:
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise InvalidTransferRequest(f"block ids {bad[:8]} out of range [0, {self.num_blocks})")

    def to_dict(self) -> dict[str, Any]:
        return {
            "layer_start": self.layer_start,
            "layer_end": self.layer_end,
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "regions": [[r.base_addr, r.length, r.device_id, r.mem_type] for r in self.regions],
            "planes": self.planes,
            **({} if self.paged_layers is None else {"paged_layers": list(self.paged_layers)}),
            **({"states": [s.to_list() for s in self.states]} if self.states else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVLayout:
        try:
            regions = tuple(
                MemoryRegion(int(a), int(n), int(d), str(m)) for a, n, d, m in data["regions"]
            )
            return cls(
                layer_start=int(data["layer_start"]),
                layer_end=int(data["layer_end"]),
                num_blocks=int(data["num_blocks"]),
                block_size=int(data["block_size"]),
                num_kv_heads=int(data["num_kv_heads"]),
                head_dim=int(data["head_dim"]),
                dtype=str(data["dtype"]),
                regions=regions,
                planes=int(data.get("planes", 2)),
                paged_layers=(
                    None
                    if data.get("paged_layers") is None
                    else tuple(int(x) for x in data["paged_layers"])
                ),
                states=tuple(StateRegion.from_list(x) for x in data.get("states", ())),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, InvalidTransferRequest):
                raise
            raise InvalidTransferRequest(f"malformed KV layout: {exc!r}") from exc

    @cached_property
    def _slices(self) -> dict[tuple[int, int], KVLayout]:
        return {}

    def layer_slice(self, layer_start: int, layer_end: int) -> KVLayout:
        """The same pool restricted to layers ``[layer_start, layer_end)``; built once per
        range (a sender slices per WRITE; the slice's ``paged_bases`` are then computed once)."""
        got = self._slices.get((layer_start, layer_end))
        if got is None:
            got = self._slices[(layer_start, layer_end)] = self._slice(layer_start, layer_end)
        return got

    def _slice(self, layer_start: int, layer_end: int) -> KVLayout:
        if not self.covers(layer_start, layer_end):
            raise LayoutMismatch(
                f"layers [{layer_start}, {layer_end}) not in [{self.layer_start}, {self.layer_end})"
            )
        if self.hybrid:
            keep = [i for i, x in enumerate(self.paged) if layer_start <= x < layer_end]
            return replace(
                self,
                layer_start=layer_start,
                layer_end=layer_end,
                regions=tuple(self.regions[i] for i in keep) if self.regions else (),
                paged_layers=tuple(self.paged[i] for i in keep),
                states=self.states_of(layer_start, layer_end),
            )
        lo = layer_start - self.layer_start
        regions = self.regions[lo : lo + layer_end - layer_start] if self.regions else ()
        return KVLayout(
            layer_start,
            layer_end,
            self.num_blocks,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
            self.dtype,
            regions,
            self.planes,
        )


def layout_of_tensors(layer_start: int, kv_caches: Sequence[Any]) -> KVLayout:
    """Describe per-layer torch tensors ``[num_blocks, planes, block_size, kv_heads, head_dim]``."""
    if not kv_caches:
        raise InvalidTransferRequest("need at least one layer tensor")
    first = kv_caches[0]
    shape = tuple(first.shape)
    if len(shape) != 5 or shape[1] not in (1, 2):
        raise InvalidTransferRequest(
            "KV tensors must be [num_blocks, planes (1 or 2), block_size, kv_heads, head_dim], "
            f"got {shape}"
        )
    regions = []
    for t in kv_caches:
        if tuple(t.shape) != shape or t.dtype != first.dtype or not t.is_contiguous():
            raise InvalidTransferRequest("all layer tensors must be contiguous, same shape/dtype")
        regions.append(_region_of(t))
    return KVLayout(
        layer_start=layer_start,
        layer_end=layer_start + len(kv_caches),
        num_blocks=shape[0],
        block_size=shape[2],
        num_kv_heads=shape[3],
        head_dim=shape[4],
        dtype=str(first.dtype).removeprefix("torch."),
        regions=tuple(regions),
        planes=shape[1],
    )


@dataclass(frozen=True)
class HybridPool:
    """What a hybrid pool registers besides its paged tensors: the global layer range it
    covers, which of those layers the paged tensors are (ascending), each recurrent layer's
    state tensors ``(layer, part, tensor [num_blocks, ...])`` in layer order, and the block
    geometry (a regions-free ``KVLayout``) for a pool whose layers are all recurrent."""

    layer_end: int
    paged_layers: tuple[int, ...]
    states: tuple[tuple[int, str, Any], ...]
    geometry: KVLayout

    def layout(self, layer_start: int, kv_caches: Sequence[Any]) -> KVLayout:
        base = layout_of_tensors(layer_start, kv_caches) if kv_caches else self.geometry
        return replace(
            base,
            layer_start=layer_start,
            layer_end=self.layer_end,
            paged_layers=self.paged_layers,
            states=tuple(
                StateRegion(
                    layer,
                    part,
                    _region_of(t),
                    t[0].numel() * t.element_size(),
                    str(t.dtype).removeprefix("torch."),
                )
                for layer, part, t in self.states
            ),
        )

    def tensors(self) -> list[Any]:
        return [t for _, _, t in self.states]


def _region_of(t: Any) -> MemoryRegion:
    if not t.is_contiguous():
        raise InvalidTransferRequest("registered tensors must be contiguous")
    dev = t.get_device()
    return MemoryRegion(
        t.data_ptr(), t.numel() * t.element_size(), max(dev, 0), "DRAM" if dev < 0 else "VRAM"
    )
