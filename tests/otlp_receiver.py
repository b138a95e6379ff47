"""A real OTLP/HTTP trace receiver on loopback for the tracing tests: accepts POST /v1/traces
(protobuf ``ExportTraceServiceRequest``, as the OpenTelemetry SDK's exporter sends it) and
keeps every span, with its service name, for the test to wait on and inspect."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str  # hex, as in a traceparent
    span_id: str
    parent_id: str  # "" for a root span
    attributes: dict[str, Any]
    events: tuple[str, ...]
    start_ns: int
    end_ns: int


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class OtlpReceiver:
    """``with OtlpReceiver() as rx``: ``rx.endpoint`` for ``--otlp-endpoint``; ``wait_for``
    blocks until the spans received satisfy a predicate (woken by each export)."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._cond = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver._add(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _add(self, request: Any) -> None:
        spans = []
        for rs in request.resource_spans:
            attrs = {a.key: _value(a.value) for a in rs.resource.attributes}
            service = attrs.get("service.name", "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(ReceivedSpan(
                        service, s.name, s.trace_id.hex(), s.span_id.hex(),
                        s.parent_span_id.hex(),
                        {a.key: _value(a.value) for a in s.attributes},
                        tuple(e.name for e in s.events), s.start_time_unix_nano,
                        s.end_time_unix_nano,
                    ))  # fmt: skip
        with self._cond:
            self.spans.extend(spans)
            self._cond.notify_all()

    def wait_for(
        self, done: Callable[[list[ReceivedSpan]], bool], timeout_s: float, what: str
    ) -> list[ReceivedSpan]:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not done(self.spans):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({(s.service, s.name) for s in self.spans})
                    raise AssertionError(f"timed out waiting for {what}; received {names}")
                self._cond.wait(left)
            return list(self.spans)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
