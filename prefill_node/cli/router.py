"""`wavepp router`: the cluster router: one PrefillService endpoint in front of many pipelines."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from prefill_node.cli.options import (
    add_discovery_arguments,
    add_network_arguments,
    add_tls_arguments,
    add_tracing_argument,
    configure_tracing,
    discovery_from_args,
    run_logged,
    serve_until_signal,
    server_config,
    start_server,
)
from prefill_node.client.remote_args import add_client_tls_arguments
from prefill_router.calibration import CalibrationConfig
from prefill_router.scoring import DEFAULT_AFFINITY_SLACK

DESCRIPTION = """\
Route prefill requests to the pipeline that holds the longest prefix of each prompt on ALL of
its stages, without piling everything onto one pipeline. The router speaks the same
PrefillService (wavepp.prefill.v1) as a pipeline, so every client works against it unchanged;
KV destinations pass through and the stages still ship their KV straight to decode.

It follows every pipeline's KV events (SubscribeKvEvents) into a global prefix index, hashes
each prompt with the pipelines' own block hashing (model identity, block size, cache_salt:
tenants never match each other's blocks), scores the ready pipelines (--policy), records the
prompt's blocks as pending on the chosen one (a burst sharing a new prefix lands together),
and forwards the request as token ids (text is tokenised here, once). A pipeline that dies or
turns NOT_SERVING leaves the candidate set within about a second and its index entries with
it; a request a pipeline refused before admitting it is retried once on the next best one.

