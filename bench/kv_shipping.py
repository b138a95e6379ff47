"""Benchmark: end-to-end prefill throughput with KV shipping ON (push to decode) vs OFF.

One engine (``--engine pipeline``, the default: the multi-process runtime, one OS process
per stage; ``--engine local``: the in-process LocalEngine; either way each stage owns its
NIXL agent) serves the same prompts twice per run: OFF (no ``kv_destination``: KV stays on
the prefill tier) and ON (push: every stage WRITEs its layers into blocks a reference
decode worker in another process allocated; the request completes only when every stage's
WRITE landed and was notified). Timed: each request's ``submit -> result`` (what a router
waits for), wall and this process's CPU time (local: the engine and shipping threads;
pipeline: the leader process only, stage 0 with its shipping thread; other stages and the
decode process are not counted). After each ON request the decode worker confirms the KV
arrived (outside the timed region).

Prompts are random token ids; each pass replaces token 0 with a per-pass salt so no pass
hits the prefix cache of an earlier one (same compute in every pass). Modes alternate order
run by run; one untimed warm-up pass per mode (NIXL connects on the first push). Median of
``--runs`` runs; ratio = ON / OFF throughput (goal >= 0.95: shipping hides behind compute).

    PYTHONPATH=. python bench/kv_shipping.py --json out/kv_shipping.json [--runs 3]
        [--prompts 6] [--tokens 512] [--model DIR] [--threads 1] [--engine pipeline|local]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import uuid
from pathlib import Path

from tqdm import tqdm


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, required=True, help="write the rows here")
    p.add_argument("--model", type=Path, help="HF checkpoint dir (default: built-in SmolLM2)")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument(
        "--engine",
        choices=("pipeline", "local"),
        default="pipeline",
        help="multi-process pipeline (default) or the in-process LocalEngine",
    )
    p.add_argument("--runs", type=int, default=3, help="timed runs per mode (median)")
    p.add_argument("--prompts", type=int, default=6, help="prompts per pass")
    p.add_argument("--tokens", type=int, default=512, help="tokens per prompt")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-chunk-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = p.parse_args()
    if args.runs < 3:
        p.error("--runs must be >= 3 (median of at least three)")
    return args


class Bench:
    """The engine, the decode worker and the prompts; ``run_pass`` times one pass."""

    def __init__(self, args: argparse.Namespace, model_dir: Path) -> None:
        from prefill_node.decode.worker_process import DecodeWorkerProcess, DecodeWorkerSpec
        from prefill_node.kv_shipping.shipper import KVShippingConfig
        from prefill_node.runtime.local_engine import LocalEngine, LocalEngineConfig

        blocks_per_prompt = -(-args.tokens // args.block_size)
        self.decode = DecodeWorkerProcess(
            DecodeWorkerSpec(
                model_dir=str(model_dir),
                num_blocks=blocks_per_prompt + 4,
                block_size=args.block_size,
            )
        )
        if args.engine == "pipeline":
            from prefill_node.runtime.factory import start_pipeline_engine

            self.engine = start_pipeline_engine(
                model_dir,
                args.stages,
                num_blocks=blocks_per_prompt * 4,
                block_size=args.block_size,
                max_wave_tokens=args.max_chunk_tokens,
                kv_shipping=KVShippingConfig(),
            )
        else:
            config = LocalEngineConfig(
                num_stages=args.stages,
                num_blocks=blocks_per_prompt * 4,
                block_size=args.block_size,
                max_chunk_tokens=args.max_chunk_tokens,
            )
            self.engine = LocalEngine.from_model_dir(model_dir, config, KVShippingConfig())
        rng = random.Random(0)
        vocab = self.engine.vocab_size
        self.prompts = [
            [rng.randrange(vocab) for _ in range(args.tokens)] for _ in range(args.prompts)
        ]
        self._salts = iter(range(1, vocab))

    def run_pass(self, ship: bool, progress: tqdm) -> tuple[float, float]:
        """Prefill every prompt once; (wall seconds, CPU seconds) summed over the requests."""
        from prefill_node.engine.types import PrefillOptions

        salt = next(self._salts)
        wall = cpu = 0.0
        for base in self.prompts:
            prompt = [salt, *base[1:]]
            request_id = uuid.uuid4().hex[:12]
            dest = self.decode.expect_push(request_id, prompt) if ship else None
            w0, c0 = time.perf_counter(), time.process_time()
            result = self.engine.submit(prompt, PrefillOptions(request_id, kv_destination=dest))
            result = result.result()
            wall += time.perf_counter() - w0
            cpu += time.process_time() - c0
            if result.computed_tokens != len(prompt):
                raise RuntimeError(f"pass hit the prefix cache ({result.cached_tokens} cached)")
            if ship:  # the KV really arrived: decode yields the first token only after it did
                list(self.decode.generate(request_id, result.first_token_id, 1))
                self.decode.release(request_id)
            progress.update(1)
        return wall, cpu

    def close(self) -> None:
        self.engine.shutdown()
        self.decode.stop()


def main() -> None:
    import torch

    args = parse_args()
    torch.set_num_threads(args.threads)
    model_dir = args.model
    if model_dir is None:
        from prefill_node.model.default_model import default_model_dir

        model_dir = default_model_dir()
    bench = Bench(args, model_dir)
    rows: list[dict] = []
    tokens = args.prompts * args.tokens
    try:
        with tqdm(total=(args.runs + 1) * 2 * args.prompts, desc="prefill passes") as bar:
            bench.run_pass(False, bar)  # warm-up (untimed)
            bench.run_pass(True, bar)
            for run in range(args.runs):
                order = (False, True) if run % 2 == 0 else (True, False)
                for ship in order:
                    wall, cpu = bench.run_pass(ship, bar)
                    rows.append(
                        {
                            "mode": "shipping_on" if ship else "shipping_off",
                            "engine": args.engine,
                            "run": run,
                            "stages": args.stages,
                            "prompts": args.prompts,
                            "prompt_tokens": args.tokens,
                            "wall_s": round(wall, 4),
                            "cpu_s": round(cpu, 4),
                            "tok_per_s": round(tokens / wall, 1),
                        }
                    )
    finally:
        bench.close()
    summary = {}
    for mode in ("shipping_off", "shipping_on"):
        mine = [r for r in rows if r["mode"] == mode]
        summary[mode] = (
            statistics.median(r["tok_per_s"] for r in mine),
            statistics.median(r["cpu_s"] for r in mine),
        )
    ratio = summary["shipping_on"][0] / summary["shipping_off"][0]
    cpu_ratio = summary["shipping_on"][1] / summary["shipping_off"][1]
    rows.append(
        {
            "mode": "summary",
            "engine": args.engine,
            "off_tok_per_s": summary["shipping_off"][0],
            "on_tok_per_s": summary["shipping_on"][0],
            "ratio_on_over_off": round(ratio, 4),
            "cpu_ratio_on_over_off": round(cpu_ratio, 4),
            "runs": args.runs,
        }
    )
    print(f"\n{'mode':<14}{'run':>4}{'wall s':>9}{'cpu s':>9}{'tok/s':>10}")
    for r in rows[:-1]:
        print(
            f"{r['mode']:<14}{r['run']:>4}{r['wall_s']:>9.3f}{r['cpu_s']:>9.3f}{r['tok_per_s']:>10.1f}"
        )
    print(
        f"median tok/s: off {summary['shipping_off'][0]:.1f}, on {summary['shipping_on'][0]:.1f}"
        f" -> ratio {ratio:.3f}x (goal >= 0.95); CPU time ratio {cpu_ratio:.3f}x"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
