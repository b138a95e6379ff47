"""Simulator: drives the real admission core, deterministic, exact schedules, roofline, CLI."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from prefill_node.cli.main import main
from prefill_node.core.planner import PlannerMode
from prefill_node.core.policy import sync_admission_policy, trtllm_policy, wave_policy
from prefill_node.core.wave import ScheduledChunk
from prefill_node.sim.policies import ExecutorKind
from prefill_node.sim.presets import PRESETS, Preset, UnknownPresetError, get_preset
from prefill_node.sim.report import compare, regressions
from prefill_node.sim.roofline import PipelineRoofline
from prefill_node.sim.simulator import Simulator
from prefill_node.sim.specs import GPUSpec, InvalidSpecError, LinkSpec, ModelSpec, RoundCostSpec
from prefill_node.sim.workloads import InvalidWorkloadError, WorkloadKind, WorkloadSpec

TOY_MODEL = ModelSpec(
    name="toy",
    num_layers=4,
    hidden=256,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    dense_intermediate=512,
    vocab=1000,
)
TOY_GPU = GPUSpec(
    name="toy",
    memory_bytes=40e6,
    hbm_bytes_per_s=1e12,
    linear_flops_per_s=2e11,
    attention_flops_per_s=2e11,
    flops_efficiency=1.0,
    usable_memory_fraction=1.0,
)
# 2 stages of 2 layers; KV 2 x 2 x 64 x 2 bytes x 2 layers = 1 KiB per token per stage.
TOY = Preset(
    name="toy",
    description="4-layer toy model on 2 stages, admission cost comparable to compute",
    model=TOY_MODEL,
    gpu=TOY_GPU,
    link=LinkSpec(bytes_per_s=1e10, latency_s=1e-5),
    rounds=RoundCostSpec(phase_latency_s=1e-3, host_s_per_token=1e-6),
    num_stages=2,
    block_size=64,
    max_wave_tokens=1024,
    min_wave_tokens=256,
    max_batch=16,
    input_lens=(2048, 4096, 8192),
)


def run(kind: WorkloadKind, conc: int, policy, preset: Preset = TOY, n: int = 24, **kw):
    check = kw.pop("check", False)
    spec = WorkloadSpec(kind, 4096, conc, n, preset.block_size, suffix_tokens=512, **kw)
    return Simulator(preset, spec, policy, check_integrity=check).run()


def test_toy_roofline_is_the_hand_computed_formula():
    roof = PipelineRoofline(TOY_MODEL, TOY_GPU, TOY.link, 2, 64)
    # Per layer: attention 256*256 (q) + 2*256*128 (k, v) + 256*256 (o) = 196,608 params,
    # MLP 3*256*512 = 393,216; 2 layers -> 1,179,648 active params per stage.
    # Chunk of 512 at offset 3584: pairs = 512 * (3584 + 256) = 1,966,080, pair FLOPs
    # 4 * 4 heads * 64 = 1024, 2 layers. Compute-bound (bytes are ~MBs at 1 TB/s).
    lin = 2 * 1_179_648 * 512
    att = 2 * 1024 * 512 * (3584 + 256)
    expected = (lin + att) / 2e11
    got = roof.stage_time(0, [ScheduledChunk("a", 3584, 512)])
    assert got == pytest.approx(expected, rel=1e-12)
    # Capacity: (40e6 - weights) // (1024 bytes * 64 tokens); stage 0 also holds the
    # embedding and stage 1 the LM head, 1000 * 256 * 2 bytes each.
    weights = 2 * (196_608 + 393_216) * 2 + 1000 * 256 * 2
    assert roof.stages[0].capacity_blocks == int((40e6 - weights) // (1024 * 64))
    assert roof.transfer_time(1000) == pytest.approx(1e-5 + 1000 * 256 * 2 / 1e10)


def test_presets_match_their_model_cards():
    # Totals from the public cards: MiniMax-M2 230B, GLM-5 744B, Kimi-K2 ~1.04T.
    for name, total in (("minimax-pp4", 230e9), ("glm5-pp4", 744e9), ("kimi-pp8", 1.04e12)):
        assert get_preset(name).model.total_params() == pytest.approx(total, rel=0.02)
    for preset in PRESETS.values():  # every preset builds and fits its GPUs
        roof = PipelineRoofline(
            preset.model, preset.gpu, preset.link, preset.num_stages, preset.block_size
        )
        assert min(s.capacity_blocks for s in roof.stages) * preset.block_size > max(
            preset.input_lens
        )
    with pytest.raises(UnknownPresetError, match="choose one of"):
        get_preset("nope")


def test_same_seed_same_output_other_seed_other_prompts():
    a = run(WorkloadKind.MIXED, 4, wave_policy(2), seed=7)
    b = run(WorkloadKind.MIXED, 4, wave_policy(2), seed=7)
    c = run(WorkloadKind.MIXED, 4, wave_policy(2), seed=8)
    assert a == b
    assert a.cached_fraction != c.cached_fraction  # the warm/cold draw depends on the seed


def test_reuse_goes_through_the_real_core_and_integrity_holds_throughout():
    res = run(WorkloadKind.REUSE, 4, wave_policy(2), n=12, check=True)
    assert (res.completed, res.rejected) == (12, 0)
    # 90% of 4096 = 3686 -> 3648 tokens (57 whole blocks) seeded, all found on both stages.
    assert res.cached_fraction == pytest.approx(3648 / 4096)
    cold = run(WorkloadKind.COLD, 4, trtllm_policy(2), n=12, check=True)
    assert cold.cached_fraction == 0.0


def test_request_larger_than_a_stage_cache_is_rejected_by_the_core():
    small = replace(TOY, gpu=replace(TOY_GPU, memory_bytes=4e6))  # ~3,000 tokens per stage
    res = run(WorkloadKind.COLD, 2, wave_policy(2), preset=small, n=5)
    assert (res.completed, res.rejected) == (0, 5)


def test_every_planner_ablation_completes_with_integrity():
    for mode in PlannerMode:
        res = run(WorkloadKind.COLD, 1, wave_policy(2, mode), n=6, check=True)
        assert (res.completed, res.rejected) == (6, 0)


def test_regressions_lists_settings_where_wave_is_behind_by_more_than_the_tolerance():
    wave = run(WorkloadKind.REUSE, 2, wave_policy(2), n=4)
    lock = run(WorkloadKind.REUSE, 2, trtllm_policy(2), n=4)
    slow = replace(wave, throughput_tok_s=0.9 * lock.throughput_tok_s)
    assert [c.wave for c in regressions([slow, lock])] == [slow]
    assert regressions([replace(wave, throughput_tok_s=0.98 * lock.throughput_tok_s), lock]) == []


def test_bad_workloads_and_specs_raise_typed_errors():
    with pytest.raises(InvalidWorkloadError, match="exceed the 4K suffix"):
        WorkloadSpec(WorkloadKind.SUFFIX, 4096, 1, 1, 64)
    with pytest.raises(InvalidWorkloadError, match="concurrency"):
        WorkloadSpec(WorkloadKind.COLD, 4096, 0, 1, 64)
    with pytest.raises(InvalidSpecError, match="does not fit"):
        PipelineRoofline(TOY_MODEL, replace(TOY_GPU, memory_bytes=1e5), TOY.link, 2, 64)


def test_cli_writes_rows_table_and_plot(tmp_path, capsys):
    out, png = tmp_path / "rows.json", tmp_path / "plot.png"
    code = main(
        [
            "sim",
            "--preset",
            "cpu",
            "--workload",
            "reuse90",
            "--input-len",
            "1024",
            "--concurrency",
            "1",
            "2",
            "--requests",
            "4",
            "--json",
            str(out),
            "--plot",
            str(png),
        ]
    )
    assert code == 0
    rows = json.loads(out.read_text())
    assert [(r["policy"], r["concurrency"]) for r in rows] == [
        ("wave[cost]", 1),
        ("trtllm", 1),
        ("wave[cost]", 2),
        ("trtllm", 2),
    ]
    assert all(isinstance(v, int | float | str) for r in rows for v in r.values())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "wave/baseline throughput over 2 settings" in text
    assert main(["sim", "--preset", "cpu", "--concurrency", "0"]) == 2


def test_compare_pairs_wave_with_the_baseline_of_the_same_setting():
    wave = run(WorkloadKind.REUSE, 2, wave_policy(2), n=4)
    lock = run(WorkloadKind.REUSE, 2, trtllm_policy(2), n=4)
    (pair,) = compare([wave, lock])
    assert pair.ratio == pytest.approx(wave.throughput_tok_s / lock.throughput_tok_s)


def test_cpu_bench_preset_is_bench_pipeline_setup_with_calibrated_costs():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import pipeline as bench  # bench/pipeline.py: the setup the preset must describe

    p = get_preset("cpu-bench")
    m, cfg = p.model, bench.MODEL
    assert (m.hidden, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim) == (
        cfg["hidden_size"],
        cfg["num_hidden_layers"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
    )
    assert (m.dense_intermediate, m.vocab) == (cfg["intermediate_size"], cfg["vocab_size"])
    spec = bench.make_spec("wave")
    assert (p.block_size, p.max_wave_tokens, p.min_wave_tokens, p.max_batch) == (
        spec.block_size,
        spec.max_wave_tokens,
        spec.min_wave_tokens,
        spec.max_batch,
    )
    assert p.num_stages == len(spec.layer_ranges) and p.input_lens == (bench.PROMPT,)
    roof = PipelineRoofline(p.model, p.gpu, p.link, p.num_stages, p.block_size)
    assert [s.capacity_blocks for s in roof.stages] == list(spec.stage_blocks)
    assert [(s.layer_start, s.layer_end) for s in roof.stages] == list(spec.layer_ranges)
    # forward-only preset: exactly the fitted a, c, k of bench/calibrate_cpu.py
    fwd = get_preset("cpu-bench-forward")
    froof = PipelineRoofline(fwd.model, fwd.gpu, fwd.link, 2, 16)
    cost = froof.chunk_cost_model()
    assert cost.per_token_s == pytest.approx(68.4e-6)
    assert cost.per_token_context_s == pytest.approx(62.1e-9)
    warm = [ScheduledChunk(str(i), 448, 64) for i in range(4)]
    pairs = 4 * 64 * (448 + 32)
    assert froof.stage_time(1, warm) == pytest.approx(256 * 68.4e-6 + pairs * 62.1e-9 + 4e-4)
    # calibrated preset: compute x1.0 plus 2 ms per wave, 6 us of leader host work per
    # prompt token and 2 ms per round phase (bench/sim_vs_pipeline.py --fit)
    expected = 1.0 * (256 * 68.4e-6 + pairs * 62.1e-9 + 4e-4) + 2e-3
    assert roof.stage_time(1, warm) == pytest.approx(expected)
    assert (p.rounds.host_s_per_token, p.rounds.phase_latency_s) == (6e-6, 2e-3)


def test_cpu_bench_preset_runs_deterministically_through_the_core():
    p = get_preset("cpu-bench")
    runs = [
        Simulator(
            p, WorkloadSpec(WorkloadKind.REUSE, 512, 4, 8, p.block_size), pol, check_integrity=True
        ).run()
        for pol in (wave_policy(2, PlannerMode.MPU), wave_policy(2, PlannerMode.MPU))
    ]
    assert runs[0] == runs[1]
    assert (runs[0].completed, runs[0].rejected) == (8, 0)
    assert runs[0].cached_fraction == pytest.approx(448 / 512)  # 28 whole blocks seeded


# ---- the trtllm baseline's executor loops (executor_loops.py) ---------------------


def test_executor_loops_charge_every_rank_serially_in_wave_order():
    from prefill_node.sim.executor_loops import ExecutorLoops, LoopCosts, WaveHostWork

    loops = ExecutorLoops(3, LoopCosts(walk_s_per_token=1e-6, add_s_per_token=2e-6, hop_s=1e-5))
    work = WaveHostWork(pass_walk_tokens=1000, batch_walk_tokens=400, first_chunk_tokens=500)
    assert loops.leader_free_at() == 0.0
    k, launch0 = loops.begin(0.0, work)
    # rank 0: its scheduler pass walks 1000 tokens (1 ms), then add_sequence 500 (1 ms)
    assert (k, launch0) == (0, pytest.approx(2e-3))
    # rank 1 gets the schedule one hop after rank 0's pass, re-walks the wave's first
    # chunks (can_schedule) and the whole pass (replay), then add_sequence: 2.4 ms
    assert loops.launch_time(1, 0) == pytest.approx(1e-3 + 1e-5 + 1.4e-3 + 1e-3)
    # rank 2 one more hop behind rank 1's receive
    assert loops.launch_time(2, 0) == pytest.approx(1e-3 + 2e-5 + 2.4e-3)
    assert loops.leader_free_at() == pytest.approx(2e-3)  # one wave ahead of GPU 0
    loops.begin(2e-3, WaveHostWork(0, 0, 0))
    assert loops.leader_free_at() is None  # wave 2 waits for GPU 0 to finish wave 0
    loops.gpu_done(0, 0, 5e-3)
    assert loops.leader_free_at() == pytest.approx(5e-3)
    # rank 1's wave 1: its loop is free after launching wave 0 (3.41 ms), no GPU wait yet
    assert loops.launch_time(1, 1) == pytest.approx(1e-3 + 1e-5 + 2.4e-3)
    loops.gpu_done(1, 0, 9e-3)
    loops.begin(5e-3, WaveHostWork(0, 0, 100))
    # rank 1's wave 2 starts only after its GPU finished wave 0 (sync previous sampler event)
    assert loops.launch_time(1, 2) == pytest.approx(9e-3 + 2e-6 * 100)
    assert loops.host_busy_s[0] == pytest.approx(2e-3 + 2e-4)


def _trtllm_single(walk_s: float):
    """One 4,096-token suffix request alone on TOY under trtllm, host costs given."""
    preset = replace(TOY, rounds=replace(TOY.rounds, walk_s_per_token=walk_s))
    spec = WorkloadSpec(WorkloadKind.SUFFIX, 4096, 1, 1, 64, suffix_tokens=512)
    sim = Simulator(preset, spec, trtllm_policy(2))
    return sim.run(), sim.roof, preset


def test_trtllm_request_waits_for_each_rank_loop_exactly():
    # Cheap walks: rank 1's loop finishes while stage 0 computes, only rank 0 stalls.
    res, roof, p = _trtllm_single(27e-9)
    chunk = [ScheduledChunk("req-0", 3584, 512)]  # 3,584 tokens seeded, 512 computed
    t0, t1 = roof.stage_time(0, chunk), roof.stage_time(1, chunk)
    launch0 = 27e-9 * 3584 + 1e-6 * 4096  # pass walk + add_sequence of the whole prompt
    expected = launch0 + t0 + roof.transfer_time(512) + t1
    assert res.p50_latency_s == pytest.approx(expected, rel=1e-9)
    assert res.loop_stall_s == pytest.approx(launch0, rel=1e-9)
    # Dear walks: rank 1 re-walks the prefix twice (can_schedule + its replayed pass) after
    # rank 0's pass and a hop, and stage 1 idles until its own loop has launched the wave.
    res, roof, p = _trtllm_single(1e-5)
    walk0 = 1e-5 * 3584
    launch1 = walk0 + p.link.latency_s + 1e-5 * (3584 + 3584) + 1e-6 * 4096
    arrive1 = walk0 + 1e-6 * 4096 + t0 + roof.transfer_time(512)
    assert launch1 > arrive1
    assert res.p50_latency_s == pytest.approx(launch1 + t1, rel=1e-9)
    assert res.loop_stall_s == pytest.approx(walk0 + 1e-6 * 4096 + launch1 - arrive1, rel=1e-9)


def test_trtllm_scheduler_pass_walks_every_admitted_context_request():
    # At c=8 the pass walks all admitted requests' cached prefixes on every iteration,
    # so dearer walks slow trtllm down while wave (no such pass) is unaffected.
    cheap = replace(TOY, rounds=replace(TOY.rounds, walk_s_per_token=0.0))
    dear = replace(TOY, rounds=replace(TOY.rounds, walk_s_per_token=1e-5))
    lock = [run(WorkloadKind.SUFFIX, 8, trtllm_policy(2), preset=p) for p in (cheap, dear)]
    wave = [run(WorkloadKind.SUFFIX, 8, wave_policy(2), preset=p) for p in (cheap, dear)]
    assert wave[0] == replace(wave[1], preset=wave[0].preset)
    assert lock[1].throughput_tok_s < 0.8 * lock[0].throughput_tok_s
    assert lock[1].loop_stall_s > lock[0].loop_stall_s
    again = run(WorkloadKind.SUFFIX, 8, trtllm_policy(2), preset=dear)
    assert again == lock[1]  # deterministic


# ---- sync-admission: rounds on the leader's loop (leader_rounds.py) ---------


def test_leader_rounds_phase_waits_for_a_busy_stage_then_advances():
    from prefill_node.errors import InvariantError
    from prefill_node.sim.leader_rounds import LeaderRounds

    lr = LeaderRounds(3, 2, 1e-3)
    assert (lr.active, lr.one_way_s) == (False, 5e-4)
    lr.begin()
    with pytest.raises(InvariantError):
        lr.begin()
    assert lr.arrive(1, stage_busy=False) is True  # idle stage answers at once
    assert lr.arrive(2, stage_busy=True) is False  # mid-wave: parked behind the wave
    assert lr.reply(1) is False
    with pytest.raises(InvariantError):
        lr.next_phase()  # stage 2 still owes phase 1
    assert lr.stage_free(1) is False and lr.stage_free(2) is True and lr.stage_free(2) is False
    assert lr.reply(2) is True
    assert lr.next_phase() is True and lr.phase == 2
    assert lr.arrive(1, False) and lr.arrive(2, False)
    assert not lr.reply(2) and lr.reply(1)
    assert lr.next_phase() is False and not lr.active


def _leader_rounds_single(walk_s: float):
    preset = replace(
        TOY,
        executor=ExecutorKind.WAVEPP_RUNTIME,
        rounds=replace(TOY.rounds, walk_s_per_token=walk_s),
    )
    spec = WorkloadSpec(WorkloadKind.SUFFIX, 4096, 1, 1, 64, suffix_tokens=512)
    sim = Simulator(preset, spec, sync_admission_policy(2))
    return sim.run(), sim.roof


def test_sync_admission_request_pays_the_round_on_stage0_loop_exactly():
    res, roof = _leader_rounds_single(27e-9)
    chunk = [ScheduledChunk("req-0", 3584, 512)]
    t0, t1 = roof.stage_time(0, chunk), roof.stage_time(1, chunk)
    # the leader's host work for the 4,096-token prompt, then 3 phases of 1 ms (stage 1 is
    # idle, answers at once), then the wave: no scheduler walks, no per-rank replay
    round_s = 1e-6 * 4096 + 3 * 1e-3
    assert res.p50_latency_s == pytest.approx(round_s + t0 + roof.transfer_time(512) + t1)
    assert res.loop_stall_s == pytest.approx(round_s)
    assert _leader_rounds_single(1e-5)[0] == res  # the walk cost plays no part


def test_leader_sharing_stage0_core_delays_stage0_by_its_host_work_exactly():
    """With ``leader_shares_stage0_core`` the wave policy's round host work (1 us per prompt
    token) also occupies stage 0 before its next wave; without it only admission waits."""
    spec = WorkloadSpec(WorkloadKind.SUFFIX, 4096, 1, 1, 64, suffix_tokens=512)
    off, on = (
        Simulator(replace(TOY, leader_shares_stage0_core=flag), spec, wave_policy(2)).run()
        for flag in (False, True)
    )
    assert TOY.rounds.host_s_per_token == 1e-6 and off.completed == on.completed == 1
    assert on.p50_latency_s - off.p50_latency_s == pytest.approx(1e-6 * 4096)
    assert get_preset("cpu-bench").leader_shares_stage0_core
    assert not get_preset("glm5-pp4").leader_shares_stage0_core


def test_cpu_bench_runs_our_runtime_and_gpu_presets_trtllm_executor():
    assert get_preset("cpu-bench").executor is ExecutorKind.WAVEPP_RUNTIME
    assert get_preset("cpu-bench-forward").executor is ExecutorKind.WAVEPP_RUNTIME
    for name in ("glm5-pp4", "minimax-pp4", "kimi-pp8"):
        assert get_preset(name).executor is ExecutorKind.TRTLLM
    p = get_preset("cpu-bench")
    spec = WorkloadSpec(WorkloadKind.MIXED, 1024, 8, 16, p.block_size, seed=3)
    runs = [Simulator(p, spec, sync_admission_policy(2), check_integrity=True).run() for _ in "ab"]
    assert runs[0] == runs[1] and (runs[0].completed, runs[0].rejected) == (16, 0)
    assert runs[0].loop_stall_s > 0


def test_round_host_work_charges_cached_prefix_tokens_at_their_own_rate():
    flat = RoundCostSpec(phase_latency_s=1e-3, host_s_per_token=6e-6)
    split = replace(flat, host_s_per_cached_token=2e-6)
    assert flat.round_s(1024, 912) == pytest.approx(3e-3 + 6e-6 * 1024)  # unset: one rate
    assert split.round_s(1024, 912) == pytest.approx(3e-3 + 6e-6 * 112 + 2e-6 * 912)
    assert split.host_s(1024, 5000) == pytest.approx(2e-6 * 1024)  # cached never > prompt
    assert get_preset("cpu-bench").rounds.host_s_per_cached_token == 2e-6


def test_cached_prefix_rate_speeds_up_simulated_reuse_on_a_shared_leader_core():
    base = get_preset("cpu-bench")
    costly = replace(base, rounds=replace(base.rounds, host_s_per_cached_token=None))
    spec = WorkloadSpec(WorkloadKind.REUSE, 1024, 64, 192, base.block_size, seed=1)
    pol = wave_policy(2, PlannerMode.MPU)
    runs = [Simulator(p, spec, pol).run() for p in (base, costly)]
    assert runs[0].throughput_tok_s > 1.1 * runs[1].throughput_tok_s
