"""A capacity escrow: victims held for one request's uncached blocks, evicted only when used."""

from __future__ import annotations

from prefill_node.core.block import KVBlock
from prefill_node.core.block_pool import BlockPool
from prefill_node.errors import InvariantError


class Escrow:
    """References to ``target`` victim blocks (free or evictable cached) claimed for ``owner``.

    Victims are not evicted when claimed: they stay findable, and a prefix hit of another
    request may take one over (``BlockPool.touch`` cancels the claim). Such a victim is
    "stolen"; it no longer counts, and the next ``settle`` picks a replacement. A
    COMMITTED escrow is kept whole by its stage: a hit may take a victim only after
    ``replace`` found a substitute, so ``take`` never comes up short.

    The escrow never evicts anything itself: ``take`` hands victims to the pool, which
    evicts them at that moment (materialisation). ``release`` gives unused victims back to
    the free-queue head, still findable.
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.target = 0
        self._victims: dict[int, KVBlock] = {}

    def _prune(self) -> None:
        stolen = [i for i, b in self._victims.items() if b.claimed_by != self.owner]
        for block_id in stolen:
            del self._victims[block_id]

    @property
    def held(self) -> int:
        """Victims still claimed by this escrow (stolen ones excluded)."""
        return sum(1 for b in self._victims.values() if b.claimed_by == self.owner)

    def victims(self) -> list[KVBlock]:
        """The valid victims, for integrity checks and tests."""
        return [b for b in self._victims.values() if b.claimed_by == self.owner]

    def settle(self, pool: BlockPool, target: int) -> bool:
        """Hold exactly ``target`` victims: drop stolen ones, claim replacements or give back
        extras. False if the pool is short; the escrow then holds what it could get and the
        caller decides (cleanup releases it).
        """
        self._prune()
        self.target = target
        have = len(self._victims)
        if have > target:
            extra = list(self._victims.values())[target:]
            for block in extra:
                del self._victims[block.block_id]
            pool.unclaim(extra, self.owner)
            return True
        got = pool.claim(target - have, self.owner)
        if got is None:
            return False
        for block in got:
            self._victims[block.block_id] = block
        return True

    def replace(self, pool: BlockPool, victim: KVBlock) -> bool:
        """Claim a substitute for ``victim`` (about to be taken over by a hit); False if none."""
        if victim.claimed_by != self.owner:
            raise InvariantError(f"{victim!r} is not a victim of {self.owner!r}")
        got = pool.claim(1, self.owner)
        if got is None:
            return False
        del self._victims[victim.block_id]
        pool.unclaim([victim], self.owner)  # back to the queue head; the hit pins it next
        self._victims[got[0].block_id] = got[0]
        return True

    def take(self, pool: BlockPool, n: int) -> list[KVBlock]:
        """Turn ``n`` victims into fresh blocks with one reference each (evicting them now)."""
        self._prune()
        if n > len(self._victims) or n > self.target:
            raise InvariantError(
                f"escrow of {self.owner!r} holds {len(self._victims)} of {self.target}, "
                f"asked for {n}"
            )
        taken = list(self._victims.values())[:n]
        for block in taken:
            del self._victims[block.block_id]
        pool.take_claimed(taken, self.owner)
        self.target -= n
        return taken

    def release(self, pool: BlockPool) -> None:
        """Give every unused victim back to the free-queue head (order kept)."""
        self._prune()
        pool.unclaim(list(self._victims.values()), self.owner)
        self._victims.clear()
        self.target = 0
