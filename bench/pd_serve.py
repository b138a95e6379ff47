"""Benchmark: vLLM's OpenAI server alone vs gateway + prefill tier + vLLM decode, same cores.

SYSTEMS (all on the same N cores: this process's affinity, or the first --cores of it):
  vllm        `vllm serve` alone (the peer env's CPU build) on all N cores: colocated
              prefill and decode, prefix caching on;
  decode      the PD system's vLLM decode instance asked directly (no gateway, no tier:
              it computes every prompt); with pd-local at --rates c1, the gateway's own
              added latency;
  pd-auto, pd-remote, pd-local
              `wavepp gateway --prefill MODE` in front of `wavepp router` + one `wavepp serve`
              pipeline (--tier-cores cores, one stage per core) and one vLLM decode instance
              (WavePPConnector as kv_consumer, KV events to the gateway) on the other cores.
With ``--runs N`` every row runs N times (the PD systems back to back in each cell, their
order rotated by run) and a median row per cell follows (``run: "median"``).
Load: vLLM's own generator (`vllm bench serve`, openai completions backend, streaming,
temperature 0, --ignore-eos), datasets `random` and `prefix_repetition`, at each --rates
value (requests/s; `inf`; `c1` = one request at a time). Every row waits for a quiet
machine first (bench/quiet.py) and uses its own seed, so no two rows share prompts.

Rows: system, dataset, rate, ttft_p50_ms, ttft_p95_ms, itl_p50_ms, output_tok_s,
request_per_s, remote_prefill_share (the gateway's decisions during the row; null for
systems without a gateway), decode_kv_transfer_share (of the prompt tokens the decode
instance processed during the row, the share it loaded over NIXL rather than computed, from
its vllm:prompt_tokens_by_source_total; null for `vllm`), plus completed / failed requests,
lengths and cores.

  VLLM_PEER_ENV=/path/.venv-vllm .venv/bin/python bench/pd_serve.py --json out/pd_serve.json
  .venv/bin/python bench/pd_serve.py --json /tmp/pd.json --systems pd-auto --datasets random \\
      --rates 1 --num-prompts 4 --input-len 256 --output-len 8     # smoke: one tiny row

The gateway (`wavepp gateway`) runs from --gateway-checkout (default: this checkout).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from provenance import provenance
from quiet import wait_quiet
from vllm_server import REPO, VllmServer

from prefill_node.cli.options import parse_listening
from prefill_node.process_tree import LineReader, terminate

NAME = "smol"
SYSTEMS = ("vllm", "decode", "pd-auto", "pd-remote", "pd-local")
DATASETS = ("random", "prefix_repetition")
BENCH = (
    "import sys; from vllm.benchmarks.serve import add_cli_args, main; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser as P; "
    "p = P(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
)


def peer_python() -> Path:
    return Path(os.environ.get("VLLM_PEER_ENV") or REPO / ".venv-vllm") / "bin" / "python"


class Wavepp:
    """A `wavepp` subcommand as a child process pinned to ``cores``; ``target`` from its
    ``listening on`` line."""

    def __init__(self, argv: list[str], cores: list[int], log: Path, cwd: Path = REPO) -> None:
        env = dict(os.environ, PYTHONPATH=str(cwd), PYTHONDONTWRITEBYTECODE="1")
        pin = ["taskset", "-c", ",".join(map(str, cores))]
        self.log = log
        with open(log, "w") as err:
            self.proc = subprocess.Popen(
                [*pin, sys.executable, "-m", "prefill_node.cli.main", *argv],
                stdout=subprocess.PIPE, stderr=err, text=True, cwd=cwd, env=env,
                start_new_session=True,
            )  # fmt: skip
        lines = LineReader(self.proc.stdout, f"{argv[0]}-stdout")
        deadline = time.monotonic() + 300
        while (left := deadline - time.monotonic()) > 0:
            line = lines.next_line(left)
            if line is None:
                break
            if (listening := parse_listening(line)) is not None:
                self.target = listening.target
                return
        terminate(self.proc, 5)
        raise RuntimeError(f"wavepp {argv[0]} did not start: {log.read_text()[-3000:]}")

    def stop(self) -> None:
        terminate(self.proc, 30)


def counter_sums(url: str, name: str, label: str) -> dict[str, float]:
    """The counter ``name`` at ``url``/metrics, summed by ``label``."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[s.labels[label]] = out.get(s.labels[label], 0) + s.value
    return out


def share(before: dict[str, float], after: dict[str, float], part: str, whole: tuple) -> float:
    """``part``'s share of what the counters in ``whole`` grew by between two reads."""
    grew = {k: after.get(k, 0) - before.get(k, 0) for k in whole}
    return grew[part] / max(1.0, sum(grew.values()))


DECISIONS = ("wavepp_gateway_prefill_decisions_total", "prefill")
SOURCES = ("vllm:prompt_tokens_by_source_total", "source")


