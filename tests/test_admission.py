"""Admission rounds over several stages: each outcome, fallback, substitution, FCFS, cleanup."""

import pickle

import pytest

from prefill_node.core.admission_messages import (
    Aborted,
    Admitted,
    CommitOrder,
    Phase,
    Rejected,
    ReserveOrder,
    ReserveStatus,
    RoundRequest,
    RoundResult,
    StageReply,
    StageReservation,
    Wait,
)
from prefill_node.core.block_pool import BlockPool
from prefill_node.core.coordinator import (
    AdmissionCoordinator,
    CoordinatorConfig,
    DuplicateRequestError,
)
from prefill_node.core.execution_results import BlockTable, Completion, MismatchReason
from prefill_node.core.hashing import ExtraKeys, hash_block_tokens
from prefill_node.core.kv_events import BlockStored
from prefill_node.core.request import EmptyPromptError, PromptBlocks, RequestSpec
from prefill_node.core.reservation import Reservation
from prefill_node.core.round_driver import run_round
from prefill_node.core.stage_admission import (
    InvalidStageConfigError,
    StageAdmission,
    StageConfig,
)
from prefill_node.errors import InvariantError, StageStateError

B = 4
EXTRA = ExtraKeys("tiny")


def spec(rid, tokens, extra=EXTRA):
    return RequestSpec(rid, tuple(tokens), extra)


def hashes_of(tokens):
    return hash_block_tokens(tokens, B, EXTRA)


def make(capacities, **kw):
    stages = [StageAdmission(StageConfig(s, n, B, **kw)) for s, n in enumerate(capacities)]
    coord = AdmissionCoordinator(CoordinatorConfig(B, tuple(capacities)))
    return coord, stages


def run_to_completion(stages, rid, num_tokens, start=0, chunk=5):
    for st in stages:
        pos = start
        while pos < num_tokens:
            n = min(chunk, num_tokens - pos)
            assert isinstance(st.materialise(rid, pos, n), BlockTable)
            pos += n
        assert isinstance(st.complete(rid), Completion)


def check_all(stages):
    for st in stages:
        st.check_integrity()


PREFIX = list(range(100, 116))  # 4 full blocks


def test_cold_request_is_admitted_with_its_whole_prompt_escrowed():
    coord, stages = make([10, 8])
    (out,) = run_round(coord, stages, [spec("a", range(10))])  # 3 blocks (last partial)
    assert out == Admitted("a", 10, 0, (StageReservation(0, 0, 3), StageReservation(1, 0, 3)))
    for st in stages:
        assert st.pool.stats().claimed == 3 and st.pool.stats().in_use == 0  # nothing evicted yet
        assert st.materialise("a", 0, 6) == BlockTable("a", (0, 1), 0, 0, 6)
        assert st.materialise("a", 6, 4) == BlockTable("a", (0, 1, 2), 0, 6, 10)
        assert st.complete("a") == Completion("a", (0, 1, 2), 2, kept_pinned=False)
    check_all(stages)
    assert coord.num_queued == 0 and not coord.has_work()


def test_reuse_is_the_minimum_over_stages_and_pins_only_that_prefix():
    coord, stages = make([12, 12])
    run_round(coord, stages, [spec("a", PREFIX + [1])])
    run_to_completion(stages, "a", 17)
    # Evict the prefix's last two blocks on stage 1 only (tail-first eviction).
    victims = stages[1].pool.allocate(8 + 2)  # 7 free + the partial, then 2 cached
    assert victims is not None
    stages[1].pool.free(victims)
    (out,) = run_round(coord, stages, [spec("b", PREFIX + [7, 7])])
    assert isinstance(out, Admitted) and out.cached_len == 2 * B
    assert [r.leased_blocks for r in out.reservations] == [2, 2]
    assert stages[0].pool.stats().in_use == 2  # stage 0 pins 2 of its 4 cached blocks
    check_all(stages)
    run_to_completion(stages, "b", 18, start=8)
    check_all(stages)


def test_whole_prompt_cached_reuses_every_block_and_copies_the_last_to_recompute_a_token():
    coord, stages = make([8])
    run_round(coord, stages, [spec("a", PREFIX)])
    run_to_completion(stages, "a", 16)
    (out,) = run_round(coord, stages, [spec("b", PREFIX)])
    # all 4 blocks leased; one more escrowed for the private copy of the last one
    assert out == Admitted("b", 16, 15, (StageReservation(0, 4, 1),))
    check_all(stages)
    table = stages[0].materialise("b", 15, 1)
    assert table == BlockTable("b", (0, 1, 2, 4), 15, 15, 16, copy_block=(3, 4))
    check_all(stages)
    done = stages[0].complete("b")
    assert done == Completion("b", (0, 1, 2, 4), 0, kept_pinned=False)  # nothing new cached
    assert stages[0].pool.stats().in_use == 0
    check_all(stages)


