"""PipelineKVEventAggregator: exact event sequences, a brute-force model, real block pools."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefill_node.core.block_pool import BlockPool
from prefill_node.core.hashing import BlockHash, ExtraKeys, hash_block_tokens
from prefill_node.core.kv_event_aggregator import PipelineKVEventAggregator, StageEvents
from prefill_node.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from prefill_node.errors import InvariantError

BS = 2
CHAIN_LEN = 4  # hashes 0..3 are one chain, 4..7 the next, ...: parent(h) = h - 1


def parent_of(h: int) -> BlockHash | None:
    return None if h % CHAIN_LEN == 0 else BlockHash(h - 1)


def tokens_of(h: int) -> tuple[int, ...]:
    return (10 * h, 10 * h + 1)


def stored(*hashes: int) -> BlockStored:
    """A chain run as a pool would emit it (parent and tokens derived from the hashes)."""
    tokens = tuple(t for h in hashes for t in tokens_of(h))
    return BlockStored(tuple(BlockHash(h) for h in hashes), parent_of(hashes[0]), tokens, BS)


def removed(*hashes: int) -> BlockRemoved:
    return BlockRemoved(tuple(BlockHash(h) for h in hashes))


def test_stored_once_the_last_stage_holds_it():
    agg = PipelineKVEventAggregator(2)
    assert agg.ingest(0, [stored(0, 1, 2)]) == []
    assert agg.ingest(1, [stored(0, 1)]) == [stored(0, 1)]
    assert agg.ingest(1, [stored(2)]) == [stored(2)]
    assert agg.published == {0, 1, 2}
    agg.check_integrity()


def test_stage_order_does_not_matter():
    agg = PipelineKVEventAggregator(3)
    assert agg.ingest(2, [stored(0, 1)]) == []
    assert agg.ingest(0, [stored(0)]) == []
    assert agg.ingest(1, [stored(0, 1)]) == [stored(0)]
    assert agg.ingest(0, [stored(1)]) == [stored(1)]
    agg.check_integrity()


def test_removed_when_any_stage_drops_it_and_republished_when_all_hold_it_again():
    agg = PipelineKVEventAggregator(2)
    agg.ingest_many([StageEvents(0, [stored(0, 1, 2)]), StageEvents(1, [stored(0, 1, 2)])])
    assert agg.ingest(1, [removed(2, 1)]) == [removed(2, 1)]
    assert agg.ingest(0, [removed(2)]) == []  # no longer published: nothing to withdraw
    assert agg.ingest(0, [stored(2)]) == []  # stage 1 still lacks it
    assert agg.ingest(1, [stored(1, 2)]) == [stored(1, 2)]
    assert agg.ingest(0, [removed(1)]) == [removed(1)]
    assert agg.ingest(0, [stored(1)]) == [stored(1)]
    assert agg.published == {0, 1, 2}
    agg.check_integrity()


def test_removed_before_every_stage_stored_it_is_never_published():
    agg = PipelineKVEventAggregator(2)
    assert agg.ingest(0, [stored(4), removed(4)]) == []
    assert agg.ingest(1, [stored(4)]) == []
    assert agg.published == frozenset()
    assert agg.resident(1) == {4}
    agg.check_integrity()


def test_clear_on_any_stage_withdraws_everything_but_remembers_the_others():
    agg = PipelineKVEventAggregator(2)
    agg.ingest_many([StageEvents(0, [stored(0, 1)]), StageEvents(1, [stored(0, 1)])])
    assert agg.ingest(0, [AllBlocksCleared()]) == [AllBlocksCleared()]
    assert agg.published == frozenset()
    # stage 1 kept its blocks: they are published again as soon as stage 0 has them
    assert agg.ingest(0, [stored(0, 1)]) == [stored(0, 1)]
    agg.check_integrity()


def test_children_follow_their_parents_within_one_ingest():
    agg = PipelineKVEventAggregator(2)
    agg.ingest(1, [stored(0, 1, 2)])
    # an out-of-order feed (not what a pool emits, but the aggregator must not care)
    out = agg.ingest(0, [stored(2), stored(1), stored(0)])
    assert out == [stored(0, 1, 2)]


def test_one_round_of_all_stages_coalesces_into_chain_runs():
    agg = PipelineKVEventAggregator(2)
    out = agg.ingest_many(
        [
            StageEvents(0, [stored(0, 1), stored(4)]),
            StageEvents(1, [stored(0), stored(1), stored(4)]),
        ]
    )
    assert out == [stored(0, 1), stored(4)]  # two chains: 4 starts a new prompt


def test_stored_then_removed_in_one_call_keeps_the_order_and_the_tokens():
    agg = PipelineKVEventAggregator(2)
    agg.ingest(0, [stored(0)])
    out = agg.ingest_many([StageEvents(1, [stored(0)]), StageEvents(0, [removed(0)])])
    assert out == [stored(0), removed(0)]
    assert agg.published == frozenset()
    agg.check_integrity()


def test_redundant_updates_are_ignored_and_counted():
    agg = PipelineKVEventAggregator(1)
    assert agg.ingest(0, [stored(0, 1)]) == [stored(0, 1)]
    assert agg.ingest(0, [stored(0, 1, 2)]) == [stored(2)]
    assert agg.ingest(0, [removed(7)]) == []
    assert agg.ignored == 3
    agg.check_integrity()


def test_snapshot_replays_the_published_set_as_chains():
    agg = PipelineKVEventAggregator(2)
    agg.ingest_many([StageEvents(s, [stored(0, 1, 2), stored(4, 5)]) for s in (0, 1)])
    agg.ingest(0, [removed(1)])
    snap = sorted(agg.snapshot(), key=lambda e: e.block_hashes[0])
    assert snap == [stored(0), stored(2), stored(4, 5)]


def test_broken_feeds_raise():
    agg = PipelineKVEventAggregator(2)
    with pytest.raises(InvariantError, match="stage 2"):
        agg.ingest(2, [stored(0)])
    with pytest.raises(InvariantError, match="carries 1 tokens"):
        agg.ingest(0, [BlockStored((BlockHash(0),), None, (1,), BS)])
    with pytest.raises(InvariantError, match=">= 1 stage"):
        PipelineKVEventAggregator(0)


# ---- brute-force model -------------------------------------------------------------

NUM_HASHES = 3 * CHAIN_LEN


@st.composite
def stage_event(draw: st.DrawFn) -> KVEvent:
    kind = draw(st.sampled_from(["store", "store", "store", "remove", "remove", "clear"]))
    if kind == "clear":
        return AllBlocksCleared()
    if kind == "remove":
        return removed(*draw(st.lists(st.integers(0, NUM_HASHES - 1), min_size=1, max_size=4)))
    start = draw(st.integers(0, NUM_HASHES - 1))
    length = draw(st.integers(1, CHAIN_LEN - start % CHAIN_LEN))
    return stored(*range(start, start + length))


def replay(consumer: set[BlockHash], out: list[KVEvent]) -> None:
    """Apply the pipeline feed like a router would, checking that it never contradicts."""
    for event in out:
        if isinstance(event, AllBlocksCleared):
            consumer.clear()
        elif isinstance(event, BlockRemoved):
            assert set(event.block_hashes) <= consumer, "removal of an unpublished block"
            consumer.difference_update(event.block_hashes)
        else:
            assert not set(event.block_hashes) & consumer, "block published twice"
            assert event.parent_hash == parent_of(event.block_hashes[0])
            assert event.token_ids == tuple(t for h in event.block_hashes for t in tokens_of(h))
            for prev, h in zip(event.block_hashes, event.block_hashes[1:], strict=False):
                assert parent_of(h) == prev, "a run must be a chain"
            consumer.update(event.block_hashes)


def assert_parents_first(out: list[KVEvent]) -> None:
    """Within consecutive BlockStored events, a parent stored there comes before its child."""
    segment: list[BlockHash] = []
    for event in [*out, None]:
        if isinstance(event, BlockStored):
            segment.extend(event.block_hashes)
            continue
        pos = {h: i for i, h in enumerate(segment)}
        for i, h in enumerate(segment):
            p = parent_of(h)
            assert p not in pos or pos[p] < i, f"block {h} before its parent {p}"
        segment = []


@settings(max_examples=300, deadline=None)
@given(
    num_stages=st.integers(1, 4),
    rounds=st.lists(
        st.lists(
            st.tuples(st.integers(0, 3), st.lists(stage_event(), max_size=4)),
            min_size=1,
            max_size=3,
        ),
        max_size=25,
    ),
)
def test_published_set_is_the_intersection_of_the_stages(num_stages, rounds):
    agg = PipelineKVEventAggregator(num_stages)
    model: list[set[BlockHash]] = [set() for _ in range(num_stages)]
    consumer: set[BlockHash] = set()
    for batch in rounds:
        batch = [(s % num_stages, events) for s, events in batch]
        for s, events in batch:
            for event in events:
                if isinstance(event, AllBlocksCleared):
                    model[s].clear()
                elif isinstance(event, BlockRemoved):
                    model[s].difference_update(event.block_hashes)
                else:
                    model[s].update(event.block_hashes)
        out = agg.ingest_many(StageEvents(s, events) for s, events in batch)
        replay(consumer, out)
        assert_parents_first(out)
        assert consumer == agg.published == set.intersection(*model)
        agg.check_integrity()


# ---- real block pools ----------------------------------------------------------------

EXTRA = ExtraKeys(model_id="m")


@settings(max_examples=60, deadline=None)
@given(
    capacities=st.lists(st.integers(3, 9), min_size=2, max_size=3),
    prompts=st.lists(st.lists(st.integers(0, 2), min_size=2, max_size=12), max_size=30),
    reset_at=st.integers(0, 40),
)
def test_real_pools_feed_the_intersection(capacities, prompts, reset_at):
    """Stages of different sizes run the same prompts; their pools' own events, aggregated,
    always describe exactly the blocks resident on every pool."""
    pools = [BlockPool(n, BS, enable_events=True) for n in capacities]
    agg = PipelineKVEventAggregator(len(pools))
    consumer: set[BlockHash] = set()
    for i, prompt in enumerate(prompts):
        hashes = hash_block_tokens(prompt, BS, EXTRA)
        full = len(prompt) // BS
        for pool in pools:
            n = min(-(-len(prompt) // BS), pool.num_blocks)
            blocks = pool.allocate(n)
            assert blocks is not None
            k = min(full, n)
            if k:
                tokens = [tuple(prompt[j * BS : (j + 1) * BS]) for j in range(k)]
                # cache the blocks after the resident prefix (as a stage that reused it would)
                first = pool.index.longest_prefix(hashes[:k])
                if first < k and all(h not in pool.index for h in hashes[first:k]):
                    pool.cache_blocks(
                        blocks[first:k],
                        hashes[first:k],
                        tokens[first:k],
                        EXTRA,
                        parent_hash=hashes[first - 1] if first else None,
                    )
            pool.free(blocks)
        if i == reset_at:
            assert pools[i % len(pools)].reset_prefix_cache()
        out = agg.ingest_many(StageEvents(s, p.drain_events()) for s, p in enumerate(pools))
        for event in out:
            if isinstance(event, AllBlocksCleared):
                consumer.clear()
            elif isinstance(event, BlockRemoved):
                consumer.difference_update(event.block_hashes)
            else:
                consumer.update(event.block_hashes)
        resident = [set(p.index.counts()) for p in pools]
        assert consumer == agg.published == set.intersection(*resident)
        agg.check_integrity()
        for pool in pools:
            pool.check_integrity()
