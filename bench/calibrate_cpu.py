"""Fit the simulator's CPU stage-time constants to one bench/pipeline.py stage's real forward.

Times ``StageModel.forward`` of each stage slice of the bench model (bench/pipeline.py
``MODEL``, 2 layers per stage) at one thread on a grid of wave shapes, then fits by least
squares ``t = per_token * T + per_pair * P + per_chunk * N`` where ``T`` = tokens,
``P`` = causal query-key pairs ``sum l * (s + l/2)``, ``N`` = chunks in the wave (no
constant term: a free one fits slightly negative, the per-chunk term absorbs it). These are
the ``cpu-bench`` preset's constants (prefill_node/sim/presets.py). Also times a gloo
send/recv of one wave's activations between two local processes (the link), when asked.

Out of sample: the three constants are fitted on ``FIT_SHAPES`` only (both stages); the
``VALIDATION_SHAPES`` (a cold slice, a warm multi-chunk wave and a mid-size chunk at an
offset: one of each kind the fit has seen, at other sizes) are never used for fitting. The
summary reports the error on each set separately (``fit_*`` and ``validation_*`` columns).

    OMP_NUM_THREADS=1 python bench/calibrate_cpu.py --json calib_cpu.json [--link]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline import BLOCK, MODEL, PROMPT  # noqa: E402

# (chunk length, chunk start, chunks per wave): cold M-slices, warm 64-token suffixes, and
# a few in between so that tokens, pairs and chunk count vary independently.
FIT_SHAPES = (
    (256, 0, 1),
    (128, 0, 1),
    (128, 384, 1),
    (64, 448, 4),
    (32, 480, 8),
    (64, 0, 4),
)
VALIDATION_SHAPES = (
    (512, 0, 1),
    (64, 448, 2),
    (256, 256, 1),
)
SHAPES = FIT_SHAPES + VALIDATION_SHAPES


def time_stage(stage: int, reps: int) -> list[dict]:
    from prefill_node.model.batch import ChunkBatch, ChunkSpec
    from prefill_node.model.config import ModelConfig
    from prefill_node.model.paged_kv import PagedKVCache
    from prefill_node.model.partition import LayerRange
    from prefill_node.model.stage_model import StageModel

    cfg = ModelConfig.from_hf_config(MODEL, name="bench-tiny")
    model = StageModel.random_init(cfg, LayerRange(2 * stage, 2 * stage + 2), 0)
    blocks = PROMPT // BLOCK
    kv = PagedKVCache.for_model(cfg, model.layer_range, 8 * blocks, BLOCK)
    rows = []
    for length, start, n in SHAPES:
        chunks = tuple(
            ChunkSpec(start, length, tuple(range(i * blocks, (i + 1) * blocks))) for i in range(n)
        )
        batch = ChunkBatch(chunks)
        t_tokens = batch.total_tokens
        x = (
            torch.randn(t_tokens, cfg.hidden_size)
            if stage
            else torch.randint(0, MODEL["vocab_size"], (t_tokens,))
        )
        model(x, batch, kv)  # warm-up
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            model(x, batch, kv)
            times.append(time.perf_counter() - t0)
        pairs = n * length * (start + length / 2)
        rows.append(
            {
                "stage": stage,
                "set": "fit" if (length, start, n) in FIT_SHAPES else "validation",
                "chunk_len": length,
                "chunk_start": start,
                "chunks": n,
                "tokens": t_tokens,
                "pairs": pairs,
                "median_s": statistics.median(times),
            }
        )
    return rows


def _design(rows: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    a = np.array([[r["tokens"], r["pairs"], r["chunks"]] for r in rows])
    return a, np.array([r["median_s"] for r in rows])


def fit(rows: list[dict]) -> dict[str, float]:
    """Least-squares per_token*T + per_pair*P + per_chunk*N over the ``fit`` rows of
    ``rows``; relative errors on those rows and on the ``validation`` rows (never fitted)."""
    a, y = _design([r for r in rows if r["set"] == "fit"])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    out = {
        "per_token_s": float(coef[0]),
        "per_pair_s": float(coef[1]),
        "per_chunk_s": float(coef[2]),
    }
    for name in ("fit", "validation"):
        subset = [r for r in rows if r["set"] == name]
        if subset:
            a, y = _design(subset)
            err = np.abs(a @ coef - y) / y
            out[f"{name}_rows"] = len(subset)
            out[f"{name}_max_rel_err"] = float(np.max(err))
            out[f"{name}_mean_rel_err"] = float(np.mean(err))
    return out


def _link_worker(rank: int, port: int, tokens: int, reps: int, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buf = torch.zeros(tokens, MODEL["hidden_size"])
    times = []
    for _ in range(reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf[:1], 1)  # ack: round trip minus a tiny message
        else:
            dist.recv(buf, 0)
            dist.send(buf[:1], 0)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        out.put(statistics.median(times[1:]))
    dist.destroy_process_group()


def measure_link(tokens: int, reps: int) -> float:
    """Median seconds of a gloo send of ``tokens`` fp32 activations plus a 1-row ack."""
    import multiprocessing as mp

    from prefill_node.runtime.dist_env import free_local_port

    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_local_port()
    procs = [ctx.Process(target=_link_worker, args=(r, port, tokens, reps, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    value = out.get(timeout=120)
    for p in procs:
        p.join()
    return value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", type=Path, required=True, help="write the rows + the fits here")
    ap.add_argument("--reps", type=int, default=5, help="timed forwards per shape (median)")
    ap.add_argument("--link", action="store_true", help="also time a gloo activation send")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for stage in tqdm((0, 1), desc="stages"):
        rows += time_stage(stage, args.reps)
    fits = {f"stage{s}": fit([r for r in rows if r["stage"] == s]) for s in (0, 1)}
    fits["pooled"] = fit(rows)  # same code on both stages: the preset takes this one
    link = {}
    if args.link:
        link = {f"link_{t}_tok_s": measure_link(t, 20) for t in (16, 256)}
    for r in rows:
        print(
            f"stage {r['stage']} {r['set']:<10} l={r['chunk_len']:3d} s={r['chunk_start']:3d} "
            f"x{r['chunks']} T={r['tokens']:3d}: {r['median_s'] * 1e3:6.2f} ms"
        )
    for name, f in fits.items():
        print(
            f"{name}: {f['per_token_s'] * 1e6:.2f} us/token "
            f"+ {f['per_pair_s'] * 1e9:.2f} ns/pair + {f['per_chunk_s'] * 1e3:.3f} ms/chunk; "
            f"fit rows ({f['fit_rows']}): mean {f['fit_mean_rel_err']:.1%} max "
            f"{f['fit_max_rel_err']:.1%}; validation rows ({f['validation_rows']}, not fitted): "
            f"mean {f['validation_mean_rel_err']:.1%} max {f['validation_max_rel_err']:.1%}"
        )
    for name, v in link.items():
        print(f"{name}: {v * 1e3:.3f} ms")
    out = [dict(r) for r in rows]
    out += [{"stage": name, **f} for name, f in fits.items()]
    out += [{"stage": "link", "name": k, "seconds": v} for k, v in link.items()]
    args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
