"""LeaderCore (sans-IO) driven against real StageAdmission objects, no processes."""

from __future__ import annotations

import pytest

from prefill_node.core.coordinator import DuplicateRequestError
from prefill_node.core.stage_admission import StageAdmission, StageConfig
from prefill_node.errors import NeverFitsError
from prefill_node.runtime.leader_core import LeaderCore
from prefill_node.runtime.messages import WaveResult
from prefill_node.runtime.spec import InvalidPipelineSpecError, ModelSource, PipelineSpec


class _Model:
    name = "m"


def _spec(policy: str = "wave", blocks=(16, 12)) -> PipelineSpec:
    return PipelineSpec(
        model=ModelSource(config={"x": 1}),
        layer_ranges=((0, 1), (1, 3)),
        stage_blocks=blocks,
        block_size=4,
        policy=policy,
        max_wave_tokens=16,
        min_wave_tokens=8,
    )


def _admit_all(core: LeaderCore, stages: list[StageAdmission]) -> list:
    outcomes = []
    msg = core.begin_round()
    while msg is not None:
        msg, outcomes = core.finish_phase([s.handle(msg) for s in stages])
    return outcomes


def _stages(spec: PipelineSpec) -> list[StageAdmission]:
    return [
        StageAdmission(StageConfig(s, n, spec.block_size)) for s, n in enumerate(spec.stage_blocks)
    ]


def test_waves_cover_each_prompt_once_in_order_and_completion_frees_capacity() -> None:
    spec = _spec()
    top_k = {"a": 2, "b": 1}  # what the engine's records hold
    core = LeaderCore(spec, _Model(), lambda rid: (top_k.get(rid, 1), None, ""))
    stages = _stages(spec)
    core.submit("a", tuple(range(30)), None)
    core.submit("b", tuple(range(100, 110)), None)
    outcomes = _admit_all(core, stages)
    assert [(o.request_id, o.cached_tokens, o.error) for o in outcomes] == [
        ("a", 0, None),
        ("b", 0, None),
    ]
    assert not core.has_round_work()
    covered: dict[str, list[tuple[int, int]]] = {"a": [], "b": []}
    while (header := core.next_wave()) is not None:
        assert header.num_tokens <= spec.max_wave_tokens
        for c in header.chunks:
            covered[c.request_id].append((c.start, c.start + c.length))
            assert c.top_logprobs == top_k[c.request_id] and c.kv_destination is None
            for s in stages:  # what each stage's LOOP does
                assert not hasattr(s.materialise(c.request_id, c.start, c.length), "reason")
                if c.is_last:
                    s.complete(c.request_id)
        core.wave_done(WaveResult(header.wave_id))
    for rid, n in (("a", 30), ("b", 10)):
        spans = covered[rid]
        assert spans[0][0] == 0 and spans[-1][1] == n
        assert all(x[1] == y[0] for x, y in zip(spans, spans[1:], strict=False))
    assert core.idle and core.counts().inflight_requests == 0
    for s in stages:
        s.check_integrity()
        assert s.pool.stats().in_use == 0
    # a second request with the same prefix reuses it on every stage
    core.submit("c", tuple(range(30)) + (7,), None)
    assert [o.cached_tokens for o in _admit_all(core, stages)] == [28]


def test_abort_defers_stage_cleanup_until_in_flight_chunks_return() -> None:
    spec = _spec()
    core, stages = LeaderCore(spec, _Model()), _stages(spec)
    core.submit("a", tuple(range(40)), None)
    _admit_all(core, stages)
    header = core.next_wave()
    assert header is not None and header.chunks[0].request_id == "a"
    for s in stages:
        s.materialise("a", header.chunks[0].start, header.chunks[0].length)
    core.abort("a")
    with pytest.raises(DuplicateRequestError, match="still in the pipeline"):
        core.submit("a", (1, 2, 3), None)  # its stage state is not cleaned up yet
    assert core.next_wave() is None  # nothing more is scheduled for it
    assert not core.has_round_work()  # and no forget goes out while its chunk is in flight
    assert all(s.pool.stats().in_use > 0 for s in stages)
    core.wave_done(WaveResult(header.wave_id))
    assert core.has_round_work()
    assert _admit_all(core, stages) == []  # the round carries only the forget
    for s in stages:
        s.check_integrity()
        assert s.pool.stats().in_use == 0 and s.num_reservations == 0