def test_whole_prompt_cached_recomputes_its_last_block_when_a_copy_cannot_fit():
    coord, stages = make([4])  # the prompt fills the stage: no room for a copy
    run_round(coord, stages, [spec("a", PREFIX)])
    run_to_completion(stages, "a", 16)
    (out,) = run_round(coord, stages, [spec("b", PREFIX)])
    assert out == Admitted("b", 16, 12, (StageReservation(0, 3, 1),))
    assert stages[0].materialise("b", 12, 4).copy_block is None
    check_all(stages)


def test_wait_when_a_stage_is_full_then_admitted_after_completion():
    coord, stages = make([16, 6])
    run_round(coord, stages, [spec("a", range(20))])  # 5 blocks of stage 1's 6
    (out,) = run_round(coord, stages, [spec("b", range(500, 508))])  # 2 blocks
    assert out == Wait("b", ReserveStatus.NO_CAPACITY, 1)
    assert stages[0].num_reservations == 1 and stages[0].pool.stats().claimed == 5  # b released
    check_all(stages)
    assert coord.queued_ids() == ["b"]
    run_to_completion(stages, "a", 20)
    (out,) = run_round(coord, stages)
    assert isinstance(out, Admitted) and coord.num_queued == 0
    check_all(stages)


def test_rejected_when_bigger_than_a_stage_cache_and_never_queued():
    coord, stages = make([16, 4])
    (out,) = run_round(coord, stages, [spec("big", range(17))])
    assert isinstance(out, Rejected) and "stage 1 holds 4 blocks" in out.reason
    assert coord.num_queued == 0 and not coord.has_work()
    (ok,) = run_round(coord, stages, [spec("fits", range(16))])
    assert isinstance(ok, Admitted)


def test_strict_fcfs_a_waiting_head_blocks_later_requests():
    coord, stages = make([6, 6])
    run_round(coord, stages, [spec("a", range(16))])  # 4 of 6 blocks
    outs = run_round(coord, stages, [spec("big", range(200, 212)), spec("small", [1])])
    assert outs == (
        Wait("big", ReserveStatus.NO_CAPACITY, 0),
        Wait("small", ReserveStatus.FCFS_BLOCKED, 0),
    )
    assert coord.queued_ids() == ["big", "small"]
    run_to_completion(stages, "a", 16)
    outs = run_round(coord, stages)
    assert [type(o) for o in outs] == [Admitted, Admitted]
    check_all(stages)


def test_a_round_where_every_stage_leases_the_same_prefix_is_one_phase():
    coord, stages = make([10, 10])
    run_round(coord, stages, [spec("a", PREFIX + [1])])
    run_to_completion(stages, "a", 17)
    coord.enqueue(spec("b", PREFIX + [2, 3]))
    msg = coord.begin_round()
    assert msg.phase is Phase.RESERVE and msg.reserves == (ReserveOrder("b"),)
    assert [s.request_id for s in msg.new_requests] == ["b"]  # token ids travel here, once
    replies = [st.handle(msg) for st in stages]
    assert [r.reserved[0].confirmed_blocks for r in replies] == [4, 4]
    result = coord.finish_phase(replies)
    assert isinstance(result, RoundResult)  # no COMMIT: both committed at 4 already
    (out,) = result.outcomes
    assert isinstance(out, Admitted) and out.cached_len == 16
    assert [st.reservation("b").committed for st in stages] == [True, True]
    check_all(stages)


def test_stages_that_lease_more_lower_to_the_common_boundary_in_a_commit_phase():
    coord, stages = make([10, 10])
    run_round(coord, stages, [spec("a", PREFIX + [1])])
    run_to_completion(stages, "a", 17)
    pressure = stages[1].pool.allocate(6 + 2)  # stage 1 evicts 2 prefix blocks
    stages[1].pool.free(pressure)
    coord.enqueue(spec("b", PREFIX + [2, 3]))
    msg = coord.begin_round()
    replies = [st.handle(msg) for st in stages]
    assert [r.reserved[0].confirmed_blocks for r in replies] == [4, 2]
    assert [r.reserved[0].escrow_blocks for r in replies] == [1, 3]
    msg = coord.finish_phase(replies)
    assert msg.phase is Phase.COMMIT and msg.commits == (CommitOrder("b", 2),)
    replies = [st.handle(msg) for st in stages]
    assert [r.committed[0].escrow_blocks for r in replies] == [3, 3]  # stage 0 topped up
    result = coord.finish_phase(replies)
    assert isinstance(result, RoundResult)
    assert result.outcomes[0].cached_len == 8
    assert [len(st.reservation("b").lease) for st in stages] == [2, 2]  # stage 0 shrank
    check_all(stages)


