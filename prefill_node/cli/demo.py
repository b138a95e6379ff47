"""`wavepp demo`: the whole local tier in one command (router + pipelines + NIXL + decode).

Starts ``--pipelines`` pipelines (``wavepp serve``, each a multi-process pipeline of
``--stages`` stage processes with KV shipping on) and ``wavepp router`` in front of them,
all as child processes on loopback. Then, through the router:

1. two tenants (their own ``cache_salt`` and a long system prompt each) ask questions; each
   line shows the pipeline the router chose and how many prompt tokens it found cached
   (the second question of a tenant reuses its system prompt on the same pipeline);
2. one question goes through a reference decode worker (``wavepp decode --prefill-server``
   pointed at the router): the stages WRITE their KV straight into the decode worker over
   NIXL, and it streams the answer;
3. the pipeline holding the first tenant's prefix is killed (SIGKILL): the router drops it
   from its candidates and the tenant's next question is served by the other pipeline;
4. the router's per-pipeline load and its routing metrics are printed, and everything stops.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefill_node.cli.options import parse_listening

DESCRIPTION = """\
Run the local prefill tier on the default model (or --model): --pipelines pipelines of
--stages stage processes each (KV shipping on), the cluster router in front of them, and a
reference decode worker. Two tenants with long system prompts ask questions through the
router (each line shows where it went and how many tokens were cached), one answer is
decoded from KV shipped over NIXL, then a pipeline is killed and the router fails over.

examples:
  wavepp demo
  wavepp demo --pipelines 3 --policy least-loaded
  wavepp demo --mode pull --max-new-tokens 48
"""

SHOWN_METRICS = ("wavepp_router_decisions_total", "wavepp_router_cached_tokens_total",
                 "wavepp_router_failovers_total", "wavepp_pipeline_ready")  # fmt: skip


@dataclass(frozen=True)
class Tenant:
    name: str
    system: str
    questions: tuple[str, ...]


TENANTS = (
    Tenant(
        "acme-travel",
        "You are the assistant of Acme Travel, a travel agency for European city breaks. "
        "Answer in one or two short sentences, in a friendly tone. Recommend trains over "
        "planes when the trip is under six hours by rail. Mention the local currency when a "
        "traveller asks about prices. Never invent opening hours; say they should check the "
        "official website. Our partner hotels are in Paris, Vienna, Prague and Lisbon; "
        "suggest them when a traveller asks where to stay. Keep answers under fifty words.",
        ("What is the capital of France?", "Which city is famous for its trams, Lisbon or Oslo?",
         "Is it faster to take the train from Paris to London?"),
    ),
    Tenant(
        "globex-support",
        "You are the support assistant of Globex, a company that sells home espresso "
        "machines. Answer briefly and precisely. If the user describes a leak, tell them to "
        "unplug the machine first. Descaling is needed every two months with hard water and "
        "every four months with soft water. The warranty lasts two years and covers pumps "
        "and heaters but not grinders. Spare parts ship within three working days. Never "
        "promise refunds; point to the returns page instead. Keep answers under fifty words.",
        ("How often should I descale my machine?", "Does the warranty cover the grinder?"),
    ),
)  # fmt: skip


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo",
        help="run the local tier: router + pipelines + NIXL KV hand-off + decode worker",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", type=Path, help="HF checkpoint dir (default: built-in SmolLM2)")
    p.add_argument("--pipelines", type=int, default=2, help="pipelines (default 2)")
    p.add_argument("--stages", type=int, default=2, help="stages per pipeline (default 2)")
    p.add_argument(
        "--policy",
        choices=("prefix", "round-robin", "least-loaded", "prefix-only"),
        default="prefix",
        help="the router's policy (default prefix)",
    )
    p.add_argument("--mode", choices=("push", "pull"), default="push", help="KV hand-off mode")
    p.add_argument("--max-new-tokens", type=int, default=24, help="tokens to decode (default 24)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for serve")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from prefill_node.process_tree import terminate

    if min(args.pipelines, args.stages, args.max_new_tokens) < 1:
        print("wavepp demo: error: --pipelines, --stages and --max-new-tokens must be >= 1",
              file=sys.stderr)  # fmt: skip
        return 2
    cli = [sys.executable, "-m", "prefill_node.cli.main"]
    model = ["--model", str(args.model)] if args.model else []
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    started = time.monotonic()
    children: list[subprocess.Popen] = []
    try:
        pipelines = []
        for i in range(args.pipelines):  # all load their models at once
            cmd = [*cli, "serve", *model, "--stages", str(args.stages), "--host", "127.0.0.1",
                   "--port", "0", "--metrics-port", "-1", "--pipeline-id", f"pipeline-{i}",
                   "--log-level", "WARNING"]  # fmt: skip
            print(f"$ {' '.join(cmd[2:])}", flush=True)
            children.append(_spawn(cmd, env))
            pipelines.append(children[-1])
        addresses = [_wait_listening(p, "serve", args.startup_timeout)[0] for p in pipelines]
        cmd = [*cli, "router", *model, *sum((["--pipeline", a] for a in addresses), []),
               "--policy", args.policy, "--host", "127.0.0.1", "--port", "0",
               "--metrics-host", "127.0.0.1", "--metrics-port", "0", "--poll-interval", "0.25",
               "--log-level", "WARNING"]  # fmt: skip
        print(f"$ {' '.join(cmd[2:])}", flush=True)
        children.append(_spawn(cmd, env))
        router, metrics_url = _wait_listening(children[-1], "router", args.startup_timeout)
        names = dict(zip(addresses, (f"pipeline-{i}" for i in range(len(addresses))), strict=True))
        _wait_ready(router, len(addresses))
        print(f"router {router} ready in front of {len(addresses)} pipelines "
              f"({time.monotonic() - started:.0f}s)\n", flush=True)  # fmt: skip
        holder = _tenants(router, names)
        _decode(cli, model, router, args, env)
        _failover(router, names, holder, pipelines[addresses.index(holder)], len(addresses))
        _show(router, metrics_url, names)
    finally:
        for child in reversed(children):
            terminate(child)
    print(f"\ndemo done in {time.monotonic() - started:.0f}s", flush=True)
    return 0


def _spawn(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)


def _wait_listening(proc: subprocess.Popen, what: str, timeout_s: float) -> tuple[str, str | None]:
    """Read the child's stdout until its 'listening on HOST:PORT' line (model load included)."""
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"wavepp demo: {what} exited with code {proc.wait()} before ready")
        found = parse_listening(line)
        if found:
            port = found.metrics_port
            return found.target, port and f"http://127.0.0.1:{port}/metrics"
    raise SystemExit(f"wavepp demo: {what} not ready after {timeout_s:.0f}s")


