"""Regenerate every figure the README quotes into bench/results/*.json, on a quiet machine.

One command re-measures them all at the current commit:

    .venv/bin/python bench/refresh.py                      # everything (hours on 2 cores)
    .venv/bin/python bench/refresh.py --list               # the commands, run nothing
    .venv/bin/python bench/refresh.py --only pipeline,grpc_overhead
    .venv/bin/python bench/refresh.py --smoke --out /tmp/r # tiny sizes: the wiring only

Each figure is one benchmark command (``FIGURES``: the README section it backs, its
arguments, what it needs). Before each, the machine must be quiet (bench/quiet.py: fewer
than 0.15 busy cores; ``--quiet-max-s``); the command then writes ``OUT/NAME.json``, and every
row of it is stamped with its provenance (bench/provenance.py: commit, date, the command,
cores, load) where the benchmark did not stamp it itself, plus the load just before and
just after the run (``load_1m_before`` / ``load_1m_after``). A failing command is reported
and the others still run; the exit status is the number of failures.

``--smoke`` runs each command at tiny sizes (``smoke`` arguments, seconds to a few minutes):
it proves the wiring, its figures mean nothing and must not replace the committed ones.
Figures that need what this machine may lack (vLLM's peer environment, ``$VLLM_PEER_ENV`` or
.venv-vllm; the gateway package) say so in ``needs`` and are skipped with a message when it
is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from provenance import REPO, provenance
from quiet import busy_cores, wait_quiet

PY = ".venv/bin/python"
WAVEPP = ".venv/bin/wavepp"


@dataclass(frozen=True)
class Figure:
    """One results file: ``command`` (``{json}`` stands for its output path) measures what
    the README's ``section`` quotes; ``smoke`` replaces ``command`` under ``--smoke``."""

    name: str
    section: str
    command: tuple[str, ...]
    smoke: tuple[str, ...]
    needs: str = ""  # "vllm": the peer environment; "gateway": the gateway package

    def argv(self, out: Path, smoke: bool) -> list[str]:
        """The command line, run from the repository's root (the output path relative to it
        when it lies inside)."""
        path = os.path.relpath(out / f"{self.name}.json", REPO)
        if path.startswith(".."):
            path = str(out / f"{self.name}.json")
        return [path if a == "{json}" else a for a in (self.smoke if smoke else self.command)]


def _bench(script: str, *args: str) -> tuple[str, ...]:
    return (PY, f"bench/{script}.py", "--json", "{json}", *args)


_PD_LOAD = ("--rates", "c1,1", "--num-prompts", "12", "--input-len", "1024",
            "--output-len", "32")  # fmt: skip
_PD_SMOKE = ("--rates", "c1", "--num-prompts", "2", "--input-len", "64", "--output-len", "2",
             "--num-prefixes", "1")  # fmt: skip
_WAVE_SMOKE = ("--random-weights", "--runs", "1", "--wave", "2", "--chunk", "16", "--prefix", "32",
               "--cold", "32")  # fmt: skip

# a tiny cluster run of bench/router.py (every figure of it adds its policies)
_ROUTER_SMOKE = ("--runs", "1", "--requests", "8", "--tenants", "2", "--concurrency", "2",
                 "--core-runs", "1", "--num-blocks", "128")  # fmt: skip

