"""Benchmark: what an idle tier costs, and what a decode worker gets done beside it, per
NIXL progress mode.

For each ``--progress`` mode (``event``: the default, the progress thread sleeps until UCX
signals traffic; ``poll``: NIXL's thread busy-polls), one run starts ``wavepp serve
--stages N --kv-progress MODE`` (KV hand-off on: every stage owns a NIXL agent) and a
reference decode worker process with the same mode, both on the default model, then:

1. idle: CPU time of the server's process tree and of the decode worker over ``--seconds``
   once both are ready (in cores: CPU seconds per wall second);
2. decode beside the idle server: one ``--context``-token prompt is prefilled over gRPC and
   pushed to the decode worker over NIXL, which then generates ``--new-tokens`` tokens
   greedily; decode tokens/s is timed from the first generated token to the last.

Modes alternate order run by run; medians over ``--runs``; ``event_over_poll`` ratios.

    .venv/bin/python bench/idle_cpu.py --json out/idle.json [--runs 3] [--seconds 30]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

from tqdm import tqdm

from prefill_node.cli.options import parse_listening

CLI = [sys.executable, "-m", "prefill_node.cli.main"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, required=True, help="write the rows here")
    p.add_argument("--model", type=Path, help="HF checkpoint dir (default: built-in SmolLM2)")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--runs", type=int, default=3, help="runs per mode (median)")
    p.add_argument("--seconds", type=float, default=30.0, help="idle window per run")
    p.add_argument("--context", type=int, default=1200, help="prompt tokens before decoding")
    p.add_argument("--new-tokens", type=int, default=30, help="tokens the decode worker makes")
    p.add_argument("--progress", nargs="+", default=["event", "poll"], choices=["event", "poll"])
    args = p.parse_args()
    if args.runs < 3:
        p.error("--runs must be >= 3 (median of at least three)")
    return args


def start_serve(model_dir: Path, stages: int, progress: str) -> tuple[subprocess.Popen, str]:
    server = subprocess.Popen(
        [*CLI, "serve", "--model", str(model_dir), "--stages", str(stages), "--host",
         "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--threads", "1",
         "--log-level", "WARNING", "--kv-progress", progress],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )  # fmt: skip
    found = parse_listening(server.stdout.readline())
    if found is None:
        server.kill()
        raise RuntimeError("wavepp serve did not start")
    return server, found.target


def one_run(args: argparse.Namespace, model_dir: Path, progress: str, run: int) -> dict:
    from kv_transfer.progress import KVProgress
    from prefill_node.client.prefill_client import PrefillClient
    from prefill_node.decode.worker_process import DecodeWorkerProcess, DecodeWorkerSpec
    from prefill_node.process_tree import ProcessTree, terminate

    spec = DecodeWorkerSpec(
        model_dir=str(model_dir),
        num_blocks=args.context // 16 + args.new_tokens // 16 + 4,
        kv_progress=KVProgress(progress),
    )
    server, target = start_serve(model_dir, args.stages, progress)
    try:
        with DecodeWorkerProcess(spec) as decode, PrefillClient(target) as client:
            deadline = time.monotonic() + 120
            while not client.is_ready() and time.monotonic() < deadline:
                time.sleep(0.1)
            serve_tree, decode_tree = ProcessTree(server.pid), ProcessTree(decode.process.pid)
            time.sleep(2.0)  # start-up work drains
            c0, d0, w0 = serve_tree.cpu_s(), decode_tree.cpu_s(), time.monotonic()
            time.sleep(args.seconds)
            wall = time.monotonic() - w0
            serve_idle = (serve_tree.cpu_s() - c0) / wall
            decode_idle = (decode_tree.cpu_s() - d0) / wall

            rng = random.Random(run)
            vocab = client.server_info().vocab_size
            prompt = [rng.randrange(vocab) for _ in range(args.context)]
            request_id = uuid.uuid4().hex[:12]
            dest = decode.expect_push(request_id, prompt)
            p0 = time.monotonic()
            result = client.prefill(prompt, request_id=request_id, kv_destination=dest).result
            prefill_s = time.monotonic() - p0
            tokens = decode.generate(request_id, result.first_token_id, args.new_tokens + 1)
            next(tokens)  # the prefill's own first token: decode starts after it
            g0 = time.monotonic()
            made = sum(1 for _ in tokens)
            decode_s = time.monotonic() - g0
            decode.release(request_id)
    finally:
        terminate(server)
    return {
        "progress": progress,
        "run": run,
        "stages": args.stages,
        "idle_seconds": round(wall, 2),
        "serve_idle_cores": round(serve_idle, 4),
        "decode_idle_cores": round(decode_idle, 4),
        "context_tokens": args.context,
        "prefill_s": round(prefill_s, 3),
        "kv_wait_s": round(decode.kv_wait_s, 4),
        "decode_tokens": made,
        "decode_tok_s": round(made / decode_s, 2),
    }


def main() -> None:
    args = parse_args()
    model_dir = args.model
    if model_dir is None:
        from prefill_node.model.default_model import ensure_default_model

        model_dir = ensure_default_model().path
    rows: list[dict] = []
    with tqdm(total=args.runs * len(args.progress), desc="idle runs") as bar:
        for run in range(args.runs):
            order = args.progress if run % 2 == 0 else args.progress[::-1]
            for progress in order:
                rows.append(one_run(args, model_dir, progress, run))
                bar.update(1)
    keys = ("serve_idle_cores", "decode_idle_cores", "decode_tok_s", "prefill_s")
    summary: dict = {"progress": "summary", "runs": args.runs}
    for mode in args.progress:
        for key in keys:
            summary[f"{mode}_{key}"] = statistics.median(
                r[key] for r in rows if r["progress"] == mode
            )
    if {"event", "poll"} <= set(args.progress):
        summary["decode_tok_s_event_over_poll"] = round(
            summary["event_decode_tok_s"] / summary["poll_decode_tok_s"], 3
        )
    rows.append(summary)
    print(f"\n{'mode':<7}{'run':>4}{'serve idle':>12}{'decode idle':>13}{'decode tok/s':>14}")
    for r in rows[:-1]:
        print(
            f"{r['progress']:<7}{r['run']:>4}{r['serve_idle_cores']:>12.4f}"
            f"{r['decode_idle_cores']:>13.4f}{r['decode_tok_s']:>14.2f}"
        )
    for mode in args.progress:
        print(
            f"median {mode}: serve idle {summary[f'{mode}_serve_idle_cores']:.4f} cores, decode "
            f"idle {summary[f'{mode}_decode_idle_cores']:.4f}, decode "
            f"{summary[f'{mode}_decode_tok_s']:.2f} tok/s"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
