"""Admission with ``share_inflight_prefix``: a request whose next blocks an admitted request
is computing is admitted at once with those blocks PROMISED, and runs in a wave behind the
producer's chunk that ends them; each stage leases them when the producer caches them and
refuses a first chunk that would read blocks never computed there. The fallbacks: a first
chunk at the lease (the producer was dropped before its chunk was scheduled, or failed),
a wait where a promise cannot be made (a producer still being committed, recurrent-state
stages), a short shared head not worth the dependency."""

from __future__ import annotations

from prefill_node.core.admission_messages import Admitted, Promise, ReserveStatus, Wait
from prefill_node.core.coordinator import AdmissionCoordinator, CoordinatorConfig
from prefill_node.core.execution_results import (
    BlockTable,
    Completion,
    MismatchReason,
    StageStateMismatch,
)
from prefill_node.core.leader import LeaderCore
from prefill_node.core.planner import PlannerMode, WavePlanner
from prefill_node.core.policy import wave_policy
from prefill_node.core.round_driver import run_round
from prefill_node.core.stage_admission import StageAdmission, StageConfig
from prefill_node.core.wave import ScheduledChunk
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


def promised(out, rid, cached_len, producer, leased_len=0) -> bool:
    return (
        isinstance(out, Admitted)
        and out.request_id == rid
        and out.cached_len == cached_len
        and out.promise == Promise(producer, leased_len)
    )


def test_a_burst_sharing_a_new_prefix_computes_it_once():
    """The waiters are admitted at once with the prefix promised: each stage holds their
    lease (nothing) and an escrow for their whole prompt until the producer's chunk caches
    the blocks there, then leases them before the producer could let them go."""
    coord, stages = make()
    burst = [spec(r, SYSTEM + [i, i]) for i, r in enumerate("abc")]
    a, b, c = run_round(coord, stages, burst)
    assert isinstance(a, Admitted) and a.cached_len == 0 and a.promise is None
    assert promised(b, "b", len(SYSTEM), "a") and promised(c, "c", len(SYSTEM), "a")
    assert coord.queued_ids() == []
    assert coord.take_cuts() == {"a": {len(SYSTEM)}} and coord.take_cuts() == {}
    for st in stages:
        rsv = st.reservation("b")
        assert (rsv.boundary_blocks, rsv.promised, rsv.escrow.target) == (0, 8, 9)
    check_all(stages)
    run_chunk(stages[:1], "a", 0, 32)  # the producer's chunk ran on stage 0 only
    for st, held in zip(stages, (True, False), strict=True):
        for rid in "bc":
            rsv = st.reservation(rid)
            assert (rsv.boundary_blocks == 8) is held and rsv.escrow.target == 9
    assert all(blk.ref_cnt == 3 for blk in stages[0].reservation("a").new_blocks[:8])
    check_all(stages)
    table = stages[0].materialise("b", 32, 2)  # b's first chunk, behind a's on stage 0
    assert isinstance(table, BlockTable) and table.start == 32
    assert table.block_ids[:8] == stages[0].reservation("a").block_ids()[:8]
    assert stages[0].reservation("b").escrow.target == 0  # its 8 surplus victims went back
    run_chunk(stages[1:], "a", 0, 32)
    assert isinstance(stages[1].materialise("b", 32, 2), BlockTable)
    check_all(stages)
    run_to_completion(stages, "a", 34, start=32)
    run_to_completion(stages, "c", 34, start=32)
    for st in stages:
        assert isinstance(st.complete("b"), Completion)
    for rid in "abc":
        coord.finished(rid)
    check_all(stages)
    for st in stages:  # each shared block computed and cached once
        assert st.pool.stats().in_use == 0 and st.pool.stats().cached == 8
    assert run_round(coord, stages) == ()


def test_a_promise_never_reads_blocks_the_producer_did_not_compute_here():
    """A waiter's first chunk reaching a stage before the producer's chunk there (or after
    the producer failed there) is refused, whatever else that stage caches meanwhile."""
    coord, stages = make()
    a, b = run_round(coord, stages, [spec("a", SYSTEM + [1]), spec("b", SYSTEM + [2])])
    assert promised(b, "b", 32, "a")
    run_chunk(stages, "a", 0, 16)  # half the promised blocks
    for st in stages:
        assert st.reservation("b").promise_pending
        out = st.materialise("b", 32, 1)
        assert isinstance(out, StageStateMismatch)
        assert out.reason is MismatchReason.PROMISE_BROKEN and "[0, 8)" in out.detail
        assert st.reservation("b").boundary_blocks == 0  # nothing pinned from the half
        st.abort("b")  # what a stage's loop does with a mismatch
    check_all(stages)
    coord.abort("b")
    run_to_completion(stages, "a", 33, start=16)
    coord.finished("a")
    check_all(stages)
    assert all(st.pool.stats().in_use == 0 for st in stages)


