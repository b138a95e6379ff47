"""One stage's paged KV memory: a block-addressed K/V tensor per local layer.

Layout per layer: ``[num_blocks, 2, block_size, kv_heads, head_dim]`` (index 1: 0 = K,
1 = V), allocated contiguous once and never reallocated, so a transfer engine (NIXL) can
register ``tensors`` at start-up and address block b of layer l as one contiguous byte range.

This class only holds memory and moves bytes; which block belongs to whom is the sans-IO
block pool's business (block ids here are the pool's ids). Viewed as ``[num_blocks * 2,
block_size, ...]``, row ``2b`` is block b's K and ``2b + 1`` its V: gathers and scatters are
single ``index_select`` / ``index_copy_`` calls on that view, no Python loop over blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from prefill_node.errors import InvariantError
from prefill_node.model.partition import LayerRange

if TYPE_CHECKING:
    from prefill_node.model.config import ModelConfig


class PagedBlocks:
    """What every stage cache shares: one ``[num_blocks, planes, block_size, heads, width]``
    tensor per local layer, allocated once, with block-level addressing (``layer``,
    ``copy_block``, ``bytes_per_block``). ``PagedKVCache`` (K and V) and the MLA
    ``PagedLatentCache`` (one plane of whole token entries) add their reads and writes.
    ``layers``: the global layers that have a tensor, in order (default: every layer of
    ``layer_range``; a hybrid stage's recurrent layers have none)."""

    def __init__(
        self,
        layer_range: LayerRange,
        num_blocks: int,
        block_size: int,
        planes: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        layers: tuple[int, ...] | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise InvariantError(f"need >= 1 block of >= 1 token, got {num_blocks}x{block_size}")
        self.layer_range = layer_range
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.planes = planes
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.entry_parts: tuple[int, ...] = ()  # only an MLA cache splits its entries
        self.dtype = dtype
        self.device = torch.device(device)
        self.layers = tuple(layer_range) if layers is None else layers
        if any(layer not in layer_range for layer in self.layers):
            raise InvariantError(f"layers {self.layers} are not all in {layer_range}")
        self._slot = {layer: i for i, layer in enumerate(self.layers)}
        shape = (num_blocks, planes, block_size, num_kv_heads, head_dim)
        self.tensors: list[torch.Tensor] = [
            torch.zeros(shape, dtype=dtype, device=self.device) for _ in self.layers
        ]

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block occupies in ONE layer (every plane of all its tokens)."""
        numbers = self.planes * self.block_size * self.num_kv_heads * self.head_dim
        return numbers * self.dtype.itemsize

    def layer(self, global_layer: int) -> torch.Tensor:
        """The tensor of ``global_layer``; InvariantError if this stage does not hold it."""
        slot = self._slot.get(global_layer)
        if slot is None:
            raise InvariantError(
                f"layer {global_layer} has no paged tensor on this stage {self.layer_range}"
            )
        return self.tensors[slot]

    def _table(self, block_table: Sequence[int], num_tokens: int) -> torch.Tensor:
        """``block_table`` as a LongTensor on this cache's device, checked to hold
        ``num_tokens`` positions."""
        if len(block_table) * self.block_size < num_tokens:
            raise InvariantError(
                f"{len(block_table)} blocks of {self.block_size} cannot hold {num_tokens} tokens"
            )
        return torch.tensor(block_table, dtype=torch.long, device=self.device)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block ``src`` into ``dst`` in every local layer (copy-on-write of a shared
        partial block). The caller guarantees ``dst`` is not read concurrently."""
        if not (0 <= src < self.num_blocks and 0 <= dst < self.num_blocks):
            raise InvariantError(f"copy_block({src}, {dst}) outside {self.num_blocks} blocks")
        if src == dst:
            return
        for t in self.tensors:
            t[dst].copy_(t[src])


class PagedKVCache(PagedBlocks):
    """KV memory for the layers of one stage. Not thread-safe: the stage loop owns it."""

    def __init__(
        self,
        layer_range: LayerRange,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        layers: tuple[int, ...] | None = None,
    ) -> None:
        # planes 2: K and V (an MLA PagedLatentCache has one)
        super().__init__(
            layer_range, num_blocks, block_size, 2, num_kv_heads, head_dim, dtype, device, layers
        )

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        layer_range: LayerRange,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> PagedKVCache:
        return cls(
            layer_range, num_blocks, block_size, config.num_kv_heads, config.head_dim, dtype, device
        )

    def _rows(self, global_layer: int) -> torch.Tensor:
        """[num_blocks * 2, block_size, kv_heads, head_dim] view: row 2b = K of b, 2b+1 = V."""
        return self.layer(global_layer).view(
            self.num_blocks * 2, self.block_size, self.num_kv_heads, self.head_dim
        )

    def slot_index(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """LongTensor: flat K slot of each position (its V slot is K slot + block_size) in the
        ``[num_blocks * 2 * block_size, kv_heads, head_dim]`` view; ``table`` is the
        sequence's block ids as a LongTensor on this cache's device."""
        return table[positions // self.block_size] * (2 * self.block_size) + (
            positions % self.block_size
        )

    def write_slots(
        self, global_layer: int, k_slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store k, v [n, kv_heads, head_dim] at the flat K slots from ``slot_index``."""
        flat = self.layer(global_layer).view(-1, self.num_kv_heads, self.head_dim)
        flat.index_copy_(0, k_slots, k.to(self.dtype))
        flat.index_copy_(0, k_slots + self.block_size, v.to(self.dtype))

    def gather(
        self, global_layer: int, table: torch.Tensor, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [num_tokens, kv_heads, head_dim] of positions [0, num_tokens) of a sequence
        whose blocks are ``table`` (LongTensor covering at least those positions)."""
        rows = self._rows(global_layer)
        n_blocks = -(-num_tokens // self.block_size)
        ids = table[:n_blocks] * 2
        shape = (n_blocks * self.block_size, self.num_kv_heads, self.head_dim)
        k = rows.index_select(0, ids).view(shape)[:num_tokens]
        v = rows.index_select(0, ids + 1).view(shape)[:num_tokens]
        return k, v

    def write(
        self,
        global_layer: int,
        block_table: Sequence[int],
        start: int,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Store k, v [n, kv_heads, head_dim] as positions [start, start + n) of a sequence."""
        table = torch.tensor(block_table, dtype=torch.long, device=self.device)
        slots = self.slot_index(table, torch.arange(start, start + k.shape[0], device=self.device))
        self.write_slots(global_layer, slots, k, v)

    def read(
        self, global_layer: int, block_table: Sequence[int], num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [num_tokens, kv_heads, head_dim] of positions [0, num_tokens) (copies)."""
        return self.gather(global_layer, self._table(block_table, num_tokens), num_tokens)

    def read_planes(
        self, global_layer: int, block_table: Sequence[int], num_tokens: int
    ) -> tuple[torch.Tensor, ...]:
        """The cache's planes for positions [0, num_tokens): K and V."""
        return self.read(global_layer, block_table, num_tokens)
