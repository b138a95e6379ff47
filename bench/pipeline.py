"""Wave vs lockstep on a real 2-stage CPU pipeline, against a measured pure-forward ceiling.

For each workload (cold, 90% reuse, mixed 75/25) and closed-loop concurrency, both policies
run on the same multi-process pipeline (one process and one core per stage when the machine
has them). The ceiling is measured in the same run: two independent single-thread processes
(one per stage slice) doing nothing but that stage's forward on the workload's wave shapes,
concurrently; the pipeline can at best compute as fast as its slower stage, so
``efficiency = computed tok/s / min(stage tok/s)``. Every figure is the median of ``--runs``
runs; runs alternate the policies so slow drift on a shared machine hits both alike, and
the ceiling is re-measured in every run. ``busy`` is the wall-time share a stage spent in
its waves, ``cpu`` the CPU time its executing thread got meanwhile: on a machine shared with
other work cpu < busy, and the absolute figures say more about the neighbours than about us.

    python bench/pipeline.py --json pipeline.json            # full grid
    python bench/pipeline.py --quick --json pipeline.json    # c in 1, 8, 32, smaller runs
    python bench/pipeline.py --json all.json --pool a.runs.json b.runs.json  # medians of both

Writes the medians to PATH, every run's row to PATH with suffix .runs.json, a markdown
table (.md) and a plot (.png) beside it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from prefill_node.engine.types import PrefillOptions
from prefill_node.runtime.dist_env import DistEnv, free_local_port
from prefill_node.runtime.pipeline_engine import PipelineEngine
from prefill_node.runtime.spec import ModelSource, PipelineSpec

# One stage's 512-token wave takes ~50 ms on one core of this machine (2 of the 4 layers
# at ~10K tok/s, bench/calibrate_cpu.py): the issue asks for 10-60 ms per stage wave.
MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
}
BLOCK, M, B_MIN, PROMPT = 16, 512, 256, 1024  # b_min = M/2, as the paper's 8K/16K
PREFIX = PROMPT * 9 // 10 // BLOCK * BLOCK  # 90% reuse, whole blocks: 912 cached, 112 computed
NUM_PREFIXES = 4
WARMUP_SEED = 999_999  # distinct from every timed draw (random.Random(-1) == random.Random(1))


@dataclass(frozen=True)
class Workload:
    name: str
    warm_share: float  # share of requests that reuse a seeded prefix


WORKLOADS = (Workload("cold", 0.0), Workload("reuse90", 1.0), Workload("mixed75", 0.75))


def make_spec(policy: str) -> PipelineSpec:
    return PipelineSpec(
        model=ModelSource(config=MODEL, seed=0, name="bench-tiny"),
        layer_ranges=((0, 2), (2, 4)),
        stage_blocks=(2048, 2048),
        block_size=BLOCK,
        policy=policy,
        max_wave_tokens=M,
        min_wave_tokens=B_MIN,
        max_batch=128,
    )


def prompts_for(w: Workload, n: int, rng: random.Random, prefixes: list[list[int]]):
    out = []
    for _ in range(n):
        if rng.random() < w.warm_share:
            tail = [rng.randrange(2048) for _ in range(PROMPT - PREFIX)]
            out.append(rng.choice(prefixes) + tail)
        else:
            out.append([rng.randrange(2048) for _ in range(PROMPT)])
    return out


def closed_loop(engine: PipelineEngine, prompts: list[list[int]], concurrency: int) -> dict:
    """Keep ``concurrency`` requests in flight; throughput over the window in which every
    slot stays busy (until the (n - c)-th completion), latency over all requests."""
    done: list[tuple[float, int, int, float]] = []  # (time, input, computed, latency)
    lock, finished = threading.Lock(), threading.Event()
    it = iter(prompts)

    def launch() -> None:
        prompt = next(it, None)
        if prompt is None:
            return
        fut = engine.submit(prompt, PrefillOptions(top_logprobs=1))
        fut.add_done_callback(on_done)

    def on_done(fut) -> None:
        r = fut.result()
        with lock:
            done.append(
                (time.perf_counter(), r.prompt_tokens, r.computed_tokens, r.timings.total_s)
            )
            if len(done) == len(prompts):
                finished.set()
        launch()

    before = engine.stage_stats()
    t0 = time.perf_counter()
    for _ in range(min(concurrency, len(prompts))):
        launch()
    finished.wait()
    wall = time.perf_counter() - t0
    after = engine.stage_stats()
    window = done[: max(1, len(prompts) - concurrency + 1)]
    span = window[-1][0] - t0
    lat = sorted(d[3] for d in done)
    row = {
        "input_tok_s": sum(d[1] for d in window) / span,
        "computed_tok_s": sum(d[2] for d in window) / span,
        "p50_s": lat[len(lat) // 2],
        "p95_s": lat[min(len(lat) - 1, int(0.95 * len(lat)))],
        "requests": len(prompts),
    }
    for a, b in zip(before, after, strict=True):
        row[f"busy_stage{a.stage}"] = (b.busy_s - a.busy_s) / wall
        row[f"cpu_stage{a.stage}"] = (b.cpu_s - a.cpu_s) / wall
        # this stage's compute rate while it ran, measured inside the run itself
        row[f"busy_tok_s_stage{a.stage}"] = (b.tokens - a.tokens) / max(b.busy_s - a.busy_s, 1e-9)
    return row


# -- ceiling: independent single-thread processes, pure forward ------------------------------
def _wave_batches(w: Workload):
    """The waves the planner forms at full load: cold = M-token slices of whole prompts;
    warm = the (PROMPT - PREFIX)-token suffixes at offset PREFIX that fit in M."""
    from prefill_node.model.batch import ChunkBatch, ChunkSpec

    table = tuple(range(PROMPT // BLOCK))
    cold = [ChunkBatch((ChunkSpec(s, M, table),)) for s in range(0, PROMPT, M)]
    n = M // (PROMPT - PREFIX)
    warm = [ChunkBatch(tuple(ChunkSpec(PREFIX, PROMPT - PREFIX, table) for _ in range(n)))]
    k = round(w.warm_share * 4)
    return warm * k + cold * (4 - k) if 0 < k < 4 else (warm if k == 4 else cold)


def _forward_worker(stage: int, seconds: float, cpu: int | None, barrier, out) -> None:
    import os

    from prefill_node.model.config import ModelConfig
    from prefill_node.model.paged_kv import PagedKVCache
    from prefill_node.model.partition import LayerRange
    from prefill_node.model.stage_model import StageModel

    torch.set_num_threads(1)
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    cfg = ModelConfig.from_hf_config(MODEL, name="bench-tiny")
    model = StageModel.random_init(cfg, LayerRange(2 * stage, 2 * stage + 2), 0)
    kv = PagedKVCache.for_model(cfg, model.layer_range, PROMPT // BLOCK, BLOCK)
    for w in WORKLOADS:
        batches = _wave_batches(w)
        inputs = [
            torch.randn(b.total_tokens, cfg.hidden_size)
            if stage
            else torch.randint(0, 2048, (b.total_tokens,))
            for b in batches
        ]
        barrier.wait()  # both stages measure the same workload at the same time
        tokens, i = 0, 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            model(inputs[i % len(batches)], batches[i % len(batches)], kv)
            tokens += batches[i % len(batches)].total_tokens
            i += 1
        out.put((w.name, stage, tokens / (time.perf_counter() - t0)))


def ceilings(seconds: float) -> dict[str, float]:
    """Per workload, min over the two stages of pure-forward tok/s, measured concurrently."""
    from prefill_node.runtime.launcher import stage_cpus

    ctx = mp.get_context("spawn")
    out, barrier = ctx.Queue(), ctx.Barrier(2)
    cpus = stage_cpus(2)
    procs = [
        ctx.Process(
            target=_forward_worker, args=(s, seconds, cpus[s] if cpus else None, barrier, out)
        )
        for s in range(2)
    ]
    for p in procs:
        p.start()
    rates: dict[str, list[float]] = {}
    for _ in range(2 * len(WORKLOADS)):
        name, _stage, rate = out.get(timeout=seconds * len(WORKLOADS) + 300)
        rates.setdefault(name, []).append(rate)
    for p in procs:
        p.join()
    return {name: min(r) for name, r in rates.items()}


# -- driver ------------------------------------------------------------------------------------
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
        help="a cell times c + max(c, N) requests (default 32, 8 with --quick): raise it for\n"
        "steadier low-concurrency cells",
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
    rng = random.Random(0)
    prefixes = [[rng.randrange(2048) for _ in range(PREFIX)] for _ in range(NUM_PREFIXES)]

    ceiling_runs: dict[str, list[float]] = {w.name: [] for w in WORKLOADS}
    raw: dict[tuple[str, str, int], list[dict]] = {}
    total = args.runs * (2 * len(WORKLOADS) * len(levels) + 1)
    bar = tqdm(total=total, desc="ceiling + pipeline runs")
    for run in range(args.runs):
        # the ceiling is measured once per run, between the runs, to share their conditions
        for name, rate in ceilings(2.0 if args.quick else 4.0).items():
            ceiling_runs[name].append(rate)
        bar.update()
        for policy in ("wave", "lockstep") if run % 2 == 0 else ("lockstep", "wave"):
            spec = make_spec(policy)
            engine = PipelineEngine.start(spec, DistEnv(0, 2, "127.0.0.1", free_local_port()))
            try:
                # warm-up (untimed): first forwards of fresh stage processes are slow
                warmup = prompts_for(WORKLOADS[0], 8, random.Random(WARMUP_SEED), prefixes)
                closed_loop(engine, warmup, 4)
                for w in WORKLOADS:
                    for c in levels:
                        if w.warm_share:  # seed the shared prefixes (untimed), cold runs evict
                            for f in [engine.submit(p + [1], PrefillOptions()) for p in prefixes]:
                                f.result(timeout=120)
                        n = c + max(c, args.min_requests or (8 if args.quick else 32))
                        prompts = prompts_for(w, n, random.Random(run * 1000 + c), prefixes)
                        row = closed_loop(engine, prompts, c)
                        raw.setdefault((w.name, policy, c), []).append(row)
                        bar.update()
                engine.debug_check_integrity()
            finally:
                engine.shutdown()
    bar.close()
    per_run = [  # every run's own figures, for spread and pooling across invocations
        {
            "workload": wname,
            "policy": policy,
            "concurrency": c,
            "run": i,
            **r,
            "ceiling_tok_s": ceiling_runs[wname][i],
        }
        for (wname, policy, c), runs in raw.items()
        for i, r in enumerate(runs)
    ]
    args.json.with_suffix(".runs.json").write_text(json.dumps(per_run, indent=1))
    write_summary(per_run, args.json)


def summarise(per_run: list[dict]) -> list[dict]:
    """Median rows, one per (workload, policy, concurrency), from every run's own row.

    ``efficiency`` = median computed tok/s / median ceiling of that workload over the same
    runs; ``efficiency_per_run`` = the median of each run's computed / its own ceiling (less
    sensitive to drift between runs). ``wave_over_lockstep`` compares median input tok/s.
    """
    groups: dict[tuple[str, str, int], list[dict]] = {}
    for r in per_run:
        groups.setdefault((r["workload"], r["policy"], r["concurrency"]), []).append(r)
    skip = {"workload", "policy", "concurrency", "run", "source"}
    rows = []
    for (wname, policy, c), runs in groups.items():
        row: dict = {"workload": wname, "policy": policy, "concurrency": c, "runs": len(runs)}
        for key in runs[0]:
            if key not in skip and all(key in r for r in runs):
                row[key] = statistics.median(r[key] for r in runs)
        row["efficiency"] = row["computed_tok_s"] / row["ceiling_tok_s"]
        row["efficiency_per_run"] = statistics.median(
            r["computed_tok_s"] / r["ceiling_tok_s"] for r in runs
        )
        rows.append(row)
    for row in rows:
        other = next(
            r
            for r in rows
            if (r["workload"], r["concurrency"]) == (row["workload"], row["concurrency"])
            and r["policy"] != row["policy"]
        )
        row["wave_over_lockstep"] = (
            row["input_tok_s"] / other["input_tok_s"]
            if row["policy"] == "wave"
            else other["input_tok_s"] / row["input_tok_s"]
        )
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
        "| wave/lockstep |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['concurrency']} | {r['policy']} | {r['runs']} "
            f"| {r['input_tok_s']:.0f} | {r['computed_tok_s']:.0f} | {r['ceiling_tok_s']:.0f} "
            f"| {r['efficiency']:.2f} | {r['efficiency_per_run']:.2f} "
            f"| {r['p50_s']:.3f} | {r['p95_s']:.3f} | {r['busy_stage0']:.2f} "
            f"| {r['busy_stage1']:.2f} | {r['cpu_stage0']:.2f} | {r['cpu_stage1']:.2f} "
            f"| {r['wave_over_lockstep']:.2f}x |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [w.name for w in WORKLOADS]
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        for policy, style in (("wave", "o-"), ("lockstep", "s--")):
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
