"""Command-line pieces shared by several wavepp subcommands: options, server run loop."""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

_LISTENING = re.compile(
    r"wavepp (?P<name>\w+): listening on (?P<target>\S+?)(,|$)(.*metrics on :(?P<metrics>\d+))?"
)


class Listening(NamedTuple):
    """What ``start_server``'s announcement says: ``wavepp NAME: listening on HOST:PORT``."""

    name: str  # the subcommand: serve, router
    target: str  # HOST:PORT
    metrics_port: int | None


def parse_listening(line: str) -> Listening | None:
    """The announcement in ``line`` (a child's stdout), or None when it is not one."""
    found = _LISTENING.search(line)
    if found is None:
        return None
    metrics = found.group("metrics")
    return Listening(found.group("name"), found.group("target"), metrics and int(metrics))


KV_PROGRESS_HELP = (
    "how NIXL agents advance transfers: 'event' (default) sleeps until UCX signals traffic, "
    "so an idle process uses no CPU; 'poll' busy-polls one core per agent for the lowest "
    "wake-up latency (microseconds), worth it only on dedicated hosts with a spare core"
)


def add_kv_progress(group: Any) -> None:
    """``--kv-progress {event,poll}`` -> ``args.kv_progress`` (a ``KVProgress``)."""
    from kv_transfer.progress import KVProgress

    group.add_argument(
        "--kv-progress",
        type=KVProgress,
        choices=(KVProgress.EVENT, KVProgress.POLL),
        default=KVProgress.EVENT,
        metavar="{event,poll}",
        help=KV_PROGRESS_HELP,
    )


def add_network_arguments(parser: argparse.ArgumentParser, port: int, metrics_port: int) -> None:
    """The gRPC server's bind, limits and shutdown flags (``wavepp serve``, ``wavepp router``)."""
    n = parser.add_argument_group("network and limits")
    n.add_argument("--host", default="0.0.0.0", help="gRPC bind address (default 0.0.0.0)")
    n.add_argument("--port", type=int, default=port, help=f"gRPC port, 0 = any (default {port})")
    n.add_argument("--metrics-host", default="0.0.0.0", help="metrics bind address")
    n.add_argument(
        "--metrics-port",
        type=int,
        default=metrics_port,
        help=f"Prometheus /metrics HTTP port, 0 = any free port, -1 = off (default {metrics_port})",
    )
    n.add_argument(
        "--max-message-mb",
        type=int,
        default=64,
        help="largest gRPC message accepted or sent, MiB (default 64)",
    )
    n.add_argument(
        "--max-concurrent-rpcs",
        type=int,
        default=4096,
        help="calls in progress at once; more get RESOURCE_EXHAUSTED (default 4096)",
    )
    n.add_argument(
        "--max-stream-inflight",
        type=int,
        default=256,
        help="requests in flight per PrefillStream call (default 256)",
    )
    n.add_argument(
        "--grace",
        type=float,
        default=5.0,
        help="seconds to let in-flight calls finish on shutdown (default 5)",
    )


def add_tracing_argument(parser: argparse.ArgumentParser) -> None:
    """``--otlp-endpoint``: every WavePP process's switch for OpenTelemetry tracing."""
    parser.add_argument(
        "--otlp-endpoint",
        metavar="URL",
        default=None,
        help="export OpenTelemetry trace spans over OTLP/HTTP (protobuf) to this collector, "
        "e.g. http://jaeger:4318 (/v1/traces is added when missing). Trace context is taken "
        "from and passed on in W3C traceparent headers / gRPC metadata. Default: the "
        "environment's OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else off (no SDK is imported). "
        "See docs/tracing.md",
    )


def configure_tracing(args: argparse.Namespace, service_name: str) -> None:
    """Turn tracing on for this process from ``--otlp-endpoint`` or the environment."""
    from prefill_node import tracing

    tracing.configure(service_name, getattr(args, "otlp_endpoint", None))