def run_load(args, url: str, dataset: str, rate: str, seed: int, out: Path) -> dict:
    """One `vllm bench serve` run against ``url``; its result JSON."""
    argv = [str(args.peer_python), "-c", BENCH, "--backend", "vllm", "--base-url", url,
            "--endpoint", "/v1/completions", "--model", str(args.model),
            "--served-model-name", NAME, "--dataset-name", dataset,
            "--num-prompts", str(args.num_prompts), "--ignore-eos", "--temperature", "0",
            "--seed", str(seed), "--disable-tqdm", "--save-result",
            "--percentile-metrics", "ttft,itl", "--metric-percentiles", "50,95",
            "--result-dir", str(out.parent), "--result-filename", out.name]  # fmt: skip
    if rate == "c1":
        argv += ["--request-rate", "inf", "--max-concurrency", "1"]
    else:
        argv += ["--request-rate", rate]
    if dataset == "random":
        argv += ["--random-input-len", str(args.input_len),
                 "--random-output-len", str(args.output_len)]  # fmt: skip
    else:
        argv += ["--prefix-repetition-prefix-len", str(args.input_len * 3 // 4),
                 "--prefix-repetition-suffix-len", str(args.input_len // 4),
                 "--prefix-repetition-num-prefixes", str(args.num_prefixes),
                 "--prefix-repetition-output-len", str(args.output_len)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH="")
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=env, check=True,
                       timeout=args.row_timeout)  # fmt: skip
    return json.loads(out.read_text())


def row(system: str, dataset: str, rate: str, result: dict, share: float | None, args) -> dict:
    return {
        "system": system, "dataset": dataset, "rate": rate,
        "ttft_p50_ms": result["p50_ttft_ms"], "ttft_p95_ms": result["p95_ttft_ms"],
        "itl_p50_ms": result["p50_itl_ms"],
        "output_tok_s": result["output_throughput"],
        "request_per_s": result["request_throughput"],
        "remote_prefill_share": share,
        "completed": result["completed"], "failed": result.get("failed", 0),
        "num_prompts": args.num_prompts, "input_len": args.input_len,
        "output_len": args.output_len, "cores": len(args.cpus),
        "local_max_tokens": args.local_max_tokens,
    }  # fmt: skip


METRICS = ("ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms", "output_tok_s", "request_per_s",
           "remote_prefill_share", "decode_kv_transfer_share")  # fmt: skip


def medians(rows: list[dict]) -> list[dict]:
    """One row per (system, dataset, rate): the median of each metric over its runs."""
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        cells.setdefault((r["system"], r["dataset"], r["rate"]), []).append(r)
    out = []
    for runs in cells.values():
        median = {**runs[-1], "run": "median", "runs": len(runs)}
        for key in METRICS:
            values = [r[key] for r in runs if r[key] is not None]
            median[key] = statistics.median(values) if values else None
        median["completed"] = sum(r["completed"] for r in runs)
        median["failed"] = sum(r["failed"] for r in runs)
        out.append(median)
    return out


def write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1))


