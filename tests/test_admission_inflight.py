"""Admission with ``share_inflight_prefix``: a request whose next blocks an admitted request
(or an earlier one of the same round) is computing waits for them to be cached and then
reuses them, instead of computing them twice; a short shared head is not worth the wait;
completion, failure and abort all release the wait."""

from __future__ import annotations

from prefill_node.core.admission_messages import Admitted, ReserveStatus, Wait
from prefill_node.core.coordinator import AdmissionCoordinator, CoordinatorConfig
from prefill_node.core.execution_results import BlockTable
from prefill_node.core.leader import LeaderCore
from prefill_node.core.planner import PlannerMode, WavePlanner
from prefill_node.core.policy import wave_policy
from prefill_node.core.round_driver import run_round
from prefill_node.core.stage_admission import StageAdmission, StageConfig
from prefill_node.core.wave_scheduler import WaveScheduler
from prefill_node.sim.core_port import CorePort
from tests.test_admission import B, check_all, run_to_completion, spec

SYSTEM = list(range(100, 132))  # 8 full blocks


def make(capacities=(64, 64), share=True):
    stages = [StageAdmission(StageConfig(s, n, B)) for s, n in enumerate(capacities)]
    config = CoordinatorConfig(B, tuple(capacities), share_inflight_prefix=share)
    return AdmissionCoordinator(config), stages


def waits_for_prefix(out, rid) -> bool:
    return out == Wait(rid, ReserveStatus.PREFIX_IN_FLIGHT, -1)


def test_a_burst_sharing_a_new_prefix_computes_it_once():
    coord, stages = make()
    burst = [spec(r, SYSTEM + [i, i]) for i, r in enumerate("abc")]
    a, b, c = run_round(coord, stages, burst)
    assert isinstance(a, Admitted) and a.cached_len == 0
    assert waits_for_prefix(b, "b") and waits_for_prefix(c, "c")
    assert coord.queued_ids() == ["b", "c"]
    assert coord.take_cuts() == {"a": {len(SYSTEM)}} and coord.take_cuts() == {}
    assert run_round(coord, stages) == (b, c)  # still computing: still waiting
    run_to_completion(stages, "a", 34)
    assert coord.finished("a") is True
    b2, c2 = run_round(coord, stages)
    assert isinstance(b2, Admitted) and b2.cached_len == len(SYSTEM)
    assert isinstance(c2, Admitted) and c2.cached_len == len(SYSTEM)
    check_all(stages)


def test_without_the_option_every_request_computes_the_prefix():
    coord, stages = make(share=False)
    outs = run_round(coord, stages, [spec(r, SYSTEM + [i]) for i, r in enumerate("ab")])
    assert [type(o) for o in outs] == [Admitted, Admitted]
    assert [o.cached_len for o in outs] == [0, 0]


def test_a_short_shared_head_is_not_worth_waiting_for():
    coord, stages = make()
    head = SYSTEM[:8]  # 2 blocks shared, then 10 blocks of its own
    a, b = run_round(coord, stages, [spec("a", SYSTEM), spec("b", head + list(range(40)))])
    assert isinstance(a, Admitted) and isinstance(b, Admitted) and b.cached_len == 0


def test_a_request_that_waits_does_not_block_later_unrelated_ones():
    coord, stages = make()
    a, b, c = run_round(
        coord, stages, [spec("a", SYSTEM + [1]), spec("b", SYSTEM + [2]), spec("c", [7] * 9)]
    )
    assert isinstance(a, Admitted) and waits_for_prefix(b, "b") and isinstance(c, Admitted)


def test_the_wait_starts_after_what_is_already_cached():
    coord, stages = make()
    run_round(coord, stages, [spec("old", SYSTEM[:16])])
    run_to_completion(stages, "old", 16)
    coord.finished("old")
    # a computes blocks 4..7 of SYSTEM; b needs those too after its 4 cached blocks
    a, b = run_round(coord, stages, [spec("a", SYSTEM + [1]), spec("b", SYSTEM + [2])])
    assert isinstance(a, Admitted) and a.cached_len == 16 and waits_for_prefix(b, "b")


