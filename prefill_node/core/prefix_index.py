"""Per chained block hash, how many resident blocks carry it (WAVEPP.md 1's hint counters)."""

from __future__ import annotations

from collections.abc import Sequence

from prefill_node.core.hashing import BlockHash
from prefill_node.errors import InvariantError


class PrefixIndex:
    """Counters ``hash -> number of resident blocks carrying it``.

    The block pool keeps them exact (``attach`` when a block becomes findable, ``detach``
    when it is evicted), and their edges decide the stage's KV events: a hash's first
    resident copy is stored, its last one removed. ``longest_prefix`` is the paper's hint
    probe; admission does not need it (each stage's lease walks the prefix with the pool's
    collision guard, ``StageAdmission._reserve``), and it serves tests and observation.
    """

    def __init__(self) -> None:
        self._count: dict[BlockHash, int] = {}

    def __len__(self) -> int:
        """Number of distinct hashes present."""
        return len(self._count)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._count

    def count(self, block_hash: BlockHash) -> int:
        return self._count.get(block_hash, 0)

    def attach(self, block_hash: BlockHash) -> bool:
        """Count one more resident block with this hash; True if the hash is new here."""
        n = self._count.get(block_hash, 0)
        self._count[block_hash] = n + 1
        return n == 0

    def detach(self, block_hash: BlockHash) -> bool:
        """Count one resident block fewer; True if no block carries the hash any more."""
        n = self._count.get(block_hash, 0)
        if n <= 0:
            raise InvariantError(f"detach of hash {block_hash:#x} that is not attached")
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

    def counts(self) -> dict[BlockHash, int]:
        """A copy of the counters (for integrity checks and tests)."""
        return dict(self._count)
