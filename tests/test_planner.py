"""MPU wave planner: formulas, hysteresis sequences and FCFS packing with exact budgets."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefill_node.core.cost_model import ChunkCostModel, InvalidCostModelError
from prefill_node.core.planner import (
    InvalidPlannerConfigError,
    PlannerConfig,
    PlannerMode,
    WavePlanner,
    drain_bound,
    target_budget,
)
from prefill_node.core.wave import ScheduledChunk, UnscheduledWork, Wave
from prefill_node.errors import InvariantError

# P = 4: R = 8, S = 12, raise after 4, lower after 4; budgets 16384 / 8192 / 4096 / 2048.
CFG = PlannerConfig(num_stages=4, max_wave_tokens=16384, min_wave_tokens=2048, block_size=256)


def work(*remaining: int, start: int = 0) -> list[UnscheduledWork]:
    return [UnscheduledWork(f"r{i}", start, start + n) for i, n in enumerate(remaining)]


def test_derived_constants():
    assert (CFG.ring_size, CFG.target_waves, CFG.raise_after, CFG.lower_after) == (8, 12, 4, 4)
    assert CFG.candidate_budgets() == (16384, 8192, 4096, 2048)
    f3 = PlannerConfig(
        num_stages=2, max_wave_tokens=1024, min_wave_tokens=256, block_size=16, fill_factor=3
    )
    assert (f3.ring_size, f3.target_waves) == (4, 8)  # S = 2P + (3-1)P


def test_candidates_align_down_to_blocks_and_stop_at_b_min():
    cfg = PlannerConfig(num_stages=4, max_wave_tokens=12 * 96, min_wave_tokens=96, block_size=96)
    # 1152 -> 576 -> 288 -> alignDown_96(144) = 96
    assert cfg.candidate_budgets() == (1152, 576, 288, 96)
    paper = PlannerConfig(num_stages=4, max_wave_tokens=16384, min_wave_tokens=8192, block_size=32)
    assert paper.candidate_budgets() == (16384, 8192)


@pytest.mark.parametrize(
    ("remaining", "expected"),
    [
        ((12 * 16384,), 16384),  # W / M = 12 = S exactly
        ((12 * 16384 - 1,), 8192),  # just short of 12 waves at M
        ((8193,) * 12, 16384),  # N_{>8192} = 12 = S although W / M = 6
        ((8192,) * 12, 8192),  # N_{>8192} = 0; W / 8192 = 12
        ((4096,) * 5, 2048),  # nothing reaches S: b_min
        ((1000,), 2048),
        ((), 2048),
    ],
)
def test_target_budget(remaining, expected):
    assert target_budget(CFG, work(*remaining)) == expected


def test_hysteresis_lowers_after_p_decisions_to_the_streaks_largest_target():
    planner = WavePlanner(CFG)
    small, mid = work(1000), work(*(8192,) * 12)  # targets 2048 and 8192
    assert [planner.decide_budget(small) for _ in range(3)] == [16384, 16384, 16384]
    assert planner.decide_budget(mid) == 8192  # 4th lower decision; max(2048, 8192)
    assert planner.budget == 8192


def test_hysteresis_raise_needs_r_over_2_uninterrupted_decisions():
    planner = WavePlanner(CFG)
    for _ in range(4):
        planner.decide_budget(work(1000))
    assert planner.budget == 2048
    big = work(12 * 16384)
    same = work(1000)  # target 2048 == budget: ends the streak
    seq = [planner.decide_budget(w) for w in (big, big, big, same, big, big, big, big)]
    assert seq == [2048, 2048, 2048, 2048, 2048, 2048, 2048, 16384]


def test_hysteresis_raise_goes_to_the_streaks_smallest_target():
    planner = WavePlanner(CFG)
    for _ in range(4):
        planner.decide_budget(work(1000))
    targets = [work(12 * 16384), work(12 * 4096), work(12 * 16384), work(12 * 16384)]
    assert [planner.decide_budget(w) for w in targets] == [2048, 2048, 2048, 4096]


def test_direction_change_restarts_the_streak():
    planner = WavePlanner(CFG)
    for _ in range(4):
        planner.decide_budget(work(*(8192,) * 12))  # -> 8192
    assert planner.budget == 8192
    up, down = work(12 * 16384), work(1000)
    seq = [planner.decide_budget(w) for w in (up, up, up, down, up, up, up, up)]
    assert seq == [8192] * 7 + [16384]


def test_no_hysteresis_and_fixed_modes():
    from dataclasses import replace

    nohyst = WavePlanner(replace(CFG, mode=PlannerMode.MPU_NO_HYSTERESIS))
    assert [nohyst.decide_budget(w) for w in (work(1000), work(12 * 16384))] == [2048, 16384]
    fixed = WavePlanner(replace(CFG, mode=PlannerMode.FIXED))
    assert [fixed.decide_budget(work(1000)) for _ in range(10)] == [16384] * 10


def chunks(wave: Wave | None) -> list[tuple[str, int, int]]:
    assert wave is not None
    return [(c.request_id, c.start, c.length) for c in wave.chunks]


# P = 2, M = 512, b_min = 256, B = 16 (what `wavepp serve` runs), drain bound k = 16.
DRAIN = PlannerConfig(
    num_stages=2, max_wave_tokens=512, min_wave_tokens=256, block_size=16, wave_overhead_tokens=16
)


def test_drain_bound_is_the_square_root_rule_in_whole_blocks():
    assert drain_bound(DRAIN, 1024) == 128  # sqrt(1024 * 16 / 1)
    assert drain_bound(DRAIN, 1000) == 128  # sqrt(16000) = 126.5, aligned up
    assert drain_bound(DRAIN, 1) == 16  # at least one block
    assert drain_bound(DRAIN, 1 << 20) == 512  # never above M
    four = PlannerConfig(4, 512, 256, 16, wave_overhead_tokens=48)
    assert drain_bound(four, 1024) == 128  # sqrt(1024 * 48 / 3)
    off = PlannerConfig(2, 512, 256, 16)
    one_stage = PlannerConfig(1, 512, 256, 16, wave_overhead_tokens=16)
    assert drain_bound(off, 16) == drain_bound(one_stage, 16) == 512  # no bound


def test_drain_bound_caps_shallow_work_below_b_min_and_leaves_deep_work_at_m():
    assert target_budget(DRAIN, work(128 * 8)) == 128  # MPU alone: b_min = 256
    assert target_budget(replace(DRAIN, wave_overhead_tokens=0), work(1024)) == 256
    assert target_budget(DRAIN, work(*[4096] * 4)) == 512  # deep: sqrt(16384 * 16) > M


def test_an_idle_pipeline_takes_the_target_at_once_only_with_a_drain_bound():
    planner = WavePlanner(DRAIN)  # budget M from the start, as after a deep burst
    assert planner.budget == 512
    assert planner.decide_budget(work(1024), idle=False) == 512  # one lower decision of P
    assert planner.decide_budget(work(1024), idle=True) == 128
    plain = WavePlanner(replace(DRAIN, wave_overhead_tokens=0))
    assert plain.decide_budget(work(1024), idle=True) == 512  # MPU's hysteresis as before


def test_a_lone_prompt_runs_in_waves_that_shrink_as_it_drains():
    """Planned one wave at a time, the first on an idle pipeline: every wave follows the
    drain bound of what is left, so the last waves are the smallest."""
    planner, start, sizes = WavePlanner(DRAIN), 0, []
    while start < 2048:
        wave = planner.plan([UnscheduledWork("p", start, 2048)], idle=start == 0)
        (chunk,) = wave.chunks
        sizes.append(chunk.length)
        start = chunk.end
    assert sizes[0] == 192  # sqrt(2048 * 16) = 181, in whole blocks
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] < sizes[0]
    assert sum(sizes) == 2048 and max(sizes) < 256  # all below b_min


def test_packing_fcfs_with_fragment_of_the_room():
    planner = WavePlanner(CFG)  # budget 16384, fragments >= max(2048, 8192)
    wave = planner.plan([UnscheduledWork("a", 512, 4608), UnscheduledWork("b", 0, 100_000)])
    assert chunks(wave) == [("a", 512, 4096), ("b", 0, 12288)]


def test_fragment_rule_declines_small_room_but_final_remainders_fill_it():
    planner = WavePlanner(CFG)
    pending = [
        UnscheduledWork("a", 0, 10_000),  # final remainder, unaligned: allowed
        UnscheduledWork("b", 0, 100_000),  # room 6384 -> fragment 6144 < 8192: declined
        UnscheduledWork("c", 256, 3256),  # final remainder of 3000 fits
        UnscheduledWork("d", 0, 5000),  # 5000 > room 3384 and fragment 3328 < 8192
    ]
    assert chunks(planner.plan(pending)) == [("a", 0, 10_000), ("c", 256, 3000)]


def test_without_fragment_rule_every_wave_is_filled_to_the_brim():
    from dataclasses import replace

    planner = WavePlanner(replace(CFG, mode=PlannerMode.FIXED, fragment_rule=False))
    pending = [UnscheduledWork("a", 0, 10_000), UnscheduledWork("b", 0, 100_000)]
    assert chunks(planner.plan(pending)) == [("a", 0, 10_000), ("b", 0, 6144)]


def test_wave_ids_increase_and_request_cap_holds():
    from dataclasses import replace

    planner = WavePlanner(replace(CFG, max_wave_requests=2))
    first = planner.plan(work(100, 100, 100))
    second = planner.plan(work(100))
    assert first is not None and second is not None
    assert (first.wave_id, len(first), second.wave_id) == (0, 2, 1)
    assert planner.plan([]) is None


def test_cost_aware_gives_long_context_chunks_fewer_tokens():
    from dataclasses import replace

    # a = 1 s/token, c = 1/1024 s per (token x context token); for a cold request ref =
    # (first_start + end)/2 = 32768, so tau = 16384 * (1 + 32) = 540672 s. At offset 49152:
    # l * (49 + l/2048) <= 540672 -> l = 10031, aligned down to 9984. At offset 0 the
    # M = 16384 token cap binds.
    cost = ChunkCostModel(per_token_s=1.0, per_token_context_s=1 / 1024)
    planner = WavePlanner(replace(CFG, mode=PlannerMode.COST_AWARE), cost)
    assert chunks(planner.plan([UnscheduledWork("x", 0, 65536, 0)])) == [("x", 0, 16384)]
    tail = [UnscheduledWork("x", 49152, 65536, first_start=0)]
    assert chunks(planner.plan(tail)) == [("x", 49152, 9984)]
    assert cost.chunk_cost(49152, 9984) <= 540672 < cost.chunk_cost(49152, 10240)
    # A reuse suffix computes [49152, 65536) only: ref = 57344, tau = 16384 * (1 + 56) =
    # 933888 s = chunk_cost(49152, 16384), so it gets the whole M-token budget, not the
    # 9984 tokens a cold request's tail gets at the same offset (without first_start the
    # planner takes next_start, the same here).
    for suffix in (UnscheduledWork("y", 49152, 65536, 49152), UnscheduledWork("y", 49152, 65536)):
        fresh = WavePlanner(replace(CFG, mode=PlannerMode.COST_AWARE), cost)  # budget M
        assert chunks(fresh.plan([suffix])) == [("y", 49152, 16384)]
    assert cost.chunk_cost(49152, 16384) == 933888
    with pytest.raises(InvariantError):
        UnscheduledWork("z", 100, 200, first_start=101)


def test_cost_model_max_length_is_exact():
    cost = ChunkCostModel(per_token_s=2e-6, per_token_context_s=3e-10)
    for start in (0, 1000, 100_000):
        for budget in (1e-3, 0.05, 2.0):
            n = cost.max_length(start, budget)
            assert cost.chunk_cost(start, n) <= budget < cost.chunk_cost(start, n + 1)
    with pytest.raises(InvalidCostModelError):
        ChunkCostModel(0.0, 0.0)


def test_bad_config_and_chunks_raise_typed_errors():
    with pytest.raises(InvalidPlannerConfigError, match="multiple of block_size"):
        PlannerConfig(num_stages=4, max_wave_tokens=1000, min_wave_tokens=256, block_size=256)
    with pytest.raises(InvalidPlannerConfigError, match="min_wave_tokens <= max_wave_tokens"):
        PlannerConfig(num_stages=4, max_wave_tokens=256, min_wave_tokens=512, block_size=256)
    with pytest.raises(InvalidPlannerConfigError, match="needs a cost model"):
        WavePlanner(PlannerConfig(4, 1024, 256, 256, mode=PlannerMode.COST_AWARE))
    with pytest.raises(InvariantError):
        ScheduledChunk("a", 0, 0)
    with pytest.raises(InvariantError, match="two chunks"):
        Wave(0, (ScheduledChunk("a", 0, 1), ScheduledChunk("a", 1, 1)))


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 40), st.integers(1, 40_000)), min_size=1, max_size=20),
    st.sampled_from(list(PlannerMode)),
)
def test_packing_invariants(items, mode):
    """Any work: chunks are FCFS-ordered, start where the work starts, respect the budget
    (or the M token cap in cost mode) and the fragment rule, and the first request always
    gets a chunk, so planning makes progress."""
    from dataclasses import replace

    cost = ChunkCostModel(per_token_s=1e-6, per_token_context_s=1e-10)
    planner = WavePlanner(replace(CFG, mode=mode), cost)
    pending = [UnscheduledWork(f"r{i}", s * 256, s * 256 + n) for i, (s, n) in enumerate(items)]
    for _ in range(3):
        wave = planner.plan(pending)
        assert wave is not None and wave.chunks[0].request_id == pending[0].request_id
        by_id = {w.request_id: w for w in pending}
        order = [int(c.request_id[1:]) for c in wave.chunks]
        assert order == sorted(order)
        assert wave.num_tokens <= CFG.max_wave_tokens
        budget = planner.budget
        assert budget in CFG.candidate_budgets()
        if mode is not PlannerMode.COST_AWARE:
            assert wave.num_tokens <= budget
        for c in wave.chunks:
            w = by_id[c.request_id]
            assert c.start == w.next_start and c.end <= w.end
            if c.end < w.end:  # a fragment: block-aligned, big enough unless it came first
                assert c.length % CFG.block_size == 0
                if c is not wave.chunks[0] and mode is not PlannerMode.COST_AWARE:
                    assert c.length >= max(CFG.min_wave_tokens, budget // 2)
        taken = {c.request_id: c for c in wave.chunks}
        left = []
        for w in pending:
            c = taken.get(w.request_id)
            if c is None:
                left.append(w)
            elif c.end < w.end:
                left.append(UnscheduledWork(w.request_id, c.end, w.end))
        pending = left
        if not pending:
            break