def test_a_first_chunk_at_the_lease_drops_the_promise_and_computes_the_prefix():
    """The leader's fallback (the producer was dropped before its chunk was scheduled): the
    waiter starts at its lease, gives back any promised block it had leased, and its escrow,
    kept whole, holds room for every block it now computes."""
    coord, stages = make()
    a, b = run_round(coord, stages, [spec("a", SYSTEM + [1]), spec("b", SYSTEM + [2])])
    run_chunk(stages[:1], "a", 0, 32)  # stage 0 fulfilled the promise, stage 1 did not
    assert stages[0].reservation("b").boundary_blocks == 8
    for st in stages:
        st.abort("a")
    coord.abort("a")
    check_all(stages)
    for st in stages:
        table = st.materialise("b", 0, 33)
        assert isinstance(table, BlockTable) and table.start == 0
        assert len(table.block_ids) == 9
        assert isinstance(st.complete("b"), Completion)
    coord.finished("b")
    check_all(stages)
    assert all(st.pool.stats().in_use == 0 for st in stages)


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


def test_a_promised_request_does_not_block_later_unrelated_ones():
    coord, stages = make()
    a, b, c = run_round(
        coord, stages, [spec("a", SYSTEM + [1]), spec("b", SYSTEM + [2]), spec("c", [7] * 9)]
    )
    assert isinstance(a, Admitted) and promised(b, "b", 32, "a") and isinstance(c, Admitted)


def test_the_promise_starts_after_what_is_already_cached():
    coord, stages = make()
    run_round(coord, stages, [spec("old", SYSTEM[:16])])
    run_to_completion(stages, "old", 16)
    coord.finished("old")
    # a computes blocks 4..7 of SYSTEM; b is promised those after its 4 leased blocks
    a, b = run_round(coord, stages, [spec("a", SYSTEM + [1]), spec("b", SYSTEM + [2])])
    assert isinstance(a, Admitted) and a.cached_len == 16
    assert promised(b, "b", 32, "a", leased_len=16)


def test_a_promise_stops_before_the_block_of_the_last_token():
    """A waiter whose prompt ends on a block boundary inside the producer's prefix computes
    its last block itself: a promise never leaves it nothing to compute."""
    coord, stages = make()
    a, b = run_round(coord, stages, [spec("a", SYSTEM + [1]), spec("b", SYSTEM)])
    assert promised(b, "b", 28, "a")  # 7 of SYSTEM's 8 blocks


def test_a_producer_still_being_committed_makes_its_waiters_wait():
    """A chain: b is promised a's prefix and computes more; c shares b's longer prefix. b
    goes through a COMMIT phase in the same round, so c cannot be promised b's blocks yet:
    it waits, and the next round promises them."""
    coord, stages = make()
    own = list(range(50, 66))  # b: SYSTEM, then 4 blocks of its own
    outs = run_round(
        coord,
        stages,
        [spec("a", SYSTEM + [1]), spec("b", SYSTEM + own), spec("c", SYSTEM + own + [3])],
    )
    assert promised(outs[1], "b", 32, "a") and waits_for_prefix(outs[2], "c")
    (c,) = run_round(coord, stages)
    assert promised(c, "c", 48, "b")


def test_recurrent_state_stages_wait_instead_of_being_promised():
    """Where a stage resumes only at recurrent-state snapshots, a waiter waits for the blocks
    to be cached on every stage (the rounds after the producer's chunks admit it)."""
    stages = [
        StageAdmission(StageConfig(0, 64, B)),
        StageAdmission(StageConfig(1, 64, B, snapshot_interval_blocks=2)),
    ]
    coord = AdmissionCoordinator(CoordinatorConfig(B, (64, 64), share_inflight_prefix=True))
    a, b = run_round(coord, stages, [spec("a", SYSTEM + [1]), spec("b", SYSTEM + [2])])
    assert isinstance(a, Admitted) and waits_for_prefix(b, "b")
    run_chunk(stages, "a", 0, 32)
    assert coord.computed("a", 32) is True
    (b2,) = run_round(coord, stages)
    assert isinstance(b2, Admitted) and b2.cached_len == 32 and b2.promise is None
    check_all(stages)