def _wait_ready(router: str, pipelines: int, timeout_s: float = 60.0) -> None:
    from prefill_node.client.prefill_client import PrefillClient

    deadline = time.monotonic() + timeout_s
    with PrefillClient(router) as client:
        while time.monotonic() < deadline:
            load = client.load()
            if sum(p.ready for p in load.pipelines) == pipelines and client.is_ready():
                return
            time.sleep(0.2)
    raise SystemExit("wavepp demo: the router did not see every pipeline ready")


def _ask(client: Any, tenant: Tenant, question: str, names: dict[str, str]) -> str:
    remote = client.prefill(question, chat=True, system=tenant.system, cache_salt=tenant.name,
                            deadline_s=120)  # fmt: skip
    r = remote.result
    print(f"  {tenant.name:<15} {names.get(r.served_by, r.served_by):<11} prompt "
          f"{r.prompt_tokens:>4} tokens, cached {r.cached_tokens:>4}, computed "
          f"{r.computed_tokens:>3} | {question}", flush=True)  # fmt: skip
    return r.served_by


def _tenants(router: str, names: dict[str, str]) -> str:
    """Both tenants' questions, interleaved; returns the pipeline of the first tenant."""
    from prefill_node.client.prefill_client import PrefillClient

    print("1. two tenants ask through the router (cache_salt = tenant):", flush=True)
    first: dict[str, str] = {}
    with PrefillClient(router) as client:
        for round_ in range(max(len(t.questions) for t in TENANTS)):
            for tenant in TENANTS:
                if round_ < len(tenant.questions):
                    where = _ask(client, tenant, tenant.questions[round_], names)
                    first.setdefault(tenant.name, where)
    return first[TENANTS[0].name]


def _decode(cli: list[str], model: list[str], router: str, args: argparse.Namespace,
            env: dict[str, str]) -> None:  # fmt: skip
    print("\n2. a decode worker gets its KV over NIXL from the stages the router chose:",
          flush=True)  # fmt: skip
    cmd = [*cli, "decode", *model, "--prefill-server", router, "--mode", args.mode,
           "--max-new-tokens", str(args.max_new_tokens), TENANTS[0].questions[0]]  # fmt: skip
    print(f"$ {' '.join(cmd[2:])}", flush=True)
    code = subprocess.call(cmd, env=env, stderr=subprocess.STDOUT)
    if code != 0:
        raise SystemExit(f"wavepp demo: decode exited {code}")


def _failover(router: str, names: dict[str, str], holder: str, victim: subprocess.Popen,
              pipelines: int) -> None:  # fmt: skip
    from prefill_node.client.prefill_client import PrefillClient

    print(f"\n3. SIGKILL {names[holder]} (it holds {TENANTS[0].name}'s prefix):", flush=True)
    killed = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    with PrefillClient(router) as client:
        while any(p.ready for p in client.load().pipelines if p.address == holder):
            time.sleep(0.05)
        print(f"  the router dropped it after {time.monotonic() - killed:.2f}s; still "
              f"serving: {client.is_ready()}", flush=True)  # fmt: skip
        tenant = TENANTS[0]
        for question in tenant.questions[:2]:
            _ask(client, tenant, question, names)


def _show(router: str, metrics_url: str | None, names: dict[str, str]) -> None:
    from prefill_node.client.prefill_client import PrefillClient

    with PrefillClient(router) as client:
        load = client.load()
    print("\n4. the router's view:", flush=True)
    for p in load.pipelines:
        state = "ready" if p.ready else "gone"
        print(f"  {names.get(p.address, p.address)} ({p.address}): {state}, "
              f"{p.indexed_blocks} prefix blocks indexed")  # fmt: skip
    if metrics_url is None:
        return
    with urllib.request.urlopen(metrics_url, timeout=5) as response:
        text = response.read().decode()
    lines = [ln for ln in text.splitlines() if ln.startswith(SHOWN_METRICS)]
    print("  metrics:\n    " + "\n    ".join(lines), flush=True)
