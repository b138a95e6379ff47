"""Side by side: bench/pipeline.py's measured rows vs the simulator's `cpu-bench` prediction.

For every (workload, concurrency) of a pipeline.json, simulates the same closed loop (same
prompt length, reuse, request count - the row's ``requests``, else ``c + max(c, --tail)`` -
throughput over the window in which every client stays busy, as bench/pipeline.py measures
it) under both policies with the calibrated ``cpu-bench`` preset, median over 3 prompt
draws (and, for reference, ``cpu-bench-forward``: the isolated forward's costs only), and
flags predictions more than ``--tolerance`` off. The runtime's wave policy plans with the
MPU planner (runtime/leader.py), so does the simulated one here; the simulated
sync-admission is our runtime's (rounds on stage 0's loop; the preset's executor is
``ExecutorKind.WAVEPP_RUNTIME``).
The simulator is deterministic given the draw.

``--fit`` grid-searches every pipeline term the ``cpu-bench`` preset fits (compute scale,
per-wave cost, the leader's host work per prompt token and per cached-prefix token, round
phase latency, whether the leader's host work shares stage 0's core) on the
``--in-sample`` concurrency levels only (default 1, 8, 32): a coarse grid, then a finer
one around its best, and reports the best point's error on the in-sample rows and on the
out-of-sample rows, which the search never saw. Without ``--fit`` the table marks each row
in-sample or OUT-of-sample, and the summary gives both errors separately.

    python bench/sim_vs_pipeline.py --pipeline pipeline_full.json --fit
    python bench/sim_vs_pipeline.py --pipeline pipeline_full.json \\
        --json sim_vs_pipeline.json --md sim_vs_pipeline.md
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from prefill_node.core.planner import PlannerMode
from prefill_node.core.policy import sync_admission_policy, wave_policy
from prefill_node.sim.presets import Preset, get_preset
from prefill_node.sim.roofline import PipelineRoofline
from prefill_node.sim.simulator import Simulator
from prefill_node.sim.workloads import WorkloadKind, WorkloadSpec

KINDS = {"cold": WorkloadKind.COLD, "reuse90": WorkloadKind.REUSE, "mixed75": WorkloadKind.MIXED}
PROMPT = 1024  # bench/pipeline.py PROMPT


def simulate(
    preset: Preset, workload: str, concurrency: int, policy: str, tail: int, seeds: int = 3
) -> dict:
    """The simulator's figures for one bench row, measured the way bench/pipeline.py does:
    the median over ``seeds`` prompt draws, as the bench takes the median of its runs (with
    9-64 requests a run, the warm share of mixed75 varies by +-15% between draws)."""
    runs = [_simulate_once(preset, workload, concurrency, policy, tail, s) for s in range(seeds)]
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def _simulate_once(
    preset: Preset, workload: str, concurrency: int, policy: str, tail: int, seed: int
) -> dict:
    n = concurrency + max(concurrency, tail)
    spec = WorkloadSpec(KINDS[workload], PROMPT, concurrency, n, preset.block_size, seed=seed)
    pol = wave_policy(2, PlannerMode.MPU) if policy == "wave" else sync_admission_policy(2)
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
    bench_rows: list[dict],
    preset: Preset,
    tolerance: float,
    progress: bool = True,
    tail: int = 32,
    seeds: int = 3,
) -> list[dict]:
    """One flat row per bench row: measured, predicted, predicted/measured, flags.
    ``tail``: the bench timed ``c + max(c, tail)`` requests a row, unless the row says
    (``requests``)."""
    out = []
    simulated = [b for b in bench_rows if b["policy"] in ("wave", "sync-admission")]
    for b in tqdm(simulated, desc="simulating", disable=not progress):
        c = b["concurrency"]
        t = int(b["requests"]) - c if "requests" in b else max(c, tail)
        s = simulate(preset, b["workload"], c, b["policy"], t, seeds)
        row = {"workload": b["workload"], "concurrency": b["concurrency"], "policy": b["policy"]}
        for key in ("input_tok_s", "computed_tok_s", "p50_s"):
            row[f"bench_{key}"] = b[key]
            row[f"sim_{key}"] = s[key]
            row[f"sim_over_bench_{key}"] = s[key] / b[key]
        row["bench_busy"] = (b["busy_stage0"] + b["busy_stage1"]) / 2
        row["sim_busy"] = s["utilisation"]
        if "paired_runs" in b:  # bench/pipeline.py's paired ratio (median of per-run ratios)
            row["bench_wave_over_baseline"] = b["wave_over_sync_admission"]
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
            if f"{src}_wave_over_baseline" not in row:
                row[f"{src}_wave_over_baseline"] = (
                    wave[f"{src}_input_tok_s"] / lock[f"{src}_input_tok_s"]
                )
        ratio = row["sim_wave_over_baseline"] / row["bench_wave_over_baseline"]
        row["sim_over_bench_ratio"] = ratio
        row["flag_input"] = abs(row["sim_over_bench_input_tok_s"] - 1) > tolerance
        row["flag_ratio"] = abs(ratio - 1) > tolerance
    out.sort(key=lambda r: (r["workload"], r["concurrency"], r["policy"]))
    return out


def with_overheads(
    preset: Preset,
    scale: float,
    wave_s: float,
    host_s: float,
    phase_s: float | None = None,
    cached_s: float | None = None,
    shares_core: bool | None = None,
) -> Preset:
    """``preset`` with compute ``scale``d, ``wave_s`` per wave per stage, ``host_s`` of the
    leader's round host work per prompt token and (if given) ``phase_s`` per round phase,
    ``cached_s`` per cached-prefix token and ``leader_shares_stage0_core``."""
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
    rounds = replace(preset.rounds, host_s_per_token=host_s)
    if phase_s is not None:
        rounds = replace(rounds, phase_latency_s=phase_s)
    if cached_s is not None:
        rounds = replace(rounds, host_s_per_cached_token=cached_s)
    shares = preset.leader_shares_stage0_core if shares_core is None else shares_core
    return replace(preset, gpu=gpu, rounds=rounds, leader_shares_stage0_core=shares)


COARSE = {  # compute scale, ms per wave per stage, us per prompt token, ms per round phase
    "scale": (1.0, 1.1, 1.2, 1.3),
    "wave_ms": (0.0, 2.0, 4.0, 8.0),
    "host_us_per_token": (1.0, 3.0, 6.0, 12.0),
    "phase_ms": (1.0,),
    "cached_us_per_token": (1.0, 2.0, 6.0),
    "shares_core": (0.0, 1.0),  # leader_shares_stage0_core off / on
}


def _log_error(rows: list[dict]) -> float:
    return statistics.mean(abs(math.log(r["sim_over_bench_input_tok_s"])) for r in rows)


def fit_overheads(
    bench_rows: list[dict], preset: Preset, tail: int, grid: dict[str, tuple[float, ...]]
) -> list[dict]:
    """Grid search over ``grid`` (keys as ``COARSE``) minimising the mean |log(sim / bench)|
    of input tok/s over ``bench_rows`` (the in-sample rows); results sorted best first."""
    points = [
        dict(zip(grid, values, strict=True))
        for values in itertools.product(*(grid[k] for k in grid))
    ]
    out = []
    for g in tqdm(points, desc="fitting"):
        p = with_overheads(
            preset,
            g["scale"],
            g["wave_ms"] * 1e-3,
            g["host_us_per_token"] * 1e-6,
            g["phase_ms"] * 1e-3,
            g["cached_us_per_token"] * 1e-6,
            bool(g["shares_core"]),
        )
        rows = compare(bench_rows, p, 0.2, progress=False, tail=tail)
        out.append({**g, "err": _log_error(rows)})
    return sorted(out, key=lambda r: r["err"])


def refine(best: dict, coarse: dict[str, tuple[float, ...]]) -> dict[str, tuple[float, ...]]:
    """A 3-point grid per term around ``best``: half the coarse grid's step either side
    (phase latency: x0.5, x1, x2)."""
    out = {}
    for key, values in coarse.items():
        v = best[key]
        if key == "phase_ms":
            out[key] = (v / 2, v, v * 2)
            continue
        if key == "shares_core":
            out[key] = (v,)
            continue
        steps = sorted({abs(b - a) for a, b in itertools.pairwise(values)})
        half = steps[0] / 2
        out[key] = tuple(sorted({max(v - half, values[0] if key == "scale" else 0.0), v, v + half}))
    return out


def markdown(rows: list[dict], in_sample: set[int] | None = None) -> str:
    lines = [
        "| workload | c | sample | policy | bench in tok/s | sim in tok/s | sim/bench "
        "| sim fwd-only | computed share bench/sim | bench busy | sim busy | bench w/l "
        "| sim w/l | sim/bench w/l |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        f1 = " **>20%**" if r["flag_input"] else ""
        f2 = " **>20%**" if r["flag_ratio"] else ""
        sample = "-" if in_sample is None else ("in" if r["concurrency"] in in_sample else "OUT")
        lines.append(
            f"| {r['workload']} | {r['concurrency']} | {sample} | {r['policy']} "
            f"| {r['bench_input_tok_s']:.0f} | {r['sim_input_tok_s']:.0f} "
            f"| {r['sim_over_bench_input_tok_s']:.2f}{f1} "
            f"| {r.get('sim_forward_only_input_tok_s', float('nan')):.0f} "
            f"| {r['bench_computed_tok_s'] / r['bench_input_tok_s']:.2f}/"
            f"{r['sim_computed_tok_s'] / r['sim_input_tok_s']:.2f} | {r['bench_busy']:.2f} "
            f"| {r['sim_busy']:.2f} | {r['bench_wave_over_baseline']:.2f}x "
            f"| {r['sim_wave_over_baseline']:.2f}x | {r['sim_over_bench_ratio']:.2f}{f2} |"
        )
    return "\n".join(lines)


def summary(rows: list[dict], tolerance: float) -> str:
    """Error figures of ``rows``: flagged cells, mean |log| of throughput and of w/l."""
    n_in = sum(r["flag_input"] for r in rows)
    n_ratio = sum(r["flag_ratio"] for r in rows) // 2
    ratio_err = statistics.mean(abs(math.log(r["sim_over_bench_ratio"])) for r in rows)
    return (
        f"{len(rows)} rows: {n_in} throughput cells and {n_ratio} of {len(rows) // 2} "
        f"wave/baseline ratios off by more than {tolerance:.0%}; mean |log(sim/bench)| "
        f"input tok/s {_log_error(rows):.3f}, wave/baseline {ratio_err:.3f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--pipeline", type=Path, required=True, help="bench/pipeline.py --json rows")
    ap.add_argument("--json", type=Path, default=None, help="write the side-by-side rows here")
    ap.add_argument("--md", type=Path, default=None, help="write the markdown table here")
    ap.add_argument("--preset", default="cpu-bench")
    ap.add_argument("--tolerance", type=float, default=0.2, help="flag |sim/bench - 1| above")
    ap.add_argument(
        "--in-sample",
        default="1,8,32",
        help="concurrency levels the fit sees; the others are out-of-sample (default 1,8,32)",
    )
    ap.add_argument("--fit", action="store_true", help="grid-fit the pipeline overheads")
    ap.add_argument(
        "--tail",
        type=int,
        default=32,
        help="rows without a `requests` count timed c + max(c, TAIL) requests (bench/pipeline.py"
        " default 32; 16 before 2026-11-29 14:00, 8 with --quick)",
    )
    args = ap.parse_args()
    bench_rows = json.loads(args.pipeline.read_text())
    in_sample = {int(c) for c in args.in_sample.split(",")}
    if args.fit:  # from the forward-only constants, as presets.py's comments describe
        fit_rows = [r for r in bench_rows if r["concurrency"] in in_sample]
        base = get_preset("cpu-bench-forward")
        coarse = fit_overheads(fit_rows, base, args.tail, COARSE)
        print("coarse grid, best 6:")
        for r in coarse[:6]:
            print(r)
        fine = fit_overheads(fit_rows, base, args.tail, refine(coarse[0], COARSE))
        print("refined grid, best 6:")
        for r in fine[:6]:
            print(r)
        best = fine[0]
        fitted = with_overheads(
            base,
            best["scale"],
            best["wave_ms"] * 1e-3,
            best["host_us_per_token"] * 1e-6,
            best["phase_ms"] * 1e-3,
            best["cached_us_per_token"] * 1e-6,
            bool(best["shares_core"]),
        )
        held_out = [r for r in bench_rows if r["concurrency"] not in in_sample]
        for label, subset in (("in-sample (fitted)", fit_rows), ("out-of-sample", held_out)):
            if subset:
                rows = compare(subset, fitted, args.tolerance, progress=False, tail=args.tail)
                print(f"{label}: {summary(rows, args.tolerance)}")
        return
    rows = compare(bench_rows, get_preset(args.preset), args.tolerance, tail=args.tail)

    forward = compare(
        bench_rows, get_preset("cpu-bench-forward"), args.tolerance, progress=False, tail=args.tail
    )
    for row, f in zip(rows, forward, strict=True):
        row["sim_forward_only_input_tok_s"] = f["sim_input_tok_s"]
        row["sample"] = "in" if row["concurrency"] in in_sample else "out"
    preset = get_preset(args.preset)
    gpu, rounds = preset.gpu, preset.rounds
    lines = [
        f"# simulator `{args.preset}` vs `{args.pipeline.name}` (bench/pipeline.py)",
        "",
        f"Preset terms: compute x{1 / gpu.flops_efficiency:.2f}, "
        f"{gpu.layer_overhead_s * 1e3:.2f} ms per layer per wave, "
        f"{rounds.host_s_per_token * 1e6:.1f} us leader host work per prompt token, "
        f"{rounds.phases} round phases of {rounds.phase_latency_s * 1e3:.1f} ms; executor "
        f"model {preset.executor.value}. Fit rows (in-sample): c in "
        f"{sorted(in_sample)}; the others are out-of-sample. Cells more than "
        f"{args.tolerance:.0%} off are marked. w/b = wave / sync-admission input tok/s.",
        "",
        markdown(rows, in_sample),
        "",
    ]
    for label, subset in (
        ("in-sample", [r for r in rows if r["sample"] == "in"]),
        ("out-of-sample", [r for r in rows if r["sample"] == "out"]),
        ("all", rows),
    ):
        if subset:
            lines.append(f"- {label}: {summary(subset, args.tolerance)}")
    fwd_err = statistics.mean(
        abs(math.log(r["sim_forward_only_input_tok_s"] / r["bench_input_tok_s"])) for r in rows
    )
    lines.append(f"- forward-only preset, all rows: mean |log(sim/bench)| {fwd_err:.3f}")
    text = "\n".join(lines)
    print(text)
    if args.md:
        args.md.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