def test_a_promise_a_stage_can_no_longer_keep_admits_the_request_at_its_lease():
    """The producer finished while the round ran and one stage evicted its blocks before the
    COMMIT: that stage says the promise lapsed, the request is admitted at its lease, and
    the stage that did lease the blocks gives them back at the first chunk."""
    coord, stages = make()
    run_round(coord, stages, [spec("a", SYSTEM + [1])])
    coord.enqueue(spec("b", SYSTEM + [2]))
    reserve = coord.begin_round()
    stale = [st.handle(reserve) for st in stages]  # before a computed anything
    run_to_completion(stages, "a", 33)
    assert coord.finished("a") is True
    pool = stages[1].pool
    pool.free(pool.allocate(pool.num_free_queued))  # stage 1 evicts every cached block
    commit = coord.finish_phase(stale)
    (b,) = coord.finish_phase([st.handle(commit) for st in stages]).outcomes
    assert isinstance(b, Admitted) and b.cached_len == 0 and b.promise is None
    assert [st.reservation("b").boundary_blocks for st in stages] == [8, 0]
    for st in stages:
        table = st.materialise("b", 0, 33)
        assert isinstance(table, BlockTable) and len(table.block_ids) == 9
        assert isinstance(st.complete("b"), Completion)
    check_all(stages)


def test_a_producer_aborted_while_the_round_runs_promises_nothing():
    """The producer is dropped between a round's RESERVE and COMMIT: the waiter is admitted
    at its lease, and the stages' promise lapses at its first chunk."""
    coord, stages = make()
    (a,) = run_round(coord, stages, [spec("a", SYSTEM + [1])])
    coord.enqueue(spec("b", SYSTEM + [2]))
    msg = coord.begin_round()
    step = coord.finish_phase([st.handle(msg) for st in stages])
    assert [c.promised_blocks for c in step.commits] == [8]
    coord.abort("a")
    (b,) = coord.finish_phase([st.handle(step) for st in stages]).outcomes
    assert isinstance(b, Admitted) and b.cached_len == 0 and b.promise is None
    for st in stages:
        assert st.reservation("b").promised == 8
        assert isinstance(st.materialise("b", 0, 33), BlockTable)
    check_all(stages)


def run_chunk(stages, rid, start, length):
    """What every stage's loop does with a non-last chunk: run it, then cache its full blocks."""
    for st in stages:
        assert isinstance(st.materialise(rid, start, length), BlockTable)
        st.cache_computed(rid, start + length)


def test_a_claim_dropped_while_a_round_runs_is_promised_and_kept_at_once():
    """The leader learns a chunk passed every stage between a round's RESERVE replies and
    their processing: the replies predate the blocks' caching, so the round still treats
    them as being computed, and the promise it makes is fulfilled by the COMMIT itself."""
    coord, stages = make()
    own = list(range(50, 70))
    (a,) = run_round(coord, stages, [spec("a", SYSTEM + own)])
    coord.enqueue(spec("b", SYSTEM + [1, 2]))
    reserve = coord.begin_round()
    stale = [st.handle(reserve) for st in stages]  # before a's chunk was cached: 0 blocks
    run_chunk(stages, "a", 0, 32)
    assert coord.computed("a", 32) is True
    step = coord.finish_phase(stale)
    (b,) = coord.finish_phase([st.handle(step) for st in stages]).outcomes
    assert promised(b, "b", len(SYSTEM), "a")
    assert all(st.reservation("b").boundary_blocks == 8 for st in stages)
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


def leader_over(port, max_wave_tokens=48):
    policy = wave_policy(2, PlannerMode.MPU)
    cfg = policy.planner_config(
        max_wave_tokens=max_wave_tokens, min_wave_tokens=16, block_size=B, max_wave_requests=8
    )
    return LeaderCore(port.coordinator, WaveScheduler(policy, WavePlanner(cfg)), token_scale=2)


def make_port():
    return CorePort(B, 2, (64, 64), (2, 2), model_id="tiny", stage_headroom_blocks=(0, 0),
                    max_round_requests=8, share_inflight_prefix=True)  # fmt: skip


def run_wave(port, leader, wave):
    for chunk in wave.chunks:
        for stage in (0, 1):
            port.materialise(stage, chunk)
            if leader.is_last(chunk):
                port.complete(stage, chunk.request_id)
            else:
                port.cache_computed(stage, chunk)
    return leader.wave_done(wave.wave_id)