def test_a_stage_that_cannot_top_up_at_the_common_boundary_makes_the_request_wait():
    coord, stages = make([6, 6])
    run_round(coord, stages, [spec("a", PREFIX + [1])])
    run_to_completion(stages, "a", 17)  # 4 blocks cached on each stage
    stages[1].pool.free(stages[1].pool.allocate(4))  # stage 1 evicts prefix blocks 2, 3
    # stage 0: another request pins the whole prefix, so lowering b's lease frees nothing
    assert _reserve(stages[0], "c", PREFIX + [5], 80).status is ReserveStatus.OK
    coord.enqueue(spec("b", PREFIX + [2, 3]))
    msg = coord.begin_round()
    replies = [st.handle(msg) for st in stages]
    assert [r.reserved[0].confirmed_blocks for r in replies] == [4, 2]
    msg = coord.finish_phase(replies)
    assert msg.phase is Phase.COMMIT
    replies = [st.handle(msg) for st in stages]
    assert [c.ok for r in replies for c in r.committed] == [False, True]
    msg = coord.finish_phase(replies)
    assert msg.phase is Phase.RELEASE and msg.releases == ("b",)
    result = coord.finish_phase([st.handle(msg) for st in stages])
    assert result.outcomes == (Wait("b", ReserveStatus.NO_CAPACITY, 0),)
    assert [st.reservation("b") for st in stages] == [None, None]
    check_all(stages)
    stages[0].abort("c")
    (out,) = run_round(coord, stages)  # the retry fits
    assert isinstance(out, Admitted) and out.cached_len == 8
    check_all(stages)


def _prime_cached_prefix(st, tokens):
    """Stage-local: compute ``tokens`` and leave their full blocks cached, unpinned."""
    st.handle(
        RoundRequest(
            90, Phase.RESERVE, new_requests=(spec("p", tokens),), reserves=(ReserveOrder("p"),)
        )
    )
    run_to_completion([st], "p", len(tokens))


def _reserve(st, rid, tokens, round_id):
    reply = st.handle(
        RoundRequest(
            round_id,
            Phase.RESERVE,
            new_requests=(spec(rid, tokens),),
            reserves=(ReserveOrder(rid),),
        )
    )
    return reply.reserved[0]


def test_a_reservation_is_committed_where_its_lease_ends():
    st = StageAdmission(StageConfig(0, 8, B))
    _prime_cached_prefix(st, PREFIX + [1])
    a = _reserve(st, "a", PREFIX + [7, 8], 1)
    assert (a.status, a.confirmed_blocks, a.escrow_blocks) == (ReserveStatus.OK, 4, 1)
    rsv = st.reservation("a")
    assert rsv.committed and rsv.next_token == 16
    assert isinstance(st.materialise("a", 16, 2), BlockTable)  # runnable with no COMMIT
    with pytest.raises(InvariantError, match="committed after it started"):
        st.handle(RoundRequest(2, Phase.COMMIT, commits=(CommitOrder("a", 2),)))
    st.check_integrity()


def test_a_committed_escrow_is_never_short_a_hit_on_its_victim_is_a_miss():
    st = StageAdmission(StageConfig(0, 8, B))
    _prime_cached_prefix(st, PREFIX + [1])
    _reserve(st, "a", range(500, 532), 1)
    c = _reserve(st, "c", PREFIX + [9], 2)
    assert c.confirmed_blocks == 0 and c.status is ReserveStatus.NO_CAPACITY
    assert st.reservation("a").escrow.held == 8
    table = st.materialise("a", 0, 32)
    assert sorted(table.block_ids) == list(range(8))
    st.check_integrity()


def test_a_hit_on_a_committed_victim_takes_it_over_only_with_a_substitute():
    st = StageAdmission(StageConfig(0, 12, B))
    _prime_cached_prefix(st, PREFIX + [1])
    _prime_cached_prefix(st, list(range(700, 709)))  # queue [6..11, 3, 2, 1, 0, 5, 4]
    _reserve(st, "a", range(500, 536), 1)  # 9 victims: 6..11, 3, 2, 1
    assert st.pool.free_queue.block_ids() == [0, 5, 4]
    c = _reserve(st, "c", PREFIX + [9], 2)
    # c pins 0; takes over 1 and 2 once a got 5 and 4 instead; 3 has no substitute left,
    # and a committed escrow is never left short, so c's prefix ends there.
    assert c.confirmed_blocks == 3 and c.status is ReserveStatus.NO_CAPACITY
    escrow = st.reservation("a").escrow
    assert {v.block_id for v in escrow.victims()} == {3, 4, 5, 6, 7, 8, 9, 10, 11}
    assert (escrow.held, escrow.target) == (9, 9)
    st.check_integrity()


