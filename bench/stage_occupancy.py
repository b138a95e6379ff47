"""Benchmark: where a pipeline's wall time goes on bench/peer_vllm.py's cases, with core
sharing and the planner's drain bound each turned off beside the default.

Four pipelines of --stages stage processes on the default model (SmolLM2-135M-Instruct),
all up for the whole run: ``default`` (``wavepp serve``'s defaults: core sharing on,
runtime/core_share.py, an idle stage lends its core to the stages that compute; MPU's wave
sizes), ``drain-bound`` (the planner's drain bound on, core/planner.py,
``--wave-overhead-tokens 16``: shallow work gets waves small enough that fill and drain stay
short), ``pinned`` (no core sharing: each stage pinned to its own core) and
``pinned-drain-bound`` (both changes). In each run every case of bench/peer_vllm_cases.py
runs on all four back to back, the order rotating case by case and run by run, each after a
quiet-machine wait (bench/quiet.py).
All prompts of a case are submitted at once, in this process (no gRPC: this bench looks at
the pipeline, bench/peer_vllm.py at the served tier).

Per case and setting: computed tok/s and wall time; per stage, the share of the wall time
it spent running waves (``busy``), the CPU time its executing thread got meanwhile
(``cpu``, per wall second: above ``busy`` never, below it when the core is shared), its
waves, and the share of the layers it ran with borrowed cores (``wide``). A pipeline's
wall time is at least its busiest stage's busy time; the rest is fill, drain and waiting
(a stage idles while its neighbour computes, and the leader admits between waves).
Medians over --runs runs; ``default / this`` is each run's computed tok/s ratio of the
default pipeline to this one, then the median (above 1: the default computes faster).

    .venv/bin/python bench/stage_occupancy.py --json out/occupancy.json   # ~6 min on 2 cores
    .venv/bin/python bench/stage_occupancy.py --json /tmp/o.json --quick --runs 1

Writes every row (flat: kind run / median / ratio) to PATH and the table to PATH with .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from peer_vllm_cases import DEFAULT, QUICK, Case, make_cases
from pipeline_workers import PipelineDriver, serve_commands
from quiet import wait_quiet
from tqdm import tqdm

from prefill_node.core.planner import CPU_WAVE_OVERHEAD_TOKENS
from prefill_node.mkl_vendor import reexec_with_shim

SETTINGS = {  # name -> EngineConfig fields it changes from the defaults
    "default": {},
    "drain-bound": {"wave_overhead_tokens": CPU_WAVE_OVERHEAD_TOKENS},
    "pinned": {"core_share": False},
    "pinned-drain-bound": {"core_share": False, "wave_overhead_tokens": CPU_WAVE_OVERHEAD_TOKENS},
}
BASE = "default"  # the setting every other one is compared with
BLOCK, WAVE_TOKENS = 16, 512  # what `wavepp serve` and bench/peer_vllm.py use


def _driver_main(setting: dict, stages: int, dtype: str, blocks: int, conn) -> None:
    """One pipeline led from this child process (``PipelineDriver``, ``serve_commands``):
    "measure" (case, run) replies a row."""
    from prefill_node.model.default_model import default_model_dir
    from prefill_node.model.loader_hf import load_hf_config
    from prefill_node.model.partition import split_layers
    from prefill_node.runtime.engine_config import EngineConfig
    from prefill_node.runtime.factory import start_pipeline_engine

    model_dir = default_model_dir()
    config = load_hf_config(model_dir)
    layers = [len(r) for r in split_layers(config.num_layers, stages)]
    engine = start_pipeline_engine(EngineConfig(
        model_dir=model_dir, stages=stages, num_blocks=blocks, block_size=BLOCK,
        max_wave_tokens=WAVE_TOKENS, dtype=dtype, **setting))  # fmt: skip
    warm = Case("warm", 2, 512)  # first forwards build oneDNN's primitives
    serve_commands(
        conn,
        engine,
        lambda _cmd, args: measure(engine, *args, config.vocab_size, layers),
        lambda: measure(engine, warm, -1, config.vocab_size, layers),
    )


def measure(engine, case: Case, run: int, vocab: int, layers: list[int]) -> dict:
    """One case on one pipeline: the seed prompts untimed, then every prompt in flight."""
    from prefill_node.engine.types import PrefillOptions

    seed, prompts = case.draw(run, vocab)
    for p in seed:
        engine.submit(p, PrefillOptions(top_logprobs=1)).result()
    before = engine.stage_stats()
    t0 = time.perf_counter()
    futures = [engine.submit(p, PrefillOptions(top_logprobs=1)) for p in prompts]
    results = [f.result() for f in futures]
    wall = time.perf_counter() - t0
    after = engine.stage_stats()
    computed = sum(r.computed_tokens for r in results)
    row = {"wall_s": round(wall, 4), "computed_tokens": computed,
           "computed_tok_s": round(computed / wall, 1)}  # fmt: skip
    for a, b in zip(before, after, strict=True):
        waves = b.waves - a.waves
        row[f"stage{a.stage}_busy"] = round((b.busy_s - a.busy_s) / wall, 3)
        row[f"stage{a.stage}_cpu"] = round((b.cpu_s - a.cpu_s) / wall, 3)
        row[f"stage{a.stage}_waves"] = waves
        wide = (b.wide_layers - a.wide_layers) / max(1, waves * layers[a.stage])
        row[f"stage{a.stage}_wide"] = round(wide, 3)
    return row


def summarise(per_run: list[dict]) -> list[dict]:
    """Median rows per (setting, case) and per case and setting the paired ratio of the
    default's computed tok/s to the setting's."""
    out: list[dict] = []
    cases = list(dict.fromkeys(r["case"] for r in per_run))
    for case in cases:
        for setting in SETTINGS:
            rows = [r for r in per_run if r["case"] == case and r["setting"] == setting]
            if not rows:
                continue
            keys = [k for k in rows[0] if k.startswith(("stage", "wall", "computed"))]
            med = {k: round(statistics.median(r[k] for r in rows), 3) for k in keys}
            out.append({"kind": "median", "setting": setting, "case": case,
                        "runs": len(rows)} | med)  # fmt: skip
        pairs: dict[int, dict[str, float]] = {}
        for r in per_run:
            if r["case"] == case:
                pairs.setdefault(r["run"], {})[r["setting"]] = r["computed_tok_s"]
        for setting in SETTINGS:
            if setting == BASE:
                continue
            ratios = [p[BASE] / p[setting] for p in pairs.values() if {BASE, setting} <= set(p)]
            if not ratios:
                continue
            out.append({"kind": "ratio", "case": case, "setting": setting, "runs": len(ratios),
                        "computed_tok_s": round(statistics.median(ratios), 3)})  # fmt: skip
    return out


def table(summary: list[dict], stages: int) -> str:
    head = ["case", "setting", "computed tok/s", "wall s"]
    head += [f"stage {s} busy / cpu / waves / wide" for s in range(stages)]
    head.append("default / this")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ratio = {
        (r["case"], r["setting"]): r["computed_tok_s"] for r in summary if r["kind"] == "ratio"
    }
    for r in summary:
        if r["kind"] != "median":
            continue
        cells = [r["case"], r["setting"], f"{r['computed_tok_s']:,.0f}", f"{r['wall_s']:.2f}"]
        cells += [f"{r[f'stage{s}_busy']:.2f} / {r[f'stage{s}_cpu']:.2f} / "
                  f"{r[f'stage{s}_waves']:.0f} / {r[f'stage{s}_wide']:.2f}"
                  for s in range(stages)]  # fmt: skip
        key = (r["case"], r["setting"])
        cells.append(f"{ratio[key]:.2f}x" if key in ratio else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, required=True, help="write the rows here")
    ap.add_argument("--runs", type=int, default=3, help="runs (medians; default 3)")
    ap.add_argument("--stages", type=int, default=2, help="stages per pipeline (default 2)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--quick", action="store_true", help="bench/peer_vllm.py's tiny cases")
    args = ap.parse_args()
    reexec_with_shim()  # stage processes and the leaders' processes inherit it: fast MKL

    cases = make_cases(**(QUICK if args.quick else DEFAULT))
    blocks = 2 * max(c.input_tokens + c.prompt_tokens for c in cases) // BLOCK
    drivers = {name: PipelineDriver(name, _driver_main, fields, args.stages, args.dtype, blocks)
               for name, fields in SETTINGS.items()}  # fmt: skip
    per_run: list[dict] = []
    try:
        for d in drivers.values():  # both load their models at once
            d.wait_ready()
        with tqdm(total=args.runs * len(cases) * len(drivers), desc="occupancy") as bar:
            for run in range(args.runs):
                for i, case in enumerate(cases):
                    shift = (run + i) % len(drivers)
                    order = list(drivers)[shift:] + list(drivers)[:shift]
                    for name in order:
                        bar.set_description(f"run {run} {case.name}: {name}")
                        settle = wait_quiet()
                        row = drivers[name].call("measure", case, run)
                        per_run.append({"kind": "run", "setting": name, "case": case.name,
                                        "run": run, "dtype": args.dtype, "settle_s":
                                        round(settle, 2)} | row)  # fmt: skip
                        bar.update()
    finally:
        for d in drivers.values():
            d.stop()
    summary = summarise(per_run)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(per_run + summary, indent=1))
    text = table(summary, args.stages)
    args.json.with_suffix(".md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