class PdSystem:
    """Tier (pipeline + router) on the first cores, vLLM decode on the rest; gateways on
    demand, one per prefill mode."""

    def __init__(self, args, logs: Path) -> None:
        self.args, self.logs = args, logs
        tier, decode = args.cpus[: args.tier_cores], args.cpus[args.tier_cores :]
        self.tier_cores = tier
        # ipc: vLLM binds it and the gateway connects; nothing listens on a TCP port
        self.events = f"ipc://{logs}/decode-kv-events.ipc"
        self.decode = VllmServer(args.peer_python, args.model, logs / "vllm-decode.log",
                                 served_model_name=NAME, decode=True,
                                 events_endpoint=self.events,
                                 cores=",".join(map(str, decode)))  # fmt: skip
        self.parts: list = [self.decode]
        self.pipeline = self._start(
            ["serve", "--model", str(args.model), "--stages", str(len(tier)), "--dtype",
             "float32", "--threads", "1", "--host", "127.0.0.1", "--port", "0",
             "--metrics-port", "-1", "--log-level", "WARNING"], "serve")  # fmt: skip
        self.router = self._start(
            ["router", "--pipeline", self.pipeline.target, "--host", "127.0.0.1", "--port",
             "0", "--metrics-port", "-1", "--log-level", "WARNING"], "router")  # fmt: skip
        self.decode.wait_ready()

    def _start(self, argv: list[str], name: str, cwd: Path = REPO) -> Wavepp:
        part = Wavepp(argv, self.tier_cores, self.logs / f"{name}.log", cwd)
        self.parts.append(part)
        return part

    def gateway(self, mode: str) -> Wavepp:
        budget = self.args.local_max_tokens
        budget = [] if budget is None else ["--local-max-tokens", str(budget)]
        return self._start(
            ["gateway", "--router", self.router.target, "--decode", self.decode.url,
             "--decode-kv-events", self.events, "--prefill", mode, "--model",
             str(self.args.model), "--served-model-name", NAME, "--host", "127.0.0.1",
             "--port", "0", "--log-level", "WARNING", *budget], f"gateway-{mode}",
            self.args.gateway_checkout,
        )  # fmt: skip

    def stop(self) -> None:
        for part in reversed(self.parts):
            with contextlib.suppress(Exception):
                part.stop()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", type=Path, required=True, help="rows, rewritten after each")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--datasets", default=",".join(DATASETS))
    ap.add_argument("--rates", default="c1,1,2,4", help="requests/s, inf, c1 (default c1,1,2,4)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=1024, help="prompt tokens (default 1024)")
    ap.add_argument("--output-len", type=int, default=64, help="generated tokens (default 64)")
    ap.add_argument("--num-prefixes", type=int, default=4, help="prefix_repetition prefixes")
    ap.add_argument("--cores", type=int, help="use the first N allowed cores (default all)")
    ap.add_argument("--tier-cores", type=int, help="cores of the prefill tier (default N/2)")
    ap.add_argument("--model", type=Path, help="HF checkpoint dir (default: built-in SmolLM2)")
    ap.add_argument("--gateway-checkout", type=Path, default=REPO,
                    help="a checkout with `wavepp gateway` (default: this one)")  # fmt: skip
    ap.add_argument("--row-timeout", type=float, default=1800.0)
    ap.add_argument("--local-max-tokens", type=int,
                    help="the gateways' --local-max-tokens (default: the gateway's)")  # fmt: skip
    ap.add_argument(
        "--runs", type=int, default=1,
        help="runs of every row; with 2+, a median row per cell follows (run 'median'); the "
        "PD systems run each cell back to back, in an order rotated by run",
    )  # fmt: skip
    args = ap.parse_args()
    allowed = sorted(os.sched_getaffinity(0))
    args.cpus = allowed[: args.cores] if args.cores else allowed
    args.tier_cores = args.tier_cores or max(1, len(args.cpus) // 2)
    systems = args.systems.split(",")
    if unknown := set(systems) - set(SYSTEMS):
        ap.error(f"unknown systems {sorted(unknown)}")
    if any(s != "vllm" for s in systems) and not 0 < args.tier_cores < len(args.cpus):
        ap.error(f"--tier-cores must leave decode at least one of {len(args.cpus)} cores")
    args.peer_python = peer_python()
    if not args.peer_python.is_file():
        ap.error(f"{args.peer_python} not found: build scripts/setup_vllm_peer.sh")
    if args.model is None:
        from prefill_node.model.default_model import default_model_dir

        args.model = default_model_dir()
    rows: list[dict] = []
    logs = Path(tempfile.mkdtemp(prefix="pd_serve-"))
    print(f"cores {args.cpus} (tier {args.tier_cores}); logs in {logs}", file=sys.stderr)
    seed = 0

    def measure(system: str, url: str, gateway: bool, decode_url: str | None,
                dataset: str, rate: str, run: int) -> None:  # fmt: skip
        nonlocal seed
        seed += 1
        settle = wait_quiet()
        decisions = counter_sums(url, *DECISIONS) if gateway else None
        sources = counter_sums(decode_url, *SOURCES) if decode_url else None
        result = run_load(args, url, dataset, rate, seed, logs / f"{system}-{seed}.json")
        extra = {"run": run, "settle_s": round(settle, 2), "decode_kv_transfer_share": None}
        remote = None
        if decisions is not None:
            after = counter_sums(url, *DECISIONS)
            remote = share(decisions, after, "remote", ("remote", "local"))
        if sources is not None:  # prompt tokens decode loaded over NIXL vs computed
            after = counter_sums(decode_url, *SOURCES)
            extra["decode_kv_transfer_share"] = share(
                sources, after, "external_kv_transfer", ("external_kv_transfer", "local_compute")
            )
        row_ = {**row(system, dataset, rate, result, remote, args), **extra}
        rows.append({**row_, **provenance()})
        print(json.dumps(rows[-1]), file=sys.stderr)
        write(args.json, rows)

    cells = [(d, r) for d in args.datasets.split(",") for r in args.rates.split(",")]
    if "vllm" in systems:
        alone = VllmServer(args.peer_python, args.model, logs / "vllm-alone.log",
                           served_model_name=NAME, cores=",".join(map(str, args.cpus)))  # fmt: skip
        try:
            alone.wait_ready()
            for run in range(args.runs):
                for dataset, rate in cells:
                    measure("vllm", alone.url, False, None, dataset, rate, run)
        finally:
            alone.stop()
    if any(s != "vllm" for s in systems):
        pd = PdSystem(args, logs)
        try:
            # every gateway up at once, so each cell runs the systems back to back, in an
            # order rotated by run (none always first on a fresh tier or decode cache)
            urls = {"decode": pd.decode.url}
            for system in systems:
                if system.startswith("pd-"):
                    urls[system] = f"http://{pd.gateway(system.removeprefix('pd-')).target}"
            order = [s for s in systems if s != "vllm"]
            for run in range(args.runs):
                turn = order[run % len(order) :] + order[: run % len(order)]
                for dataset, rate in cells:
                    for system in turn:
                        measure(system, urls[system], system != "decode", pd.decode.url,
                                dataset, rate, run)  # fmt: skip
        finally:
            pd.stop()
    if args.runs > 1:
        rows.extend(medians(rows))
        write(args.json, rows)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
