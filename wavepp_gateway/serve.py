"""Run the gateway: build the fleet, the tier client and the request path on uvicorn's loop,
and serve the app on a socket bound first (so ``--port 0`` can announce its port)."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Sequence
from dataclasses import dataclass

from prefill_node.model.tokenizer import PromptTokenizer
from prefill_node.openai_api.listener import tcp_listener
from prefill_router.discovery import PipelineDiscovery, PipelineEndpoint
from wavepp_gateway.config import GatewayConfig
from wavepp_gateway.decode_fleet import DecodeFleet, EventsEndpoint
from wavepp_gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Listener:
    host: str
    port: int


def events_by_address(
    decode: Sequence[str], events: Sequence[str], port: int | None
) -> EventsEndpoint:
    """Where each instance publishes KV events: paired in order with ``--decode`` when
    ``events`` are listed, else ``tcp://HOST:port`` of each instance when ``port`` is given
    (Kubernetes: the same port on every pod), else nowhere."""
    if events and len(events) != len(decode):
        raise ValueError("give one --decode-kv-events per --decode, in the same order")
    paired = dict(zip(decode, events, strict=False))  # empty events: none paired

    def endpoint(e: PipelineEndpoint) -> str | None:
        if e.address in paired:
            return paired[e.address]
        if port is not None:
            return f"tcp://{e.address.rsplit(':', 1)[0]}:{port}"
        return None

    return endpoint


def serve(
    config: GatewayConfig,
    tokenizer: PromptTokenizer,
    discovery: PipelineDiscovery,
    events_endpoint: EventsEndpoint,
    listener: Listener,
) -> None:
    """Serve until SIGINT / SIGTERM; prints ``wavepp gateway: listening on HOST:PORT``."""
    import uvicorn

    from wavepp_gateway.app import build_app
    from wavepp_gateway.request_path import RequestPath
    from wavepp_gateway.tier import PrefillTier

    metrics = GatewayMetrics()

    async def factory():
        fleet = DecodeFleet(discovery, f"{config.served_model}|decode", metrics,
                            poll_s=config.decode_poll_s,
                            events_endpoint=events_endpoint)  # fmt: skip
        await fleet.start()
        tier = None
        if config.router is not None:
            tier = PrefillTier(
                config.router, config.score_timeout_s, config.prefill_timeout_s, config.router_tls
            )

        async def close() -> None:
            await fleet.aclose()
            if tier is not None:
                await tier.close()

        return RequestPath(config, tokenizer, fleet, tier, metrics), fleet, close

    sock = tcp_listener(listener.host, listener.port)
    app = build_app(factory, metrics)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=5))  # fmt: skip

    async def run() -> None:
        loop = asyncio.get_running_loop()
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.02)
        if serving.done():
            serving.result()
            return
        for sig in (signal.SIGINT, signal.SIGTERM):  # uvicorn's own handlers, then ours
            loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
        host, port = sock.getsockname()[:2]
        print(f"wavepp gateway: listening on {host}:{port}", flush=True)
        await serving

    import uvloop  # vLLM's server loop too: a fraction of asyncio's cost per callback

    uvloop.run(run())