def test_materialise_refuses_chunks_that_do_not_match_local_state():
    coord, stages = make([10])
    (out,) = run_round(coord, stages, [spec("a", PREFIX + [1])])
    st = stages[0]
    assert st.materialise("nope", 0, 4).reason is MismatchReason.UNKNOWN_REQUEST
    assert st.materialise("a", 4, 4).reason is MismatchReason.WRONG_POSITION
    assert st.materialise("a", 0, 0).reason is MismatchReason.OUT_OF_RANGE
    assert st.materialise("a", 0, 18).reason is MismatchReason.OUT_OF_RANGE
    assert st.complete("a").reason is MismatchReason.INCOMPLETE
    assert isinstance(st.materialise("a", 0, 8), BlockTable)
    bad = st.materialise("a", 0, 8)  # a chunk twice
    assert bad.reason is MismatchReason.WRONG_POSITION
    with pytest.raises(StageStateError, match="stage 0 cannot run request 'a'"):
        raise bad.to_error()
    st.check_integrity()


def test_materialise_refuses_a_reservation_that_was_not_committed():
    rsv = Reservation(PromptBlocks(spec("a", range(8)), B))
    assert rsv.materialise(BlockPool(8, B), 0, 0, 8).reason is MismatchReason.NOT_COMMITTED


@pytest.mark.parametrize("when", ["reserved", "committed", "half", "kept"])
def test_abort_at_any_point_returns_every_block(when):
    st = StageAdmission(StageConfig(0, 8, B))
    _prime_cached_prefix(st, PREFIX + [1])
    _reserve(st, "a", PREFIX + list(range(9)), 1)  # committed at 4
    if when != "reserved":  # lowered to 3
        st.handle(RoundRequest(2, Phase.COMMIT, commits=(CommitOrder("a", 3),)))
    if when in ("half", "kept"):
        st.materialise("a", 12, 6)
    if when == "kept":
        st.materialise("a", 18, 7)
        assert st.complete("a", keep_pinned=True).kept_pinned
        assert st.pool.stats().in_use == 7
    assert st.abort("a") is True
    assert st.abort("a") is False
    stats = st.pool.stats()
    assert (stats.in_use, stats.claimed) == (0, 0)
    assert st.pool.index.longest_prefix(hashes_of(PREFIX)) == 4  # the prefix stays cached
    st.check_integrity()


def test_keep_pinned_until_unpin():
    coord, stages = make([8])
    run_round(coord, stages, [spec("a", range(10))])
    st = stages[0]
    st.materialise("a", 0, 10)
    done = st.complete("a", keep_pinned=True)
    assert done == Completion("a", (0, 1, 2), 2, kept_pinned=True)
    assert st.pool.stats().in_use == 3
    assert st.materialise("a", 10, 1).reason is MismatchReason.NOT_COMMITTED
    assert st.unpin("a") is True and st.unpin("a") is False
    assert st.pool.stats().in_use == 0 and st.pool.stats().cached == 2
    st.check_integrity()


def test_abort_through_the_coordinator_mid_round_and_after_admission():
    coord, stages = make([8, 8])
    coord.enqueue(spec("a", range(9)))
    msg = coord.begin_round()
    replies = [st.handle(msg) for st in stages]
    assert coord.abort("a") is True
    msg = coord.finish_phase(replies)
    while not isinstance(msg, RoundResult):
        msg = coord.finish_phase([st.handle(msg) for st in stages])
    assert msg.outcomes == (Aborted("a"),)
    assert coord.has_work()  # the stages still hold a's reservation until the next message
    assert run_round(coord, stages) == ()
    assert all(st.num_reservations == 0 and st.pool.stats().claimed == 0 for st in stages)
    (out,) = run_round(coord, stages, [spec("b", range(9))])
    stages[0].materialise("b", 0, 4)
    assert coord.abort("b") is False  # admitted already: only the stages hold it
    run_round(coord, stages)
    assert all(st.pool.stats().in_use == 0 and st.pool.stats().claimed == 0 for st in stages)
    check_all(stages)


