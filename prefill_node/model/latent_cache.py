"""One stage's paged MLA memory: per local layer, every token's latent + rotated key + indexer key.

Layout per layer: ``[num_blocks, 1, block_size, 1, entry_width]`` with ``entry_width =
kv_lora_rank + qk_rope_head_dim + index_head_dim`` (``MlaConfig.entry_width``), i.e. a GQA
pool's 5-D shape with ONE plane (not K and V) of one "head" per token: one block id
covers ALL of a token's per-layer state (the compressed KV latent, the shared rotated key
part, and the sparse-attention indexer's key), so the sans-IO block pool, escrow and prefix
hashing count, pin, hash and evict MLA blocks exactly like GQA blocks. Allocated contiguous
once and never reallocated; a transfer engine registers ``tensors`` like ``PagedKVCache``'s
and describes them with ``planes = 1``, ``num_kv_heads = 1``, ``head_dim = entry_width``
(the KV manifest / ``KvLayout`` fields), so the KV hand-off moves whole token entries. The cache
only holds memory; block ownership is the block pool's. A Kimi Linear stage's cache
(``HybridLatentCache``) holds such entries for its MLA layers only, plus recurrent-state
snapshots per block for its KDA layers (``RecurrentStateCache``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from prefill_node.errors import InvariantError
from prefill_node.model.paged_kv import PagedBlocks, PagedKVCache
from prefill_node.model.partition import LayerRange
from prefill_node.model.recurrent_cache import (
    HybridKVCache,
    RecurrentSnapshots,
    RecurrentStateCache,
)

if TYPE_CHECKING:
    from prefill_node.model.config import MlaConfig, ModelConfig


class PagedLatentCache(PagedBlocks):
    """MLA cache memory for the layers of one stage. Not thread-safe: the stage loop owns it.
    Offers ``PagedKVCache``'s addressing (``slot_index``, ``copy_block``) so the attention
    plan and the block pool's copy-on-write work unchanged."""

    def __init__(
        self,
        mla: MlaConfig,
        layer_range: LayerRange,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        layers: tuple[int, ...] | None = None,
    ) -> None:
        # one plane of one "head" per token, as wide as the whole entry
        width = mla.entry_width
        super().__init__(layer_range, num_blocks, block_size, 1, 1, width, dtype, device, layers)
        self.mla = mla
        self.entry_parts = (mla.kv_lora_rank, mla.qk_rope_head_dim, mla.index_head_dim)

    def slot_index(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """LongTensor: flat slot of each position in the ``[num_blocks * block_size, width]``
        view; ``table`` is the sequence's block ids on this cache's device."""
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def write_slots(self, global_layer: int, slots: torch.Tensor, entries: torch.Tensor) -> None:
        """Store entries [n, entry_width] at the flat slots from ``slot_index``."""
        flat = self.layer(global_layer).view(-1, self.mla.entry_width)
        flat.index_copy_(0, slots, entries.to(self.dtype))

    def gather(self, global_layer: int, table: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Entries [num_tokens, entry_width] of positions [0, num_tokens) of a sequence whose
        blocks are ``table`` (LongTensor covering at least those positions)."""
        n_blocks = -(-num_tokens // self.block_size)
        blocks = self.layer(global_layer).index_select(0, table[:n_blocks])
        return blocks.view(-1, self.mla.entry_width)[:num_tokens]

    def read_planes(
        self, global_layer: int, block_table: Sequence[int], num_tokens: int
    ) -> tuple[torch.Tensor, ...]:
        """The cache's planes for positions [0, num_tokens): here the one of entries."""
        return (self.read(global_layer, block_table, num_tokens),)

    def read(self, global_layer: int, block_table: Sequence[int], num_tokens: int) -> torch.Tensor:
        """``gather`` from a Python block table (a copy)."""
        return self.gather(global_layer, self._table(block_table, num_tokens), num_tokens)

    def split(self, entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Entries [n, width] -> (latent [n, kv_lora], rotated key [n, rope], indexer key)."""
        return entries.split(list(self.entry_parts), dim=-1)


class HybridLatentCache(RecurrentStateCache, PagedLatentCache):
    """The cache of a stage of a hybrid model with MLA attention (Kimi Linear): latent
    entries for its MLA layers plus ``recurrent`` snapshots for its KDA layers."""

    def __init__(
        self,
        config: ModelConfig,
        layer_range: LayerRange,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if config.mla is None:
            raise InvariantError(f"{config.family.value} has no MLA layers")
        attention, linear = self.split_layers(config, layer_range)
        super().__init__(
            config.mla, layer_range, num_blocks, block_size, dtype, device, layers=attention
        )
        self.recurrent = RecurrentSnapshots(config, linear, num_blocks, dtype, self.device)


StageCache = PagedKVCache | PagedLatentCache


def stage_cache(
    config: ModelConfig,
    layer_range: LayerRange,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> StageCache:
    """The paged cache a stage of ``config`` needs: MLA latent blocks, GQA K/V blocks, or
    (hybrid models) K/V blocks for the attention layers plus recurrent-state snapshots."""
    if config.recurrent is not None and config.mla is not None:
        return HybridLatentCache(config, layer_range, num_blocks, block_size, dtype, device)
    if config.recurrent is not None:
        return HybridKVCache(config, layer_range, num_blocks, block_size, dtype, device)
    if config.mla is not None:
        return PagedLatentCache(config.mla, layer_range, num_blocks, block_size, dtype, device)
    return PagedKVCache.for_model(config, layer_range, num_blocks, block_size, dtype, device)
