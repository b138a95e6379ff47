"""Host cost of one stage's share of an admission round, per prompt token, on this CPU.

Runs the real sans-IO core (one StageAdmission + the coordinator, direct calls) on cold
prompts and on warm prompts whose prefix (all but 4,096 tokens) is cached, and reports
nanoseconds per prompt token: spec creation, hashing, lease, escrow, commit.
This is the ``host_s_per_token`` of the simulator's rounds plane (presets.py).

    python bench/calibrate_admission.py --json calib.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from tqdm import tqdm

from prefill_node.sim.core_port import CorePort


def measure(block_size: int, length: int, runs: int) -> dict[str, float]:
    port = CorePort(
        block_size,
        1,
        [4 * length // block_size + 16],
        [1],
        model_id="calib",
        stage_headroom_blocks=[0],
        max_round_requests=16,
    )
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, 50_000, length).tolist()
    port.seed("seed", prefix)
    cold, warm = [], []
    for i in range(runs):
        fresh = rng.integers(0, 50_000, length).tolist()
        t = time.perf_counter()
        port.enqueue(port.spec(f"cold-{i}", fresh))
        port.run_round()
        cold.append(time.perf_counter() - t)
        port.stages[0].abort(f"cold-{i}")
        prompt = prefix[: length - 4096] + fresh[:4096]
        t = time.perf_counter()
        port.enqueue(port.spec(f"warm-{i}", prompt))
        port.run_round()
        warm.append(time.perf_counter() - t)
        port.stages[0].abort(f"warm-{i}")
    return {
        "block_size": block_size,
        "input_len": length,
        "cold_ns_per_token": statistics.median(cold) / length * 1e9,
        "warm_ns_per_token": statistics.median(warm) / length * 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-size", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--input-len", type=int, nargs="+", default=[32_768, 131_072])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    rows = [
        measure(b, n, args.runs)
        for b, n in tqdm([(b, n) for b in args.block_size for n in args.input_len], desc="calib")
    ]
    print(f"{'block':>5} {'input':>7} {'cold ns/tok':>11} {'warm ns/tok':>11}")
    for r in rows:
        print(
            f"{r['block_size']:>5} {r['input_len']:>7} "
            f"{r['cold_ns_per_token']:>11.0f} {r['warm_ns_per_token']:>11.0f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
