"""What one forward pass computes: a batch of prompt chunks, each with its KV block table.

A chunk is tokens [start, start + length) of one sequence. Its ``block_table`` lists the
cache blocks that hold the sequence's positions [0, start + length) in order (position p
lives in block ``block_table[p // block_size]`` at offset ``p % block_size``). The caller
(the stage's cache) owns and pins those blocks for the duration of the forward; the
positions [0, start) must already hold that sequence's KV (computed earlier or reused).

Rows of the batch's activations are the chunks' tokens concatenated in chunk order.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from prefill_node.errors import InvariantError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ChunkSpec:
    """Tokens [start, start + length) of one sequence; ``block_table`` covers [0, end)."""

    start: int
    length: int
    block_table: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.start < 0 or self.length < 1:
            raise InvariantError(f"a chunk needs start >= 0 and length >= 1, got {self}")
        if any(b < 0 for b in self.block_table):
            raise InvariantError(f"block ids must be >= 0, got {self.block_table}")

    @property
    def end(self) -> int:
        return self.start + self.length

    def blocks_needed(self, block_size: int) -> int:
        """Blocks that positions [0, end) span."""
        return -(-self.end // block_size)


@dataclass(frozen=True)
class ChunkBatch:
    """The chunks of one forward pass, in row order. Several chunks of one sequence may
    share a batch: every chunk's KV is written before any attention reads the cache."""

    chunks: tuple[ChunkSpec, ...]

    def __post_init__(self) -> None:
        if not self.chunks:
            raise InvariantError("a ChunkBatch needs at least one chunk")

    @cached_property
    def total_tokens(self) -> int:
        return sum(c.length for c in self.chunks)

    @cached_property
    def row_offsets(self) -> tuple[int, ...]:
        """First row of each chunk, plus the total at the end (len = num_chunks + 1)."""
        offsets = [0]
        for c in self.chunks:
            offsets.append(offsets[-1] + c.length)
        return tuple(offsets)

    def positions_list(self) -> list[int]:
        """Absolute position of every row, as a Python list."""
        out: list[int] = []
        for c in self.chunks:
            out.extend(range(c.start, c.end))
        return out

    def positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """LongTensor [total_tokens]: the absolute position of every row."""
        import torch

        return torch.tensor(self.positions_list(), dtype=torch.long, device=device)

    def last_token_rows(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """LongTensor [num_chunks]: the row of each chunk's last token (where its logits are)."""
        import torch

        return torch.tensor(
            [end - 1 for end in self.row_offsets[1:]], dtype=torch.long, device=device
        )

    def check_block_tables(self, block_size: int, num_blocks: int) -> None:
        """Raise InvariantError unless every table covers its chunk with valid block ids."""
        for i, c in enumerate(self.chunks):
            need = c.blocks_needed(block_size)
            if len(c.block_table) < need:
                raise InvariantError(
                    f"chunk {i} ends at {c.end} and needs {need} blocks of {block_size}, "
                    f"its table has {len(c.block_table)}"
                )
            if any(b >= num_blocks for b in c.block_table[:need]):
                raise InvariantError(f"chunk {i} table {c.block_table} exceeds {num_blocks} blocks")
