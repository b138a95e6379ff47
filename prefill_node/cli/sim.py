"""`wavepp sim`: discrete-event simulation of WavePP vs the trtllm (TRT-LLM PP) baseline."""

from __future__ import annotations

import argparse
import json
import sys

_DESCRIPTION = """\
Simulate one prefill pipeline under the WavePP policy (admission rounds run ahead of
execution, cost-aware wave planner by default) and the trtllm baseline (TensorRT-LLM's PP
executor - every rank's loop schedules, walks cached prefixes and allocates serially before
it launches a micro-batch) or the sync-admission ablation (this project's runtime with the
leader's admission rounds on stage 0's loop; what the cpu-bench presets are compared with
the real pipeline on); fixed chunk budget M in both, driving the real sans-IO admission core
(block pools, leases, escrows, coordinator) with a roofline cost model of the preset's
model and GPUs. Closed loop: each of C clients sends its next request when the previous
one completes. Deterministic given --seed.

Prints one line per run (input tokens/s incl. cached ones, p50/p95 latency, cached
fraction, mean stage utilisation) and the wave/baseline throughput ratio per setting.

examples:
  wavepp sim --preset glm5-pp4 --workload suffix4k --concurrency 1 32 128
  wavepp sim --preset minimax-pp4 --workload reuse90 --input-len 262144 --planner all
  wavepp sim --sweep paper --json sweep.json --plot sweep.png
  wavepp sim --preset cpu --workload mixed --input-len 4096 --concurrency 4
  wavepp sim --preset cpu-bench --workload reuse90 --input-len 1024 --planner mpu
  wavepp sim --reproduce-paper --json paper.json   # the paper's figures beside the simulator's
  wavepp sim --cluster 8 --json cluster.json --plot cluster.png   # routing policies, N pipelines
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    from prefill_node.core.planner import DEFAULT_PLANNER_MODE, PlannerMode
    from prefill_node.sim.presets import PRESETS
    from prefill_node.sim.workloads import WorkloadKind

    p = subparsers.add_parser(
        "sim",
        help="simulate wave vs trtllm admission on a pipeline (roofline cost model)",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--preset",
        nargs="+",
        choices=sorted(PRESETS),
        default=None,
        help="pipeline setup(s) (default: glm5-pp4; with --sweep paper: both PP4 presets)",
    )
    p.add_argument(
        "--workload",
        nargs="+",
        choices=[k.value for k in WorkloadKind],
        default=[WorkloadKind.SUFFIX.value],
        help="cold, reuse90 (90%% seeded prefix), mixed (75/25 warm/cold), suffix4k",
    )
    p.add_argument(
        "--input-len",
        nargs="+",
        type=int,
        default=None,
        help="prompt lengths in tokens (default: the preset's middle one, 131072 on GPUs)",
    )
    p.add_argument(
        "--suffix-tokens",
        type=int,
        default=4096,
        help="fresh tokens of a suffix4k prompt (default 4096; lower it for short inputs)",
    )
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32, 128])
    p.add_argument(
        "--policy",
        choices=["wave", "trtllm", "sync-admission", "both", "all"],
        default="both",
        help="both = wave and trtllm (the TensorRT-LLM PP baseline); all adds the "
        "sync-admission ablation (default both)",
    )
    p.add_argument(
        "--planner",
        choices=[m.value for m in PlannerMode] + ["all"],
        default=DEFAULT_PLANNER_MODE.value,
        help=(
            "wave planner: fixed (M, like trtllm), mpu, mpu-nohyst, cost (cost-aware); "
            f"all = every ablation (default: {DEFAULT_PLANNER_MODE.value})"
        ),
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--requests", type=int, default=None, help="requests per run (default max(24, 3*C))"
    )
    p.add_argument("--sweep", choices=["paper"], default=None, help="run the paper's grid")
    p.add_argument(
        "--host-ns-per-token",
        type=float,
        default=None,
        help="override the rounds plane's host work per prompt token (sensitivity studies)",
    )
    p.add_argument(
        "--phase-latency-us",
        type=float,
        default=None,
        help="override the rounds plane's latency per message phase (sensitivity studies)",
    )
    p.add_argument(
        "--walk-ns-per-token",
        type=float,
        default=None,
        help=(
            "override the trtllm baseline's prefix-walk cost per cached token, paid by "
            "every rank's scheduler pass on every loop iteration (sensitivity studies)"
        ),
    )
    p.add_argument(
        "--reproduce-paper",
        action="store_true",
        help="the paper's figures beside the simulator's, in-sample (fitted) apart from "
        "out-of-sample, with the ablations of the headline ratio (about 1.5 minutes)",
    )
    p.add_argument(
        "--fit-paper",
        action="store_true",
        help="refit the two constants the reproduction fits and print them (many minutes)",
    )
    p.add_argument(
        "--cluster",
        type=int,
        nargs="+",
        metavar="N",
        default=None,
        help="simulate N pipelines behind the router (real index and scoring), every policy; "
        "several N run each (e.g. --cluster 8 32); a Zipf sweep runs at the first",
    )
    p.add_argument(
        "--cluster-seeds",
        type=int,
        default=1,
        metavar="K",
        help="with --cluster: run every cell with K workload seeds (--seed, --seed + 1, ...); "
        "the table is their median, the JSON has every run (default 1)",
    )
    p.add_argument("--json", metavar="PATH", default=None, help="write a list of flat rows")
    p.add_argument("--plot", metavar="PATH", default=None, help="write a PNG of the runs")
    p.add_argument(
        "--check-integrity",
        action="store_true",
        help="check every stage's cache invariants after every event (slow)",
    )
    p.set_defaults(func=run)


def _preset(name: str, args: argparse.Namespace):
    """The named preset with the rounds-plane overrides of the command line applied."""
    from dataclasses import replace

    from prefill_node.errors import InvalidRequestError
    from prefill_node.sim.presets import get_preset

    preset = get_preset(name)
    rounds = preset.rounds
    for value, field, scale in (
        (args.host_ns_per_token, "host_s_per_token", 1e-9),
        (args.phase_latency_us, "phase_latency_s", 1e-6),
        (args.walk_ns_per_token, "walk_s_per_token", 1e-9),
    ):
        if value is not None:
            if value < 0:
                raise InvalidRequestError(f"rounds-plane overrides must be >= 0, got {value}")
            rounds = replace(rounds, **{field: value * scale})
    return replace(preset, rounds=rounds)


def _reproduce_paper(args: argparse.Namespace) -> int:
    from prefill_node.sim.paper import reproduce
    from prefill_node.sim.paper_fit import fit_presets
    from prefill_node.sim.paper_table import format_table

    if args.fit_paper:
        fit = fit_presets(requests=args.requests)
        print(f"host_time_scale = {fit.host_time_scale:.4g}")
        print(f"glm5-pp4 flops_efficiency = {fit.efficiency:.4g}")
        state = "converged" if fit.converged else "NOT converged"
        print(f"{state} after {fit.rounds} alternation rounds")
        return 0 if fit.converged else 1
    rows = reproduce(requests=args.requests)
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.row() for r in rows], f, indent=1)
    return 0


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from prefill_node.core.planner import PlannerMode
    from prefill_node.core.policy import parse_planner_mode
    from prefill_node.errors import InvalidRequestError
    from prefill_node.sim.report import compare, format_table, plot, regressions
    from prefill_node.sim.sweep import grid, paper_grid, policies_for, run_setting
    from prefill_node.sim.workloads import WorkloadKind

    if args.reproduce_paper or args.fit_paper:
        return _reproduce_paper(args)
    if args.cluster is not None:
        from prefill_router.cluster_sim_cli import run_cluster

        return run_cluster(args)
    try:
        if args.sweep == "paper":
            names = args.preset or ["glm5-pp4", "minimax-pp4"]
            settings = paper_grid([_preset(n, args) for n in names], seed=args.seed)
        else:
            if any(c < 1 for c in args.concurrency):
                raise InvalidRequestError("--concurrency values must be >= 1")
            presets = [_preset(n, args) for n in (args.preset or ["glm5-pp4"])]
            kinds = [WorkloadKind(w) for w in args.workload]
            settings = grid(
                presets,
                kinds,
                args.input_len,
                args.concurrency,
                requests=args.requests,
                seed=args.seed,
                suffix_tokens=args.suffix_tokens,
            )
        modes = list(PlannerMode) if args.planner == "all" else [parse_planner_mode(args.planner)]
        jobs = [
            (s, pol)
            for s in settings
            for pol in policies_for(s.preset.num_stages, args.policy, modes)
        ]
        results = []
        for setting, policy in tqdm(jobs, desc="simulating", unit="run", disable=len(jobs) < 3):
            results.append(run_setting(setting, policy, check_integrity=args.check_integrity))
    except InvalidRequestError as exc:
        print(f"wavepp sim: error: {exc}", file=sys.stderr)
        return 2

    print(format_table(results))
    pairs = compare(results)
    if pairs:
        ratios = [c.ratio for c in pairs]
        print(
            f"\nwave/baseline throughput over {len(pairs)} settings: "
            f"min {min(ratios):.2f}x, max {max(ratios):.2f}x"
        )
        p50 = [c.p50_change * 100 for c in pairs]
        print(f"wave p50 latency vs trtllm: {min(p50):+.0f}% .. {max(p50):+.0f}%")
        bad = regressions(results)
        print(f"settings where wave is > 3% below trtllm: {len(bad)} of {len(pairs)}")
        for c in bad:
            w = c.wave
            print(f"  {w.preset} {w.workload} {w.input_len} c={w.concurrency}: {c.ratio:.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.row() for r in results], f, indent=1)
    if args.plot:
        plot(results, args.plot)
    return 0
