"""Side by side: bench/pipeline.py's measured rows vs the simulator's `cpu-bench` prediction.

For every (workload, concurrency) of a pipeline.json, simulates the same closed loop (same
prompt length, reuse, request count ``c + max(c, 8|16)``, throughput over the window in
which every client stays busy, as bench/pipeline.py measures it) under both policies with
the calibrated ``cpu-bench`` preset, median over 3 prompt draws (and, for reference,
``cpu-bench-forward``: the isolated forward's costs only), and flags predictions more
than ``--tolerance`` off.
The runtime's wave policy plans with the MPU planner (runtime/leader_core.py), so does
the simulated one here. The simulator is deterministic given the draw.

    python bench/sim_vs_pipeline.py --pipeline /work/notes/bench/pipeline.json \\
        --json sim_vs_pipeline.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from prefill_node.core.planner import PlannerMode
from prefill_node.sim.policies import lockstep_policy, wave_policy
from prefill_node.sim.presets import Preset, get_preset
from prefill_node.sim.roofline import PipelineRoofline
from prefill_node.sim.simulator import Simulator
from prefill_node.sim.workloads import WorkloadKind, WorkloadSpec

KINDS = {"cold": WorkloadKind.COLD, "reuse90": WorkloadKind.REUSE, "mixed75": WorkloadKind.MIXED}
PROMPT = 1024  # bench/pipeline.py PROMPT


def simulate(
    preset: Preset, workload: str, concurrency: int, policy: str, quick: bool, seeds: int = 3
) -> dict:
    """The simulator's figures for one bench row, measured the way bench/pipeline.py does:
    the median over ``seeds`` prompt draws, as the bench takes the median of its runs (with
    9-64 requests a run, the warm share of mixed75 varies by +-15% between draws)."""
    runs = [_simulate_once(preset, workload, concurrency, policy, quick, s) for s in range(seeds)]
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def _simulate_once(
    preset: Preset, workload: str, concurrency: int, policy: str, quick: bool, seed: int
) -> dict:
    n = concurrency + max(concurrency, 8 if quick else 16)
    spec = WorkloadSpec(KINDS[workload], PROMPT, concurrency, n, preset.block_size, seed=seed)
    pol = wave_policy(2, PlannerMode.MPU) if policy == "wave" else lockstep_policy(2)
    sim = Simulator(preset, spec, pol)
    res = sim.run()
    done = sorted(sim.records, key=lambda r: r.finished)
    window = done[: max(1, n - concurrency + 1)]
    span = window[-1].finished
    lat = sorted(r.latency for r in done)
    return {
        "input_tok_s": sum(r.prompt_tokens for r in window) / span,
        "computed_tok_s": sum(r.prompt_tokens - r.cached_tokens for r in window) / span,
        "p50_s": lat[len(lat) // 2],
        "utilisation": res.stage_utilisation,
    }


def compare(
    bench_rows: list[dict], preset: Preset, tolerance: float, progress: bool = True
) -> list[dict]:
    """One flat row per bench row: measured, predicted, predicted/measured, flags."""
    quick = max(r["concurrency"] for r in bench_rows) <= 32
    out = []
    for b in tqdm(bench_rows, desc="simulating", disable=not progress):
        s = simulate(preset, b["workload"], b["concurrency"], b["policy"], quick)
        row = {"workload": b["workload"], "concurrency": b["concurrency"], "policy": b["policy"]}
        for key in ("input_tok_s", "computed_tok_s", "p50_s"):
            row[f"bench_{key}"] = b[key]
            row[f"sim_{key}"] = s[key]
            row[f"sim_over_bench_{key}"] = s[key] / b[key]
        row["bench_busy"] = (b["busy_stage0"] + b["busy_stage1"]) / 2
        row["sim_busy"] = s["utilisation"]
        out.append(row)
    for row in out:
        other = next(
            r
            for r in out
            if (r["workload"], r["concurrency"]) == (row["workload"], row["concurrency"])
            and r["policy"] != row["policy"]
        )
        wave, lock = (row, other) if row["policy"] == "wave" else (other, row)
        for src in ("bench", "sim"):
            row[f"{src}_wave_over_lockstep"] = (
                wave[f"{src}_input_tok_s"] / lock[f"{src}_input_tok_s"]
            )
        ratio = row["sim_wave_over_lockstep"] / row["bench_wave_over_lockstep"]
        row["sim_over_bench_ratio"] = ratio
        row["flag_input"] = abs(row["sim_over_bench_input_tok_s"] - 1) > tolerance
        row["flag_ratio"] = abs(ratio - 1) > tolerance
    out.sort(key=lambda r: (r["workload"], r["concurrency"], r["policy"]))
    return out


def with_overheads(preset: Preset, scale: float, wave_s: float, host_s: float) -> Preset:
    """``preset`` with compute ``scale``d, ``wave_s`` per wave per stage, and ``host_s`` of
    round host work per prompt token."""
    layers = max(
        s.num_layers
        for s in PipelineRoofline(
            preset.model, preset.gpu, preset.link, preset.num_stages, preset.block_size
        ).stages
    )
    gpu = replace(
        preset.gpu,
        flops_efficiency=preset.gpu.flops_efficiency / scale,
        chunk_overhead_s=preset.gpu.chunk_overhead_s * scale,
        layer_overhead_s=wave_s / layers,
    )
    return replace(preset, gpu=gpu, rounds=replace(preset.rounds, host_s_per_token=host_s))


def fit_overheads(bench_rows: list[dict], preset: Preset) -> list[dict]:
    """Grid search of (compute scale, per-wave cost, round host work per token) minimising the
    mean |log(sim / bench)| of input tok/s over all rows; rows sorted best first."""
    grid = [
        (scale, wave_ms, host_us)
        for scale in (1.0, 1.2, 1.4)
        for wave_ms in (0.0, 4.0, 8.0, 12.0)
        for host_us in (1.0, 5.0, 10.0, 20.0)
    ]
    out = []
    for scale, wave_ms, host_us in tqdm(grid, desc="fitting"):
        p = with_overheads(preset, scale, wave_ms * 1e-3, host_us * 1e-6)
        rows = compare(bench_rows, p, 0.2, progress=False)
        err = sum(abs(math.log(r["sim_over_bench_input_tok_s"])) for r in rows) / len(rows)
        out.append({"scale": scale, "wave_ms": wave_ms, "host_us_per_token": host_us, "err": err})
    return sorted(out, key=lambda r: r["err"])


def markdown(rows: list[dict]) -> str:
    lines = [
        "| workload | c | policy | bench in tok/s | sim in tok/s | sim/bench | sim fwd-only "
        "| computed share bench/sim | bench busy | sim busy | bench w/l | sim w/l "
        "| sim/bench w/l |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        f1 = " **>20%**" if r["flag_input"] else ""
        f2 = " **>20%**" if r["flag_ratio"] else ""
        lines.append(
            f"| {r['workload']} | {r['concurrency']} | {r['policy']} "
            f"| {r['bench_input_tok_s']:.0f} | {r['sim_input_tok_s']:.0f} "
            f"| {r['sim_over_bench_input_tok_s']:.2f}{f1} "
            f"| {r.get('sim_forward_only_input_tok_s', float('nan')):.0f} "
            f"| {r['bench_computed_tok_s'] / r['bench_input_tok_s']:.2f}/"
            f"{r['sim_computed_tok_s'] / r['sim_input_tok_s']:.2f} | {r['bench_busy']:.2f} "
            f"| {r['sim_busy']:.2f} | {r['bench_wave_over_lockstep']:.2f}x "
            f"| {r['sim_wave_over_lockstep']:.2f}x | {r['sim_over_bench_ratio']:.2f}{f2} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--pipeline", type=Path, required=True, help="bench/pipeline.py --json rows")
    ap.add_argument("--json", type=Path, default=None, help="write the side-by-side rows here")
    ap.add_argument("--preset", default="cpu-bench")
    ap.add_argument("--tolerance", type=float, default=0.2, help="flag |sim/bench - 1| above")
    ap.add_argument("--fit", action="store_true", help="grid-fit the pipeline overheads")
    args = ap.parse_args()
    bench_rows = json.loads(args.pipeline.read_text())
    if args.fit:  # from the forward-only constants, as presets.py's comments describe
        for r in fit_overheads(bench_rows, get_preset("cpu-bench-forward"))[:8]:
            print(r)
        return
    rows = compare(bench_rows, get_preset(args.preset), args.tolerance)
    forward = compare(bench_rows, get_preset("cpu-bench-forward"), args.tolerance, progress=False)
    for row, f in zip(rows, forward, strict=True):
        row["sim_forward_only_input_tok_s"] = f["sim_input_tok_s"]
    print(markdown(rows))
    flagged = sum(r["flag_input"] for r in rows)
    print(f"\n{flagged} of {len(rows)} throughput cells off by more than {args.tolerance:.0%}")
    for key in ("sim_input_tok_s", "sim_forward_only_input_tok_s"):
        err = statistics.mean(abs(math.log(r[key] / r["bench_input_tok_s"])) for r in rows)
        print(f"mean |log(sim/bench)| of input tok/s, {key}: {err:.2f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
