"""`wavepp demo`: the whole local stack in one command, driven by the openai SDK.

Starts ``--pipelines`` pipelines (``wavepp serve``, each a multi-process pipeline of
``--stages`` stage processes with KV hand-off on, all sharing this host's idle cores through
one core board, ``--core-board``), ``wavepp router`` in front of them, a
reference decode server (``wavepp decode --serve``, OpenAI-compatible as ``vllm serve``) and
``wavepp gateway`` in front of both, all as child processes on loopback. Then, as a client
of the gateway (the ``openai`` SDK):

1. two tenants (their own ``cache_salt`` and a long system prompt each) ask questions; each
   line shows the pipeline that prefilled the prompt and the tokens it found cached there
   (the gateway's response headers), and the decode server answers from the KV it pulled
   over NIXL (the second question of a tenant reuses its system prompt on the same pipeline);
2. a short question is prefilled on the decode server itself (the gateway's decision), and
   its answer streams back;
3. the pipeline holding the first tenant's prefix is killed (SIGKILL): the router drops it
   and the gateway's next requests are prefilled on the other pipeline;
4. the router's per-pipeline view and the gateway's metrics are printed, and all stops.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefill_node.cli.options import parse_listening

DESCRIPTION = """\
Run the local stack on the default model (or --model): --pipelines pipelines of --stages
stage processes each (KV hand-off on), the cluster router in front of them, a reference
decode server (OpenAI-compatible, as vllm serve) and the gateway (the OpenAI endpoint) in
front of both. Two tenants with long system prompts ask questions through the gateway with
the openai SDK (each line shows which pipeline prefilled the prompt, how many tokens were
cached there, and the answer decoded from KV pulled over NIXL); a short question is
prefilled on decode instead; then a pipeline is killed and the router fails over.

examples:
  wavepp demo
  wavepp demo --pipelines 3 --policy least-loaded
  wavepp demo --max-new-tokens 48
"""

SHOWN_METRICS = ("wavepp_router_decisions_total", "wavepp_router_cached_tokens_total",
                 "wavepp_router_failovers_total", "wavepp_pipeline_ready",
                 "wavepp_gateway_prefill_decisions_total", "wavepp_gateway_requests_total",
                 "wavepp_gateway_kv_loads_total")  # fmt: skip
SERVED = "smollm2"
LOCAL_MAX_TOKENS = 64  # the tenants' prompts (system prompt + question) are longer: remote
SHORT_QUESTION = "What is the capital of France?"


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
    # one core board for every pipeline's stages: a pipeline computing alone borrows the
    # others' idle cores, and busy stages of two pipelines never oversubscribe the host
    board = Path(tempfile.gettempdir()) / f"wavepp-demo-cores-{os.getpid()}"
    try:
        pipelines = []
        for i in range(args.pipelines):  # all load their models at once
            cmd = [*cli, "serve", *model, "--stages", str(args.stages), "--host", "127.0.0.1",
                   "--port", "0", "--metrics-port", "-1", "--pipeline-id", f"pipeline-{i}",
                   "--core-board", str(board), "--log-level", "WARNING"]  # fmt: skip
            children.append(_start(cmd, env))
            pipelines.append(children[-1])
        cmd = [*cli, "decode", "--serve", *model, "--served-model-name", SERVED,
               "--host", "127.0.0.1", "--port", "0"]  # fmt: skip
        children.append(_start(cmd, env))
        decode = children[-1]
        addresses = [_wait_listening(p, "serve", args.startup_timeout)[0] for p in pipelines]
        cmd = [*cli, "router", *model, *sum((["--pipeline", a] for a in addresses), []),
               "--policy", args.policy, "--host", "127.0.0.1", "--port", "0",
               "--metrics-host", "127.0.0.1", "--metrics-port", "0", "--poll-interval", "0.25",
               "--log-level", "WARNING"]  # fmt: skip
        children.append(_start(cmd, env))
        router, metrics_url = _wait_listening(children[-1], "router", args.startup_timeout)
        decode_address, _ = _wait_listening(decode, "decode", args.startup_timeout)
        cmd = [*cli, "gateway", *model, "--served-model-name", SERVED, "--router", router,
               "--decode", decode_address, "--local-max-tokens", str(LOCAL_MAX_TOKENS),
               "--host", "127.0.0.1", "--port", "0", "--decode-poll-interval", "0.25",
               "--log-level", "WARNING"]  # fmt: skip
        children.append(_start(cmd, env))
        gateway, _ = _wait_listening(children[-1], "gateway", args.startup_timeout)
        names = dict(zip(addresses, (f"pipeline-{i}" for i in range(len(addresses))), strict=True))
        _wait_ready(router, len(addresses), f"http://{gateway}")
        print(f"gateway http://{gateway}/v1 ready: router {router} in front of "
              f"{len(addresses)} pipelines, decode server {decode_address} "
              f"({time.monotonic() - started:.0f}s)\n", flush=True)  # fmt: skip
        client = _openai(gateway)
        holder = _tenants(client, names, args.max_new_tokens)
        _short(client, args.max_new_tokens)
        _failover(client, router, names, holder, pipelines[addresses.index(holder)],
                  args.max_new_tokens)  # fmt: skip
        _show(router, metrics_url, f"http://{gateway}/metrics", names)
    finally:
        for child in reversed(children):
            terminate(child)
        board.unlink(missing_ok=True)
    print(f"\ndemo done in {time.monotonic() - started:.0f}s", flush=True)
    return 0


def _start(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    print(f"$ {' '.join(cmd[2:])}", flush=True)
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


def _wait_ready(router: str, pipelines: int, gateway: str, timeout_s: float = 60.0) -> None:
    from prefill_node.client.prefill_client import PrefillClient

    deadline = time.monotonic() + timeout_s
    with PrefillClient(router) as client:
        while time.monotonic() < deadline:
            load = client.load()
            if sum(p.ready for p in load.pipelines) == pipelines and client.is_ready():
                break
            time.sleep(0.2)
        else:
            raise SystemExit("wavepp demo: the router did not see every pipeline ready")
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{gateway}/health", timeout=5):
                return
        except OSError:
            time.sleep(0.2)
    raise SystemExit("wavepp demo: the gateway saw no ready decode server")


def _openai(gateway: str) -> Any:
    import openai

    return openai.OpenAI(base_url=f"http://{gateway}/v1", api_key="none", max_retries=0)


def _ask(client: Any, tenant: Tenant, question: str, names: dict[str, str],
         max_tokens: int) -> str:  # fmt: skip
    raw = client.chat.completions.with_raw_response.create(
        model=SERVED, max_tokens=max_tokens, temperature=0,
        messages=[{"role": "system", "content": tenant.system},
                  {"role": "user", "content": question}],
        extra_body={"cache_salt": tenant.name},
    )  # fmt: skip
    answer, headers = raw.parse(), raw.headers
    pipeline = headers.get("x-wavepp-prefill-pipeline", "")
    prompt, cached = answer.usage.prompt_tokens, int(headers["x-wavepp-cached-tokens"])
    print(f"  {tenant.name:<15} {names.get(pipeline, pipeline or 'decode'):<11} prompt "
          f"{prompt:>4} tokens, cached {cached:>4}, computed {prompt - cached:>3} | prefill "
          f"{headers['x-wavepp-prefill']}, decoded on {headers['x-wavepp-decode']} | {question}"
          f"\n{'':<30}-> {answer.choices[0].message.content.strip()}", flush=True)  # fmt: skip
    return pipeline


def _tenants(client: Any, names: dict[str, str], max_tokens: int) -> str:
    """Both tenants' questions, interleaved; returns the pipeline of the first tenant."""
    print("1. two tenants ask through the gateway (openai SDK, cache_salt = tenant):",
          flush=True)  # fmt: skip
    first: dict[str, str] = {}
    for round_ in range(max(len(t.questions) for t in TENANTS)):
        for tenant in TENANTS:
            if round_ < len(tenant.questions):
                where = _ask(client, tenant, tenant.questions[round_], names, max_tokens)
                first.setdefault(tenant.name, where)
    return first[TENANTS[0].name]


