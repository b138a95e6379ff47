"""Benchmark: our prefill tier against vLLM's CPU build, same model, prompts and cores.

SYSTEMS (all on the same N cores: this process's affinity, or the first --cores of it):
- wavepp-pipeline: `wavepp serve --stages N` (one stage process and one torch thread per core),
  driven over gRPC by an asyncio client in this process, every prompt of a case in flight;
- wavepp-router: `wavepp router` (prefix policy) in front of --router-pipelines pipelines of
  N / --router-pipelines stages; --router-cores board (default): every pipeline may run on
  all N cores and they share one host core board (`wavepp serve --core-board`: a pipeline
  computing alone borrows the idle ones' cores); split: each pipeline on its own share of
  the cores (taskset), as if each had its own host;
- vllm-eager / vllm-compiled: vLLM's offline ``LLM`` (prefix caching on; enforce_eager, or its
  default torch.compile), ``generate(prompts, max_tokens=1)`` on token ids, run by
  bench/peer_vllm_driver.py in the PEER environment (scripts/setup_vllm_peer.sh; vLLM must not
  enter the project's .venv), its OpenMP threads bound to the N cores.
The same default model (SmolLM2-135M-Instruct, dequantised to float32 safetensors) for both,
loaded as --dtypes. KV memory alike: vLLM preallocates --kv-gib; each of our configurations
gets the blocks that hold as many tokens in the same bytes (split over the router's pipelines).

CASES (bench/peer_vllm_cases.py; new random token ids every run): cold (unique prompts);
shared-first (90% shared prefix, first seen in this batch); shared-cached (same shape, the
prefix computed untimed just before); long (one long prompt). All prompts of a case go in at
once: vLLM gets one batch, our client keeps them all in flight.

ORDER: per dtype, every system starts (in parallel) and stays up for all runs; in each run
every case runs on every system back to back, in an order rotating case by case and run by
run, so the machine's drift lands on all systems alike. Each measurement starts on a quiet
machine (bench/quiet.py): a vLLM instance keeps about one core busy for about a second
after it answers, which would land on whichever system comes next; once quiet, a live
vLLM idles at 0.01-0.05 cores here, a pipeline at ~0.02.

METRICS: input tok/s = prompt tokens / wall time of the batch; computed tok/s = tokens not
served from the prefix cache, by each engine's own count. Medians over --runs runs; ratios
ours / vLLM paired by run (bench/peer_vllm_report.py); the headline is against vLLM's
default configuration (vllm-compiled), vllm-eager beside it. Every row says how many greedy
first tokens agree with each vLLM mode's (a check that both ran the same model on the same
ids); it is required: below 90%, or with no vLLM row to compare with, the bench exits 1.

    .venv/bin/python bench/peer_vllm.py --json out/peer_vllm.json   # ~13 min on 2 quiet cores
    .venv/bin/python bench/peer_vllm.py --quick --json /tmp/peer.json      # smoke, tiny sizes

Writes every row to PATH (rewritten after each cell: an interrupted run keeps what it
measured), a markdown table (.md) and a plot (--plot, default PATH with .png); process logs
under PATH with .logs/DTYPE. Every process it starts is stopped on the way out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from peer_vllm_cases import DEFAULT, QUICK, Case, estimate_seconds, make_cases
from peer_vllm_report import PEERS, SYSTEMS, first_token_agreement, plot, rates, summarise
from peer_vllm_report import table as markdown_table
from provenance import provenance
from quiet import wait_quiet
from router_cluster import BLOCK, Cluster, warm_pipeline, warm_router
from router_workload import run_closed_loop, token_stats
from tqdm import tqdm

from prefill_node.mkl_vendor import preload_env
from prefill_node.process_tree import LineReader
from prefill_node.sim.tenants import TenantRequest

REPO = Path(__file__).resolve().parent.parent
DRIVER = Path(__file__).resolve().parent / "peer_vllm_driver.py"
PEER_START_TIMEOUT_S = 900.0  # torch.compile on a busy 2-core machine takes minutes
WARM_TOKENS = 512


def peer_python() -> Path:
    env = os.environ.get("VLLM_PEER_ENV")
    return Path(env or REPO / ".venv-vllm") / "bin" / "python"


class VllmPeer:
    """bench/peer_vllm_driver.py in the peer environment, in its own session."""

    def __init__(self, args, dtype: str, mode: str, model_dir: Path, logs: Path) -> None:
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.kv_gib),
                   VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, args.cpus)))  # fmt: skip
        env.pop("PYTHONPATH", None)  # nothing of ours in there
        # the same MKL vendor shim our processes run with (the same torch wheel links MKL)
        env = preload_env(env)
        self.cpus = args.cpus
        self.log = logs / f"vllm-{mode}.log"
        argv = [str(args.peer_python), str(DRIVER), "--model", str(model_dir), "--dtype",
                dtype, "--mode", mode]  # fmt: skip
        with open(self.log, "w") as err:
            self.popen = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=err, env=env, text=True,
                                          start_new_session=True)  # fmt: skip
        self.lines = LineReader(self.popen.stdout, f"vllm-{mode}-stdout")

    def _answer(self, timeout_s: float) -> dict:
        try:
            line = self.lines.next_line(timeout_s)
        except TimeoutError:
            line = None
        if not line:
            tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"vLLM driver gave no answer (log {self.log}):\n{tail}")
        return json.loads(line)

    def wait_ready(self) -> float:
        return self._answer(PEER_START_TIMEOUT_S)["startup_s"]

    def measure(self, seed: list[list[int]], prompts: list[list[int]]) -> dict:
        self.popen.stdin.write(json.dumps({"seed": seed, "prompts": prompts}) + "\n")
        self.popen.stdin.flush()
        a = self._answer(PEER_START_TIMEOUT_S)
        return rates(a["prompt_tokens"], a["cached_tokens"], a["wall_s"]) | {
            "first_tokens": a["first_tokens"], "first_top": a.get("first_top")}  # fmt: skip

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.popen.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait()


class OursTier:
    """One of our configurations on a Cluster (bench/router_cluster.py): its address."""

    def __init__(self, system: str, cluster: Cluster, args, dtype: str, blocks: int) -> None:
        self.system, self._cluster, self._router = system, cluster, None
        self.cpus = args.cpus
        self._calls = 0  # request ids: f"{tag}{call}-{i}", unique over the server's life
        extra = ("--dtype", dtype, *args.serve_arg)
        k = 1 if system == "wavepp-pipeline" else args.router_pipelines
        n = len(args.cpus) // k  # stages per pipeline: one core each
        shares = [args.cpus[i * n : (i + 1) * n] for i in range(k)]
        if k > 1 and args.router_cores == "board":  # one board for the host's pipelines
            extra += ("--core-board", str(args.json.with_suffix(".logs") / f"cores-{dtype}"))
            shares = [args.cpus] * k
        self._pipelines = [
            cluster.serve(f"{system}-{dtype}-p{i}", blocks // k, shares[i], n, extra)
            for i in range(k)
        ]

    def wait_ready(self) -> float:
        t0 = time.perf_counter()
        for p in self._pipelines:
            warm_pipeline(p.wait_listening().address, WARM_TOKENS)
        if self.system == "wavepp-router":
            self._router = self._cluster.router("prefix", self._pipelines)
            warm_router(self._router.address, len(self._pipelines))
        return time.perf_counter() - t0

    @property
    def address(self) -> str:
        return (self._router or self._pipelines[0]).address

    def measure(self, seed: list[list[int]], prompts: list[list[int]]) -> dict:
        bar, self._calls = tqdm(disable=True), self._calls + 1
        if seed:
            seeds = [TenantRequest(0, "", tuple(p)) for p in seed]
            run_closed_loop(self.address, seeds, 1, f"seed{self._calls}", bar)
        requests = [TenantRequest(0, "", tuple(p)) for p in prompts]
        outcomes, wall_s = run_closed_loop(
            self.address, requests, len(requests), f"timed{self._calls}", bar
        )
        ordered = sorted(outcomes, key=lambda o: o.index)
        return token_stats(outcomes, wall_s) | {
            "wall_s": wall_s,
            "first_tokens": [o.first_token for o in ordered],
            "first_top": [[list(t) for t in o.top[:2]] for o in ordered] if all(
                o.top for o in ordered) else None,
        }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", type=Path, required=True, help="write the rows here")
    ap.add_argument("--plot", type=Path, help="the plot (default: PATH with .png)")
    ap.add_argument("--runs", type=int, default=3, help="runs (medians; default 3)")
    ap.add_argument("--quick", action="store_true", help="tiny cases, 1 run: a smoke test")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset")
    ap.add_argument("--cores", type=int, help="use the first N allowed cores (default all)")
    ap.add_argument("--router-pipelines", type=int, default=2, help="pipelines behind the router")
    ap.add_argument(
        "--router-cores",
        choices=("board", "split"),
        default="board",
        help="the router's pipelines: board = all on every core, sharing idle cores through "
        "one host core board (default); split = each on its own share of the cores",
    )
    ap.add_argument("--kv-gib", type=int, default=1, help="KV cache GiB per system (whole GiB)")
    ap.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="one more `wavepp serve` flag for our pipelines, repeatable (e.g.\n"
        "--serve-arg=--min-wave-tokens=128); the rows' `serve_args` say which",
    )
    ap.add_argument(
        "--peer-python",
        type=Path,
        default=peer_python(),
        help="the peer env's python (default $VLLM_PEER_ENV/bin/python or .venv-vllm)",
    )
    args = ap.parse_args()
    allowed = sorted(os.sched_getaffinity(0))
    args.cpus = allowed[: args.cores] if args.cores else allowed
    args.runs = 1 if args.quick and args.runs == 3 else args.runs
    args.max_chunk_tokens, args.router_arg = 512, []  # what router_cluster.Cluster reads
    systems, dtypes = args.systems.split(","), args.dtypes.split(",")
    if unknown := set(systems) - set(SYSTEMS):
        ap.error(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    if len(args.cpus) % args.router_pipelines:
        ap.error(f"{len(args.cpus)} cores do not split into {args.router_pipelines} pipelines")
    if set(systems) & set(PEERS) and not args.peer_python.is_file():
        ap.error(f"no vLLM peer environment at {args.peer_python}: run scripts/setup_vllm_peer.sh "
                 "(or set VLLM_PEER_ENV / --peer-python)")  # fmt: skip
    cases = make_cases(**(QUICK if args.quick else DEFAULT))
    expected = estimate_seconds(cases, systems, dtypes, args.runs, len(args.cpus))
    print(
        f"{len(systems)} systems x {len(dtypes)} dtypes x {len(cases)} cases x {args.runs} "
        f"run(s) on cores {args.cpus}; expected ~{expected / 60:.0f} min on quiet cores"
    )
    for c in cases:
        print(f"  {c.name}: {c.prompts} x {c.prompt_tokens} tokens, shared prefix "
              f"{c.prefix_tokens}{' (cached first)' if c.precached else ''}")  # fmt: skip
    t0 = time.perf_counter()
    per_run = run_all(args, systems, dtypes, cases)
    print(f"done in {(time.perf_counter() - t0) / 60:.1f} min (expected ~{expected / 60:.0f})")
    summary, problems = write(per_run, args)
    print(markdown_table(summary))
    settles: dict[str, list[float]] = {}
    for r in per_run:
        settles.setdefault(r["after"] or "(start)", []).append(r["settle_s"])
    waits = ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in sorted(settles.items()))
    print(f"wait for a quiet machine, by the system measured just before (median s): {waits}")
    if problems:  # agreement is required: a row without it is not a comparison
        print("first-token agreement FAILED:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    return 0


def run_all(args, systems: list[str], dtypes: list[str], cases: tuple[Case, ...]) -> list[dict]:
    """Per dtype: start every system, then every run's cases on all of them; the run rows."""
    import torch

    from prefill_node.model.config import ModelConfig
    from prefill_node.model.default_model import default_model_dir

    model_dir = default_model_dir()
    config = ModelConfig.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    per_run: list[dict] = []
    bar = tqdm(total=len(dtypes) * args.runs * len(cases) * len(systems), desc="cells")
    for dtype in dtypes:
        per_token = config.kv_bytes_per_token(config.num_layers, getattr(torch, dtype))
        blocks = int(args.kv_gib * 2**30 / per_token) // BLOCK  # the same bytes as vLLM's
        logs = args.json.with_suffix(".logs") / dtype
        logs.mkdir(parents=True, exist_ok=True)
        with Cluster(model_dir, logs, args) as cluster:
            live: dict[str, VllmPeer | OursTier] = {}
            try:
                for s in systems:  # all start at once; each loads its model in parallel
                    if s in PEERS:
                        live[s] = VllmPeer(args, dtype, s.split("-")[1], model_dir, logs)
                    else:
                        live[s] = OursTier(s, cluster, args, dtype, blocks)
                bar.set_description(f"{dtype}: starting {', '.join(systems)}")
                with ThreadPoolExecutor(len(live)) as pool:
                    started = list(pool.map(lambda t: t.wait_ready(), live.values()))
                took = ", ".join(f"{s} {v:.0f} s" for s, v in zip(live, started, strict=True))
                print(f"\n{dtype} ready: {took}")
                for run in range(args.runs):
                    for i, case in enumerate(cases):
                        after = per_run[-1]["system"] if per_run else ""
                        per_run += run_case(live, case, run, i, dtype, config.vocab_size, bar,
                                            after)  # fmt: skip
                        write(per_run, args, final=False)
            finally:
                for t in live.values():
                    if isinstance(t, VllmPeer):
                        t.stop()
    bar.close()
    return per_run


