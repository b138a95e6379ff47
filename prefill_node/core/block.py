"""One KV block's bookkeeping record (no tensor data: the executor owns the memory)."""

from __future__ import annotations

from prefill_node.core.hashing import BlockHash, ExtraKeys


class KVBlock:
    """Metadata of physical block ``block_id`` of one stage's paged KV cache.

    States (exactly one holds; ``BlockPool.check_integrity`` verifies it):

    - in use: ``ref_cnt > 0``; not in the free queue, not claimed.
    - free-queued: ``ref_cnt == 0``, linked into the free queue; it may still carry a
      ``block_hash`` (evictable cached block, lazily evicted when handed out again).
    - claimed: ``ref_cnt == 0``, held by exactly one capacity escrow (``claimed_by`` is the
      request id); out of the free queue but, if hashed, still findable by prefix hits.

    Only ``BlockPool`` mutates these fields; everyone else treats a KVBlock as read-only.
    """

    __slots__ = (
        "block_id",
        "ref_cnt",
        "block_hash",
        "parent_hash",
        "token_ids",
        "extra",
        "has_snapshot",
        "claimed_by",
        "prev_free",
        "next_free",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        # What the hash covers, kept for the collision guard and for BlockStored events.
        self.parent_hash: BlockHash | None = None
        self.token_ids: tuple[int, ...] = ()
        self.extra: ExtraKeys | None = None
        self.has_snapshot = False  # a recurrent-state snapshot is stored at this block's end
        self.claimed_by: str | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    @property
    def is_cached(self) -> bool:
        """True while the block is registered in the prefix index under ``block_hash``."""
        return self.block_hash is not None

    def matches(
        self, parent_hash: BlockHash | None, token_ids: tuple[int, ...], extra: ExtraKeys
    ) -> bool:
        """Collision guard: True only if this block really holds these tokens after ``parent``."""
        return (
            self.parent_hash == parent_hash and self.token_ids == token_ids and self.extra == extra
        )

    def __repr__(self) -> str:
        return (
            f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash}, "
            f"claimed_by={self.claimed_by!r})"
        )
