"""One request's capacity on one stage, from its lease and escrow to completion or abort."""

from __future__ import annotations

from collections.abc import Callable

from prefill_node.core.block import KVBlock
from prefill_node.core.block_pool import BlockPool
from prefill_node.core.escrow import Escrow
from prefill_node.core.execution_results import (
    BlockTable,
    Completion,
    MismatchReason,
    StageStateMismatch,
)
from prefill_node.core.lease import PrefixLease
from prefill_node.core.request import (
    PromptBlocks,
    blocks_needed,
    copies_last_block,
    reused_tokens,
)
from prefill_node.errors import InvariantError


class Reservation:
    """Lease (reused prefix, pinned) + escrow (victims for the rest) + materialised blocks.

    Life cycle on a stage: reserved (lease + escrow) -> committed (capacity guaranteed; the
    boundary may still go down, never up, until the first chunk) -> materialised chunk by
    chunk (victims become real blocks) -> completed (new full blocks cached, pins dropped or
    kept for a KV pull).
    ``release`` undoes any stage of that: escrow first, then the blocks and the lease.

    Invariant: ``len(lease) + escrow.target + len(new_blocks) == prompt.num_blocks + c``
    from the moment the reservation holds capacity until completion, where ``c`` is 1 when
    the lease covers the whole prompt (``copies_last``): its last block stays pinned in the
    lease and a private copy of it (the first new block) takes its place in the table, so
    the last token is recomputed without writing into a cached block.

    A promised in-flight prefix (``promise``): the request was admitted to reuse blocks
    ``[leased, promised)`` that another request (the producer) is still computing. Until
    its first chunk the reservation holds the lease (``leased`` blocks, really cached), an
    escrow for EVERY block after it, promised ones included, and, once the producer's
    chunk cached them here, the promised blocks too (``fulfil`` extends the lease, all or
    nothing; ``promise_surplus`` counts them), so the invariant reads ``... == num_blocks
    + c + promise_surplus``. The first chunk settles it: starting at ``promised`` it
    needs the extension (a broken promise is a mismatch: nothing runs on KV that was never
    computed) and gives the surplus escrow back; starting at ``leased`` (the leader's
    fallback when the producer was dropped) it drops the extension and computes the
    blocks itself with the escrow it kept. A promise never covers the block holding the
    prompt's last token, so it never needs the copied last block.
    """

    def __init__(self, prompt: PromptBlocks) -> None:
        self.prompt = prompt
        self.lease = PrefixLease()
        self.escrow = Escrow(prompt.request_id)
        self.new_blocks: list[KVBlock] = []
        self.committed = False
        self.completed = False
        self.next_token = 0
        self.cached_early = 0  # leading new full blocks cached before completion
        self.promised = 0  # the lease's length once a promise is fulfilled; 0: no promise
        self.leased = 0  # the lease's length when the promise was made

    @property
    def request_id(self) -> str:
        return self.prompt.request_id

    @property
    def boundary_blocks(self) -> int:
        return len(self.lease)

    @property
    def cached_len(self) -> int:
        p = self.prompt
        return reused_tokens(p.num_tokens, p.block_size, len(self.lease))

    @property
    def copies_last(self) -> bool:
        p = self.prompt
        return copies_last_block(p.num_tokens, p.block_size, len(self.lease))

    @property
    def held_blocks(self) -> int:
        """Blocks this reservation accounts for (shared prefix blocks counted per request)."""
        return len(self.lease) + self.escrow.target + len(self.new_blocks)

    @property
    def promise_pending(self) -> bool:
        """A promise whose blocks are not all leased yet."""
        return len(self.lease) < self.promised

    @property
    def promise_surplus(self) -> int:
        """Promised blocks leased while the escrow still covers them (before the first chunk)."""
        return len(self.lease) - self.leased if self.promised else 0

    @property
    def needed_blocks(self) -> int:
        """``held_blocks`` once reserved: the prompt's blocks, plus the copy of a wholly
        cached prompt's last block."""
        return self.prompt.num_blocks + self.copies_last

    def reserve_suffix(self, pool: BlockPool) -> bool:
        """Escrow victims for everything after the lease (and the copy of its last block if
        it covers the prompt); False (holding a partial escrow) when the pool is short."""
        return self.escrow.settle(pool, self.needed_blocks - len(self.lease))

    def commit(self, pool: BlockPool, boundary_blocks: int) -> bool:
        """Shrink the lease to the negotiated boundary, re-check the escrow (substituting
        stolen victims, topping up for the longer suffix) and commit. False if short.

        A committed reservation may commit again at a lower boundary until its first chunk
        materialises (the round's COMMIT phase, when the stages' leases differ)."""
        started = self.committed and self.next_token != self.cached_len
        if self.new_blocks or self.completed or started or self.promised:
            raise InvariantError(f"{self.request_id!r} committed after it started")
        self.lease.shrink(pool, boundary_blocks)
        if not self.reserve_suffix(pool):
            return False
        self.committed = True
        self.next_token = self.cached_len
        return True

    def promise(self, promised_blocks: int) -> None:
        """Reuse prompt blocks up to ``promised_blocks`` once they are cached here (class
        docstring); the caller committed the reservation at its lease just before."""
        p = self.prompt
        if not self.committed or self.new_blocks or self.promised or self.completed:
            raise InvariantError(f"{self.request_id!r}: a promise after it started")
        if not len(self.lease) < promised_blocks <= (p.num_tokens - 1) // p.block_size:
            raise InvariantError(
                f"{self.request_id!r}: promise of {promised_blocks} blocks past a lease of "
                f"{len(self.lease)} in a prompt of {p.num_tokens} tokens"
            )
        self.promised, self.leased = promised_blocks, len(self.lease)

    def fulfil(self, pool: BlockPool, may_pin: Callable[[KVBlock], bool]) -> bool:
        """Lease the promised blocks if all of them are cached now; True once they are."""
        if not self.promise_pending:
            return True
        if not self.lease.extend(pool, self.prompt, self.promised, may_pin):
            return False
        self.next_token = self.cached_len
        return True

    def _settle_promise(self, pool: BlockPool, stage: int, start: int):
        """The first chunk decides a promise (class docstring); a mismatch or None."""
        bs = self.prompt.block_size
        if start == self.promised * bs and not self.promise_pending:
            self.escrow.settle(pool, self.needed_blocks - len(self.lease))  # gives back only
        elif start == self.leased * bs:
            self.lease.shrink(pool, self.leased)
            self.next_token = self.cached_len
        elif start == self.promised * bs:
            return self._mismatch(
                stage,
                MismatchReason.PROMISE_BROKEN,
                f"blocks [{len(self.lease)}, {self.promised}) were promised by a request that "
                "never cached them here",
            )
        else:
            return None  # the position check reports it
        self.promised = self.leased = 0
        return None

    def materialise(self, pool: BlockPool, stage: int, start: int, length: int):
        """Real blocks for chunk [start, start + length): BlockTable or StageStateMismatch."""
        end = start + length
        if not self.committed or self.completed:
            state = "completed" if self.completed else "not committed"
            return self._mismatch(stage, MismatchReason.NOT_COMMITTED, f"reservation is {state}")
        if length <= 0 or end > self.prompt.num_tokens:
            return self._mismatch(
                stage,
                MismatchReason.OUT_OF_RANGE,
                f"chunk [{start}, {end}) outside prompt of {self.prompt.num_tokens} tokens",
            )
        if self.promised:
            broken = self._settle_promise(pool, stage, start)
            if broken is not None:
                return broken
        if start != self.next_token:
            return self._mismatch(
                stage,
                MismatchReason.WRONG_POSITION,
                f"chunk starts at {start}, this stage expects {self.next_token} "
                f"(cached prefix {self.cached_len} tokens)",
            )
        shared = len(self.lease) - self.copies_last
        need = blocks_needed(end, self.prompt.block_size) - shared - len(self.new_blocks)
        copy = None
        if need > 0:
            self.new_blocks.extend(self.escrow.take(pool, need))
            if self.copies_last and start == self.cached_len:
                copy = (self.lease.blocks[-1].block_id, self.new_blocks[0].block_id)
        self.next_token = end
        return BlockTable(self.request_id, self.block_ids(), self.cached_len, start, end, copy)

    def cache_computed(self, pool: BlockPool, computed: int, snapshot_interval: int | None) -> int:
        """Chunks up to token ``computed`` ran on this stage: cache the new full blocks
        below it that are not cached yet, so other requests can reuse them while this one
        still runs (they stay pinned by it). Returns the number of blocks cached now."""
        if not self.committed or self.completed or computed > self.next_token:
            raise InvariantError(
                f"{self.request_id!r}: cache_computed up to {computed} of {self.next_token} tokens"
            )
        p, first = self.prompt, len(self.lease)
        upto = min(computed // p.block_size, p.num_full_blocks) - first
        return self._cache(pool, upto, snapshot_interval)

    def _cache(self, pool: BlockPool, upto: int, snapshot_interval: int | None) -> int:
        """Cache ``new_blocks[cached_early:upto]``: new block j holds prompt block
        ``len(lease) + j`` (with ``copies_last`` there is no full block after the lease)."""
        p, lo = self.prompt, len(self.lease) + self.cached_early
        hi = len(self.lease) + upto
        if hi <= lo:
            return 0
        snaps = None
        if snapshot_interval is not None:
            snaps = [(i + 1) % snapshot_interval == 0 for i in range(lo, hi)]
        pool.cache_blocks(
            self.new_blocks[self.cached_early : upto],
            p.hashes[lo:hi],
            p.token_blocks[lo:hi],
            p.spec.extra,
            p.parent_of(lo),
            snaps,
        )
        self.cached_early = upto
        return hi - lo

    def complete(self, pool: BlockPool, stage: int, snapshot_interval: int | None, keep: bool):
        """Cache the new full blocks and unpin (unless ``keep``): Completion or mismatch."""
        if not self.committed or self.completed or self.next_token != self.prompt.num_tokens:
            return self._mismatch(
                stage,
                MismatchReason.INCOMPLETE,
                f"{self.next_token} of {self.prompt.num_tokens} tokens materialised",
            )
        if self.escrow.target:
            raise InvariantError(f"{self.request_id!r} completed with an unused escrow")
        n_full = self.prompt.num_full_blocks - len(self.lease)  # the partial last block: never
        self._cache(pool, n_full, snapshot_interval)
        self.completed = True
        table = self.block_ids()
        if not keep:
            self.release(pool)
        return Completion(self.request_id, table, n_full, kept_pinned=keep)

    def release(self, pool: BlockPool) -> None:
        """Drop everything: escrow first, then materialised blocks and lease (tail first)."""
        self.escrow.release(pool)
        chain = self.lease.blocks + self.new_blocks
        self.lease.blocks = []
        self.new_blocks = []
        pool.free(chain)

    def block_ids(self) -> tuple[int, ...]:
        """The request's block table: the shared prefix (less a copied last block), then its
        own blocks."""
        shared = self.lease.blocks[: len(self.lease) - self.copies_last]
        return tuple(b.block_id for b in shared) + tuple(b.block_id for b in self.new_blocks)

    def _mismatch(self, stage: int, reason: MismatchReason, detail: str) -> StageStateMismatch:
        return StageStateMismatch(self.request_id, stage, reason, detail)