def test_failure_and_abort_release_the_waiters():
    coord, stages = make()
    a, b = run_round(coord, stages, [spec("a", SYSTEM + [1]), spec("b", SYSTEM + [2])])
    assert waits_for_prefix(b, "b")
    coord.abort("a")  # the producer is dropped: b computes the prefix itself
    (b2,) = run_round(coord, stages)
    assert isinstance(b2, Admitted) and b2.cached_len == 0
    (c,) = run_round(coord, stages, [spec("c", SYSTEM + [3])])
    assert waits_for_prefix(c, "c")
    assert coord.finished("b") is True  # b failed: nothing of it will be cached
    (c2,) = run_round(coord, stages)
    assert isinstance(c2, Admitted) and c2.cached_len == 0
    assert coord.finished("nobody") is False


def test_an_aborted_waiter_leaves_the_queue():
    coord, stages = make()
    run_round(coord, stages, [spec("a", SYSTEM + [1]), spec("b", SYSTEM + [2])])
    assert coord.abort("b") is True
    assert coord.queued_ids() == []
    run_to_completion(stages, "a", 33)
    coord.finished("a")
    assert run_round(coord, stages) == ()
    check_all(stages)


def run_chunk(stages, rid, start, length):
    """What every stage's loop does with a non-last chunk: run it, then cache its full blocks."""
    for st in stages:
        assert isinstance(st.materialise(rid, start, length), BlockTable)
        st.cache_computed(rid, start + length)


def test_a_waiter_is_admitted_once_the_chunks_it_needs_passed_every_stage():
    coord, stages = make()
    own = list(range(50, 70))  # a: the 8 shared blocks, then 5 blocks of its own
    a, b = run_round(coord, stages, [spec("a", SYSTEM + own), spec("b", SYSTEM + [1, 2])])
    assert isinstance(a, Admitted) and waits_for_prefix(b, "b")
    run_chunk(stages, "a", 0, 16)
    assert coord.computed("a", 16) is True  # blocks 0..3 are cached on every stage
    # b would compute the other 4 shared blocks itself; as they are half of its rest, it waits
    assert waits_for_prefix(run_round(coord, stages)[0], "b")
    assert isinstance(stages[0].materialise("a", 16, 16), BlockTable)
    stages[0].cache_computed("a", 32)  # stage 0 holds the whole prefix, stage 1 not yet
    assert waits_for_prefix(run_round(coord, stages)[0], "b")
    assert isinstance(stages[1].materialise("a", 16, 16), BlockTable)
    stages[1].cache_computed("a", 32)
    assert coord.computed("a", 32) is True and coord.computed("a", 32) is False
    (b2,) = run_round(coord, stages)
    assert isinstance(b2, Admitted) and b2.cached_len == len(SYSTEM)  # a is still running
    for st in stages:
        assert st.reservation("a").completed is False
        assert all(blk.ref_cnt == 2 for blk in st.reservation("b").lease.blocks)  # shared
    check_all(stages)
    run_to_completion(stages, "b", 34, start=32)
    run_to_completion(stages, "a", 52, start=32)
    assert coord.finished("a") is True  # a's own blocks were still claimed
    check_all(stages)
    (c,) = run_round(coord, stages, [spec("c", SYSTEM + own + [9])])
    assert isinstance(c, Admitted) and c.cached_len == 52  # each block cached once, findable
    check_all(stages)


def test_a_claim_dropped_while_a_round_runs_still_defers_its_waiters_in_that_round():
    """The leader learns a chunk passed every stage between a round's LOOKUP replies and
    their processing: the replies predate the blocks' caching, so admitting the waiter now
    would compute them again. It waits; the next round finds them cached."""
    coord, stages = make()
    own = list(range(50, 70))
    a, b = run_round(coord, stages, [spec("a", SYSTEM + own), spec("b", SYSTEM + [1, 2])])
    assert isinstance(a, Admitted) and waits_for_prefix(b, "b")
    lookup = coord.begin_round()
    stale = [st.handle(lookup) for st in stages]  # before a's chunk was cached: 0 blocks
    run_chunk(stages, "a", 0, 32)
    assert coord.computed("a", 32) is True
    step = coord.finish_phase(stale)
    while not hasattr(step, "outcomes"):
        step = coord.finish_phase([st.handle(step) for st in stages])
    assert [waits_for_prefix(o, "b") for o in step.outcomes] == [True]
    (b2,) = run_round(coord, stages)
    assert isinstance(b2, Admitted) and b2.cached_len == len(SYSTEM)
    check_all(stages)