def run_case(
    live: dict, case: Case, run: int, i: int, dtype: str, vocab: int, bar, after: str
) -> list:
    """``case`` of ``run`` on every live system, back to back, in an order that rotates with
    the run and the case's index ``i``: a row each."""
    seed, prompts = case.draw(run, vocab)
    systems = list(live)
    shift = (run + i) % len(systems)
    rows = []
    for s in systems[shift:] + systems[:shift]:
        bar.set_description(f"{dtype} run {run} {case.name}: {s}")
        settle_s = wait_quiet()
        row = {"kind": "run", "system": s, "dtype": dtype, "case": case.name, "run": run,
               "prompts": case.prompts, "prompt_tokens": case.prompt_tokens,
               "prefix_tokens": case.prefix_tokens, "cores": len(live[s].cpus),
               "settle_s": round(settle_s, 2), "after": after}  # fmt: skip
        rows.append(row | live[s].measure(seed, prompts))
        after = s
        bar.update()
    return rows


def write(per_run: list[dict], args, final: bool = True) -> tuple[list[dict], list[str]]:
    """Every row to --json (run rows with their first tokens' agreement, medians, ratios,
    each with its provenance); at the end also the table (.md) and the plot. Returns the
    summary and the first-token agreement problems (``first_token_agreement``)."""
    problems = first_token_agreement(per_run)
    summary = summarise(per_run)
    rows = [{k: v for k, v in r.items() if k not in ("first_tokens", "first_top")}
            for r in per_run]  # fmt: skip
    serve_args = " ".join(args.serve_arg)
    rows = [r | {"serve_args": serve_args, "router_cores": args.router_cores} | provenance()
            for r in rows + summary]  # fmt: skip
    args.json.write_text(json.dumps(rows, indent=1))
    if final and summary:
        args.json.with_suffix(".md").write_text(markdown_table(summary) + "\n")
        plot(summary, args.plot or args.json.with_suffix(".png"))
    return summary, problems


if __name__ == "__main__":
    sys.exit(main())