def _short(client: Any, max_tokens: int) -> None:
    print("\n2. a short question: cheaper to prefill on the decode server itself (streamed):",
          flush=True)  # fmt: skip
    raw = client.chat.completions.with_raw_response.create(
        model=SERVED, max_tokens=max_tokens, temperature=0, stream=True,
        messages=[{"role": "user", "content": SHORT_QUESTION}],
    )  # fmt: skip
    headers = raw.headers
    print(f"  prefill {headers['x-wavepp-prefill']} ({headers['x-wavepp-prefill-reason']}), "
          f"decoded on {headers['x-wavepp-decode']} | {SHORT_QUESTION}\n  -> ", end="",
          flush=True)  # fmt: skip
    for chunk in raw.parse():
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print(flush=True)


def _failover(client: Any, router: str, names: dict[str, str], holder: str,
              victim: subprocess.Popen, max_tokens: int) -> None:  # fmt: skip
    from prefill_node.client.prefill_client import PrefillClient

    print(f"\n3. SIGKILL {names[holder]} (it holds {TENANTS[0].name}'s prefix):", flush=True)
    killed = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    with PrefillClient(router) as router_client:
        while any(p.ready for p in router_client.load().pipelines if p.address == holder):
            time.sleep(0.05)
        print(f"  the router dropped it after {time.monotonic() - killed:.2f}s; still "
              f"serving: {router_client.is_ready()}", flush=True)  # fmt: skip
    tenant = TENANTS[0]
    for question in tenant.questions[:2]:
        _ask(client, tenant, question, names, max_tokens)


def _show(router: str, metrics_url: str | None, gateway_metrics: str,
          names: dict[str, str]) -> None:  # fmt: skip
    from prefill_node.client.prefill_client import PrefillClient

    with PrefillClient(router) as client:
        load = client.load()
    print("\n4. the router's view:", flush=True)
    for p in load.pipelines:
        state = "ready" if p.ready else "gone"
        print(f"  {names.get(p.address, p.address)} ({p.address}): {state}, "
              f"{p.indexed_blocks} prefix blocks indexed")  # fmt: skip
    lines = []
    for url in (metrics_url, gateway_metrics):
        if url is not None:
            with urllib.request.urlopen(url, timeout=5) as response:
                text = response.read().decode()
            lines += [ln for ln in text.splitlines() if ln.startswith(SHOWN_METRICS)]
    print("  metrics:\n    " + "\n    ".join(lines), flush=True)