def test_cache_computed_caches_only_full_blocks_below_the_computed_end_and_only_once():
    coord, (st,) = make(capacities=(64,))
    (a,) = run_round(coord, [st], [spec("a", SYSTEM + [1, 2, 3])])  # 8 full blocks + 3
    assert isinstance(a, Admitted)
    assert isinstance(st.materialise("a", 0, 6), BlockTable)
    assert st.cache_computed("a", 6) == 1  # [4, 6) is not full yet
    assert st.cache_computed("a", 6) == 0
    assert st.pool.index.longest_prefix(st.prompt_blocks("a").hashes) == 1
    assert isinstance(st.materialise("a", 6, 26), BlockTable)
    assert st.cache_computed("a", 32) == 7
    assert isinstance(st.materialise("a", 32, 3), BlockTable)
    done = st.complete("a")
    assert done.cached_blocks == 8 and st.pool.stats().cached == 8  # nothing cached twice
    assert st.cache_computed("a", 35) == 0 and st.cache_computed("nobody", 4) == 0
    st.check_integrity()


def test_an_aborted_producer_leaves_what_it_published_for_the_waiters():
    coord, stages = make()
    a, b = run_round(coord, stages, [spec("a", SYSTEM + [1]), spec("b", SYSTEM + [2])])
    assert waits_for_prefix(b, "b")
    run_chunk(stages, "a", 0, 20)
    coord.abort("a")  # a fails or is aborted after its first chunk passed every stage
    (b2,) = run_round(coord, stages)
    assert isinstance(b2, Admitted) and b2.cached_len == 20  # the published blocks: exact KV
    check_all(stages)
    run_to_completion(stages, "b", 33, start=20)
    coord.finished("b")
    check_all(stages)
    assert all(st.pool.stats().in_use == 0 for st in stages)


def test_the_simulators_leader_releases_a_waiter_chunk_by_chunk_in_real_tokens():
    """The simulator's ``LeaderCore`` over its port (one id per 2 tokens): the producer's
    chunk is cut where the waiter's prefix ends, the waiter waits while that chunk has not
    passed every stage, the returned wave releases it, and lengths come back in real
    tokens."""
    port = CorePort(B, 2, (64, 64), (2, 2), model_id="tiny", stage_headroom_blocks=(0, 0),
                    max_round_requests=8, share_inflight_prefix=True)  # fmt: skip
    policy = wave_policy(2, PlannerMode.MPU)
    cfg = policy.planner_config(
        max_wave_tokens=48, min_wave_tokens=16, block_size=B, max_wave_requests=8
    )
    leader = LeaderCore(port.coordinator, WaveScheduler(policy, WavePlanner(cfg)), token_scale=2)
    ids = SYSTEM[:16]  # 16 ids of 2 tokens: 8 blocks of 4 tokens (2 ids each)
    assert leader.enqueue(port.spec("a", ids + list(range(20)))) is None  # 72 tokens
    assert leader.enqueue(port.spec("b", ids + [1])) is None  # 34 tokens
    a, b = run_round(leader, port.stages)
    assert isinstance(a, Admitted) and a.num_tokens == 72 and waits_for_prefix(b, "b")
    ends = []
    while True:
        wave = leader.next_wave()
        assert wave is not None and [c.request_id for c in wave.chunks] == ["a"]
        (chunk,) = wave.chunks
        assert chunk.end <= 32 or chunk.start >= 32  # never across b's prefix end
        ends.append(chunk.end)
        port.materialise(0, chunk)
        port.cache_computed(0, chunk)
        assert waits_for_prefix(run_round(leader, port.stages)[0], "b")  # stage 1: not yet
        port.materialise(1, chunk)
        port.cache_computed(1, chunk)
        done = leader.wave_done(wave.wave_id)
        if chunk.end == 32:
            break
        assert not done.released
    assert done.released and done.finished == ()
    (b2,) = run_round(leader, port.stages)
    assert isinstance(b2, Admitted) and b2.cached_len == 32  # in real tokens
    assert all(st.reservation("a") is not None for st in port.stages)  # a still runs
    port.check_integrity()
