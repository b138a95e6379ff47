"""A decode-side KV load as an OpenTelemetry span under the trace the request carried.

The prefill side puts the W3C ``traceparent`` of its decode request in ``kv_transfer_params``
(``params.TRACE_KEY``). A decode process that traces (vLLM started with
``--otlp-traces-endpoint``, ``wavepp decode --serve --otlp-endpoint``) has installed its
global tracer provider; the load is recorded through the OpenTelemetry API only, so this
module configures nothing. Without a ``traceparent``, or where the OpenTelemetry API is not
installed (a vLLM environment without it), every call returns None at once.
"""

from __future__ import annotations

from typing import Any

_API: Any = None  # (trace module, propagator) once imported; False: not installed


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
    return trace.get_tracer("wavepp.kv_transfer").start_span(
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
