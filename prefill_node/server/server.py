"""The pipeline leader's gRPC front: grpc.aio server with health, reflection, limits and TLS.

Health (grpc.health.v1): "" is liveness (SERVING while the engine is live), the service name
``wavepp.prefill.v1.PrefillService`` is readiness (SERVING once every stage is up). A monitor
task polls ``engine.health()`` every ``health_poll_s`` and flips both, and the servicer
refuses requests with UNAVAILABLE while not ready. Once the engine is no longer live (a
pipeline with a dead stage has no way back) ``lost`` is set, for an owner that exits then.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from prefill_node.engine.types import Engine, EngineHealth
from prefill_node.model.tokenizer import PromptTokenizer
from prefill_node.server.debug_servicer import DebugServicer, IntegrityCheckable
from prefill_node.server.kv_event_hub import KVEventHub
from prefill_node.server.metrics import ServerMetrics
from prefill_node.server.servicer import PrefillServicer, method_handlers
from wavepp_proto.prefill.v1 import debug_pb2, debug_pb2_grpc, prefill_pb2

log = logging.getLogger(__name__)

SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name
DEBUG_SERVICE_NAME = debug_pb2.DESCRIPTOR.services_by_name["DebugService"].full_name
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(frozen=True)
class TLSConfig:
    """Server TLS from PEM files; ``client_ca_file`` set = mutual TLS (client certs required)."""

    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = None

    def credentials(self) -> grpc.ServerCredentials:
        for path in (self.cert_file, self.key_file, self.client_ca_file):
            if path is not None and not Path(path).is_file():
                raise FileNotFoundError(f"TLS file {path} does not exist")
        ca = Path(self.client_ca_file).read_bytes() if self.client_ca_file else None
        return grpc.ssl_server_credentials(
            [(Path(self.key_file).read_bytes(), Path(self.cert_file).read_bytes())],
            root_certificates=ca,
            require_client_auth=ca is not None,
        )


@dataclass(frozen=True)
class ServerConfig:
    """Network and limit settings. Port 0 picks a free port (see PrefillServer.port)."""

    host: str = "0.0.0.0"
    port: int = 50051
    metrics_host: str = "0.0.0.0"
    metrics_port: int | None = None  # None: no /metrics endpoint
    max_message_bytes: int = 64 * 1024 * 1024
    # Calls in progress on ALL services (health and Abort included); beyond it gRPC itself
    # answers RESOURCE_EXHAUSTED. Keep it well above the expected in-flight request count.
    max_concurrent_rpcs: int | None = 4096
    max_stream_inflight: int = 256  # per PrefillStream call
    health_poll_s: float = 0.5
    grace_s: float = 5.0
    tls: TLSConfig | None = None
    model_name: str = ""  # reported by GetServerInfo
    # True: engine.submit may block (an engine that computes inside it), so it runs on a
    # thread pool; False: submit only enqueues (both wavepp engines) and is called inline.
    blocking_submit: bool = True
    # Serve wavepp.prefill.v1.DebugService (CheckIntegrity); the engine must be checkable.
    debug_service: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port {self.port} is not in [0, 65535]")
        if self.max_message_bytes < 1024:
            raise ValueError("max_message_bytes must be at least 1024")
        if self.max_stream_inflight < 1 or self.health_poll_s <= 0:
            raise ValueError("max_stream_inflight must be >= 1 and health_poll_s > 0")


class PrefillServer:
    """Owns the grpc.aio server, health and metrics of one engine; not the engine itself."""

    def __init__(
        self,
        engine: Engine,
        config: ServerConfig,
        *,
        tokenizer: PromptTokenizer | None = None,
        kv_events: KVEventHub | None = None,
    ) -> None:
        self._engine = engine
        self._config = config
        self.metrics = ServerMetrics(load=engine.load)
        self.servicer = PrefillServicer(
            engine,
            tokenizer=tokenizer,
            metrics=self.metrics,
            kv_events=kv_events,
            max_stream_inflight=config.max_stream_inflight,
            model_name=config.model_name,
            blocking_submit=config.blocking_submit,
        )
        self.health = HealthServicer()
        self._debug: DebugServicer | None = None
        if config.debug_service:
            if not isinstance(engine, IntegrityCheckable):
                raise ValueError("this engine cannot check its stages: no debug service")
            self._debug = DebugServicer(engine)
        self._server: grpc.aio.Server | None = None
        self._monitor: asyncio.Task | None = None
        self.lost = asyncio.Event()  # set once the engine is not live: only a restart helps
        self.port = 0
        self.metrics_port: int | None = None

    async def start(self) -> None:
        """Bind, start serving, and start the health monitor (first check done before return)."""
        cfg = self._config
        options = [
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        server = grpc.aio.server(options=options, maximum_concurrent_rpcs=cfg.max_concurrent_rpcs)
        handlers = method_handlers(self.servicer)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),)
        )
        server.add_registered_method_handlers(SERVICE_NAME, handlers)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                 reflection.SERVICE_NAME]  # fmt: skip
        if self._debug is not None:
            debug_pb2_grpc.add_DebugServiceServicer_to_server(self._debug, server)
            names.append(DEBUG_SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        address = f"{cfg.host}:{cfg.port}"
        if cfg.tls is not None:
            self.port = server.add_secure_port(address, cfg.tls.credentials())
        else:
            self.port = server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"cannot bind the gRPC server to {address}")
        await self._apply_health(await asyncio.to_thread(self._engine.health))
        await server.start()
        self._server = server
        if cfg.metrics_port is not None:
            self.metrics_port = self.metrics.serve_http(cfg.metrics_port, cfg.metrics_host)
        self._monitor = asyncio.create_task(self._watch_health())
        log.info("serving %s on port %d (tls=%s)", SERVICE_NAME, self.port, cfg.tls is not None)

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    async def stop(self, grace_s: float | None = None) -> None:
        """Mark NOT_SERVING, let in-flight calls finish for ``grace_s``, then stop. Idempotent;
        the engine is left running (its owner shuts it down)."""
        if self._monitor is not None:
            self._monitor.cancel()
            self._monitor = None
        await self.health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(self._config.grace_s if grace_s is None else grace_s)
            self._server = None
        await self.servicer.close_sources()
        self.servicer.close()
        self.metrics.close()

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(self._config.health_poll_s)
            try:
                state = await asyncio.to_thread(self._engine.health)
            except Exception as exc:
                log.warning("engine.health() failed: %s", exc)
                state = EngineHealth(live=False, ready=False, detail=f"health check failed: {exc}")
            await self._apply_health(state)

    async def _apply_health(self, state: EngineHealth) -> None:
        if state.ready != self.servicer.ready:
            log.warning("pipeline readiness -> %s %s", state.ready, state.detail)
        self.servicer.ready = state.ready
        self.servicer.not_ready_detail = state.detail or "not all stages are up"
        await self.health.set("", _SERVING if state.live else _NOT_SERVING)
        if not state.live:
            self.lost.set()
        await self.health.set(SERVICE_NAME, _SERVING if state.ready else _NOT_SERVING)
