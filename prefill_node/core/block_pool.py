"""One stage's block pool: ref counts, LRU free queue with lazy eviction, hash map, KV events."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prefill_node.core.block import KVBlock
from prefill_node.core.free_queue import FreeBlockQueue
from prefill_node.core.hashing import BlockHash, ExtraKeys
from prefill_node.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from prefill_node.core.prefix_index import PrefixIndex
from prefill_node.errors import InvalidRequestError, InvariantError


@dataclass(frozen=True)
class PoolStats:
    """One stage's block counts; the one source of every occupancy figure above the pool.

    By state (``free + cached + in_use == total``): ``free``: unreferenced and holding
    nothing; ``cached``: unreferenced but findable (evictable); ``in_use``: referenced.
    ``claimed`` (a subset of free + cached; ``claimed_cached`` of them cached) counts
    unreferenced blocks held by capacity escrows, i.e. not available to anyone else.

    By who may take a block (``used + unclaimed_free + unclaimed_cached == total``):
    ``used`` counts a running request's escrowed victims as its own from admission on,
    although it materialises them chunk by chunk. This is what a stage's load means to
    the router and to GetLoad (``engine.types.StageLoad``, built by
    ``runtime.messages.StageStats.load``), whichever transport carries it.
    """

    total: int
    free: int
    cached: int
    in_use: int
    claimed: int
    claimed_cached: int = 0

    @property
    def available(self) -> int:
        """Blocks a new escrow could still claim (free or evictable, not claimed)."""
        return self.free + self.cached - self.claimed

    @property
    def used(self) -> int:
        """Blocks referenced or escrowed for an admitted request."""
        return self.in_use + self.claimed

    @property
    def unclaimed_free(self) -> int:
        return self.free - (self.claimed - self.claimed_cached)

    @property
    def unclaimed_cached(self) -> int:
        return self.cached - self.claimed_cached


class BlockPool:
    """The sans-IO bookkeeping of ``num_blocks`` KV blocks of ``block_size`` tokens.

    Contract:
    - Whoever gets a block from ``allocate`` / ``take_claimed`` or pins one with ``touch``
      owns one reference and must hand it back with ``free`` exactly once.
    - Lazy eviction: a freed cached block stays findable (``lookup``) until the free queue
      hands it out again; only then is its hash dropped and ``BlockRemoved`` emitted.
    - ``free`` puts a chain back tail first (cached blocks to the queue tail, last block
      first) so that a prefix's tail is evicted before its head; blocks holding nothing
      go to the head, so they are reused before anything worth keeping is evicted.
    - ``claim`` takes unreferenced blocks out of the free queue for a capacity escrow
      WITHOUT evicting them: they stay findable until ``take_claimed`` turns them into
      real blocks. A ``touch`` on a claimed block (a prefix hit) cancels the claim; the
      escrow holder notices through ``claimed_by`` and substitutes a victim.
    - Every state change that makes a hash findable or unfindable is appended to the
      event buffer (when enabled); the owner drains it with ``drain_events``.
    Not thread-safe: the owner serialises calls (the stage's cache lock).
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_events: bool = False) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise InvalidRequestError(
                f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.index = PrefixIndex()
        self._blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self._blocks)
        self._by_hash: dict[BlockHash, dict[int, KVBlock]] = {}
        self._num_claimed = 0
        self._num_claimed_cached = 0  # claimed blocks still findable
        self._num_in_use = 0
        self._num_evictable = 0  # unreferenced blocks that are still cached
        self._enable_events = enable_events
        self._events: list[KVEvent] = []

    # ---- queries -------------------------------------------------------------------

    def block(self, block_id: int) -> KVBlock:
        return self._blocks[block_id]

    @property
    def events_enabled(self) -> bool:
        """Whether state changes are buffered as KV events for ``drain_events``."""
        return self._enable_events

    @property
    def num_free_queued(self) -> int:
        """Unreferenced, unclaimed blocks: what ``allocate`` and ``claim`` can hand out."""
        return len(self.free_queue)

    def stats(self) -> PoolStats:
        unused = self.num_blocks - self._num_in_use
        return PoolStats(
            total=self.num_blocks,
            free=unused - self._num_evictable,
            cached=self._num_evictable,
            in_use=self._num_in_use,
            claimed=self._num_claimed,
            claimed_cached=self._num_claimed_cached,
        )

    def lookup(
        self,
        block_hash: BlockHash,
        parent_hash: BlockHash | None,
        token_ids: tuple[int, ...],
        extra: ExtraKeys,
    ) -> KVBlock | None:
        """A resident block holding exactly these tokens after this parent, or None.

        Authoritative (collision-guarded). Among duplicates prefers a block already in use,
        then a free-queued one, then a claimed one. Does not pin: call ``touch``.
        """
        copies = self._by_hash.get(block_hash)
        if not copies:
            return None
        best: KVBlock | None = None
        for block in copies.values():
            if not block.matches(parent_hash, token_ids, extra):
                continue
            if block.ref_cnt > 0:
                return block
            if best is None or (best.claimed_by is not None and block.claimed_by is None):
                best = block
        return best

    # ---- reference counting --------------------------------------------------------

    def allocate(self, n: int) -> list[KVBlock] | None:
        """``n`` fresh blocks with one reference each, evicting LRU cached ones; None if short."""
        if n > len(self.free_queue):
            return None
        blocks = [self.free_queue.popleft() for _ in range(n)]
        self._hand_out(blocks)
        return blocks

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Pin blocks found by ``lookup``: one more reference each (cancels a claim)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._num_evictable -= block.block_hash is not None
                if block.claimed_by is not None:
                    block.claimed_by = None
                    self._num_claimed -= 1
                    self._num_claimed_cached -= block.block_hash is not None
                else:
                    self.free_queue.remove(block)
                self._num_in_use += 1
            block.ref_cnt += 1

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """Drop one reference from each block of a chain given in prompt order."""
        for block in reversed(blocks):
            if block.ref_cnt <= 0:
                raise InvariantError(f"free of unreferenced block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._num_in_use -= 1
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self._num_evictable += 1
                    self.free_queue.append(block)

    # ---- escrow claims -------------------------------------------------------------

    def claim(self, n: int, owner: str) -> list[KVBlock] | None:
        """Reserve ``n`` victims from the LRU head for ``owner`` without evicting; None if short."""
        if n > len(self.free_queue):
            return None
        blocks = [self.free_queue.popleft() for _ in range(n)]
        for block in blocks:
            block.claimed_by = owner
            self._num_claimed_cached += block.block_hash is not None
        self._num_claimed += n
        return blocks

    def unclaim(self, blocks: Sequence[KVBlock], owner: str) -> None:
        """Give unused victims back to the queue head (in order), still findable."""
        for block in reversed(blocks):
            self._check_claim(block, owner)
            block.claimed_by = None
            self._num_claimed_cached -= block.block_hash is not None
            self.free_queue.appendleft(block)
        self._num_claimed -= len(blocks)

    def take_claimed(self, blocks: Sequence[KVBlock], owner: str) -> None:
        """Turn ``owner``'s victims into fresh blocks with one reference each (evicts now)."""
        for block in blocks:
            self._check_claim(block, owner)
            block.claimed_by = None
            self._num_claimed_cached -= block.block_hash is not None
        self._num_claimed -= len(blocks)
        self._hand_out(blocks)

    def _check_claim(self, block: KVBlock, owner: str) -> None:
        if block.claimed_by != owner or block.ref_cnt != 0:
            raise InvariantError(f"{block!r} is not a victim claimed by {owner!r}")

    def _hand_out(self, blocks: Sequence[KVBlock]) -> None:
        removed: list[BlockHash] = []
        for block in blocks:
            if block.block_hash is not None:
                self._num_evictable -= 1
                if self._uncache(block, block.block_hash):
                    removed.append(block.block_hash)
            block.block_hash = block.parent_hash = None
            block.token_ids, block.extra, block.has_snapshot = (), None, False
            block.ref_cnt = 1
        self._num_in_use += len(blocks)
        if removed and self._enable_events:
            self._events.append(BlockRemoved(tuple(removed)))

    def _uncache(self, block: KVBlock, block_hash: BlockHash) -> bool:
        copies = self._by_hash[block_hash]
        del copies[block.block_id]
        if not copies:
            del self._by_hash[block_hash]
        return self.index.detach(block_hash)

    # ---- caching -------------------------------------------------------------------

    def cache_blocks(
        self,
        blocks: Sequence[KVBlock],
        block_hashes: Sequence[BlockHash],
        token_blocks: Sequence[tuple[int, ...]],
        extra: ExtraKeys,
        parent_hash: BlockHash | None = None,
        snapshots: Sequence[bool] | None = None,
    ) -> None:
        """Make computed full blocks findable. ``blocks`` is a chain in prompt order whose
        first block follows ``parent_hash``; each must be in use and not cached yet.
        """
        if not len(blocks) == len(block_hashes) == len(token_blocks):
            raise InvariantError("cache_blocks: blocks, hashes and tokens differ in length")
        stored: list[tuple[BlockHash | None, list[BlockHash], list[int]]] = []
        parent = parent_hash
        run_open = False
        for i, block in enumerate(blocks):
            if block.ref_cnt <= 0 or block.block_hash is not None:
                raise InvariantError(f"cache_blocks on {block!r}: must be in use and uncached")
            if len(token_blocks[i]) != self.block_size:
                raise InvariantError(f"cache_blocks: block {i} is not full")
            h = block_hashes[i]
            block.block_hash, block.parent_hash = h, parent
            block.token_ids, block.extra = token_blocks[i], extra
            block.has_snapshot = bool(snapshots[i]) if snapshots is not None else False
            self._by_hash.setdefault(h, {})[block.block_id] = block
            is_new = self.index.attach(h)
            if is_new and self._enable_events:
                if not run_open:
                    stored.append((parent, [], []))
                stored[-1][1].append(h)
                stored[-1][2].extend(token_blocks[i])
            run_open = is_new
            parent = h
        for run_parent, hashes, tokens in stored:
            event = BlockStored(tuple(hashes), run_parent, tuple(tokens), self.block_size)
            self._events.append(event)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; refused (False) while any block is in use."""
        if self._num_in_use:
            return False
        self._num_evictable = self._num_claimed_cached = 0
        for block in self._blocks:
            if block.block_hash is not None:
                self._uncache(block, block.block_hash)
                block.block_hash = block.parent_hash = None
                block.token_ids, block.extra, block.has_snapshot = (), None, False
        if self._enable_events:
            self._events.append(AllBlocksCleared())
        return True

    def drain_events(self) -> list[KVEvent]:
        """Hand over (and forget) the events buffered since the last drain, oldest first."""
        events, self._events = self._events, []
        return events

    # ---- integrity -----------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise InvariantError if any counter, link, claim or index entry is inconsistent."""
        self.free_queue.check_integrity()
        in_use = claimed = claimed_cached = queued = evictable = 0
        seen: dict[BlockHash, int] = {}
        for block in self._blocks:
            in_queue = block in self.free_queue
            if block.ref_cnt < 0:
                raise InvariantError(f"{block!r} has a negative ref count")
            if block.ref_cnt > 0:
                in_use += 1
                if in_queue or block.claimed_by is not None:
                    raise InvariantError(f"{block!r} is referenced yet free-queued or claimed")
            elif in_queue == (block.claimed_by is not None):
                raise InvariantError(f"{block!r} must be either free-queued or claimed")
            claimed += block.claimed_by is not None
            claimed_cached += block.claimed_by is not None and block.block_hash is not None
            queued += in_queue
            if block.block_hash is not None:
                evictable += block.ref_cnt == 0
                if self._by_hash.get(block.block_hash, {}).get(block.block_id) is not block:
                    raise InvariantError(f"{block!r} is cached but missing from the hash map")
                seen[block.block_hash] = seen.get(block.block_hash, 0) + 1
            elif block.has_snapshot or block.token_ids:
                raise InvariantError(f"{block!r} is uncached but keeps cached metadata")
        if sum(len(c) for c in self._by_hash.values()) != sum(seen.values()):
            raise InvariantError("hash map holds blocks that are not cached")
        if seen != self.index.counts():
            raise InvariantError("hint counters disagree with the resident blocks")
        counters = (
            self._num_in_use, self._num_claimed, self._num_claimed_cached, self._num_evictable
        )  # fmt: skip
        if (in_use, claimed, claimed_cached, evictable) != counters:
            raise InvariantError(
                f"counters (in_use, claimed, claimed_cached, evictable)={counters}, "
                f"actual {(in_use, claimed, claimed_cached, evictable)}"
            )
        stats = self.stats()
        if stats.free + stats.cached + stats.in_use != self.num_blocks or stats.free < 0:
            raise InvariantError(f"accounting broken: {stats}")
        if queued + claimed + in_use != self.num_blocks:
            raise InvariantError("free-queued + claimed + in use != total")