def test_prompt_larger_than_a_stage_never_fits() -> None:
    core = LeaderCore(_spec(blocks=(16, 3)), _Model())
    with pytest.raises(NeverFitsError, match="stage 1 holds 3 blocks"):
        core.check_fits(13)
    core.check_fits(12)


def test_spec_round_trips_as_json_and_rejects_bad_options() -> None:
    spec = _spec("sync-admission")
    assert PipelineSpec.from_json(spec.to_json()) == spec
    with pytest.raises(InvalidPipelineSpecError, match="contiguous"):
        PipelineSpec(ModelSource(config={}), ((0, 1), (2, 3)), (4, 4))
    with pytest.raises(InvalidPipelineSpecError, match="policy"):
        PipelineSpec(ModelSource(config={}), ((0, 1),), (4,), policy="fast")
    with pytest.raises(InvalidPipelineSpecError, match="multiples of block_size"):
        PipelineSpec(
            ModelSource(config={}),
            ((0, 1),),
            (4,),
            block_size=16,
            max_wave_tokens=40,
            min_wave_tokens=16,
        )
    with pytest.raises(InvalidPipelineSpecError, match="exactly one"):
        ModelSource()


@pytest.mark.parametrize("policy", ["wave", "sync-admission"])
def test_on_loop_policies_keep_one_chunk_of_a_request_in_flight_wave_pipelines_them(policy) -> None:
    """TensorRT-LLM's PP executor (and both on-loop policies) skips requests with a chunk in
    flight and keeps P micro-batches; WavePP pipelines a request's chunks over R = 2P waves."""
    spec = _spec(policy)
    assert spec.ring == (2 if policy == "sync-admission" else 4)
    core, stages = LeaderCore(spec, _Model()), _stages(spec)
    core.submit("a", tuple(range(40)), None)  # 40 tokens: 3 chunks of <= 16
    _admit_all(core, stages)
    first = core.next_wave()
    assert first is not None and [c.request_id for c in first.chunks] == ["a"]
    second = core.next_wave()
    if policy == "sync-admission":
        assert second is None  # "a" is in flight: nothing else to schedule
        core.wave_done(WaveResult(first.wave_id))
        second = core.next_wave()
    assert second is not None and second.chunks[0].start == first.chunks[0].length


def _run_on_stages(stages: list[StageAdmission], header) -> None:
    """What each stage's LOOP does with a wave: materialise every chunk, then complete the
    requests it ends and publish the full blocks of the others."""
    for c in header.chunks:
        for s in stages:
            assert not hasattr(s.materialise(c.request_id, c.start, c.length), "reason")
            if c.is_last:
                s.complete(c.request_id)
            else:
                s.publish(c.request_id, c.start + c.length)


@pytest.mark.parametrize("policy", ["wave", "sync-admission"])
def test_a_prefix_waiter_is_admitted_as_soon_as_the_producers_chunks_passed(policy) -> None:
    """b waits for the prefix a computes; a's chunks are cut where that prefix ends, and b
    is admitted once a's chunks holding it have returned from the last stage, while a
    still runs, and reuses exactly that prefix."""
    spec = _spec(policy, blocks=(32, 32))
    core, stages = LeaderCore(spec, _Model()), _stages(spec)
    system = tuple(range(100, 120))  # 5 blocks
    core.submit("a", system + tuple(range(40)), None)  # 60 tokens: chunks of <= 16
    core.submit("b", system + (1, 2), None)
    admitted: dict[str, tuple[int, bool]] = {"a": (0, True)}  # -> (cached, a still running)
    assert [(o.request_id, o.cached_tokens) for o in _admit_all(core, stages)] == [("a", 0)]
    assert _admit_all(core, stages) == [] and not core.has_round_work()  # b waits, idle
    pending, ends = [], []
    while True:
        for o in _admit_all(core, stages):
            running = stages[-1].reservation("a") is not None
            admitted[o.request_id] = (o.cached_tokens, running)
        while (header := core.next_wave()) is not None:
            pending.append(header)
        if not pending:
            break
        header = pending.pop(0)  # the oldest wave passes every stage and returns
        ends += [c.start + c.length for c in header.chunks if c.request_id == "a"]
        _run_on_stages(stages, header)
        core.wave_done(WaveResult(header.wave_id))
    assert admitted == {"a": (0, True), "b": (20, True)}
    assert 20 in ends and ends[-1] == 60
    assert core.idle
    for s in stages:
        s.check_integrity()
        assert s.pool.stats().in_use == 0
