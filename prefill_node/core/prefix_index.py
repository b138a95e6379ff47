"""The hint index: per chained block hash, how many resident blocks carry it (WAVEPP.md 1)."""

from __future__ import annotations

from collections.abc import Sequence

from prefill_node.core.hashing import BlockHash
from prefill_node.errors import InvariantError


class PrefixIndex:
    """Counters ``hash -> number of resident blocks carrying it`` plus snapshot counters.

    This is a HINT: it answers "how long a prefix is probably cached here" in O(log n)
    probes without touching blocks, pins or the collision guard. The block pool keeps it
    exact (``attach`` when a block becomes findable, ``detach`` when it is evicted), but a
    reader must still confirm a hint authoritatively (the lease does) before relying on it:
    between the lookup and the lease a block may be evicted, and a 64-bit collision is
    only caught by the pool's token comparison.

    Snapshot counters serve stages with recurrent-state layers: a prefix is reusable there
    only up to a block boundary where a recurrent-state snapshot is stored.
    """

    def __init__(self) -> None:
        self._count: dict[BlockHash, int] = {}
        self._snapshots: dict[BlockHash, int] = {}

    def __len__(self) -> int:
        """Number of distinct hashes present."""
        return len(self._count)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._count

    def count(self, block_hash: BlockHash) -> int:
        return self._count.get(block_hash, 0)

    def has_snapshot(self, block_hash: BlockHash) -> bool:
        return block_hash in self._snapshots

    def attach(self, block_hash: BlockHash, *, snapshot: bool = False) -> bool:
        """Count one more resident block with this hash; True if the hash is new here."""
        n = self._count.get(block_hash, 0)
        self._count[block_hash] = n + 1
        if snapshot:
            self._snapshots[block_hash] = self._snapshots.get(block_hash, 0) + 1
        return n == 0

    def detach(self, block_hash: BlockHash, *, snapshot: bool = False) -> bool:
        """Count one resident block fewer; True if no block carries the hash any more."""
        n = self._count.get(block_hash, 0)
        if n <= 0:
            raise InvariantError(f"detach of hash {block_hash:#x} that is not attached")
        if snapshot:
            s = self._snapshots.get(block_hash, 0)
            if s <= 0:
                raise InvariantError(f"detach of snapshot {block_hash:#x} that is not attached")
            if s == 1:
                del self._snapshots[block_hash]
            else:
                self._snapshots[block_hash] = s - 1
        if n == 1:
            del self._count[block_hash]
            return True
        self._count[block_hash] = n - 1
        return False

    def longest_prefix(self, hashes: Sequence[BlockHash], limit: int | None = None) -> int:
        """Number of leading blocks of ``hashes[:limit]`` that are present (hint).

        Exponential probe over prefix lengths 1, 2, 4, ... then binary search between the
        last present and the first absent probe: O(log n) dictionary lookups. Assumes
        presence is monotone along the chain, which tail-first eviction makes the common
        case; where it is not (a hole in the middle), the answer is some present boundary
        before a hole, which the authoritative lease re-check then corrects.
        """
        n = len(hashes) if limit is None else min(limit, len(hashes))
        if n == 0 or hashes[0] not in self._count:
            return 0
        good, probe = 1, 2  # invariant: prefix of length `good` is present
        while probe <= n and hashes[probe - 1] in self._count:
            good, probe = probe, probe * 2
        bad = min(probe, n + 1)  # a prefix of length `bad` is absent (or beyond the end)
        while bad - good > 1:
            mid = (good + bad) // 2
            if hashes[mid - 1] in self._count:
                good = mid
            else:
                bad = mid
        return good

    def snapshot_boundary(self, hashes: Sequence[BlockHash], upto: int) -> int:
        """Backward scan: largest k <= ``upto`` with a snapshot after block k-1, else 0."""
        for k in range(min(upto, len(hashes)), 0, -1):
            if hashes[k - 1] in self._snapshots:
                return k
        return 0

    def reusable_blocks(
        self, hashes: Sequence[BlockHash], limit: int | None = None, *, needs_snapshot: bool
    ) -> int:
        """The stage-local hint: longest present prefix, moved back to a snapshot if required."""
        boundary = self.longest_prefix(hashes, limit)
        return self.snapshot_boundary(hashes, boundary) if needs_snapshot else boundary

    def counts(self) -> dict[BlockHash, int]:
        """A copy of the counters (for integrity checks and tests)."""
        return dict(self._count)

    def snapshot_counts(self) -> dict[BlockHash, int]:
        return dict(self._snapshots)
