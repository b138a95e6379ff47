"""Block pool: exact block ids and eviction order on a tiny pool, events, claims, integrity."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from prefill_node.core.block_pool import BlockPool
from prefill_node.core.hashing import ExtraKeys, hash_block_tokens
from prefill_node.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from prefill_node.errors import InvalidRequestError, InvariantError

B = 16
EXTRA = ExtraKeys("tiny")


def blocks_of(tokens):
    return [tuple(tokens[i : i + B]) for i in range(0, len(tokens) // B * B, B)]


def compute_and_cache(pool, tokens, extra=EXTRA):
    """Allocate blocks for ``tokens`` as a request would, cache the full ones, return them."""
    n = -(-len(tokens) // B)
    blocks = pool.allocate(n)
    assert blocks is not None
    full = blocks_of(tokens)
    pool.cache_blocks(blocks[: len(full)], hash_block_tokens(tokens, B, extra), full, extra)
    return blocks


def hit_chain(pool, tokens, extra=EXTRA):
    """The authoritative cached prefix of ``tokens`` (not pinned)."""
    found, parent = [], None
    for h, toks in zip(hash_block_tokens(tokens, B, extra), blocks_of(tokens), strict=True):
        block = pool.lookup(h, parent, toks, extra)
        if block is None:
            break
        found.append(block)
        parent = h
    return found


@pytest.fixture
def pool():
    p = BlockPool(11, B, enable_events=True)
    yield p
    p.check_integrity()


def test_allocation_takes_lru_head_and_free_returns_chain_tail_first(pool):
    a = compute_and_cache(pool, list(range(48)))  # 3 full blocks
    assert [b.block_id for b in a] == [0, 1, 2]
    assert pool.free_queue.block_ids() == list(range(3, 11))
    pool.free(a)
    # The chain goes to the tail last block first: block 2 is evicted before 1, 1 before 0.
    assert pool.free_queue.block_ids() == [3, 4, 5, 6, 7, 8, 9, 10, 2, 1, 0]
    assert pool.stats().cached == 3 and pool.stats().free == 8
    other = pool.allocate(8)
    assert [b.block_id for b in other] == list(range(3, 11))
    pool.drain_events()
    evicted = pool.allocate(1)
    assert [b.block_id for b in evicted] == [2]
    assert pool.drain_events() == [BlockRemoved((hash_block_tokens(list(range(48)), B, EXTRA)[2],))]
    assert [b.block_id for b in hit_chain(pool, list(range(48)))] == [0, 1]


def test_partial_last_block_is_not_cached_and_is_reused_first(pool):
    a = compute_and_cache(pool, list(range(40)))  # 2 full + 1 partial
    assert [b.block_id for b in a] == [0, 1, 2]
    assert a[2].block_hash is None
    pool.free(a)
    assert pool.free_queue.block_ids() == [2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 0]
    assert pool.allocate(1)[0].block_id == 2


def test_hit_pins_from_the_middle_of_the_queue_and_lazy_eviction_keeps_it_findable(pool):
    tokens = list(range(32))
    a = compute_and_cache(pool, tokens)
    pool.free(a)
    assert pool.free_queue.block_ids() == [2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 0]
    hit = hit_chain(pool, tokens + [99] * 16)
    assert [b.block_id for b in hit] == [0, 1]
    pool.touch(hit)
    assert pool.free_queue.block_ids() == list(range(2, 11))
    assert pool.stats() == pool.stats().__class__(total=11, free=9, cached=0, in_use=2, claimed=0)
    pool.free(hit)
    assert pool.free_queue.block_ids() == [2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 0]


def test_lru_order_across_two_chains(pool):
    a = compute_and_cache(pool, list(range(32)))  # blocks 0, 1
    b = compute_and_cache(pool, list(range(500, 532)))  # blocks 2, 3
    pool.free(b)
    pool.free(a)  # a is now more recently used than b
    assert pool.free_queue.block_ids()[-4:] == [3, 2, 1, 0]
    assert [x.block_id for x in pool.allocate(9)][-2:] == [3, 2]
    assert hit_chain(pool, list(range(500, 532))) == []
    assert len(hit_chain(pool, list(range(32)))) == 2


def test_collision_guard_rejects_a_hash_hit_with_other_tokens(pool):
    tokens = list(range(16))
    real = hash_block_tokens(tokens, B, EXTRA)
    blocks = pool.allocate(1)
    pool.cache_blocks(blocks, real, [tuple(range(100, 116))], EXTRA)  # forged collision
    assert pool.lookup(real[0], None, tuple(tokens), EXTRA) is None
    assert pool.lookup(real[0], None, tuple(range(100, 116)), EXTRA) is blocks[0]
    assert pool.lookup(real[0], None, tuple(range(100, 116)), ExtraKeys("other")) is None
    pool.free(blocks)


def test_events_stored_removed_and_duplicates(pool):
    tokens = list(range(32))
    hashes = hash_block_tokens(tokens, B, EXTRA)
    a = compute_and_cache(pool, tokens)
    assert pool.drain_events() == [BlockStored(hashes, None, tuple(tokens), B)]
    dup = compute_and_cache(pool, tokens)  # same content computed twice concurrently
    assert pool.drain_events() == []
    assert pool.index.count(hashes[0]) == 2
    pool.free(dup)
    pool.free(a)
    assert pool.free_queue.block_ids()[-4:] == [3, 2, 1, 0]
    pool.allocate(7)
    pool.drain_events()
    pool.allocate(2)  # evicts 3 then 2: the duplicates, so nothing disappears
    assert pool.drain_events() == []
    assert pool.index.count(hashes[1]) == 1
    pool.allocate(1)  # evicts block 1: last copy of hashes[1]
    assert pool.drain_events() == [BlockRemoved((hashes[1],))]
    assert pool.index.count(hashes[0]) == 1


def test_stored_event_splits_around_hashes_already_present(pool):
    tokens = list(range(48))
    hashes = hash_block_tokens(tokens, B, EXTRA)
    first = pool.allocate(1)
    pool.cache_blocks(first, hashes[1:2], [tuple(tokens[16:32])], EXTRA, parent_hash=hashes[0])
    pool.drain_events()
    compute_and_cache(pool, tokens)
    assert pool.drain_events() == [
        BlockStored(hashes[:1], None, tuple(tokens[:16]), B),
        BlockStored(hashes[2:], hashes[1], tuple(tokens[32:]), B),
    ]


def test_claims_do_not_evict_and_a_hit_cancels_the_claim(pool):
    tokens = list(range(32))
    a = compute_and_cache(pool, tokens)
    pool.free(a)
    assert pool.allocate(9) is not None  # only 1, 0 left in the queue
    victims = pool.claim(2, "r1")
    assert [v.block_id for v in victims] == [1, 0]
    assert pool.allocate(1) is None and pool.claim(1, "r2") is None
    assert pool.stats().claimed == 2 and pool.stats().available == 0
    hit = hit_chain(pool, tokens)  # claimed victims stay findable
    assert [b.block_id for b in hit] == [0, 1]
    pool.touch(hit[:1])
    assert victims[1].claimed_by is None and victims[0].claimed_by == "r1"
    with pytest.raises(InvariantError):
        pool.take_claimed([victims[1]], "r1")
    pool.take_claimed([victims[0]], "r1")  # evicts it now
    assert victims[0].block_hash is None and victims[0].ref_cnt == 1
    assert pool.drain_events()[-1] == BlockRemoved((hash_block_tokens(tokens, B, EXTRA)[1],))


def test_escrowed_victims_count_as_used_and_leave_the_free_and_cached_counts(pool):
    """``PoolStats.used`` (what GetLoad reports per stage) counts claimed victims as used
    from the claim on, whether they still hold a cached prefix or nothing."""
    tokens = list(range(32))
    pool.free(compute_and_cache(pool, tokens))  # blocks 1, 0 cached at the queue's tail
    held = pool.allocate(7)  # blocks 2..8: the head of the queue; 9, 10, 1, 0 left
    victims = pool.claim(3, "r")  # 9, 10 (empty) and 1 (cached)
    stats = pool.stats()
    assert (stats.in_use, stats.claimed, stats.claimed_cached) == (7, 3, 1)
    assert (stats.used, stats.unclaimed_free, stats.unclaimed_cached) == (10, 0, 1)
    assert stats.used + stats.unclaimed_free + stats.unclaimed_cached == stats.total
    pool.check_integrity()
    pool.touch(hit_chain(pool, tokens))  # a hit on 0, 1 cancels the claim on 1
    stats = pool.stats()
    assert (stats.claimed, stats.claimed_cached, stats.used) == (2, 0, 11)
    pool.check_integrity()
    pool.take_claimed([v for v in victims if v.claimed_by == "r"], "r")
    assert pool.stats().claimed_cached == 0 and pool.stats().used == 11
    pool.free(held)


def test_unclaim_returns_victims_to_the_head_in_order(pool):
    victims = pool.claim(3, "r")
    assert pool.free_queue.block_ids() == list(range(3, 11))
    pool.unclaim(victims, "r")
    assert pool.free_queue.block_ids() == list(range(11))


def test_reset_prefix_cache_refused_while_in_use(pool):
    a = compute_and_cache(pool, list(range(32)))
    assert pool.reset_prefix_cache() is False
    pool.free(a)
    pool.drain_events()
    assert pool.reset_prefix_cache() is True
    assert pool.drain_events() == [AllBlocksCleared()]
    assert len(pool.index) == 0 and pool.stats().cached == 0


def test_allocate_beyond_capacity_returns_none(pool):
    assert pool.allocate(12) is None
    assert pool.allocate(11) is not None
    assert pool.allocate(1) is None


def test_integrity_check_detects_corruption():
    p = BlockPool(4, B)
    blocks = p.allocate(2)
    blocks[0].ref_cnt = 0  # leaked reference: neither in use, queued nor claimed
    with pytest.raises(InvariantError):
        p.check_integrity()
    q = BlockPool(4, B)
    q.index.attach(hash_block_tokens(list(range(16)), B, EXTRA)[0])
    with pytest.raises(InvariantError, match="hint counters"):
        q.check_integrity()
    with pytest.raises(InvariantError):
        BlockPool(2, B).free([BlockPool(2, B).block(0)])


def test_bad_sizes_raise_typed_error():
    with pytest.raises(InvalidRequestError):
        BlockPool(0, 16)


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / hit / free / claim / take / unclaim over prompts sharing prefixes."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(12, 4, enable_events=True)
        self.held: list[list] = []  # chains we own one reference each on
        self.claims: dict[str, list] = {}
        self.n = 0

    @rule(prefix=st.integers(0, 3), length=st.integers(1, 20))
    def run_request(self, prefix, length):
        tokens = [prefix] * 4 + list(range(length))
        hashes = hash_block_tokens(tokens, 4, EXTRA)
        full = [tuple(tokens[i : i + 4]) for i in range(0, len(hashes) * 4, 4)]
        hit, parent = [], None
        for h, t in zip(hashes, full, strict=True):
            b = self.pool.lookup(h, parent, t, EXTRA)
            if b is None:  # a claimed block is a valid hit: touch cancels the claim
                break
            hit.append(b)
            parent = h
        self.pool.touch(hit)
        new = self.pool.allocate(-(-len(tokens) // 4) - len(hit))
        if new is None:
            self.pool.free(hit)
            return
        n_full = len(hashes) - len(hit)
        self.pool.cache_blocks(new[:n_full], hashes[len(hit) :], full[len(hit) :], EXTRA, parent)
        self.held.append(hit + new)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def finish(self, i):
        self.pool.free(self.held.pop(i % len(self.held)))

    @rule(n=st.integers(1, 4))
    def claim(self, n):
        self.n += 1
        owner = f"r{self.n}"
        got = self.pool.claim(n, owner)
        if got is not None:
            self.claims[owner] = got

    @precondition(lambda self: self.claims)
    @rule(take=st.booleans())
    def settle_claim(self, take):
        owner, victims = self.claims.popitem()
        still = [v for v in victims if v.claimed_by == owner]
        if take:
            self.pool.take_claimed(still, owner)
            self.held.append(still)
        else:
            self.pool.unclaim(still, owner)

    @invariant()
    def consistent(self):
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        for chain in self.held:
            for b in chain:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for block_id, n in refs.items():
            assert self.pool.block(block_id).ref_cnt == n  # nothing we hold was evicted
        assert self.pool.stats().in_use == len(refs)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
