"""OpenTelemetry tracing for every WavePP process: off unless an OTLP endpoint is configured.

One process configures it once, at start (``configure``), with its service name
(``wavepp-gateway``, ``wavepp-router``, ``wavepp-leader``, ``wavepp-stage-N``,
``wavepp-decode``) and an OTLP/HTTP traces endpoint (``--otlp-endpoint``, else the standard
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``). Spans are exported in batches (protobuf over HTTP)
and flushed by ``shutdown`` (also registered at exit).

Contract for callers on hot paths: check ``enabled()`` first; while tracing is off nothing
from the OpenTelemetry SDK or API is imported and no span object is made. Trace context
crosses processes in the W3C form (``traceparent`` / ``tracestate``): gRPC metadata, HTTP
headers, ``PrefillOptions.traceparent`` and wave chunks (leader -> stages), and
``kv_transfer_params`` (gateway -> decode). Spans are started with an explicit parent
(``parent``: a traceparent string or a carrier mapping), never from an implicit current
context, so threads and event loops need no context plumbing.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

log = logging.getLogger(__name__)

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
DEFAULT_PATH = "/v1/traces"

# Attribute names, the same on every service.
REQUEST_ID = "wavepp.request_id"
PIPELINE = "wavepp.pipeline"
CACHED_TOKENS = "wavepp.cached_tokens"
PROMPT_TOKENS = "wavepp.prompt_tokens"
STAGE = "wavepp.stage"
WAVE_ID = "wavepp.wave_id"

_tracer: Any = None  # the process's Tracer while tracing is on; None: off
_provider: Any = None
_endpoint = ""


def enabled() -> bool:
    """True when this process exports spans. The one check a hot path pays when off."""
    return _tracer is not None


def resolve_endpoint(endpoint: str | None) -> str:
    """``endpoint`` (a base URL such as http://collector:4318, or the full .../v1/traces),
    else the environment's, as the full traces URL; "" when neither is set."""
    url = (endpoint or os.environ.get(ENDPOINT_ENV, "")).strip()
    if not url:
        return ""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--otlp-endpoint must be an http(s) URL, got {url!r}")
    return url if url.rstrip("/").endswith(DEFAULT_PATH) else url.rstrip("/") + DEFAULT_PATH


def configure(service_name: str, endpoint: str | None = None) -> bool:
    """Turn tracing on for this process when an endpoint is given or in the environment;
    True when on. Imports the SDK only then. Calling it again changes nothing."""
    global _tracer, _provider, _endpoint
    if _tracer is not None:
        return True
    url = resolve_endpoint(endpoint)
    if not url:
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from kv_transfer import load_trace

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
    # Not installed as the global provider: FastAPI's own telemetry would pick it up and
    # export a span per HTTP request (every /metrics scrape); kv_transfer's KV-load spans
    # are told about it instead.
    load_trace.use_provider(provider)
    _provider, _endpoint = provider, url
    _tracer = provider.get_tracer("wavepp")
    atexit.register(shutdown)
    log.info("tracing on: %s exports spans to %s", service_name, url)
    return True


def shutdown() -> None:
    """Export every span still buffered, then stop; a no-op when off."""
    global _tracer, _provider
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()


def child_env() -> dict[str, str]:
    """Environment for a child process (a locally launched stage) that should trace to the
    same endpoint; empty when off."""
    return {ENDPOINT_ENV: _endpoint} if _tracer is not None else {}


def _context(parent: str | Mapping[str, str] | Iterable[tuple[str, Any]] | None) -> Any:
    if not parent:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    if isinstance(parent, str):
        carrier: Mapping[str, str] = {TRACEPARENT: parent}
    elif isinstance(parent, Mapping):
        carrier = parent
    else:  # gRPC metadata: (key, value) pairs
        carrier = {k: v for k, v in parent if k in (TRACEPARENT, TRACESTATE)}
    if TRACEPARENT not in carrier:
        return None
    return TraceContextTextMapPropagator().extract(carrier)


_KINDS = ("internal", "server", "client")


def start_span(
    name: str,
    parent: Any = None,
    attributes: Mapping[str, Any] | None = None,
    *,
    kind: str = "internal",
    start_ns: int | None = None,
) -> Any:
    """A started span under ``parent`` (a traceparent, a carrier mapping, gRPC metadata, or
    None for a new trace); None while tracing is off. The caller ends it (``end``)."""
    if _tracer is None:
        return None
    from opentelemetry.trace import SpanKind

    span_kind = (SpanKind.INTERNAL, SpanKind.SERVER, SpanKind.CLIENT)[_KINDS.index(kind)]
    return _tracer.start_span(
        name, context=_context(parent), kind=span_kind, attributes=attributes,
        start_time=start_ns,
    )  # fmt: skip


def end(span: Any, end_ns: int | None = None, error: BaseException | str | None = None) -> None:
    """End ``span`` (None: nothing), marking it failed when ``error`` is given."""
    if span is None:
        return
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, str(error) or type(error).__name__))
    span.end(end_time=end_ns)


def record(
    name: str,
    parent: Any,
    start_ns: int,
    end_ns: int,
    attributes: Mapping[str, Any] | None = None,
) -> Any:
    """A span already over (times known afterwards: queue wait, admission, a wave)."""
    span = start_span(name, parent, attributes, start_ns=start_ns)
    end(span, end_ns)
    return span


def traceparent(span: Any) -> str:
    """``span``'s W3C traceparent ("" for None), for a child in another thread or process."""
    return dict(headers(span)).get(TRACEPARENT, "")


def headers(span: Any) -> list[tuple[str, str]]:
    """``span``'s context as W3C headers / gRPC metadata pairs; empty for None."""
    if span is None:
        return []
    from opentelemetry.trace import set_span_in_context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=set_span_in_context(span))
    return list(carrier.items())


def wall_ns(t_monotonic: float) -> int:
    """A ``time.monotonic()`` instant as wall-clock nanoseconds (span timestamps)."""
    return time.time_ns() - int((time.monotonic() - t_monotonic) * 1e9)