def test_recurrent_stage_falls_back_to_a_common_snapshot_boundary():
    stages = [
        StageAdmission(StageConfig(0, 16, B)),
        StageAdmission(StageConfig(1, 16, B, snapshot_interval_blocks=3)),
    ]
    coord = AdmissionCoordinator(CoordinatorConfig(B, (16, 16)))
    tokens = list(range(30))  # 7 full blocks; snapshots after blocks 3 and 6
    run_round(coord, stages, [spec("a", tokens)])
    run_to_completion(stages, "a", 30)
    (out,) = run_round(coord, stages, [spec("b", tokens[:20] + [1, 2])])  # 5 full shared
    assert out.cached_len == 3 * B
    assert stages[1].reservation("b").lease.snapshot_boundaries() == (3,)
    check_all(stages)


def test_admission_cap_keeps_headroom_but_never_blocks_a_lone_request():
    coord, stages = make([10], headroom_blocks=4)
    (a,) = run_round(coord, stages, [spec("a", range(32))])  # 8 blocks > cap 6: alone, ok
    assert isinstance(a, Admitted)
    (b,) = run_round(coord, stages, [spec("b", [5])])
    assert b == Wait("b", ReserveStatus.ADMISSION_CAP, 0)
    run_to_completion(stages, "a", 32)
    outs = run_round(coord, stages, [spec("c", range(40, 60))])  # b: 1 block, c: 5 -> 6
    assert [type(o) for o in outs] == [Admitted, Admitted]


def test_completion_emits_stored_events_for_new_full_blocks_only():
    coord, stages = make([8], enable_kv_events=True)
    run_round(coord, stages, [spec("a", PREFIX + [1])])
    run_to_completion(stages, "a", 17)
    events = stages[0].drain_events()
    assert events == [BlockStored(hashes_of(PREFIX), None, tuple(PREFIX), B)]
    run_round(coord, stages, [spec("b", PREFIX + [1, 2, 3, 4, 5])])
    run_to_completion(stages, "b", 21, start=16)
    assert stages[0].drain_events() == [
        BlockStored(hashes_of(PREFIX + [1, 2, 3, 4])[4:], hashes_of(PREFIX)[-1], (1, 2, 3, 4), B)
    ]


def test_salted_requests_do_not_share():
    coord, stages = make([16])
    run_round(coord, stages, [spec("a", PREFIX + [1], ExtraKeys("tiny", "t1"))])
    run_to_completion(stages, "a", 17)
    (b,) = run_round(coord, stages, [spec("b", PREFIX + [1], ExtraKeys("tiny", "t2"))])
    (c,) = run_round(coord, stages, [spec("c", PREFIX + [1], ExtraKeys("tiny", "t1"))])
    assert (b.cached_len, c.cached_len) == (0, 16)


def test_bad_input_and_protocol_misuse():
    with pytest.raises(EmptyPromptError):
        spec("e", [])
    with pytest.raises(InvalidStageConfigError):
        StageConfig(0, 4, B, headroom_blocks=4)
    coord, stages = make([8, 8])
    coord.enqueue(spec("a", [1]))
    with pytest.raises(DuplicateRequestError):
        coord.enqueue(spec("a", [2]))
    msg = coord.begin_round()
    with pytest.raises(InvariantError):
        coord.begin_round()
    with pytest.raises(InvariantError, match="replies do not match"):
        coord.finish_phase([stages[0].handle(msg)])
    with pytest.raises(InvariantError, match="replies do not match"):
        coord.finish_phase([StageReply(99, Phase.RESERVE, 0), StageReply(99, Phase.RESERVE, 1)])


def test_every_round_message_survives_pickling_as_the_rounds_plane_sends_it():
    coord, stages = make([8, 8])
    _prime_cached_prefix(stages[0], PREFIX[:8] + [1])  # stage 0 alone: a COMMIT phase follows
    coord.enqueue(spec("p", PREFIX[:8] + [2]))
    coord.enqueue(spec("q", range(9), ExtraKeys("tiny", "salt")))
    messages = [coord.begin_round()]
    while True:
        wire = pickle.loads(pickle.dumps(messages[-1]))
        assert wire == messages[-1]
        replies = [pickle.loads(pickle.dumps(st.handle(wire))) for st in stages]
        step = coord.finish_phase(replies)
        if isinstance(step, RoundResult):
            break
        messages.append(step)
    assert [type(o) for o in pickle.loads(pickle.dumps(step)).outcomes] == [Admitted, Admitted]
    assert [m.phase for m in messages] == [Phase.RESERVE, Phase.COMMIT]
    assert messages[1].new_requests == ()
    assert len(pickle.dumps(messages[1])) < 400  # later phases carry ids and ints only
