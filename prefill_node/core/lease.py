"""A local lease: the pinned, authoritatively checked cached prefix of one request on one stage."""

from __future__ import annotations

from collections.abc import Callable

from prefill_node.core.block import KVBlock
from prefill_node.core.block_pool import BlockPool
from prefill_node.core.request import PromptBlocks
from prefill_node.errors import InvariantError


class PrefixLease:
    """Blocks ``0..len-1`` of a prompt, found by the collision-guarded lookup and pinned.

    Contract: while the lease holds a block, the block holds exactly that prompt block's
    tokens (it cannot be evicted: it is referenced). After ``acquire`` the lease only
    SHRINKS (the negotiated boundary only moves down), with one exception: ``extend`` to
    the blocks an in-flight prefix promised, once the producer cached them, all of them or
    none (``Reservation``). ``release`` drops every pin. The caller serialises calls with
    every other user of the pool (the stage lock).
    """

    def __init__(self) -> None:
        self.blocks: list[KVBlock] = []
        self._acquired = False

    def __len__(self) -> int:
        return len(self.blocks)

    def acquire(
        self,
        pool: BlockPool,
        prompt: PromptBlocks,
        upto: int,
        may_pin: Callable[[KVBlock], bool],
    ) -> int:
        """Pin the longest really-cached prefix of at most ``upto`` blocks; return its length.

        ``may_pin`` is asked about every hit that some escrow holds as a victim; False
        ends the prefix there (the stage decides whether a victim may be taken over).
        """
        if self._acquired:
            raise InvariantError(f"lease of {prompt.request_id!r} acquired twice")
        self._acquired = True
        self.blocks = self._pin_run(pool, prompt, 0, upto, may_pin)
        return len(self.blocks)

    def extend(
        self,
        pool: BlockPool,
        prompt: PromptBlocks,
        upto: int,
        may_pin: Callable[[KVBlock], bool],
    ) -> bool:
        """Pin prompt blocks ``[len, upto)`` too if every one of them is cached now (True);
        otherwise pin none of them (False). Only for a promised in-flight prefix."""
        if not self._acquired or upto > prompt.num_full_blocks:
            raise InvariantError(f"lease of {prompt.request_id!r} cannot extend to {upto}")
        found = self._pin_run(pool, prompt, len(self.blocks), upto, may_pin)
        if len(self.blocks) + len(found) < upto:
            pool.free(found)
            return False
        self.blocks.extend(found)
        return True

    def _pin_run(
        self,
        pool: BlockPool,
        prompt: PromptBlocks,
        first: int,
        upto: int,
        may_pin: Callable[[KVBlock], bool],
    ) -> list[KVBlock]:
        """Pin the cached run of prompt blocks ``first, first + 1, ...`` (below ``upto``)."""
        found: list[KVBlock] = []
        found_ids = {b.block_id for b in self.blocks}  # a 64-bit collision could repeat a
        for i in range(first, min(upto, prompt.num_full_blocks)):  # block; never pin twice
            block = pool.lookup(
                prompt.hashes[i], prompt.parent_of(i), prompt.token_blocks[i], prompt.spec.extra
            )
            if block is None or block.block_id in found_ids:
                break
            if block.claimed_by is not None and not may_pin(block):
                break
            pool.touch((block,))  # pin at once: may_pin's decision for later blocks sees it
            found.append(block)
            found_ids.add(block.block_id)
        return found

    def shrink(self, pool: BlockPool, num_blocks: int) -> None:
        """Unpin every block from ``num_blocks`` on (tail first); growing is not allowed."""
        if num_blocks > len(self.blocks) or num_blocks < 0:
            raise InvariantError(f"lease cannot grow from {len(self.blocks)} to {num_blocks}")
        tail = self.blocks[num_blocks:]
        del self.blocks[num_blocks:]
        pool.free(tail)

    def release(self, pool: BlockPool) -> None:
        self.shrink(pool, 0)

    def snapshot_boundaries(self) -> tuple[int, ...]:
        """Boundaries k (blocks) with a recurrent-state snapshot after block k-1, ascending."""
        return tuple(i + 1 for i, b in enumerate(self.blocks) if b.has_snapshot)
