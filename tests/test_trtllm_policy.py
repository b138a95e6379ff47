"""The ``trtllm`` policy's mechanism, sans-IO: rank 0 decides alone, the other stages follow.

``StageAdmission.follow`` is a rank > 0 taking rank 0's admission from a wave (TensorRT-LLM's
``_pp_retry_until_can_schedule`` + ``add_sequence``); the pipeline's ``LeaderCore`` under
``trtllm`` runs its rounds against stage 0 alone and carries the decisions in the waves.
"""

from __future__ import annotations

import pytest

from prefill_node.core.admission_messages import Admitted, ReserveStatus, RoundResult
from prefill_node.core.hashing import ExtraKeys
from prefill_node.core.request import RequestSpec
from prefill_node.core.stage_admission import StageAdmission, StageConfig
from prefill_node.errors import InvariantError
from prefill_node.runtime.leader import pipeline_leader_core, wave_header
from prefill_node.runtime.spec import ModelSource, PipelineSpec

B = 4
EXTRA = ExtraKeys("m")


def _spec(rid: str, tokens) -> RequestSpec:
    return RequestSpec(rid, tuple(tokens), EXTRA)


def _run_whole(stage: StageAdmission, spec: RequestSpec, cached: int = 0) -> None:
    """Follow, compute and complete a prompt on ``stage``: its full blocks end up cached."""
    assert stage.follow(spec, cached) is ReserveStatus.OK
    table = stage.materialise(spec.request_id, cached, len(spec.token_ids) - cached)
    assert not isinstance(table, Exception) and table.start == cached
    stage.complete(spec.request_id)


def test_follow_leases_exactly_rank0s_prefix_even_when_this_stage_holds_more() -> None:
    stage = StageAdmission(StageConfig(1, 16, B))
    _run_whole(stage, _spec("seed", range(20)))  # 5 blocks cached here
    # rank 0 reuses only 2 blocks (its own cache evicted the rest): this stage follows it
    assert stage.follow(_spec("r", range(22)), 8) is ReserveStatus.OK
    rsv = stage.reservation("r")
    assert rsv is not None and rsv.committed and rsv.boundary_blocks == 2 and rsv.cached_len == 8
    table = stage.materialise("r", 8, 14)
    assert table.num_cached_tokens == 8 and table.start == 8
    stage.check_integrity()


def test_follow_fails_when_this_stage_lacks_part_of_rank0s_prefix_and_holds_nothing() -> None:
    stage = StageAdmission(StageConfig(1, 16, B))
    _run_whole(stage, _spec("seed", range(8)))  # 2 blocks cached here
    before = stage.pool.stats()
    # rank 0 reuses 4 blocks it holds; this stage has only 2 of them: the request cannot run
    assert stage.follow(_spec("r", range(30)), 16) is ReserveStatus.PREFIX_MISSING
    assert stage.reservation("r") is None and stage.prompt_blocks("r") is None
    assert stage.pool.stats() == before
    mismatch = stage.materialise("r", 16, 14)  # and a chunk of it is refused, never run
    assert mismatch.reason.value == "unknown_request"
    stage.check_integrity()


def test_follow_out_of_capacity_holds_nothing_and_a_later_follow_fits() -> None:
    stage = StageAdmission(StageConfig(1, 8, B))
    assert stage.follow(_spec("a", range(100, 124)), 0) is ReserveStatus.OK  # 6 of 8 blocks
    before = stage.pool.stats()
    assert stage.follow(_spec("b", range(200, 216)), 0) is ReserveStatus.NO_CAPACITY
    assert stage.reservation("b") is None and stage.pool.stats() == before
    stage.abort("a")  # capacity released (in the runtime: a hand-off draining)
    assert stage.follow(_spec("b", range(200, 216)), 0) is ReserveStatus.OK
    stage.check_integrity()


def test_follow_twice_is_a_bug() -> None:
    stage = StageAdmission(StageConfig(1, 8, B))
    assert stage.follow(_spec("a", range(8)), 0) is ReserveStatus.OK
    with pytest.raises(InvariantError, match="followed twice"):
        stage.follow(_spec("a", range(8)), 0)


def _pipeline_spec(policy: str, blocks=(32, 32)) -> PipelineSpec:
    return PipelineSpec(
        model=ModelSource(config={"x": 1}),
        layer_ranges=((0, 1), (1, 3)),
        stage_blocks=blocks,
        block_size=B,
        policy=policy,
        max_wave_tokens=16,
        min_wave_tokens=8,
    )


def test_trtllm_rounds_ask_stage0_alone_and_waves_carry_its_decisions() -> None:
    """No cross-stage negotiation: a round finishes on stage 0's reply alone, so stage 0's
    cache view alone sets the reuse; the admitted prompt rides its first chunk and stage 1
    follows it from the wave, or fails it when its own cache disagrees; the failure and an
    abort reach stage 1 as forgets in a later wave."""
    spec = _pipeline_spec("trtllm")
    core = pipeline_leader_core(spec)
    stages = [StageAdmission(StageConfig(s, n, B)) for s, n in enumerate(spec.stage_blocks)]
    _run_whole(stages[0], _spec("warm", range(12)))  # 3 blocks cached on stage 0 only
    core.enqueue(_spec("r", range(20)))  # shares those 3 blocks
    core.enqueue(_spec("s", range(50, 70)))
    step = core.begin_round()
    step = core.finish_phase([stages[0].handle(step)])
    assert isinstance(step, RoundResult)  # one phase, on stage 0's reply alone
    assert [(v.request_id, v.cached_len) for v in step.outcomes if isinstance(v, Admitted)] == [
        ("r", 12),  # rank 0's view: a round over both stages would have found 0
        ("s", 0),
    ]
    assert stages[1].num_reservations == 0  # stage 1 saw no round
    header = wave_header(core)
    assert [(c.request_id, c.start, c.length) for c in header.chunks] == [
        ("r", 12, 8),
        ("s", 0, 8),
    ]
    assert [s.request_id for s in header.new_requests] == ["r", "s"] and header.forgets == ()
    # stage 1 does not hold r's first 12 tokens: it cannot take rank 0's decision
    follow = stages[1].follow(header.new_requests[0], header.chunks[0].start)
    assert follow is ReserveStatus.PREFIX_MISSING and stages[1].num_reservations == 0
    assert stages[1].follow(header.new_requests[1], 0) is ReserveStatus.OK
    core.abort("s")  # in flight: stage-side cleanup waits for its chunk to return
    assert set(core.wave_done(header.wave_id, failed=("r",)).dropped) == {"r", "s"}
    core.enqueue(_spec("t", range(80, 84)))
    msg = core.begin_round()
    assert set(msg.forgets) == {"r", "s"}  # stage 0 drops both through its own round
    while not isinstance(msg, RoundResult):
        msg = core.finish_phase([stages[0].handle(msg)])
    third = wave_header(core)  # stages > 0 drop them through the next wave
    assert set(third.forgets) == {"r", "s"} and [s.request_id for s in third.new_requests] == ["t"]
    assert stages[0].num_reservations == 1  # t


def test_sync_admission_rounds_need_every_stage() -> None:
    """The ablation negotiates: its coordinator waits for every stage's reply."""
    spec = _pipeline_spec("sync-admission")
    core = pipeline_leader_core(spec)
    stages = [StageAdmission(StageConfig(s, n, B)) for s, n in enumerate(spec.stage_blocks)]
    core.enqueue(_spec("r", range(20)))
    msg = core.begin_round()
    with pytest.raises(InvariantError):
        core.finish_phase([stages[0].handle(msg)])
