"""`wavepp serve`: run a pipeline behind the gRPC prefill API, with health and metrics."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from prefill_node.cli.options import (
    add_engine_arguments,
    add_kv_progress,
    add_network_arguments,
    add_tls_arguments,
    add_tracing_argument,
    configure_tracing,
    engine_spec,
    run_logged,
    serve_until_signal,
    server_config,
    start_server,
)

DESCRIPTION = """\
Serve the PrefillService (wavepp.prefill.v1) for one pipeline: the model's layers split over
--stages stages, each with its own paged KV cache and prefix index. Clients send token ids or
text (tokenised here with the model's tokenizer); responses carry the first token, cached vs
computed tokens, per-stage KV manifests and timings. gRPC health (liveness on "", readiness on
wavepp.prefill.v1.PrefillService) and server reflection are on; Prometheus metrics are served
on --metrics-port. Each stage has a NIXL agent and ships a request's KV to the decode worker
named in its kv_destination (push) or leases it for decode to read (pull); see --kv-*.
SIGINT / SIGTERM drain in-flight calls for --grace seconds, then exit. A pipeline whose stage
died drains and exits with code 5 (see --exit-on-pipeline-lost).

examples:
  wavepp serve --stages 2 --port 50051
  wavepp serve --model ./Qwen3-0.6B --stages 4 --num-blocks 4096 --metrics-port 9400
  wavepp serve --tls-cert server.pem --tls-key server.key --tls-client-ca ca.pem
  wavepp prefill --server 127.0.0.1:50051 "What is the capital of France?"
  wavepp serve --kv-allow 10.0.0.0/8 --kv-metadata-host 10.0.0.5   # decode on other hosts
  wavepp decode --prefill-server 127.0.0.1:50051 "Hello"          # prefill -> NIXL -> decode
"""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve the gRPC prefill API for one pipeline (health, reflection, metrics)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    m = p.add_argument_group("model and pipeline")
    add_engine_arguments(
        m,
        stages=2,
        model_help="HF checkpoint dir (default: built-in SmolLM2)",
        engine_help="pipeline: one OS process per stage on torch.distributed (this process is "
        "stage 0, the leader); local: all stages simulated in this process (default pipeline)",
        policy_help="admission policy: wave (ahead of execution), trtllm (the TensorRT-LLM PP "
        "baseline) or sync-admission (an ablation) (default wave)",
    )
    m.add_argument(
        "--core-share",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --engine pipeline on CPU: a stage that has no wave to run lends its core "
        "to the stages that compute (more torch threads for them until it has work again), "
        "so a lone prompt's first and last chunks, and a short burst's fill and drain, run "
        "on every core; --no-core-share pins each stage to its own core (default on)",
    )
    m.add_argument(
        "--core-board",
        type=Path,
        metavar="PATH",
        help="share idle cores with the other pipelines on this host started with the same "
        "PATH too (e.g. /dev/shm/wavepp-cores; created on first use, up to 64 stages): a "
        "pipeline computing alone uses the cores the others leave idle, so several "
        "pipelines behind a router on one host are not each held to their own share; give "
        "them all the host's cores (no taskset split). Linux, processes of one host "
        "(default: cores are shared within this pipeline only)",
    )
    m.add_argument(
        "--debug-wave-delay",
        type=float,
        default=0.0,
        help=argparse.SUPPRESS,  # tests: every stage sleeps this long per wave
    )
    m.add_argument(
        "--stage-wait",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="how long the leader waits for every stage to load its layers and join; then "
        "it exits with an error (default 600). On Kubernetes keep it inside the leader's "
        "startup-probe allowance (the chart derives one from the other)",
    )
    m.add_argument(
        "--exit-on-pipeline-lost",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="when a stage dies or stops answering its heartbeat (a pipeline cannot recover "
        "in place), drain and exit with code 5, as a stage exits when its leader is lost, so "
        "that any supervisor restarts the pipeline whatever its probes; --no-exit-on-pipeline"
        "-lost keeps answering, not ready and not live, until stopped (default on)",
    )
    m.add_argument(
        "--pipeline-id",
        help="name of this pipeline in its KV-event stream (SubscribeKvEvents) (default: hostname)",
    )
    add_network_arguments(p, port=50051, metrics_port=9400)
    k = p.add_argument_group("KV hand-off to decode workers (NIXL)")
    k.add_argument(
        "--no-kv-shipping",
        action="store_true",
        help="no NIXL agents; requests carrying a kv_destination are rejected",
    )
    k.add_argument(
        "--kv-allow",
        action="append",
        metavar="CIDR|AGENT",
        help="decode destinations stages may WRITE to, and pipelines whose cached prefixes "
        "they may READ (a request's prefix_source): a CIDR (checked before any contact) or "
        "a NIXL agent name; repeatable (default: loopback only)",
    )
    k.add_argument(
        "--kv-transfer-timeout",
        type=float,
        default=30.0,
        help="seconds a push may take before the request fails (default 30)",
    )
    k.add_argument(
        "--kv-lease-ttl",
        type=float,
        default=30.0,
        help="pull mode: seconds a lease lives without a heartbeat (default 30; a request's "
        "lease_ttl_ms overrides it)",
    )
    add_kv_progress(k)
    k.add_argument(
        "--kv-stream",
        choices=("on", "off"),
        default="on",
        help="push mode: each stage WRITEs a chunk's finished blocks while the prompt still "
        "runs (on, default) or all of its KV after the last chunk (off)",
    )
    k.add_argument(
        "--kv-stream-layer-groups",
        type=int,
        default=4,
        help="push streaming: each stage WRITEs its last chunk in up to this many layer "
        "groups, each as soon as the forward wrote it (default 4; 1: after the forward)",
    )
    k.add_argument(
        "--kv-metadata-host",
        default="127.0.0.1",
        help="address the stages' NIXL agents serve their metadata on (pull mode); set it to "
        "this node's address reachable from decode workers (default 127.0.0.1)",
    )
    add_tls_arguments(p)
    p.add_argument(
        "--smoke-test",
        metavar="PROMPT",
        action="append",
        help="start, send each PROMPT twice over gRPC (text, chat template), print the first "
        "token and cached/computed tokens, then stop; repeatable",
    )
    p.add_argument(
        "--debug-service",
        action="store_true",
        help="serve wavepp.prefill.v1.DebugService: CheckIntegrity runs every stage's "
        "check_integrity() and reports what each stage holds (soak tests, operators)",
    )
    add_tracing_argument(p)
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return run_logged("serve", args, _run)


def _run(args: argparse.Namespace) -> int:
    import asyncio
    import socket
    from dataclasses import replace

    import torch

    from prefill_node.model.tokenizer import Tokenizer
    from prefill_node.runtime.factory import build_engine
    from prefill_node.runtime.stage_main import EXIT_PIPELINE_LOST
    from prefill_node.server.kv_event_hub import KVEventHub

    configure_tracing(args, "wavepp-leader")  # locally launched stages inherit it
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.smoke_test and args.tls_cert:
        raise ValueError("--smoke-test talks plaintext to loopback; drop the TLS flags")
    config = server_config(args, str(args.model or "default:SmolLM2-135M-Instruct"))
    model_dir = args.model
    if model_dir is None:
        from prefill_node.model.default_model import default_model_dir

        model_dir = default_model_dir()
    spec = engine_spec(
        args,
        model_dir,
        kv_handoff=_kv_handoff(args),
        debug_wave_delay_s=args.debug_wave_delay,
        core_share=args.core_share,
        core_board=args.core_board,
        stage_wait_s=args.stage_wait,
    )
    tokenizer = Tokenizer.from_dir(model_dir) if (model_dir / "tokenizer.json").is_file() else None
    kv_events = KVEventHub(args.pipeline_id or socket.gethostname())
    engine = build_engine(spec, args.engine, kv_events=kv_events.publish)
    config = replace(config, blocking_submit=False, debug_service=args.debug_service)
    exit_on_lost = args.exit_on_pipeline_lost
    try:
        lost = asyncio.run(
            _serve(engine, config, tokenizer, args.smoke_test or [], kv_events, exit_on_lost)
        )
    finally:
        engine.shutdown()
    return EXIT_PIPELINE_LOST if lost else 0


def _kv_handoff(args: argparse.Namespace) -> Any:
    """The stages' KVHandoffConfig from the --kv-* flags; None with --no-kv-shipping."""
    import ipaddress

    from kv_transfer.allowlist import AllowList
    from kv_transfer.errors import InvalidTransferRequest
    from prefill_node.kv_handoff.config import KVHandoffConfig

    if args.no_kv_shipping:
        return None
    cidrs: list[str] = []
    agents: list[str] = []
    for entry in args.kv_allow or ():
        try:
            ipaddress.ip_network(entry, strict=False)
            cidrs.append(entry)
        except ValueError:
            agents.append(entry)
    try:
        allow = AllowList.parse(cidrs, agents) if args.kv_allow else AllowList.loopback()
    except InvalidTransferRequest as exc:
        raise ValueError(f"--kv-allow: {exc}") from exc
    return KVHandoffConfig(
        allow=allow,
        transfer_timeout_s=args.kv_transfer_timeout,
        lease_ttl_s=args.kv_lease_ttl,
        metadata_host=args.kv_metadata_host,
        progress=args.kv_progress,
        stream=args.kv_stream == "on",
        stream_layer_groups=args.kv_stream_layer_groups,
    )


async def _serve(
    engine: Any,
    config: Any,
    tokenizer: Any,
    smoke_prompts: list[str],
    kv_events: Any,
    exit_on_lost: bool,
) -> bool:
    """Serve until a signal, or (``exit_on_lost``) until the pipeline is lost: True then."""
    import asyncio

    from prefill_node.server.server import PrefillServer

    server = PrefillServer(engine, config, tokenizer=tokenizer, kv_events=kv_events)
    await start_server(server, "serve", config.host)
    if not smoke_prompts:
        return await serve_until_signal(server, "serve", server.lost if exit_on_lost else None)
    try:
        await asyncio.to_thread(_smoke_test, server.port, smoke_prompts, tokenizer)
    finally:
        await server.stop()
    return False


def _smoke_test(port: int, prompts: list[str], tokenizer: Any) -> None:
    """Each prompt twice through a real gRPC client: the second run shows the prefix reuse."""
    from prefill_node.client.prefill_client import PrefillClient

    with PrefillClient(f"127.0.0.1:{port}") as client:
        for rep in (1, 2):
            for i, prompt in enumerate(prompts, 1):
                remote = client.prefill(prompt, chat=tokenizer is not None, deadline_s=600)
                r = remote.result
                token = repr(tokenizer.decode([r.first_token_id])) if tokenizer else ""
                print(
                    f"[smoke {rep}.{i}] prompt {r.prompt_tokens} tokens | cached "
                    f"{r.cached_tokens} | computed {r.computed_tokens} | first token "
                    f"{r.first_token_id} {token} | server {remote.server_s * 1e3:.1f} ms",
                    flush=True,
                )