def test_the_simulators_leader_runs_a_waiter_in_the_wave_behind_the_producers_chunk():
    """The simulator's ``LeaderCore`` over its port (one id per 2 tokens): the producer's
    chunk is cut where the waiter's prefix ends, and the waiter's first chunk goes into a
    later wave while the producer's is still in flight (before: only once it had passed
    every stage), with lengths in real tokens."""
    port = make_port()
    leader = leader_over(port)
    ids = SYSTEM[:16]  # 16 ids of 2 tokens: 8 blocks of 4 tokens (2 ids each)
    assert leader.enqueue(port.spec("a", ids + list(range(20)))) is None  # 72 tokens
    assert leader.enqueue(port.spec("b", ids + [1])) is None  # 34 tokens
    a, b = run_round(leader, port.stages)
    assert isinstance(a, Admitted) and a.num_tokens == 72
    assert promised(b, "b", 32, "a")  # in real tokens
    waves = []
    while not waves or "b" not in [c.request_id for c in waves[-1].chunks]:
        wave = leader.next_wave()
        assert wave is not None
        waves.append(wave)
    assert waves[0].chunks == (ScheduledChunk("a", 0, 32),)  # cut where b's prefix ends
    assert [(c.request_id, c.start) for c in waves[-1].chunks if c.request_id == "b"] == [("b", 32)]
    assert len(waves) > 1 and leader.waves_in_flight == len(waves)  # nothing returned yet
    for wave in waves:
        run_wave(port, leader, wave)
    while (wave := leader.next_wave()) is not None:
        run_wave(port, leader, wave)
    assert leader.idle
    port.check_integrity()
    assert all(st.pool.stats().in_use == 0 for st in port.stages)


def test_a_producer_aborted_before_its_cut_is_scheduled_sends_the_waiter_to_its_lease():
    port = make_port()
    leader = leader_over(port)
    ids = SYSTEM[:16]
    leader.enqueue(port.spec("a", ids + list(range(20))))
    leader.enqueue(port.spec("b", ids + [1]))
    run_round(leader, port.stages)
    assert leader.abort("a") is True  # nothing of a was scheduled
    wave = leader.next_wave()
    assert [(c.request_id, c.start) for c in wave.chunks] == [("b", 0)]
    run_wave(port, leader, wave)
    while (wave := leader.next_wave()) is not None:
        run_wave(port, leader, wave)
    run_round(leader, port.stages)  # a's stage-side cleanup
    assert leader.idle
    port.check_integrity()
    assert all(st.pool.stats().in_use == 0 for st in port.stages)


def test_a_producer_aborted_after_its_cut_was_scheduled_still_keeps_the_promise():
    """Its chunks in flight still run (the stage-side cleanup waits for them), so the waiter
    keeps its promise; a producer that FAILS sends a not-yet-scheduled waiter to its lease."""
    port = make_port()
    leader = leader_over(port, max_wave_tokens=32)
    ids = SYSTEM[:16]
    leader.enqueue(port.spec("a", ids + list(range(20))))
    leader.enqueue(port.spec("b", ids + [1]))
    leader.enqueue(port.spec("c", ids + [2]))
    run_round(leader, port.stages)
    first = leader.next_wave()
    assert [(c.request_id, c.end) for c in first.chunks] == [("a", 32)]
    leader.abort("a")
    second = leader.next_wave()
    assert {(c.request_id, c.start) for c in second.chunks} == {("b", 32), ("c", 32)}
    run_wave(port, leader, first)
    run_wave(port, leader, second)
    while (wave := leader.next_wave()) is not None:
        run_wave(port, leader, wave)
    run_round(leader, port.stages)
    port.check_integrity()
    assert all(st.pool.stats().in_use == 0 for st in port.stages)
    # a failure: the producer's cut chunk fails on a stage before the waiter is scheduled
    leader.enqueue(port.spec("d", SYSTEM[16:32] + list(range(20))))
    leader.enqueue(port.spec("e", SYSTEM[16:32] + [1]))
    run_round(leader, port.stages)
    wave = leader.next_wave()
    assert [c.request_id for c in wave.chunks] == ["d"]
    for chunk in wave.chunks:
        port.materialise(0, chunk)  # stage 1 fails d: its blocks never exist there
    done = leader.wave_done(wave.wave_id, failed=["d"])
    assert done.dropped == ("d",)
    wave = leader.next_wave()
    assert [(c.request_id, c.start) for c in wave.chunks] == [("e", 0)]
    run_wave(port, leader, wave)
    while (wave := leader.next_wave()) is not None:
        run_wave(port, leader, wave)
    run_round(leader, port.stages)
    assert leader.idle
    port.check_integrity()
