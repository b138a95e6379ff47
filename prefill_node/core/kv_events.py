"""KV cache events emitted by a block pool: what became findable, what stopped being findable.

These are the per-stage feed behind the router's global prefix index. The pool appends
them to a buffer as a side effect of its own state changes (so no caller can forget one);
its owner drains the buffer and publishes. A pipeline forwards a hash to the router only
when every stage has stored it, and withdraws it when any stage removed it.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefill_node.core.hashing import BlockHash


@dataclass(frozen=True)
class BlockStored:
    """Blocks ``block_hashes`` (a chain, in prompt order) became findable.

    Emitted only for hashes that had no resident copy before (a second copy of a hash
    changes nothing for a reader of the feed), so one insertion may yield several events.

    ``parent_hash`` is the hash of the block before the first one (None at a prompt start);
    ``token_ids`` is the flat concatenation of the blocks' tokens
    (``len(token_ids) == len(block_hashes) * block_size``).
    """

    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    """The last resident block carrying each of these hashes was evicted."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every cached block of this pool was dropped (prefix cache reset)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
