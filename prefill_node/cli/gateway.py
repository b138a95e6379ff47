"""`wavepp gateway`: the OpenAI-compatible front door over the prefill tier and a decode fleet."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from prefill_node.cli.options import add_discovery_arguments, discovery_from_args
from prefill_node.client.remote_args import add_client_tls_arguments

DESCRIPTION = """\
Serve OpenAI's HTTP API (POST /v1/completions and /v1/chat/completions, streamed or not;
GET /v1/models, /health, /metrics) in front of the prefill tier (`wavepp router`) and a
fleet of decode instances (`vllm serve` with the WavePPConnector as kv_consumer, or
`wavepp decode --serve`). The openai SDK, curl and `vllm bench serve` work unchanged.

Per request: the prompt is tokenised once (the model's tokenizer and chat template), a
decode instance is picked (least load from its /metrics, longest cached prefix from its
vLLM KV events), and the prompt is prefilled either on the tier in pull mode (its leased
KV manifests go to decode in kv_transfer_params) or on the decode instance itself. The
decode's answer is relayed unchanged; headers say where it went: x-wavepp-prefill
(remote|local), x-wavepp-prefill-pipeline, x-wavepp-cached-tokens, x-wavepp-decode.

--prefill auto (default) decides per request: local when the tier is unavailable, or when
what decode would compute (prompt minus its cached prefix), added to the prompt tokens the
gateway sent it to compute that have not answered yet, is at most --local-max-tokens;
over that budget, while the tier's estimated queue exceeds --max-tier-queue, local when
decode's first token is predicted before the tier's (decode: that work at the instance's
prefill rate, learned from its streams, --decode-prefill-rate until then; tier: the
router's queue + suffix estimate plus a learned hand-off); remote otherwise
(docs/gateway.md). remote: always the tier (503 when it is down); local: never.

Decode instances must serve the model under --served-model-name (vllm serve
--served-model-name NAME).

examples:
  wavepp gateway --router 127.0.0.1:50050 --decode 127.0.0.1:8100 --port 8000
  wavepp gateway --router 127.0.0.1:50050 --decode 10.0.0.7:8000 --decode 10.0.0.8:8000 \\
      --decode-kv-events-port 5557
  wavepp gateway --router wavepp-router:50050 --k8s-service vllm-decode --prefill remote
  curl localhost:8000/v1/completions -H content-type:application/json \\
      -d '{"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is"}'
"""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "gateway",
        help="OpenAI-compatible HTTP front door: prefill on the tier or decode, decode fleet",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_discovery_arguments(
        p,
        "decode",
        "decode instances",
        "a decode instance's HTTP address (http:// optional); repeatable",
        port_name="http",
    )
    d = p.add_argument_group("decode instances' load and caches")
    d.add_argument(
        "--decode-kv-events",
        action="append",
        default=[],
        metavar="ENDPOINT",
        help="a decode instance's KV-event publisher, e.g. tcp://10.0.0.7:5557, one per "
        "--decode in order; the gateway connects, so vLLM must bind (--kv-events-config "
        "endpoint tcp://*:5557 or ipc://...)",
    )
    d.add_argument(
        "--decode-kv-events-port",
        type=int,
        metavar="PORT",
        help="every instance publishes KV events on this port of its own host",
    )
    d.add_argument(
        "--decode-poll-interval",
        type=float,
        default=1.0,
        help="seconds between reads of each instance's /metrics (default 1)",
    )
    t = p.add_argument_group("prefill")
    t.add_argument(
        "--router",
        metavar="HOST:PORT",
        help="the prefill tier (`wavepp router`); without it every prompt is local",
    )
    t.add_argument(
        "--prefill",
        choices=("auto", "remote", "local"),
        default="auto",
        help="where prompts are computed (default auto: per request)",
    )
    t.add_argument(
        "--local-max-tokens",
        type=int,
        default=256,
        help="auto: decode's prefill budget: a suffix decode would compute is computed "
        "there while it and decode's unanswered local prompts stay within this many "
        "tokens (default 256)",
    )
    t.add_argument(
        "--max-tier-queue",
        type=float,
        default=2.0,
        help="auto: the tier's estimated queue, seconds, beyond which a prompt over the "
        "budget goes local when decode's first token is predicted sooner (default 2)",
    )
    t.add_argument(
        "--decode-prefill-rate",
        type=float,
        default=5000.0,
        metavar="TOKENS_PER_S",
        help="auto: a decode instance's prefill rate until its first streamed local "
        "prefill is measured; optimistic on purpose, so that local is tried and learned "
        "(default 5000)",
    )
    t.add_argument(
        "--prefill-timeout",
        type=float,
        default=120.0,
        help="seconds a prefill on the tier may take (default 120)",
    )
    add_client_tls_arguments(p, "router", "the router")
    m = p.add_argument_group("model")
    m.add_argument(
        "--model",
        type=Path,
        help="HF checkpoint dir: tokenizer, chat template, context length "
        "(default: built-in SmolLM2)",
    )
    m.add_argument(
        "--served-model-name",
        help="the name clients send as `model` and decode serves (default: the model's name)",
    )
    m.add_argument(
        "--max-model-len",
        type=int,
        help="prompt + completion limit (default: the model's context length)",
    )
    n = p.add_argument_group("network")
    n.add_argument("--host", default="0.0.0.0", help="bind address (default 0.0.0.0)")
    n.add_argument("--port", type=int, default=8000, help="HTTP port, 0 = any (default 8000)")
    from prefill_node.cli.options import add_tracing_argument

    add_tracing_argument(p)
    p.add_argument(
        "--log-level",
        default="INFO",
        help="logging level; DEBUG logs each prefill decision (default INFO)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from prefill_node.cli.options import run_logged

    return run_logged("gateway", args, _run)


def _run(args: argparse.Namespace) -> int:
    from prefill_node.cli.options import configure_tracing
    from prefill_node.client.remote_args import client_tls
    from prefill_node.model.loader_hf import load_hf_config
    from prefill_node.model.tokenizer import Tokenizer
    from wavepp_gateway.config import DecisionRule, GatewayConfig, PrefillMode
    from wavepp_gateway.serve import Listener, events_by_address, serve

    configure_tracing(args, "wavepp-gateway")
    model_dir = args.model
    if model_dir is None:
        from prefill_node.model.default_model import default_model_dir

        model_dir = default_model_dir()
    model = load_hf_config(model_dir)
    decode = [a.removeprefix("http://").rstrip("/") for a in args.decode or ()]
    config = GatewayConfig(
        served_model=args.served_model_name or model.name,
        max_model_len=args.max_model_len or model.max_position_embeddings,
        router=args.router,
        router_tls=client_tls(args.router_ca, args.router_cert, args.router_key, "router"),
        mode=PrefillMode(args.prefill),
        rule=DecisionRule(
            local_max_tokens=args.local_max_tokens,
            max_tier_queue_s=args.max_tier_queue,
            decode_prefill_rate=args.decode_prefill_rate,
        ),
        prefill_timeout_s=args.prefill_timeout,
        decode_poll_s=args.decode_poll_interval,
    )
    events = events_by_address(decode, args.decode_kv_events, args.decode_kv_events_port)
    serve(config, Tokenizer.from_dir(model_dir), discovery_from_args(args, decode), events,
          Listener(args.host, args.port))  # fmt: skip
    return 0
