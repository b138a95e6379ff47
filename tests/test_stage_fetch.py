"""One stage's side of a prefix fetch, sans IO: the target's reservation for a copy
(``begin_fetch`` / ``end_fetch``) and the source's pins on its cached run (``pin_cached``).
Every step keeps ``check_integrity`` true; nothing is held once a fetch ended."""

from prefill_node.core.block_pool import PoolStats
from prefill_node.core.execution_results import BlockTable, Completion
from prefill_node.core.hashing import ExtraKeys
from prefill_node.core.kv_events import BlockStored
from prefill_node.core.request import RequestSpec
from prefill_node.core.stage_admission import FetchSkip, StageAdmission, StageConfig

B = 4
EXTRA = ExtraKeys("tiny")
PREFIX = tuple(range(100, 124))  # 6 full blocks


def stage(num_blocks: int = 16, **kw) -> StageAdmission:
    return StageAdmission(StageConfig(0, num_blocks, B, enable_kv_events=True, **kw))


def spec(rid: str, tokens) -> RequestSpec:
    return RequestSpec(rid, tuple(tokens), EXTRA)


def compute(st: StageAdmission, rid: str, tokens) -> None:
    """Cache ``tokens`` (whole blocks) on this stage: reserve, commit, one chunk, complete
    (the reservation a request takes; ``begin_fetch`` makes it for whole blocks)."""
    table = st.begin_fetch(spec(rid, tokens))
    assert isinstance(table, BlockTable)
    assert isinstance(st.complete(rid), Completion)


def idle(st: StageAdmission) -> PoolStats:
    st.check_integrity()
    stats = st.pool.stats()
    assert stats.in_use == 0 and stats.claimed == 0 and st.num_reservations == 0
    assert st.transfer_pins == 0
    return stats


def test_a_cold_stage_makes_room_for_the_whole_prefix_and_caches_it_as_computed():
    st = stage()
    table = st.begin_fetch(spec("f", PREFIX))
    assert (table.start, table.end, table.num_cached_tokens) == (0, 24, 0)
    assert len(set(table.block_ids)) == 6
    st.check_integrity()
    st.drain_events()
    assert st.end_fetch("f", landed=True) == 6
    stored = [e for e in st.drain_events() if isinstance(e, BlockStored)]
    assert sum(len(e.block_hashes) for e in stored) == 6  # published like computed blocks
    assert idle(st).cached == 6


def test_a_stage_copies_only_the_blocks_after_what_it_holds():
    st = stage()
    compute(st, "r", PREFIX[:8])  # 2 full blocks cached
    table = st.begin_fetch(spec("f", PREFIX))
    assert (table.start, table.end, table.num_cached_tokens) == (8, 24, 8)
    assert st.end_fetch("f", landed=True) == 4
    assert idle(st).cached == 6
    assert st.begin_fetch(spec("again", PREFIX)) is FetchSkip.HELD
    idle(st)


def test_a_copy_that_did_not_land_gives_its_blocks_back_unhashed():
    st = stage()
    st.begin_fetch(spec("f", PREFIX))
    assert st.end_fetch("f", landed=False) == 0
    stats = idle(st)
    assert stats.cached == 0 and stats.free == 16
    assert isinstance(st.begin_fetch(spec("g", PREFIX)), BlockTable)  # none of it cached


def test_a_fetch_is_not_held_to_the_headroom_cap_but_needs_room():
    st = stage(num_blocks=10, headroom_blocks=6)
    other = st.begin_fetch(spec("running", range(500, 512)))  # 3 blocks tied up
    assert isinstance(other, BlockTable)
    # a request would be capped here (3 + 6 > 10 - 6); a copy's blocks come back by itself
    table = st.begin_fetch(spec("f", PREFIX))
    assert isinstance(table, BlockTable) and table.end == 24
    st.end_fetch("f", landed=True)
    assert st.begin_fetch(spec("too-big", range(600, 640))) is FetchSkip.NO_ROOM  # 10 blocks
    st.end_fetch("running", landed=True)
    idle(st)


def test_a_stage_that_resumes_at_snapshots_never_fetches_nor_lends():
    st = stage(snapshot_interval_blocks=2)
    assert st.begin_fetch(spec("f", PREFIX)) is FetchSkip.UNSUPPORTED
    assert st.pin_cached(spec("l", PREFIX)) is None
    idle(st)


def test_the_source_pins_its_cached_run_until_the_lease_gives_it_back():
    st = stage()
    compute(st, "r", PREFIX[:16])  # 4 full blocks cached
    held = st.pin_cached(spec("lend", PREFIX))
    assert held.num_tokens == 16 and len(held.blocks) == 4
    assert (held.start, held.end) == (0, 16)
    st.check_integrity()
    assert st.transfer_pins == 4 and st.pool.stats().in_use == 4
    again = st.pin_cached(spec("lend-2", PREFIX))  # two readers: two pins each
    assert st.transfer_pins == 8
    st.unpin_transfer(held.blocks)
    st.unpin_transfer(again.blocks)
    assert idle(st).cached == 4
    assert st.pin_cached(spec("cold", range(900, 912))) is None


def test_the_lent_run_ends_where_the_cache_does():
    st = stage(num_blocks=8)
    compute(st, "r", PREFIX[:16])  # 4 full blocks cached, 4 free
    # a 7-block copy takes the 4 free blocks and evicts the 3 least recently used cached
    # ones (the prefix's tail: a chain is freed tail first)
    assert isinstance(st.begin_fetch(spec("big", range(700, 728))), BlockTable)
    held = st.pin_cached(spec("lend", PREFIX))
    assert held.num_tokens == 4 and len(held.blocks) == 1
    st.check_integrity()
    st.unpin_transfer(held.blocks)
    st.end_fetch("big", landed=False)
    idle(st)