def add_discovery_arguments(
    parser: argparse.ArgumentParser, static_flag: str, peers: str, static_help: str, port_name: str
) -> None:
    """Where a server finds its peers (``peers``, e.g. "pipelines"), one of: repeated
    ``--STATIC_FLAG HOST:PORT``, or ``--k8s-service NAME`` (list + watch of that Service's
    EndpointSlices in ``--namespace``, their port ``--k8s-port-name``, default ``port_name``).
    ``discovery_from_args`` builds it."""
    d = parser.add_argument_group(f"{peers} (one of)")
    where = d.add_mutually_exclusive_group(required=True)
    where.add_argument(f"--{static_flag}", action="append", metavar="HOST:PORT", help=static_help)
    where.add_argument(
        "--k8s-service",
        metavar="NAME",
        help=f"discover the {peers} from the EndpointSlices of this Kubernetes Service "
        "(list + watch; needs get/list/watch on endpointslices)",
    )
    d.add_argument("--namespace", default=None, help="the Service's namespace (default: own)")
    d.add_argument(
        "--k8s-port-name",
        default=port_name,
        help=f"the EndpointSlice port to reach them on (default {port_name})",
    )


def discovery_from_args(args: argparse.Namespace, static: list[str] | None) -> Any:
    """The peers ``add_discovery_arguments`` named: ``static`` addresses when given, else
    the Service's EndpointSlices (in the pod's own namespace unless ``--namespace``)."""
    from prefill_router.discovery import EndpointSliceDiscovery, StaticDiscovery, own_namespace

    if static:
        return StaticDiscovery(static)
    return EndpointSliceDiscovery(
        args.k8s_service, args.namespace or own_namespace(), port_name=args.k8s_port_name
    )


def add_engine_arguments(
    group: Any, *, stages: int, model_help: str, engine_help: str, policy_help: str
) -> None:
    """The engine flags ``wavepp serve`` and ``wavepp prefill`` share, with one set of
    defaults (``EngineConfig``'s; only the stage count is the command's), read back by
    ``engine_spec``; ``--engine`` is the transport ``build_engine`` takes."""
    from prefill_node.core.policy import POLICY_NAMES
    from prefill_node.runtime.engine_config import TRANSPORTS, config_defaults
    from prefill_node.runtime.spec import DEVICES, DTYPES

    d = config_defaults()
    blocks = ",".join(str(b) for b in d["num_blocks"])
    group.add_argument("--model", type=Path, help=model_help)
    group.add_argument(
        "--stages", type=int, default=stages, help=f"pipeline stages (default {stages})"
    )
    group.add_argument("--engine", choices=TRANSPORTS, default=TRANSPORTS[0], help=engine_help)
    group.add_argument("--policy", choices=POLICY_NAMES, default=d["policy"], help=policy_help)
    group.add_argument(
        "--num-blocks",
        default=blocks,
        help=f"KV blocks per stage: one number, or one per stage comma-separated "
        f"(default {blocks})",
    )
    group.add_argument(
        "--block-size",
        type=int,
        default=d["block_size"],
        help=f"tokens per KV block (default {d['block_size']})",
    )
    group.add_argument(
        "--max-chunk-tokens",
        type=int,
        default=d["max_wave_tokens"],
        help="the wave budget M: tokens per forward chunk, rounded up to whole blocks "
        f"(default {d['max_wave_tokens']})",
    )
    group.add_argument(
        "--min-wave-tokens",
        type=int,
        help="smallest wave the planner shrinks to when little work is queued (b_min): "
        "smaller keeps a short burst pipelined over the stages, larger keeps each forward "
        "big; whole blocks (default: half of --max-chunk-tokens)",
    )
    group.add_argument(
        "--wave-overhead-tokens",
        type=int,
        default=d["wave_overhead_tokens"],
        help="a wave's fixed cost (weight reads, dispatch, the hop between stages) in tokens "
        "of compute: when little work is queued the planner makes waves about "
        "sqrt(queued tokens x this / (stages - 1)) tokens, so a lone prompt or a short burst "
        "keeps every stage busy instead of waiting through a big first and last wave "
        f"(default {d['wave_overhead_tokens']}: off; on CPU smaller waves cost more than the "
        "fill and drain they save, see docs/wavepp.md)",
    )
    group.add_argument(
        "--max-model-len", type=int, help="longest prompt accepted (default: model's)"
    )
    group.add_argument(
        "--dtype",
        choices=DTYPES,
        default=d["dtype"],
        help=f"weights and KV dtype (default {d['dtype']})",
    )
    group.add_argument(
        "--device",
        choices=DEVICES,
        default=d["device"],
        help=f"torch device (default {d['device']})",
    )
    group.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")


