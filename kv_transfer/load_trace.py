"""A decode-side KV load as an OpenTelemetry span under the trace the request carried.

The prefill side puts the W3C ``traceparent`` of its decode request in ``kv_transfer_params``
(``params.TRACE_KEY``). The load is recorded through the OpenTelemetry API only, with the
provider ``use_provider`` was given (``wavepp decode --serve --otlp-endpoint``:
``prefill_node.tracing``), else the global one (vLLM started with ``--otlp-traces-endpoint``
installs its own); this module configures nothing. Without a ``traceparent``, or where the
OpenTelemetry API is not installed (a vLLM environment without it), every call returns None
at once.
"""

from __future__ import annotations

from typing import Any

_API: Any = None  # (trace module, propagator) once imported; False: not installed
_provider: Any = None  # this process's tracer provider when its owner set one


def use_provider(provider: Any) -> None:
    """Record KV loads with ``provider`` instead of the global tracer provider."""
    global _provider
    _provider = provider


def _api() -> Any:
    global _API
    if _API is None:
        try:
            from opentelemetry import trace
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError:
            _API = False
        else:
            _API = (trace, TraceContextTextMapPropagator())
    return _API


def start_load(traceparent: str | None, request_id: str, num_tokens: int) -> Any:
    """A started ``wavepp.decode.kv_load`` span, or None (no trace context, or no API)."""
    if not traceparent:
        return None
    api = _api()
    if not api:
        return None
    trace, propagator = api
    context = propagator.extract({"traceparent": traceparent})
    provider = _provider or trace.get_tracer_provider()
    return provider.get_tracer("wavepp.kv_transfer").start_span(
        "wavepp.decode.kv_load", context=context,
        attributes={"wavepp.request_id": request_id, "wavepp.kv_tokens": num_tokens},
    )  # fmt: skip


def end_load(span: Any, num_bytes: int, error: str | None) -> None:
    """End ``span`` (None: nothing) with what was read, failed when ``error`` is given."""
    if span is None:
        return
    span.set_attribute("wavepp.kv_bytes", num_bytes)
    if error is not None:
        trace, _ = _api()
        span.set_status(trace.Status(trace.StatusCode.ERROR, error))
    span.end()