FIGURES = (
    Figure(
        "pipeline",
        "bench/pipeline.py: wave vs trtllm vs sync-admission at c = 1, 8, 32, efficiency",
        _bench("pipeline", "--quick", "--runs", "3", "--min-requests", "32"),
        _bench(
            "pipeline",
            "--runs",
            "1",
            "--concurrency",
            "1",
            "--min-requests",
            "1",
            "--ceiling-s",
            "0.1",
        ),
    ),
    Figure(
        "sim_paper",
        "wavepp sim --reproduce-paper: the paper table, in- and out-of-sample, ablations",
        (WAVEPP, "sim", "--reproduce-paper", "--json", "{json}"),
        (
            WAVEPP,
            "sim",
            "--preset",
            "cpu",
            "--workload",
            "reuse90",
            "--input-len",
            "1024",
            "--concurrency",
            "1",
            "--requests",
            "4",
            "--json",
            "{json}",
        ),
    ),
    Figure(
        "sim_grid",
        "wavepp sim --sweep paper: wave ahead in N of 40 settings, p50 changes",
        (WAVEPP, "sim", "--sweep", "paper", "--planner", "mpu", "--json", "{json}"),
        (
            WAVEPP,
            "sim",
            "--preset",
            "cpu",
            "--workload",
            "cold",
            "--input-len",
            "1024",
            "--concurrency",
            "1",
            "2",
            "--requests",
            "4",
            "--json",
            "{json}",
        ),
    ),
    Figure(
        "sim_cluster",
        "wavepp sim --cluster 8 32: routing policies over N pipelines, fetch against the oracle",
        (WAVEPP, "sim", "--cluster", "8", "32", "--cluster-seeds", "3", "--json", "{json}"),
        (WAVEPP, "sim", "--cluster", "2", "--requests", "8", "--json", "{json}"),
    ),
    Figure(
        "grpc_overhead",
        "bench/grpc_overhead.py: what the gRPC front adds, against a bare floor",
        _bench("grpc_overhead"),
        _bench(
            "grpc_overhead",
            "--engines",
            "fixed",
            "--runs",
            "1",
            "--requests",
            "32",
            "--concurrency",
            "8",
            "--service-ms",
            "2",
        ),
    ),
    Figure(
        "router_fetch",
        "bench/router.py: the fetch policy against prefix and the oracle",
        _bench(
            "router",
            "--policies",
            "prefix,fetch,oracle",
            "--overhead-concurrency",
            "",
            "--runs",
            "3",
            "--core-runs",
            "1",
        ),
        _bench("router", *_ROUTER_SMOKE, "--policies", "fetch", "--overhead-concurrency", ""),
    ),  # fmt: skip
    Figure(
        "router",
        "bench/router.py: routing policies, router overhead (paired), router core",
        _bench("router"),
        _bench(
            "router",
            *_ROUTER_SMOKE,
            "--policies",
            "prefix",
            "--overhead-concurrency",
            "1",
            "--overhead-requests",
            "10",
        ),
    ),  # fmt: skip
    Figure(
        "idle_cpu",
        "bench/idle_cpu.py: idle CPU and decode speed per NIXL progress mode",
        _bench("idle_cpu"),
        _bench(
            "idle_cpu",
            "--runs",
            "3",
            "--seconds",
            "1",
            "--context",
            "64",
            "--new-tokens",
            "2",
            "--progress",
            "event",
        ),
    ),
    Figure(
        "kv_shipping",
        "bench/kv_shipping.py: KV shipping on vs off, streamed vs at the end",
        _bench("kv_shipping", "--runs", "3"),
        _bench("kv_shipping", "--runs", "3", "--prompts", "1", "--tokens", "128"),
    ),
    Figure(
        "peer_vllm",
        "bench/peer_vllm.py: ours vs vLLM (headline: compiled; eager beside)",
        _bench("peer_vllm"),
        # the smoke skips vLLM's compiled mode: its torch.compile alone takes minutes
        _bench(
            "peer_vllm", "--quick", "--dtypes", "float32", "--systems", "wavepp-pipeline,vllm-eager"
        ),
        needs="vllm",
    ),
    *(
        Figure(
            f"wave_forward_{short}",
            f"docs/vllm.md: a stage's forward on a shared-prefix wave and the attention kernel's "
            f"rate against the GEMM's, {dtype}",
            _bench("wave_forward", "--dtype", dtype, "--kernels"),
            _bench("wave_forward", "--dtype", dtype, "--kernels", *_WAVE_SMOKE),
        )
        for short, dtype in (("bf16", "bfloat16"), ("fp32", "float32"))
    ),
    Figure(
        "stage_occupancy",
        "bench/stage_occupancy.py: stage busy / idle, core sharing and the drain bound on vs off",
        _bench("stage_occupancy"),
        _bench("stage_occupancy", "--runs", "1", "--quick"),
    ),
    Figure(
        "gateway_overhead",
        "docs/gateway.md, README: the gateway's added latency (paired)",
        _bench("gateway_overhead"),
        _bench("gateway_overhead", "--requests", "10", "--warmup", "2"),
        needs="gateway",
    ),
    Figure(
        "pd_serve",
        "docs/gateway.md, README: auto vs remote vs local prefill behind the gateway",
        _bench(
            "pd_serve",
            *_PD_LOAD,
            "--systems",
            "pd-auto,pd-remote,pd-local",
            "--runs",
            "3",
            "--local-max-tokens",
            "1100",
        ),  # fmt: skip
        _bench("pd_serve", *_PD_SMOKE, "--systems", "pd-auto,pd-local"),
        needs="vllm",
    ),
    Figure(
        "overload",
        "docs/router.md: offered 0.5x-4x of measured capacity, goodput and admitted latency",
        _bench("overload", "--runs", "3", "--duration-s", "30"),
        _bench("overload", "--levels", "0.5,2", "--capacity-s", "2", "--duration-s", "2"),
    ),
    Figure(
        "pd_serve_colocated",
        "docs/gateway.md: vllm serve alone and its decode instance alone, same load",
        _bench("pd_serve", *_PD_LOAD, "--systems", "vllm,decode"),
        _bench("pd_serve", *_PD_SMOKE, "--systems", "vllm"),
        needs="vllm",
    ),
)