Policies: prefix (default): least estimated seconds = queued work + this prompt's uncached
suffix (linear + attention cost from the model's shape); least-loaded: least queued work;
prefix-only: longest cached prefix, ties by load; round-robin.

examples:
  wavepp router --pipeline 10.0.0.5:50051 --pipeline 10.0.0.6:50051 --port 50050
  wavepp router --k8s-service wavepp-pipelines --namespace prefill
  wavepp prefill --server 127.0.0.1:50050 "What is the capital of France?"
"""

POLICIES = {"prefix": "PREFIX", "fetch": "FETCH", "round-robin": "ROUND_ROBIN",
            "least-loaded": "LEAST_LOADED", "prefix-only": "PREFIX_ONLY"}  # fmt: skip


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "router",
        help="route prefills across pipelines by global prefix hits and load (same gRPC API)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_discovery_arguments(
        p,
        "pipeline",
        "pipelines",
        "a pipeline leader's gRPC address (`wavepp serve`); repeatable",
        port_name="grpc",
    )
    r = p.add_argument_group("routing")
    r.add_argument(
        "--policy",
        choices=tuple(POLICIES),
        default="prefix",
        help="prefix: the best global prefix hit without overloading; fetch: prefix, and a "
        "pipeline may copy the prefix from another that holds it when that finishes sooner "
        "than computing it (the pipelines need --kv-handoff and each other's hosts on their "
        "KV allow-list); default prefix",
    )
    r.add_argument(
        "--fetch-fixed-ms",
        type=float,
        default=5.0,
        help="fetch policy: the prior fixed cost of one prefix fetch (asking the source, the "
        "lease, the transfer's setup), refitted from the fetches the pipelines report "
        "(default 5)",
    )
    r.add_argument(
        "--fetch-block-us",
        type=float,
        default=20.0,
        help="fetch policy: the prior cost per fetched block on the busiest stage's link, "
        "refitted like --fetch-fixed-ms (default 20)",
    )
    r.add_argument(
        "--model",
        type=Path,
        help="the pipelines' HF checkpoint dir: tokenizer for text prompts and the cost model "
        "(default: built-in SmolLM2); pipelines serving another model are refused",
    )
    r.add_argument(
        "--pending-ttl",
        type=float,
        default=2.0,
        help="seconds a routed prompt's blocks count as held by its pipeline before that "
        "pipeline's own KV events confirm them (default 2)",
    )
    r.add_argument(
        "--affinity-slack",
        type=float,
        default=DEFAULT_AFFINITY_SLACK,
        help="prefix policy: among pipelines whose estimated finish time is within this share "
        "of the best, the one holding the longest prefix wins (keeps tenants together, so "
        "their prefixes are not computed and cached on every pipeline; 0 = pure estimate; "
        f"default {DEFAULT_AFFINITY_SLACK})",
    )
    r.add_argument(
        "--poll-interval",
        type=float,
        default=0.5,
        help="seconds between load checks of each pipeline, and between health checks of one "
        "whose health service cannot push its readiness (no Watch) (default 0.5)",
    )
    f = p.add_argument_group("overload control")
    f.add_argument(
        "--max-inflight-per-pipeline",
        type=int,
        default=32,
        help="requests forwarded at once per ready pipeline; more wait in the router's queue, "
        "served by priority and tenant by tenant in turn (0 = no bound: nothing waits; "
        "default 32)",
    )
    f.add_argument(
        "--max-queue",
        type=int,
        default=1024,
        help="requests waiting in the router's queue at most; a request that would wait "
        "beyond it is rejected at once with RESOURCE_EXHAUSTED and a retry-after-ms hint. "
        "A request whose predicted time to its result exceeds its deadline is rejected the "
        "same way (default 1024)",
    )
    f.add_argument(
        "--max-wait",
        type=float,
        default=0.0,
        help="seconds a request may be predicted to wait at most (the work queued on the best "
        "pipeline and ahead of it in the router's queue, its own prefill not counted); one "
        "predicted to wait longer is rejected at once with RESOURCE_EXHAUSTED and a "
        "retry-after-ms hint, deadline or not. It bounds the latency overload adds: set it to "
        "your time-to-first-token objective less a typical prefill (0 = no bound: only "
        "deadlines and --max-queue turn requests away; default 0)",
    )
    f.add_argument(
        "--calibration-alpha",
        type=float,
        default=CalibrationConfig.alpha,
        help="weight of the newest answer in each pipeline's measured / predicted time ratio "
        "(an EWMA starting at 1), which scales the cost model's predictions for routing and "
        f"the deadline check; 0 = off (default {CalibrationConfig.alpha})",
    )
    add_client_tls_arguments(p, "pipeline", "the pipelines")
    add_network_arguments(p, port=50050, metrics_port=9401)
    add_tls_arguments(p)
    add_tracing_argument(p)
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return run_logged("router", args, _run)


def _run(args: argparse.Namespace) -> int:
    import asyncio
    from dataclasses import replace

    from prefill_node.client.remote_args import client_tls
    from prefill_node.model.loader_hf import load_hf_config
    from prefill_node.model.tokenizer import Tokenizer
    from prefill_router.cost import cost_model_for
    from prefill_router.flow_control import FlowConfig
    from prefill_router.pipeline_link import LinkConfig
    from prefill_router.router_engine import RouterConfig, RouterEngine
    from prefill_router.scoring import RoutingPolicy
    from prefill_router.transfer import TransferModel

    configure_tracing(args, "wavepp-router")
    if args.pending_ttl <= 0 or args.poll_interval <= 0 or args.affinity_slack < 0:
        raise ValueError(
            "--pending-ttl and --poll-interval must be positive, --affinity-slack >= 0"
        )
    model_dir = args.model
    if model_dir is None:
        from prefill_node.model.default_model import default_model_dir

        model_dir = default_model_dir()
    model = load_hf_config(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir) if (model_dir / "tokenizer.json").is_file() else None
    config = RouterConfig(
        policy=RoutingPolicy[POLICIES[args.policy]],
        cost_model=cost_model_for(model),
        pending_ttl_s=args.pending_ttl,
        affinity_slack=args.affinity_slack,
        link=LinkConfig(
            poll_s=args.poll_interval,
            tls=client_tls(args.pipeline_ca, args.pipeline_cert, args.pipeline_key, "pipeline"),
        ),
        model_name=model.name,
        flow=FlowConfig(args.max_inflight_per_pipeline, args.max_queue, args.max_wait),
        calibration=CalibrationConfig(alpha=args.calibration_alpha),
        transfer=TransferModel(args.fetch_fixed_ms / 1e3, args.fetch_block_us / 1e6),
    )
    engine = RouterEngine(discovery_from_args(args, args.pipeline), config)
    # submit only hashes, scores and starts a call: the server calls it inline
    server_cfg = replace(server_config(args, model.name), blocking_submit=False)
    try:
        asyncio.run(_serve(engine, server_cfg, tokenizer))
    finally:
        engine.shutdown()
    return 0


async def _serve(engine: Any, config: Any, tokenizer: Any) -> None:
    from prefill_node.server.server import PrefillServer

    engine.start()  # on this loop: the pipeline links share the serving loop
    try:
        server = PrefillServer(engine, config, tokenizer=tokenizer)
        server.metrics.registry.register(engine.metrics.collector())
        await start_server(server, "router", config.host)
        await serve_until_signal(server, "router")
    finally:
        await engine.aclose()
