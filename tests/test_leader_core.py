"""The sans-IO leader (``core.leader.LeaderCore``, built for a pipeline the way the runtime
builds it) driven against real StageAdmission objects, no processes; its waves in the
runtime's wire form (``runtime.leader.wave_header``)."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from prefill_node.core.admission_messages import Admitted, Promise
from prefill_node.core.coordinator import DuplicateRequestError
from prefill_node.core.hashing import ExtraKeys
from prefill_node.core.leader import LeaderCore
from prefill_node.core.request import RequestSpec
from prefill_node.core.round_driver import run_round
from prefill_node.core.stage_admission import StageAdmission, StageConfig
from prefill_node.runtime.leader import pipeline_leader_core, wave_header
from prefill_node.runtime.messages import RequestOptions
from prefill_node.runtime.spec import InvalidPipelineSpecError, ModelSource, PipelineSpec


def _submit(core: LeaderCore, rid: str, tokens: Iterable[int], options=None):
    return core.enqueue(RequestSpec(rid, tuple(tokens), ExtraKeys("m")), options)


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


def _admit_all(core: LeaderCore, stages: list[StageAdmission]) -> list[Admitted]:
    """One round if the core has round work (as the runtime's ``Leader`` runs them): what
    it admitted."""
    if not core.has_round_work():
        return []
    return [o for o in run_round(core, stages) if isinstance(o, Admitted)]


def _stages(spec: PipelineSpec) -> list[StageAdmission]:
    return [
        StageAdmission(StageConfig(s, n, spec.block_size)) for s, n in enumerate(spec.stage_blocks)
    ]


def test_waves_cover_each_prompt_once_in_order_and_completion_frees_capacity() -> None:
    spec = _spec()
    top_k = {"a": 2, "b": 1}  # what the engine gives at submit
    core = pipeline_leader_core(spec)
    stages = _stages(spec)
    _submit(core, "a", range(30), (RequestOptions(2), ""))
    _submit(core, "b", range(100, 110), (RequestOptions(1), "00-trace"))
    outcomes = _admit_all(core, stages)
    assert [(o.request_id, o.cached_len) for o in outcomes] == [("a", 0), ("b", 0)]
    assert not core.has_round_work()
    covered: dict[str, list[tuple[int, int]]] = {"a": [], "b": []}
    while (header := wave_header(core)) is not None:
        assert header.num_tokens <= spec.max_wave_tokens
        for c in header.chunks:
            first = not covered[c.request_id]  # the options go once, with the first chunk
            covered[c.request_id].append((c.start, c.start + c.length))
            assert c.options == (RequestOptions(top_k[c.request_id]) if first else None)
            assert c.traceparent == ("00-trace" if c.request_id == "b" else "")  # every chunk
            for s in stages:  # what each stage's LOOP does
                assert not hasattr(s.materialise(c.request_id, c.start, c.length), "reason")
                if c.is_last:
                    s.complete(c.request_id)
        core.wave_done(header.wave_id)
    for rid, n in (("a", 30), ("b", 10)):
        spans = covered[rid]
        assert spans[0][0] == 0 and spans[-1][1] == n
        assert all(x[1] == y[0] for x, y in zip(spans, spans[1:], strict=False))
    assert core.idle and core.counts().inflight_requests == 0
    assert core.options("a") is None and core.options("b") is None  # left with the requests
    for s in stages:
        s.check_integrity()
        assert s.pool.stats().in_use == 0
    # a second request with the same prefix reuses it on every stage
    _submit(core, "c", (*range(30), 7))
    assert [o.cached_len for o in _admit_all(core, stages)] == [28]


def test_abort_defers_stage_cleanup_until_in_flight_chunks_return() -> None:
    spec = _spec()
    core, stages = pipeline_leader_core(spec), _stages(spec)
    _submit(core, "a", range(40), (RequestOptions(3), ""))
    _admit_all(core, stages)
    header = wave_header(core)
    assert header is not None and header.chunks[0].request_id == "a"
    assert header.chunks[0].options == RequestOptions(3)
    for s in stages:
        s.materialise("a", header.chunks[0].start, header.chunks[0].length)
    core.abort("a")
    assert core.options("a") is None  # nothing of it is shipped or streamed any more
    with pytest.raises(DuplicateRequestError, match="still in the pipeline"):
        _submit(core, "a", (1, 2, 3))  # its stage state is not cleaned up yet
    assert core.next_wave() is None  # nothing more is scheduled for it
    assert not core.has_round_work()  # and no forget goes out while its chunk is in flight
    assert all(s.pool.stats().in_use > 0 for s in stages)
    assert core.wave_done(header.wave_id).dropped == ("a",)
    assert core.has_round_work()
    assert _admit_all(core, stages) == []  # the round carries only the forget
    for s in stages:
        s.check_integrity()
        assert s.pool.stats().in_use == 0 and s.num_reservations == 0


def test_prompt_larger_than_a_stage_never_fits() -> None:
    core = pipeline_leader_core(_spec(blocks=(16, 3)))
    assert "stage 1 holds 3 blocks" in core.check_fits(13).reason
    assert core.check_fits(12) is None
    rejected = _submit(core, "big", range(13))
    assert rejected is not None and "stage 1 holds 3 blocks" in rejected.reason
    assert core.counts().queue_depth == 0 and core.options("big") is None


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
    core, stages = pipeline_leader_core(spec), _stages(spec)
    _submit(core, "a", range(40))  # 40 tokens: 3 chunks of <= 16
    _admit_all(core, stages)
    first = core.next_wave()
    assert first is not None and [c.request_id for c in first.chunks] == ["a"]
    second = core.next_wave()
    if policy == "sync-admission":
        assert second is None  # "a" is in flight: nothing else to schedule
        core.wave_done(first.wave_id)
        second = core.next_wave()
    assert second is not None and second.chunks[0].start == first.chunks[0].length


def _run_on_stages(stages: list[StageAdmission], header) -> None:
    """What each stage's LOOP does with a wave: materialise every chunk, then complete the
    requests it ends and cache the full blocks of the others."""
    for c in header.chunks:
        for s in stages:
            assert not hasattr(s.materialise(c.request_id, c.start, c.length), "reason")
            if c.is_last:
                s.complete(c.request_id)
            else:
                s.cache_computed(c.request_id, c.start + c.length)


@pytest.mark.parametrize("policy", ["wave", "sync-admission"])
def test_a_prefix_being_computed_is_promised_and_its_waiter_runs_behind_the_chunk(policy) -> None:
    """b shares the prefix a computes: it is admitted at once with that prefix promised, a's
    chunks are cut where the prefix ends, and b's first chunk is taken into a wave after a's
    chunk that ends it while that chunk is still in flight (it no longer waits for it to
    return from the last stage); b reuses exactly that prefix and no stage leaks."""
    spec = _spec(policy, blocks=(32, 32))
    core, stages = pipeline_leader_core(spec), _stages(spec)
    system = tuple(range(100, 120))  # 5 blocks
    _submit(core, "a", system + (9, 9, 9, 9))  # 24 tokens: chunks of <= 16
    _submit(core, "b", system + (1, 2))
    outs = [(o.request_id, o.cached_len, o.promise) for o in _admit_all(core, stages)]
    assert outs == [("a", 0, None), ("b", 20, Promise("a", 0))]
    pending, returned = [], set()
    taken: dict[tuple[str, int], tuple[int, int]] = {}  # (request, start) -> (wave, end)
    b_first = None
    while True:
        _admit_all(core, stages)
        while (header := wave_header(core)) is not None:
            pending.append(header)
            for c in header.chunks:
                taken[c.request_id, c.start] = (header.wave_id, c.start + c.length)
                if c.request_id == "b" and b_first is None:
                    b_first = (header.wave_id, c.start, set(returned))
        if not pending:
            break
        header = pending.pop(0)  # the oldest wave passes every stage and returns
        _run_on_stages(stages, header)
        core.wave_done(header.wave_id)
        returned.add(header.wave_id)
    cut_wave = next(w for (r, _), (w, end) in taken.items() if r == "a" and end == 20)
    assert b_first is not None and b_first[1] == 20 and b_first[0] > cut_wave
    assert cut_wave not in b_first[2]  # a's chunk had not returned when b's was taken
    assert max(end for (r, _), (_, end) in taken.items() if r == "a") == 24
    assert core.idle
    for s in stages:
        s.check_integrity()
        assert s.pool.stats().in_use == 0
