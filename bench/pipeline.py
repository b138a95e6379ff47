"""Wave vs trtllm vs sync-admission on a real 2-stage CPU pipeline, against a pure-forward ceiling.

``trtllm`` is the baseline (TensorRT-LLM's PP scheduling: stage 0 admits alone, the other
stage follows); ``sync-admission`` is the ablation (WavePP's cross-stage admission on stage
0's loop). For each workload (cold, 90% reuse, mixed 75/25) and closed-loop concurrency, the
three policies run on the same kind of multi-process pipeline (one process and one core per
stage when the machine has them). The three pipelines stay up for a whole run and every cell
runs on them back to back (the order rotates from cell to cell and run to run), so the
machine's slow drift hits every side of each ratio alike. The ceiling is measured beside the
cells, as the best pure forward the pipeline's cores allow (``CeilingRates``): two
independent single-thread processes (one per stage slice, each on its stage's core) doing
nothing but that stage's forward on the workload's wave shapes, concurrently - the pipeline
can at best compute as fast as its slower stage - and then one process running the whole
model on the same cores with one torch thread per stage (core sharing, on by default, lends
a lone busy stage its idle neighbours' cores, so a pipeline may use both cores on one wave).
``efficiency = computed tok/s / max(pair, wide)``; both are reported
(``ceiling_pair_tok_s``, ``ceiling_wide_tok_s``). A cell's ceiling is the mean of two such
measurements (``--ceiling-s`` each), just before and just after its cells. The other
policies' pipelines idle meanwhile (gloo's loops wake ~100 times a second each): measured at
~2% of the ceiling, inside the noise. Every row carries its provenance
(bench/provenance.py).

Every figure is a median over ``--runs`` runs. ``wave/trtllm`` and ``wave/sync-admission``
are the medians of each run's own ratio (a paired comparison); ``efficiency per run``
likewise pairs each cell with the ceiling measured beside it. ``busy`` is the wall-time
share a stage spent in its waves, ``cpu`` the CPU time its executing thread got meanwhile:
on a machine shared with other work cpu < busy, and the absolute figures say more about the
neighbours than about us.

    python bench/pipeline.py --json pipeline.json            # full grid
    python bench/pipeline.py --quick --json pipeline.json    # c in 1, 8, 32, smaller runs
    python bench/pipeline.py --json all.json --pool a.runs.json b.runs.json  # medians of both

Writes the medians to PATH, every run's row to PATH with suffix .runs.json, a markdown
table (.md) and a plot (.png) beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from pipeline_workers import (  # noqa: F401  (MODEL, BLOCK, PROMPT, make_spec: the setup)
    BLOCK,
    MODEL,
    PROMPT,
    WORKLOADS,
    CeilingRates,
    ForwardCeiling,
    make_spec,
    policy_driver,
)
from provenance import provenance
from tqdm import tqdm

POLICIES = ("wave", "trtllm", "sync-admission")
BASELINES = POLICIES[1:]  # what wave is compared with: the baseline, then the ablation


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", type=Path, required=True, help="write the rows here")
    ap.add_argument("--quick", action="store_true", help="c in 1, 8, 32; fewer requests")
    ap.add_argument("--runs", type=int, default=3, help="runs per setting (median; >= 3)")
    ap.add_argument("--concurrency", type=str, default=None, help="e.g. 1,4,8,32,128")
    ap.add_argument(
        "--min-requests",
        type=int,
        default=None,
        help="a cell times c + max(c, N) requests (default 64, 8 with --quick): raise it for\n"
        "steadier low-concurrency cells",
    )
    ap.add_argument(
        "--ceiling-s",
        type=float,
        default=None,
        help="seconds of pure forward per ceiling measurement; one before and one after\n"
        "every cell pair (default 2, 1 with --quick)",
    )
    ap.add_argument(
        "--pool",
        type=Path,
        nargs="+",
        default=None,
        metavar="RUNS_JSON",
        help="run nothing: pool the .runs.json files of earlier invocations (medians over all\n"
        "their runs) and write PATH, .md and .png from them",
    )
    args = ap.parse_args()
    if args.pool:
        per_run = []
        for i, src in enumerate(args.pool):
            per_run += [{**r, "source": i} for r in json.loads(src.read_text())]
        write_summary(per_run, args.json)
        return
    levels = [1, 8, 32] if args.quick else [1, 4, 8, 32, 128]
    if args.concurrency:
        levels = [int(c) for c in args.concurrency.split(",")]
    min_requests = args.min_requests or (8 if args.quick else 64)
    ceiling_s = args.ceiling_s or (1.0 if args.quick else 2.0)
    per_run = run_grid(args.runs, levels, min_requests, ceiling_s)
    args.json.with_suffix(".runs.json").write_text(json.dumps(per_run, indent=1))
    write_summary(per_run, args.json)


def run_grid(runs: int, levels: list[int], min_requests: int, ceiling_s: float) -> list[dict]:
    """Every run starts a fresh pipeline per policy (all stay up for the run) and walks the
    grid; each cell runs on every policy back to back, in an order that rotates from cell to
    cell and run to run. The ceiling of a cell is the mean of two measurements on its
    workload that bracket the pair (the one after a cell is the next cell's one before). A
    row per (run, cell, policy)."""
    per_run: list[dict] = []
    cells = [(w, c) for w in WORKLOADS for c in levels]
    bar = tqdm(total=runs * len(cells), desc="cells (every policy + ceiling)")
    ceiling = ForwardCeiling()
    try:
        for run in range(runs):
            drivers = {p: policy_driver(p) for p in POLICIES}
            try:
                for d in drivers.values():
                    d.wait_ready()
                last: tuple[str, CeilingRates] | None = None  # (workload, rates) just measured
                for i, (w, c) in enumerate(cells):
                    if last is None or last[0] != w.name:
                        last = (w.name, ceiling.measure(w.name, ceiling_s))
                    before = last[1]
                    k = (run + i) % len(POLICIES)
                    order = POLICIES[k:] + POLICIES[:k]
                    n = c + max(c, min_requests)
                    rows = {}
                    for policy in order:
                        if w.warm_share:  # seed the shared prefixes (untimed), cold runs evict
                            drivers[policy].call("seed")
                        rows[policy] = drivers[policy].call("cell", w.name, n, run * 1000 + c, c)
                    last = (w.name, ceiling.measure(w.name, ceiling_s))
                    for policy in POLICIES:
                        per_run.append(
                            {
                                "workload": w.name,
                                "policy": policy,
                                "concurrency": c,
                                "run": run,
                                "first": order[0] == policy,
                                **rows[policy],
                                "ceiling_tok_s": (before.best + last[1].best) / 2,
                                "ceiling_pair_tok_s": (before.pair + last[1].pair) / 2,
                                "ceiling_wide_tok_s": (before.wide + last[1].wide) / 2,
                                "ceiling_before_tok_s": before.best,
                                "ceiling_after_tok_s": last[1].best,
                                **provenance(),
                            }
                        )
                    bar.update()
                for d in drivers.values():
                    d.call("check")
            finally:
                for d in drivers.values():
                    d.stop()
    finally:
        ceiling.stop()
        bar.close()
    return per_run


def summarise(per_run: list[dict]) -> list[dict]:
    """Median rows, one per (workload, policy, concurrency), from every run's own row.

    ``efficiency`` = median computed tok/s / median ceiling of that cell over the same runs;
    ``efficiency_per_run`` = the median of each run's computed / its own ceiling.
    For each baseline B (``trtllm``, ``sync-admission``; the key spells it with ``_``):
    ``wave_over_B`` = the median over runs of each run's wave / B input tok/s (paired: both
    sides of a ratio come from the same run); ``wave_over_B_medians`` compares the medians
    instead, and ``wave_ahead_of_B_runs`` counts the runs wave won, of ``paired_runs``.
    """
    groups: dict[tuple[str, str, int], list[dict]] = {}
    for r in per_run:
        groups.setdefault((r["workload"], r["policy"], r["concurrency"]), []).append(r)
    skip = {"workload", "policy", "concurrency", "run", "source", "first"}
    rows = []
    for (wname, policy, c), runs in groups.items():
        row: dict = {"workload": wname, "policy": policy, "concurrency": c, "runs": len(runs)}
        for key in runs[0]:
            if key not in skip and all(key in r for r in runs):
                values = [r[key] for r in runs]
                if all(isinstance(v, int | float) for v in values):
                    row[key] = statistics.median(values)
                else:  # provenance: one value, or every distinct one
                    distinct = sorted({str(v) for v in values})
                    row[key] = distinct[0] if len(distinct) == 1 else distinct
        row["efficiency"] = row["computed_tok_s"] / row["ceiling_tok_s"]
        row["efficiency_per_run"] = statistics.median(
            r["computed_tok_s"] / r["ceiling_tok_s"] for r in runs
        )
        rows.append(row)
    for row in rows:
        cell = (row["workload"], row["concurrency"])
        rates = {
            policy: {
                (r.get("source", 0), r["run"]): r["input_tok_s"]
                for r in per_run
                if (r["workload"], r["concurrency"]) == cell and r["policy"] == policy
            }
            for policy in POLICIES
        }
        wave = rates["wave"]
        for base in BASELINES:
            other, key = rates[base], base.replace("-", "_")
            if not other or not wave:
                continue
            ratios = [wave[k] / other[k] for k in wave if k in other]
            medians = statistics.median(wave.values()) / statistics.median(other.values())
            row[f"wave_over_{key}"] = statistics.median(ratios) if ratios else medians
            row[f"wave_over_{key}_medians"] = medians
            row[f"wave_ahead_of_{key}_runs"] = sum(x > 1.0 for x in ratios)
            row["paired_runs"] = len(ratios)
    rows.sort(key=lambda r: (r["workload"], r["concurrency"], r["policy"]))
    return rows


def write_summary(per_run: list[dict], path: Path) -> None:
    """The median rows to ``path``, a markdown table (.md) and a plot (.png) beside it."""
    rows = summarise(per_run)
    path.write_text(json.dumps(rows, indent=1))
    table = markdown(rows)
    path.with_suffix(".md").write_text(table + "\n")
    print(table)
    plot(rows, path.with_suffix(".png"))


def markdown(rows: list[dict]) -> str:
    head = (
        "| workload | c | policy | runs | input tok/s | computed tok/s | ceiling tok/s "
        "| efficiency | efficiency per run | p50 s | p95 s | busy s0 | busy s1 | cpu s0 | cpu s1 "
        "| wave/trtllm (paired) | wave ahead | wave/sync-admission (paired) | wave ahead |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['concurrency']} | {r['policy']} | {r['runs']} "
            f"| {r['input_tok_s']:.0f} | {r['computed_tok_s']:.0f} | {r['ceiling_tok_s']:.0f} "
            f"| {r['efficiency']:.2f} | {r['efficiency_per_run']:.2f} "
            f"| {r['p50_s']:.3f} | {r['p95_s']:.3f} | {r['busy_stage0']:.2f} "
            f"| {r['busy_stage1']:.2f} | {r['cpu_stage0']:.2f} | {r['cpu_stage1']:.2f} "
            f"{_versus(r, 'trtllm')}{_versus(r, 'sync_admission')}|"
        )
    return "\n".join(lines)


def _versus(row: dict, key: str) -> str:
    """``| ratio | runs ahead `` of wave against one baseline (blank cells if not run)."""
    if f"wave_over_{key}" not in row:
        return "| | "
    ahead = f"{row[f'wave_ahead_of_{key}_runs']}/{row['paired_runs']}"
    return f"| {row[f'wave_over_{key}']:.2f}x | {ahead} "


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [w.name for w in WORKLOADS]
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        for policy, style in (("wave", "o-"), ("trtllm", "s--"), ("sync-admission", "^:")):
            pts = sorted(
                (r["concurrency"], r["computed_tok_s"])
                for r in rows
                if r["workload"] == name and r["policy"] == policy
            )
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=policy)
        ceil = next(r["ceiling_tok_s"] for r in rows if r["workload"] == name)
        ax.axhline(ceil, color="grey", linestyle=":", label="compute ceiling")
        ax.set_xscale("log", base=2)
        ax.set_title(name)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("computed tok/s")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