def engine_spec(args: argparse.Namespace, model_dir: Path, **extra: Any) -> Any:
    """The ``EngineConfig`` the ``add_engine_arguments`` flags describe (validated; ``extra``:
    the command's own fields, e.g. the KV hand-off)."""
    from prefill_node.errors import InvalidRequestError
    from prefill_node.runtime.engine_config import EngineConfig

    try:
        blocks = tuple(int(x) for x in str(args.num_blocks).split(","))
    except ValueError:
        raise InvalidRequestError(
            f"--num-blocks must be integers, got {args.num_blocks!r}"
        ) from None
    return EngineConfig(
        model_dir=model_dir,
        stages=args.stages,
        policy=args.policy,
        num_blocks=blocks,
        block_size=args.block_size,
        max_wave_tokens=args.max_chunk_tokens,
        min_wave_tokens=args.min_wave_tokens,
        wave_overhead_tokens=args.wave_overhead_tokens,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        device=args.device,
        **extra,
    )


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """Server-side TLS flags."""
    t = parser.add_argument_group("TLS (optional)")
    t.add_argument("--tls-cert", type=Path, help="server certificate chain (PEM); enables TLS")
    t.add_argument("--tls-key", type=Path, help="server private key (PEM)")
    t.add_argument(
        "--tls-client-ca",
        type=Path,
        help="CA bundle (PEM) for client certificates; enables mutual TLS",
    )


def server_config(args: argparse.Namespace, model_name: str) -> Any:
    """The ServerConfig of ``add_network_arguments`` + ``add_tls_arguments`` flags."""
    from prefill_node.server.server import ServerConfig, TLSConfig

    tls = None
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        tls = TLSConfig(args.tls_cert, args.tls_key, args.tls_client_ca)
    elif args.tls_client_ca:
        raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
    return ServerConfig(
        host=args.host,
        port=args.port,
        metrics_host=args.metrics_host,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port,
        max_message_bytes=args.max_message_mb * 1024 * 1024,
        max_concurrent_rpcs=args.max_concurrent_rpcs,
        max_stream_inflight=args.max_stream_inflight,
        grace_s=args.grace,
        tls=tls,
        model_name=model_name,
    )


def run_logged(
    name: str, args: argparse.Namespace, body: Callable[[argparse.Namespace], int]
) -> int:
    """Configure logging from ``--log-level`` and run ``body``; bad input exits 2 with
    ``wavepp NAME: error: ...``, any other WaveppError exits 1 naming its type."""
    from prefill_node.errors import InvalidRequestError, WaveppError

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return body(args)
    except (InvalidRequestError, FileNotFoundError, ValueError) as exc:
        print(f"wavepp {name}: error: {exc}", file=sys.stderr)
        return 2
    except WaveppError as exc:
        print(f"wavepp {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


async def start_server(server: Any, name: str, host: str) -> None:
    """Start ``server`` (a PrefillServer) and print ``wavepp NAME: listening on HOST:PORT``
    (the line scripts and tests wait for)."""
    await server.start()
    metrics = f", metrics on :{server.metrics_port}/metrics" if server.metrics_port else ""
    print(f"wavepp {name}: listening on {host}:{server.port}{metrics}", flush=True)


async def serve_until_signal(server: Any, name: str, lost: Any = None) -> bool:
    """Serve until SIGINT / SIGTERM, or until the asyncio.Event ``lost`` is set (the engine
    behind the server died), then drain in-flight calls and stop. True: stopped because
    ``lost`` was set."""
    import asyncio
    import signal

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    waits = [asyncio.create_task(stop.wait())]
    if lost is not None:
        waits.append(asyncio.create_task(lost.wait()))
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in waits:
        task.cancel()
    was_lost = lost is not None and lost.is_set() and not stop.is_set()
    reason = "the pipeline is lost" if was_lost else "stopping"
    print(f"wavepp {name}: draining in-flight calls, then {reason}", flush=True)
    await server.stop()
    return was_lost
