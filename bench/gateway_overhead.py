"""Benchmark: what `wavepp gateway` adds to a request's latency, at c = 1.

A decode server (`wavepp decode --serve`, the bundled model) and a gateway in front of it
(`--prefill local`: no tier, the gateway parses, tokenises, picks the instance and relays),
both on loopback. The same short completion (a few prompt tokens, one generated token, not
streamed) goes straight to the decode server and through the gateway, alternately, one at a
time on kept-alive connections; the latency is the client's wall time of each call. Rows:
one per path (p50 / p95 / mean ms over ``--requests``), then the gateway's added latency:
the difference of the p50s and the median of the paired differences (each gateway call
against the direct call right before it). Every row carries its provenance.

  .venv/bin/python bench/gateway_overhead.py --json bench/results/gateway_overhead.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from provenance import provenance
from quiet import wait_quiet

from prefill_node.cli.options import parse_listening
from prefill_node.process_tree import LineReader, terminate

CLI = [sys.executable, "-m", "prefill_node.cli.main"]
SERVED = "bench"


def start(args: list[str], name: str) -> tuple[subprocess.Popen, str]:
    """``wavepp ARGS`` on loopback, and its address once it announces it."""
    proc = subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)  # fmt: skip
    lines = LineReader(proc.stdout)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            line = lines.next_line(1.0)
        except TimeoutError:
            line = None
        found = parse_listening(line) if line else None
        if found is not None and found.name == name:
            return proc, f"http://{found.target}"
        if proc.poll() is not None:
            break
    terminate(proc)
    raise SystemExit(f"gateway_overhead: `wavepp {name}` did not start")


def wait_ready(client: httpx.Client, base: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if client.get(f"{base}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"gateway_overhead: {base} never became healthy")


def call(client: httpx.Client, base: str, body: dict) -> float:
    """Seconds of one completion, checked."""
    t0 = time.perf_counter()
    answer = client.post(f"{base}/v1/completions", json=body)
    elapsed = time.perf_counter() - t0
    if answer.status_code != 200:
        raise SystemExit(f"gateway_overhead: {base} answered {answer.status_code}: {answer.text}")
    return elapsed


def summary(path: str, seconds: list[float]) -> dict:
    ms = sorted(s * 1e3 for s in seconds)
    return {
        "path": path,
        "requests": len(ms),
        "p50_ms": round(statistics.median(ms), 3),
        "p95_ms": round(ms[int(0.95 * (len(ms) - 1))], 3),
        "mean_ms": round(statistics.fmean(ms), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--requests", type=int, default=300, help="calls per path (default 300)")
    ap.add_argument("--warmup", type=int, default=20, help="calls per path first, not counted")
    ap.add_argument("--prompt-tokens", type=int, default=8, help="prompt length (default 8)")
    args = ap.parse_args()

    procs = []
    try:
        decode, decode_url = start(
            ["decode", "--serve", "--served-model-name", SERVED, "--host", "127.0.0.1",
             "--port", "0"], "decode",
        )  # fmt: skip
        procs.append(decode)
        gateway, gateway_url = start(
            ["gateway", "--decode", decode_url, "--prefill", "local", "--served-model-name",
             SERVED, "--host", "127.0.0.1", "--port", "0", "--decode-poll-interval", "0.2",
             "--log-level", "WARNING"], "gateway",
        )  # fmt: skip
        procs.append(gateway)
        body = {"model": SERVED, "prompt": list(range(100, 100 + args.prompt_tokens)),
                "max_tokens": 1, "temperature": 0}  # fmt: skip
        with httpx.Client(timeout=60) as client:
            for base in (decode_url, gateway_url):
                wait_ready(client, base)
            for _ in range(args.warmup):
                call(client, decode_url, body)
                call(client, gateway_url, body)
            settle = wait_quiet()
            direct, through = [], []
            for _ in range(args.requests):
                direct.append(call(client, decode_url, body))
                through.append(call(client, gateway_url, body))
    finally:
        for proc in reversed(procs):
            terminate(proc)
    paired = [(g - d) * 1e3 for g, d in zip(through, direct, strict=True)]
    rows = [summary("direct", direct), summary("gateway", through)]
    rows.append({
        "path": "gateway_added",
        "requests": args.requests,
        "p50_diff_ms": round(rows[1]["p50_ms"] - rows[0]["p50_ms"], 3),
        "paired_median_ms": round(statistics.median(paired), 3),
    })  # fmt: skip
    rows = [{**r, "prompt_tokens": args.prompt_tokens, "settle_s": round(settle, 2),
             **provenance()} for r in rows]  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1) + "\n")
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