def missing(needs: str) -> str | None:
    """Why a figure cannot run here, or None."""
    if needs == "vllm":
        peer = Path(os.environ.get("VLLM_PEER_ENV") or REPO / ".venv-vllm") / "bin" / "python"
        return None if peer.is_file() else f"no vLLM peer environment at {peer}"
    if needs == "gateway" and not (REPO / "wavepp_gateway").is_dir():
        return "no wavepp_gateway package in this checkout"
    return None


def stamp(path: Path, argv: list[str], before: float, after: float) -> int:
    """Add provenance to every row of ``path`` that lacks it, and the load around the run;
    returns the rows stamped (a file holding one object: that object)."""
    data = json.loads(path.read_text())
    around = {"load_1m_before": before, "load_1m_after": after}
    rows = data if isinstance(data, list) else [data]
    for row in rows:
        if isinstance(row, dict):
            row.update({k: v for k, v in provenance(argv).items() if k not in row} | around)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return len(rows)


def run(figure: Figure, out: Path, smoke: bool, quiet_max_s: float) -> bool:
    argv = figure.argv(out, smoke)
    why = missing(figure.needs)
    if why is not None:
        print(f"[{figure.name}] skipped: {why}")
        return True
    waited = wait_quiet(quiet_max_s)
    busy = busy_cores(0.5)
    if busy > 0.5:
        print(f"[{figure.name}] warning: not quiet after {waited:.0f} s ({busy:.2f} busy cores)")
    print(f"[{figure.name}] {shlex.join(argv)}", flush=True)
    before, t0 = round(os.getloadavg()[0], 2), time.perf_counter()
    done = subprocess.run(argv, cwd=REPO)
    after = round(os.getloadavg()[0], 2)
    path = REPO / argv[argv.index("--json") + 1]
    if done.returncode != 0 or not path.is_file():
        print(f"[{figure.name}] FAILED (exit {done.returncode})", file=sys.stderr)
        return False
    rows = stamp(path, argv, before, after)
    print(f"[{figure.name}] {rows} rows -> {path} in {time.perf_counter() - t0:.0f} s")
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results", help="results dir")
    ap.add_argument("--only", default="", help="comma list of figure names (default all)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: the wiring only")
    ap.add_argument(
        "--list",
        "--dry-run",
        dest="dry_run",
        action="store_true",
        help="print every figure's command (and what it backs), run nothing",
    )
    ap.add_argument(
        "--quiet-max-s",
        type=float,
        default=300.0,
        help="wait at most this long for a quiet machine before each command (default 300)",
    )
    args = ap.parse_args()
    args.out = args.out.resolve()
    names = [n for n in args.only.split(",") if n]
    if unknown := set(names) - {f.name for f in FIGURES}:
        ap.error(f"unknown figures {sorted(unknown)}; choose from {[f.name for f in FIGURES]}")
    chosen = [f for f in FIGURES if not names or f.name in names]
    if args.dry_run:
        for f in chosen:
            needs = f" (needs {f.needs})" if f.needs else ""
            print(f"# {f.name}: {f.section}{needs}\n{shlex.join(f.argv(args.out, args.smoke))}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    failed = [f.name for f in chosen if not run(f, args.out, args.smoke, args.quiet_max_s)]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return len(failed)


if __name__ == "__main__":
    sys.exit(main())
