"""The one scheduling Policy: its knobs, its headroom rule, shared by runtime and simulator."""

from __future__ import annotations

from dataclasses import replace

import pytest

from prefill_node.core.planner import PlannerMode
from prefill_node.core.policy import (
    Policy,
    PolicyKind,
    UnknownPolicyError,
    parse_planner_mode,
    parse_policy_kind,
    sync_admission_policy,
    trtllm_policy,
    wave_policy,
)
from prefill_node.runtime.spec import ModelSource, PipelineSpec
from prefill_node.sim.simulator import Simulator
from prefill_node.sim.workloads import WorkloadKind, WorkloadSpec
from tests.test_sim import TOY


def test_wave_trtllm_and_sync_admission_knobs() -> None:
    wave, lock = wave_policy(4, PlannerMode.MPU), sync_admission_policy(4)
    trt = trtllm_policy(4)
    # the baseline and the ablation share every knob; only who decides admission differs
    assert trt == Policy(**{**lock.__dict__, "kind": PolicyKind.TRTLLM})
    assert trt.rank0_decides and not lock.rank0_decides and not wave.rank0_decides
    assert trt.admission_on_loop and not wave.admission_on_loop and trt.name == "trtllm"
    assert (wave.kind, wave.ring_size, wave.max_chunks_in_flight, wave.fragment_rule) == (
        PolicyKind.WAVE,
        8,
        None,
        True,
    )
    assert (lock.kind, lock.ring_size, lock.max_chunks_in_flight, lock.fragment_rule) == (
        PolicyKind.SYNC_ADMISSION,
        4,
        1,
        False,
    )
    assert lock.planner_mode is PlannerMode.FIXED and lock.admission_on_loop
    assert (wave.name, lock.name) == ("wave[mpu]", "sync-admission")


def test_headroom_is_2PM_tokens_capped_at_a_quarter_of_the_stage() -> None:
    pol = wave_policy(2)
    # 2 * 2 * 64 tokens = 256 tokens = 16 blocks of 16
    assert pol.headroom_blocks(1000, 16, 64) == 16
    assert pol.headroom_blocks(40, 16, 64) == 10  # a quarter of 40
    assert pol.headroom_blocks(3, 16, 64) == 0


def test_planner_config_takes_mode_and_fragment_rule_from_the_policy() -> None:
    cfg = sync_admission_policy(2).planner_config(
        max_wave_tokens=64, min_wave_tokens=32, block_size=16, max_wave_requests=8
    )
    assert (cfg.mode, cfg.fragment_rule, cfg.num_stages) == (PlannerMode.FIXED, False, 2)


def test_runtime_spec_runs_the_core_policy_with_its_headroom() -> None:
    spec = PipelineSpec(
        model=ModelSource(config={"x": 1}),
        layer_ranges=((0, 1), (1, 3)),
        stage_blocks=(40, 1000),
        block_size=16,
        max_wave_tokens=64,
        min_wave_tokens=32,
        max_requests_per_round=5,
    )
    assert spec.scheduling_policy == wave_policy(2, PlannerMode.MPU, 5)
    assert [spec.headroom_blocks(s) for s in (0, 1)] == [10, 16]
    lock = replace(spec, policy="sync-admission")
    assert lock.scheduling_policy == sync_admission_policy(2, 5) and lock.ring == 2
    trt = replace(spec, policy="trtllm")
    assert trt.scheduling_policy == trtllm_policy(2, 5) and trt.ring == 2


def test_simulator_stages_get_the_policy_headroom() -> None:
    spec = WorkloadSpec(WorkloadKind.COLD, 4096, 1, 1, TOY.block_size)
    pol = wave_policy(2)
    sim = Simulator(TOY, spec, pol)
    got = [s.config.headroom_blocks for s in sim.core.stages]
    want = [
        pol.headroom_blocks(s.config.num_blocks, TOY.block_size, TOY.max_wave_tokens)
        for s in sim.core.stages
    ]
    assert got == want and all(h > 0 for h in got)


def test_names_parse_or_raise_a_typed_error() -> None:
    assert parse_policy_kind("sync-admission") is PolicyKind.SYNC_ADMISSION
    assert parse_policy_kind("trtllm") is PolicyKind.TRTLLM
    assert parse_planner_mode("cost") is PlannerMode.COST_AWARE
    with pytest.raises(UnknownPolicyError, match="choose one of wave, trtllm, sync-admission"):
        parse_policy_kind("eager")
    with pytest.raises(UnknownPolicyError):
        Policy(PolicyKind.WAVE, 0, PlannerMode.MPU, 0, True, True)
