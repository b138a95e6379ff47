"""GlobalPrefixIndex: exact feeds, gaps and resubscribes, pending entries, a brute-force model."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from prefill_node.core.hashing import BlockHash
from prefill_node.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from prefill_node.errors import InvalidRequestError
from prefill_router.index import (
    ApplyResult,
    DuplicatePipelineError,
    GlobalPrefixIndex,
    IndexIntegrityError,
    InvalidIndexInputError,
    InvalidKVBatchError,
    UnknownPipelineError,
)

CLEARED = AllBlocksCleared()


def stored(*hashes: int) -> BlockStored:
    """A run of 1-token blocks whose token is its hash (the index reads only the hashes)."""
    return BlockStored(tuple(BlockHash(h) for h in hashes), None, tuple(hashes), 1)


def removed(*hashes: int) -> BlockRemoved:
    return BlockRemoved(tuple(BlockHash(h) for h in hashes))


def subscribed(index: GlobalPrefixIndex, pid: str, *hashes: int) -> None:
    """Add ``pid`` and feed it a first batch whose snapshot holds ``hashes``."""
    index.add_pipeline(pid)
    snapshot = [stored(*hashes)] if hashes else []
    assert index.apply(pid, 1, [CLEARED, *snapshot]) is ApplyResult.RESYNCED


def test_longest_prefix_stops_at_the_first_hole():
    index = GlobalPrefixIndex()
    subscribed(index, "a", 0, 1, 3)  # 2 is missing
    subscribed(index, "b", 1, 2, 3)  # 0 is missing
    subscribed(index, "c", 0, 1, 2, 3)
    subscribed(index, "d")
    assert index.match([0, 1, 2, 3], now=0.0) == {"a": 2, "b": 0, "c": 4, "d": 0}
    assert index.match([0, 1], now=0.0) == {"a": 2, "b": 0, "c": 2, "d": 0}
    assert index.match([], now=0.0) == {"a": 0, "b": 0, "c": 0, "d": 0}
    assert index.num_blocks() == 4 and index.num_blocks("a") == 3
    index.check_integrity()


def test_events_are_set_updates_in_order():
    index = GlobalPrefixIndex()
    subscribed(index, "a", 0, 1)
    batch = [stored(1, 2), removed(0, 9), stored(0), removed(2), stored(3)]
    assert index.apply("a", 2, batch) is ApplyResult.APPLIED
    assert index.match([0, 1, 2, 3], now=0.0) == {"a": 2}
    assert index.apply("a", 3, [CLEARED, stored(5)]) is ApplyResult.APPLIED
    assert index.num_blocks("a") == 1 and index.match([5], now=0.0) == {"a": 1}
    index.check_integrity()


def test_gap_drops_entries_until_a_resubscribe_replaces_them_from_the_snapshot():
    index = GlobalPrefixIndex()
    subscribed(index, "a", 0, 1, 2)
    subscribed(index, "b", 0)
    index.record_pending("a", [7], now=0.0)
    assert index.apply("a", 2, [stored(3)]) is ApplyResult.APPLIED
    result = index.apply("a", 4, [stored(4)])  # batch 3 was lost
    assert result is ApplyResult.GAP and result.needs_resubscribe
    assert not index.synced("a")
    assert index.num_blocks("a") == 0 and index.num_pending("a") == 0
    assert index.match([0, 1], now=0.0) == {"a": 0, "b": 1}
    # leftovers of the old subscription change nothing and ask for nothing
    late = index.apply("a", 5, [stored(0, 1)])
    assert late is ApplyResult.IGNORED and not late.needs_resubscribe
    assert index.num_blocks("a") == 0
    assert index.apply("a", 1, [CLEARED, stored(0, 1), stored(9)]) is ApplyResult.RESYNCED
    assert index.synced("a")
    assert index.match([0, 1, 2, 3], now=0.0) == {"a": 2, "b": 1}
    assert index.apply("a", 2, [stored(2)]) is ApplyResult.APPLIED
    assert index.match([0, 1, 2, 3], now=0.0) == {"a": 3, "b": 1}
    index.check_integrity()


def test_a_repeated_sequence_is_a_gap_and_a_new_subscription_replaces_in_one_batch():
    index = GlobalPrefixIndex()
    subscribed(index, "a", 0, 1)
    assert index.apply("a", 2, [stored(2)]) is ApplyResult.APPLIED
    assert index.apply("a", 1, [CLEARED, stored(5, 6)]) is ApplyResult.RESYNCED
    assert index.match([0], 0.0) == {"a": 0} and index.match([5, 6], 0.0) == {"a": 2}
    assert index.apply("a", 2, []) is ApplyResult.APPLIED
    assert index.apply("a", 2, []) is ApplyResult.GAP


def test_a_new_pipeline_ignores_batches_until_its_first_subscription_batch():
    index = GlobalPrefixIndex()
    index.add_pipeline("a")
    assert not index.synced("a")
    assert index.apply("a", 2, [stored(0)]) is ApplyResult.IGNORED
    assert index.match([0], now=0.0) == {"a": 0}


def test_drop_pipeline_returns_its_blocks_and_frees_its_slot():
    index = GlobalPrefixIndex()
    subscribed(index, "a", 0, 1, 2)
    subscribed(index, "b", 0, 1)
    index.record_pending("a", [0, 1, 2, 3], now=0.0)
    assert index.drop_pipeline("a") == 3
    assert index.pipelines == ("b",)
    assert index.match([0, 1, 2], now=0.0) == {"b": 2}
    assert index.num_blocks() == 2 and index.num_pending() == 0
    index.check_integrity()
    with pytest.raises(UnknownPipelineError):
        index.apply("a", 2, [stored(5)])
    subscribed(index, "c")  # reuses a's slot and inherits nothing
    assert index.match([0, 1, 2, 3], now=0.5) == {"b": 2, "c": 0}
    assert index.pipelines == ("b", "c")
    index.check_integrity()


def test_many_pipelines_have_no_slot_limit():
    index = GlobalPrefixIndex()
    for i in range(130):
        subscribed(index, f"p{i}", *range(i % 5))
    got = index.match([0, 1, 2, 3], now=0.0)
    assert got == {f"p{i}": i % 5 for i in range(130)}
    index.check_integrity()


def test_pending_entries_count_until_they_expire():
    index = GlobalPrefixIndex(pending_ttl_s=2.0)
    subscribed(index, "a", 0)
    subscribed(index, "b")
    index.record_pending("b", [0, 1, 2], now=10.0)
    assert index.match([0, 1, 2], now=11.5) == {"a": 1, "b": 3}
    assert index.num_pending("b") == 3
    assert index.match([0, 1, 2], now=12.0) == {"a": 1, "b": 0}  # live while now < expiry
    assert index.num_pending() == 0
    index.check_integrity()


def test_a_real_store_supersedes_the_pending_entry():
    index = GlobalPrefixIndex(pending_ttl_s=2.0)
    subscribed(index, "a")
    index.record_pending("a", [0, 1, 2], now=0.0)
    assert index.apply("a", 2, [stored(0, 1)]) is ApplyResult.APPLIED
    assert index.num_pending("a") == 1 and index.num_blocks("a") == 2
    index.check_integrity()
    assert index.match([0, 1, 2], now=5.0) == {"a": 2}  # 2 expired, 0 and 1 are confirmed
    index.check_integrity()


def test_pending_entries_skip_held_blocks_and_a_removal_withdraws_them():
    """The router bench's repro: a routed prompt whose blocks the pipeline held, then
    evicted, must not count as cached until the pending TTL runs out."""
    index = GlobalPrefixIndex(pending_ttl_s=2.0)
    subscribed(index, "p0", 1, 2)
    index.record_pending("p0", [1, 2, 3], now=0.0)
    assert index.num_pending("p0") == 1  # only block 3 waits for its BlockStored
    assert index.apply("p0", 2, [BlockRemoved((1, 2, 3))]) is ApplyResult.APPLIED
    assert index.match([1, 2, 3], now=0.5) == {"p0": 0}
    assert index.num_blocks("p0") == index.num_pending("p0") == 0
    index.check_integrity()


def test_refreshing_a_pending_entry_extends_it_and_a_mid_stream_clear_keeps_it():
    index = GlobalPrefixIndex(pending_ttl_s=2.0)
    subscribed(index, "a")
    index.record_pending("a", [0, 1], now=0.0)
    index.record_pending("a", [0, 1], now=1.5)
    assert index.apply("a", 2, [CLEARED]) is ApplyResult.APPLIED
    assert index.match([0, 1], now=3.0) == {"a": 2}  # the first recording expired at 2.0
    index.check_integrity()
    assert index.match([0, 1], now=3.5) == {"a": 0}


def test_time_never_goes_back():
    index = GlobalPrefixIndex(pending_ttl_s=2.0)
    subscribed(index, "a")
    index.record_pending("a", [0], now=5.0)
    assert index.match([0], now=1.0) == {"a": 1}
    index.record_pending("a", [1], now=1.0)  # counts as 5.0: expires at 7.0
    assert index.expire(6.9) == 6.9 and index.match([0, 1], now=6.0) == {"a": 2}
    assert index.match([0, 1], now=7.0) == {"a": 0}
    index.check_integrity()


def test_bad_input_raises_a_typed_error_and_changes_nothing():
    index = GlobalPrefixIndex()
    subscribed(index, "a", 0)
    with pytest.raises(InvalidKVBatchError, match="not a KV event"):
        index.apply("a", 2, [stored(1), "nope"])  # type: ignore[list-item]
    with pytest.raises(InvalidKVBatchError, match="sequence"):
        index.apply("a", 0, [stored(1)])
    assert index.match([0, 1], now=0.0) == {"a": 1}
    assert index.apply("a", 2, []) is ApplyResult.APPLIED  # the bad batches were not counted
    with pytest.raises(DuplicatePipelineError):
        index.add_pipeline("a")
    with pytest.raises(UnknownPipelineError):
        index.record_pending("x", [0], now=0.0)
    with pytest.raises(UnknownPipelineError):
        index.drop_pipeline("x")
    with pytest.raises(InvalidIndexInputError):
        index.match([0], now=float("nan"))
    for ttl in (0.0, -1.0, float("inf")):
        with pytest.raises(InvalidIndexInputError):
            GlobalPrefixIndex(pending_ttl_s=ttl)
    assert issubclass(InvalidKVBatchError, InvalidRequestError)
    index.check_integrity()


def test_check_integrity_catches_maps_that_disagree():
    index = GlobalPrefixIndex()
    subscribed(index, "a", 0, 1)
    index._holders[BlockHash(1)] |= 1 << 5  # a bit of a slot nobody owns
    with pytest.raises(IndexIntegrityError, match="confirmed map"):
        index.check_integrity()
    index = GlobalPrefixIndex()
    subscribed(index, "a")
    index.record_pending("a", [3], now=0.0)
    index._expiry.clear()  # the entry would never expire
    with pytest.raises(IndexIntegrityError, match="no expiry entry"):
        index.check_integrity()


# ---- brute-force model -------------------------------------------------------------

PIDS = ("p0", "p1", "p2")
NUM_HASHES = 8
TTL = 2.0
QUERIES = ([0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3], [4, 5, 6, 7], [3, 2, 1, 0], [7])
hash_lists = st.lists(st.integers(0, NUM_HASHES - 1), max_size=5)
event = st.one_of(
    hash_lists.filter(bool).map(lambda hs: stored(*hs)),
    hash_lists.map(lambda hs: removed(*hs)),
    st.just(CLEARED),
)
batches = st.lists(event, max_size=4)


class IndexMachine(RuleBasedStateMachine):
    """The index against per-pipeline sets: ``truth`` is what a pipeline really holds,
    ``known`` what the index must hold for it (empty while it awaits a resubscribe)."""

    def __init__(self) -> None:
        super().__init__()
        self.index = GlobalPrefixIndex(pending_ttl_s=TTL)
        self.now = 0.0
        self.truth: dict[str, set[int]] = {}
        self.known: dict[str, set[int]] = {}
        self.pending: dict[str, dict[int, float]] = {}
        self.synced: dict[str, bool] = {}
        self.sequence: dict[str, int] = {}  # last sequence its current subscription sent

    @staticmethod
    def replay(blocks: set[int], events: list[KVEvent]) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                blocks.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                blocks.difference_update(e.block_hashes)
            else:
                blocks.clear()

    @rule(pid=st.sampled_from(PIDS))
    def add(self, pid: str) -> None:
        if pid in self.known:
            with pytest.raises(DuplicatePipelineError):
                self.index.add_pipeline(pid)
            return
        self.index.add_pipeline(pid)
        self.truth[pid], self.known[pid], self.pending[pid] = set(), set(), {}
        self.synced[pid], self.sequence[pid] = False, 0

    @rule(pid=st.sampled_from(PIDS))
    def drop(self, pid: str) -> None:
        if pid not in self.known:
            with pytest.raises(UnknownPipelineError):
                self.index.drop_pipeline(pid)
            return
        assert self.index.drop_pipeline(pid) == len(self.known[pid])
        for table in (self.truth, self.known, self.pending, self.synced, self.sequence):
            del table[pid]

    @rule(pid=st.sampled_from(PIDS), events=batches)
    def next_batch(self, pid: str, events: list[KVEvent]) -> None:
        if pid not in self.known:
            return
        self.replay(self.truth[pid], events)
        self.sequence[pid] = max(self.sequence[pid] + 1, 2)
        result = self.index.apply(pid, self.sequence[pid], events)
        if not self.synced[pid]:
            assert result is ApplyResult.IGNORED
            return
        assert result is ApplyResult.APPLIED
        self.replay(self.known[pid], events)
        for e in events:  # a store confirms a pending entry, a removal withdraws it
            if isinstance(e, BlockStored | BlockRemoved):
                for h in e.block_hashes:
                    self.pending[pid].pop(h, None)

    @rule(pid=st.sampled_from(PIDS), events=batches, skip=st.sampled_from([0, 2, 5]))
    def gap(self, pid: str, events: list[KVEvent], skip: int) -> None:
        if pid not in self.known or not self.synced[pid]:
            return
        self.replay(self.truth[pid], events)
        bad = self.sequence[pid] + skip if skip or self.sequence[pid] > 1 else 3
        self.sequence[pid] = bad
        assert self.index.apply(pid, bad, events) is ApplyResult.GAP
        self.known[pid], self.pending[pid], self.synced[pid] = set(), {}, False

    @rule(pid=st.sampled_from(PIDS), split=st.integers(1, 3))
    def resubscribe(self, pid: str, split: int) -> None:
        if pid not in self.known:
            return
        blocks = sorted(self.truth[pid])
        snapshot = [stored(*blocks[i : i + split]) for i in range(0, len(blocks), split)]
        assert self.index.apply(pid, 1, [CLEARED, *snapshot]) is ApplyResult.RESYNCED
        self.known[pid], self.pending[pid] = set(blocks), {}
        self.synced[pid], self.sequence[pid] = True, 1

    @rule(pid=st.sampled_from(PIDS), hashes=hash_lists)
    def record_pending(self, pid: str, hashes: list[int]) -> None:
        if pid not in self.known:
            return
        self.index.record_pending(pid, [BlockHash(h) for h in hashes], self.now)
        for h in hashes:
            if h not in self.known[pid]:  # held already: nothing to wait for
                self.pending[pid][h] = self.now + TTL

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0, 3.0]))
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule(query=hash_lists)
    def match(self, query: list[int]) -> None:
        assert self.index.match(query, self.now) == self.expected(query)

    def expected(self, query: list[int]) -> dict[str, int]:
        out = {}
        for pid, known in self.known.items():
            live = {h for h, expiry in self.pending[pid].items() if self.now < expiry}
            n = 0
            while n < len(query) and query[n] in known | live:
                n += 1
            out[pid] = n
        return out

    @invariant()
    def agrees_with_the_model(self) -> None:
        for query in QUERIES:
            assert self.index.match(query, self.now) == self.expected(query)
        self.index.check_integrity()
        assert self.index.pipelines == tuple(self.known)
        for pid, known in self.known.items():
            assert self.index.num_blocks(pid) == len(known)
            assert self.index.synced(pid) == self.synced[pid]
            live = sum(self.now < e for e in self.pending[pid].values())
            assert self.index.num_pending(pid) == live
        assert self.index.num_blocks() == len(set().union(*self.known.values()))


IndexMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
test_index_against_the_model = IndexMachine.TestCase
