"""A hybrid stage's cache: paged K/V for its attention layers, recurrent-state snapshots per block.

One block id still covers all of a layer slice's per-token state: besides its tokens' K/V in
the attention layers, block b carries, in every recurrent layer, a SNAPSHOT slot holding the
state (recurrent matrix + conv tail) after the last token of b written so far. For a full
block that is the state after the block's last token, which is what prefix reuse resumes
from; for the partial last block of a sequence being prefilled it is the sequence's live
state, which the next chunk continues from (a partial block is never shared: the pool hands
a writer its own). So there is no per-request state outside the blocks: a snapshot is
pinned, escrowed, copied and evicted with its block, and ``cache_bytes_per_block`` counts
its bytes in the block's size.

A chunk [start, end) reads the state from block ``table[(start - 1) // block_size]`` (zeros
when start == 0): valid when start is a block boundary whose block was completed (by this
sequence or a reused prefix), or where this sequence's previous chunk ended.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from prefill_node.errors import InvariantError
from prefill_node.model.paged_kv import PagedKVCache
from prefill_node.model.partition import LayerRange

if TYPE_CHECKING:
    from prefill_node.model.config import ModelConfig


class RecurrentSnapshots:
    """Snapshot slots of a stage's recurrent layers, indexed by block id: per layer, fp32
    matrices ``[num_blocks, value_heads, key_head_dim, value_head_dim]`` and conv tails
    ``[num_blocks, conv_kernel - 1, conv_width]`` in the cache dtype. Allocated once."""

    def __init__(
        self,
        config: ModelConfig,
        layers: tuple[int, ...],
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        r = config.recurrent
        if r is None or not all(r.is_linear(layer) for layer in layers):
            raise InvariantError(f"layers {layers} are not all recurrent layers of the model")
        self.layers = layers
        self._slot = {layer: i for i, layer in enumerate(layers)}
        state = (num_blocks, r.num_value_heads, r.key_head_dim, r.value_head_dim)
        tail = (num_blocks, r.conv_kernel - 1, r.conv_width)
        self.states = [torch.zeros(state, dtype=torch.float32, device=device) for _ in layers]
        self.tails = [torch.zeros(tail, dtype=dtype, device=device) for _ in layers]
        self.bytes_per_block = len(layers) * r.snapshot_bytes(dtype.itemsize)

    def slot(self, global_layer: int) -> int:
        slot = self._slot.get(global_layer)
        if slot is None:
            raise InvariantError(f"layer {global_layer} is not a recurrent layer of this stage")
        return slot

    def read(self, global_layer: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(state, tail) stored in ``block`` (copies)."""
        i = self.slot(global_layer)
        return self.states[i][block].clone(), self.tails[i][block].clone()

    def write(
        self, global_layer: int, blocks: torch.Tensor, states: torch.Tensor, tails: torch.Tensor
    ) -> None:
        """Store states [n, H, Dk, Dv] and tails [n, K - 1, C] into LongTensor ``blocks``."""
        i = self.slot(global_layer)
        self.states[i].index_copy_(0, blocks, states.to(torch.float32))
        self.tails[i].index_copy_(0, blocks, tails.to(self.tails[i].dtype))

    def copy_block(self, src: int, dst: int) -> None:
        for t in (*self.states, *self.tails):
            t[dst].copy_(t[src])


class RecurrentStateCache:
    """What a hybrid stage cache adds to its paged blocks (mixed in before a ``PagedBlocks``
    class holding the attention layers): ``recurrent`` snapshots for its recurrent layers,
    read and written by block id. ``HybridKVCache`` (GQA attention) and the MLA
    ``HybridLatentCache`` (Kimi Linear) are the two. Not thread-safe: the stage loop owns it."""

    recurrent: RecurrentSnapshots
    layers: tuple[int, ...]
    block_size: int
    bytes_per_block: int
    device: torch.device

    @staticmethod
    def split_layers(config: ModelConfig, layer_range: LayerRange) -> tuple[tuple[int, ...], ...]:
        """(attention layers, recurrent layers) of ``layer_range``."""
        linear = tuple(layer for layer in layer_range if config.is_linear_layer(layer))
        return tuple(layer for layer in layer_range if layer not in linear), linear

    @property
    def block_bytes(self) -> int:
        """Bytes one block occupies across ALL of this stage's layers (K/V + snapshots):
        equals ``ModelConfig.cache_bytes_per_block`` for the stage's layers."""
        return len(self.layers) * self.bytes_per_block + self.recurrent.bytes_per_block

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write of a shared block: its K/V and its snapshots."""
        super().copy_block(src, dst)  # type: ignore[misc]
        if src != dst:
            self.recurrent.copy_block(src, dst)

    def state_before(
        self, global_layer: int, block_table: Sequence[int], start: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(state, conv tail) after positions [0, start) of the sequence with
        ``block_table``: zeros at 0, else the snapshot of the block holding ``start - 1``."""
        if start == 0:
            i = self.recurrent.slot(global_layer)
            return (
                torch.zeros_like(self.recurrent.states[i][0]),
                torch.zeros_like(self.recurrent.tails[i][0]),
            )
        block = (start - 1) // self.block_size
        if block >= len(block_table):
            raise InvariantError(f"block table {block_table} does not reach position {start}")
        return self.recurrent.read(global_layer, block_table[block])

    def store_states(
        self,
        global_layer: int,
        block_table: Sequence[int],
        ends: Sequence[int],
        states: torch.Tensor,
        tails: torch.Tensor,
    ) -> None:
        """Store the states after positions [0, e) for each e in ``ends`` (> 0) in the
        snapshot slot of the block holding e - 1."""
        blocks = [block_table[(e - 1) // self.block_size] for e in ends]
        ids = torch.tensor(blocks, dtype=torch.long, device=self.device)
        self.recurrent.write(global_layer, ids, states, tails)

    def read_state(
        self, global_layer: int, block_table: Sequence[int], num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The state after positions [0, num_tokens) (what a decode worker continues from):
        ``state_before(num_tokens)``."""
        return self.state_before(global_layer, block_table, num_tokens)

    def read_planes(
        self, global_layer: int, block_table: Sequence[int], num_tokens: int
    ) -> tuple[torch.Tensor, ...]:
        """An attention layer's K and V for positions [0, num_tokens); a recurrent layer's
        (state, conv tail) after them."""
        if global_layer in self.recurrent.layers:
            return self.read_state(global_layer, block_table, num_tokens)
        return super().read_planes(global_layer, block_table, num_tokens)  # type: ignore[misc]


class HybridKVCache(RecurrentStateCache, PagedKVCache):
    """The cache of a stage of a hybrid model with GQA attention: ``PagedKVCache`` over its
    attention layers (``layers``) plus ``recurrent`` snapshots for its recurrent layers."""

    def __init__(
        self,
        config: ModelConfig,
        layer_range: LayerRange,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        attention, linear = self.split_layers(config, layer_range)
        super().__init__(
            layer_range,
            num_blocks,
            block_size,
            config.num_kv_heads,
            config.head_dim,
            dtype,
            device,
            layers=attention,
        )
        self.recurrent = RecurrentSnapshots(config, linear, num_blocks, dtype, self.device)


def snapshot_ends(start: int, end: int, block_size: int) -> list[int]:
    """Positions after which a chunk [start, end) stores a snapshot: every block boundary
    in (start, end], and ``end`` itself (the live state in a partial last block)."""
    first = (start // block_size + 1) * block_size
    ends = list(range(first, end + 1, block_size))
    if not ends or ends[-1] != end:
        ends.append(end)
    return ends
