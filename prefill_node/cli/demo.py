"""`wavepp demo`: the whole local system in one command (server + pipeline + NIXL + decode).

Starts ``wavepp serve`` (a multi-process pipeline, one OS process per stage, KV shipping on)
as a child process, waits until it listens, then for each prompt runs ``wavepp decode
--prefill-server`` (a reference decode worker in its own process: the prefill request carries
its NIXL push destination, every stage WRITEs its layers' KV into the decode worker's blocks,
and the decode worker generates the answer). Each prompt is sent twice so the second prefill
shows the prefix reuse; finally it prints the server's load and a few Prometheus metrics and
stops the server with SIGTERM. Every step is a real process talking over loopback.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

DESCRIPTION = """\
Run the complete local system: `wavepp serve` on the default model (or --model) with a
--stages-stage multi-process pipeline and KV shipping, then for each prompt a reference
decode worker (`wavepp decode --prefill-server`) that gets the prompt's KV over NIXL and
streams the greedy answer. Each prompt runs twice (the second reuses the cached prefix).

examples:
  wavepp demo
  wavepp demo --stages 3 --policy lockstep "Name three primary colours."
  wavepp demo --mode pull --max-new-tokens 48 "Write a haiku about the sea."
"""

DEFAULT_PROMPTS = ("What is the capital of France?",)
SHOWN_METRICS = ("wavepp_requests_total", "wavepp_prompt_tokens_total", "wavepp_stage_blocks")
LISTENING = re.compile(r"listening on (?P<target>\S+?)(,|$)(.*metrics on :(?P<metrics_port>\d+))?")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo",
        help="run server + multi-process pipeline + NIXL KV hand-off + decode worker locally",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompts (default: one example)")
    p.add_argument("--model", type=Path, help="HF checkpoint dir (default: built-in SmolLM2)")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages (default 2)")
    p.add_argument(
        "--policy", choices=("wave", "lockstep"), default="wave", help="admission policy"
    )
    p.add_argument("--mode", choices=("push", "pull"), default="push", help="KV hand-off mode")
    p.add_argument("--max-new-tokens", type=int, default=24, help="tokens to decode (default 24)")
    p.add_argument("--repeat", type=int, default=2, help="times each prompt runs (default 2)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for serve")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.stages < 1 or args.repeat < 1 or args.max_new_tokens < 1:
        print("wavepp demo: error: --stages, --repeat and --max-new-tokens must be >= 1",
              file=sys.stderr)  # fmt: skip
        return 2
    cli = [sys.executable, "-m", "prefill_node.cli.main"]
    model = ["--model", str(args.model)] if args.model else []
    serve_cmd = [*cli, "serve", *model, "--stages", str(args.stages), "--policy", args.policy,
                 "--host", "127.0.0.1", "--port", "0", "--metrics-host", "127.0.0.1",
                 "--metrics-port", "0"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    print(f"$ {' '.join(serve_cmd[2:])}", flush=True)
    server = subprocess.Popen(serve_cmd, stdout=subprocess.PIPE, text=True, env=env)
    try:
        target, metrics_url = _wait_listening(server, args.startup_timeout)
        print(f"server ready on {target} (metrics {metrics_url})", flush=True)
        for prompt in args.prompts or DEFAULT_PROMPTS:
            for rep in range(args.repeat):
                print(f"\n--- prompt {prompt!r}, run {rep + 1} ---", flush=True)
                decode_cmd = [*cli, "decode", *model, "--prefill-server", target,
                              "--mode", args.mode, "--max-new-tokens", str(args.max_new_tokens),
                              prompt]  # fmt: skip
                code = subprocess.call(decode_cmd, env=env)
                if code != 0:
                    print(f"wavepp demo: decode exited {code}", file=sys.stderr)
                    return code
        _show_load_and_metrics(target, metrics_url)
    finally:
        _stop(server)
    return 0


def _wait_listening(server: subprocess.Popen, timeout_s: float) -> tuple[str, str | None]:
    """Read serve's stdout until its 'listening on HOST:PORT' line (model load included)."""
    deadline = time.monotonic() + timeout_s
    assert server.stdout is not None
    while time.monotonic() < deadline:
        line = server.stdout.readline()
        if not line:
            raise SystemExit(f"wavepp demo: server exited with code {server.wait()} before ready")
        print(f"  [serve] {line.rstrip()}", flush=True)
        found = LISTENING.search(line)
        if found:
            port = found.group("metrics_port")
            return found.group("target"), port and f"http://127.0.0.1:{port}/metrics"
    raise SystemExit(f"wavepp demo: server not ready after {timeout_s:.0f}s")


def _show_load_and_metrics(target: str, metrics_url: str | None) -> None:
    from prefill_node.server.client import PrefillClient

    with PrefillClient(target) as client:
        load = client.load()
    print("\nserver load:", flush=True)
    for stage in load.stages:
        print(f"  stage {stage.stage}: {stage.used_blocks} used, {stage.cached_blocks} cached, "
              f"{stage.free_blocks} free of {stage.total_blocks} blocks")  # fmt: skip
    if metrics_url is None:
        return
    with urllib.request.urlopen(metrics_url, timeout=5) as response:
        text = response.read().decode()
    lines = [ln for ln in text.splitlines() if ln.startswith(SHOWN_METRICS)]
    print("metrics:\n  " + "\n  ".join(lines[:12]))


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    if server.stdout is not None:
        for line in server.stdout:
            print(f"  [serve] {line.rstrip()}")
