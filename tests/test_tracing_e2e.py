"""OpenTelemetry tracing across every hop, with real processes: a gateway, a router, a
2-stage pipeline with KV hand-off and a reference decode server, all started with
``--otlp-endpoint`` pointing at a real OTLP/HTTP receiver in this process. One request with
a known W3C ``traceparent`` must come back as one trace: every service's spans carry its
trace id, each span's parent is the hop before it, and the request id rides on them. With
tracing off, a serving process never imports the OpenTelemetry SDK."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from prefill_node.client.prefill_client import PrefillClient
from prefill_node.process_tree import terminate
from tests import gateway_harness as h
from tests.grpc_harness import wait_until
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CALLER_SPAN}-01"
LONG = "what is the capital of france ? " * 6  # 42 tokens: remote under --local-max-tokens 8

# (service, span name) every traced request through the whole path must produce
EXPECTED = {
    ("wavepp-gateway", "wavepp.gateway.request"),
    ("wavepp-gateway", "wavepp.gateway.tokenize"),
    ("wavepp-gateway", "wavepp.gateway.tier_score"),
    ("wavepp-gateway", "wavepp.gateway.tier_prefill"),
    ("wavepp-gateway", "wavepp.gateway.decode"),
    ("wavepp-router", "wavepp.router.score"),
    ("wavepp-router", "wavepp.router.request"),
    ("wavepp-router", "wavepp.router.route"),
    ("wavepp-router", "wavepp.router.forward"),
    ("wavepp-leader", "wavepp.leader.request"),
    ("wavepp-leader", "wavepp.leader.queue"),
    ("wavepp-leader", "wavepp.leader.admission"),
    ("wavepp-leader", "wavepp.leader.compute"),
    ("wavepp-leader", "wavepp.leader.kv_handoff"),
    ("wavepp-leader", "wavepp.stage.chunk"),  # stage 0 runs in the leader's process
    ("wavepp-leader", "wavepp.stage.kv_send"),
    ("wavepp-stage-1", "wavepp.stage.chunk"),
    ("wavepp-stage-1", "wavepp.stage.kv_send"),
    ("wavepp-decode", "wavepp.decode.kv_load"),
}


def _post(url: str, body: dict, headers: dict[str, str]) -> tuple[int, dict, dict]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json", **headers}
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        return reply.status, dict(reply.headers), json.loads(reply.read())


def _one(spans: list[ReceivedSpan], service: str, name: str) -> ReceivedSpan:
    found = [s for s in spans if s.service == service and s.name == name]
    assert len(found) == 1, (service, name, found)
    return found[0]


@pytest.fixture
def traced_path(tmp_path, monkeypatch):
    """Every process of the path, tracing to one receiver; the SDK's batch processors export
    after 50 ms instead of 5 s (the children inherit the variable)."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    model = h.model_dir(tmp_path)
    procs = []
    with OtlpReceiver() as rx:
        otlp = ("--otlp-endpoint", rx.endpoint)
        try:
            proc, pipeline = h.pipeline(model, "--kv-lease-ttl", "60", *otlp)
            procs.append(proc)
            proc, router = h.router(model, [pipeline], *otlp)
            procs.append(proc)
            proc, decode = h.decode_server(model, *otlp)
            procs.append(proc)
            proc, gateway = h.gateway(model, [decode], "--router", router,
                                      "--local-max-tokens", "8", *otlp)  # fmt: skip
            procs.append(proc)
            with PrefillClient(router) as client:
                wait_until(client.is_ready, 60, "the router ready")
            wait_until(lambda: h.get(f"{gateway}/health")[0] == 200, 30, "the gateway ready")
            wait_until(lambda: sum(h.metric(gateway, "wavepp_gateway_decode_ready").values())
                       == 1, 30, "the decode instance ready")  # fmt: skip
            yield rx, gateway, pipeline
        finally:
            for proc in reversed(procs):
                terminate(proc)


def test_one_request_is_one_trace_from_the_caller_through_every_hop(traced_path):
    rx, gateway, _ = traced_path
    body = {"model": h.SERVED, "prompt": LONG, "max_tokens": 3}
    status, headers, answer = _post(f"{gateway}/v1/completions", body, {"traceparent": TRACEPARENT})
    assert status == 200, answer
    assert headers["x-wavepp-prefill"] == "remote", headers

    def complete(spans: list[ReceivedSpan]) -> bool:
        return {(s.service, s.name) for s in spans if s.trace_id == TRACE_ID} >= EXPECTED

    received = rx.wait_for(complete, 30, "every hop's spans")
    if dump := os.environ.get("WAVEPP_TRACE_DUMP"):  # the example trace for notes and docs
        with open(dump, "w") as f:
            json.dump([s.__dict__ for s in received if s.trace_id == TRACE_ID], f, indent=1)
    # only ours: FastAPI's own telemetry (a span per HTTP call, /metrics polls included)
    # does not see our providers
    assert {s.name for s in received if not s.name.startswith("wavepp.")} == set()
    spans = [s for s in received if s.trace_id == TRACE_ID]
    one = lambda service, name: _one(spans, service, name)  # noqa: E731

    gw = one("wavepp-gateway", "wavepp.gateway.request")
    assert gw.parent_id == CALLER_SPAN  # continues the caller's trace
    for name in ("tokenize", "tier_score", "tier_prefill", "decode"):
        assert one("wavepp-gateway", f"wavepp.gateway.{name}").parent_id == gw.span_id, name
    tier_prefill = one("wavepp-gateway", "wavepp.gateway.tier_prefill")
    request_id = tier_prefill.attributes["wavepp.request_id"]
    assert request_id.startswith("gw-")

    score = one("wavepp-router", "wavepp.router.score")
    assert score.parent_id == one("wavepp-gateway", "wavepp.gateway.tier_score").span_id
    router = one("wavepp-router", "wavepp.router.request")
    assert router.parent_id == tier_prefill.span_id  # the gRPC metadata carried the context
    assert router.attributes["wavepp.request_id"] == request_id
    route = one("wavepp-router", "wavepp.router.route")
    forward = one("wavepp-router", "wavepp.router.forward")
    assert route.parent_id == forward.parent_id == router.span_id
    pipeline_id = forward.attributes["wavepp.pipeline"]
    assert route.attributes["wavepp.pipeline"] == pipeline_id
    assert tier_prefill.attributes["wavepp.pipeline"] == pipeline_id
    assert route.attributes["wavepp.cached_tokens"] == 0  # a cold cache, predicted
    assert route.attributes["wavepp.route_reason"]

    leader = one("wavepp-leader", "wavepp.leader.request")
    assert leader.parent_id == forward.span_id  # the router's forwarded call's metadata
    assert leader.attributes["wavepp.request_id"] == request_id
    for name in ("queue", "admission", "compute", "kv_handoff"):
        child = one("wavepp-leader", f"wavepp.leader.{name}")
        assert child.parent_id == leader.span_id, name
        assert child.attributes["wavepp.request_id"] == request_id
    admission = one("wavepp-leader", "wavepp.leader.admission")
    assert admission.attributes["wavepp.cached_tokens"] == 0
    prompt_tokens = admission.attributes["wavepp.prompt_tokens"]

    # each stage: one span per chunk it computed (the waves it took part in), and its KV send
    for stage, service in enumerate(("wavepp-leader", "wavepp-stage-1")):
        chunks = [s for s in spans if s.service == service and s.name == "wavepp.stage.chunk"]
        assert {s.parent_id for s in chunks} == {leader.span_id}
        assert {s.attributes["wavepp.stage"] for s in chunks} == {stage}
        assert {s.attributes["wavepp.request_id"] for s in chunks} == {request_id}
        assert sum(s.attributes["wavepp.chunk_tokens"] for s in chunks) == prompt_tokens
        assert len({s.attributes["wavepp.wave_id"] for s in chunks}) == len(chunks)
        send = one(service, "wavepp.stage.kv_send")
        assert send.parent_id == leader.span_id
        assert (send.attributes["wavepp.stage"], send.attributes["wavepp.kv_mode"]) == (
            stage,
            "pull",
        )

    # decode's KV load hangs under the gateway's decode call (kv_transfer_params carried it)
    load = one("wavepp-decode", "wavepp.decode.kv_load")
    assert load.parent_id == one("wavepp-gateway", "wavepp.gateway.decode").span_id
    assert load.attributes["wavepp.kv_bytes"] > 0


def test_a_server_with_tracing_off_never_imports_the_opentelemetry_sdk(tmp_path):
    """A real `wavepp serve` (leader and its stage process) serves a request with Python's
    import log on (PYTHONPROFILEIMPORTTIME, inherited by the stage): no OpenTelemetry module
    is imported, at start or on the request path."""
    model = h.model_dir(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPROFILEIMPORTTIME"] = "1"
    log = tmp_path / "imports.log"
    with open(log, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefill_node.cli.main", "serve", "--model", str(model),
             "--stages", "2", "--num-blocks", "64", "--block-size", str(h.BS),
             "--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--threads", "1",
             "--log-level", "WARNING", "--no-kv-shipping"],
            stdout=subprocess.PIPE, stderr=stderr, env=env, text=True,
        )  # fmt: skip
        try:
            line = proc.stdout.readline()
            assert "listening on 127.0.0.1:" in line, line
            target = line.split("listening on ")[1].split(",")[0].strip()
            with PrefillClient(target) as client:
                wait_until(client.is_ready, 60, "the pipeline ready")
                result = client.prefill(list(range(1, 40)), request_id="off").result
            assert result.prompt_tokens == 39
        finally:
            terminate(proc)
    imports = [ln for ln in log.read_text().splitlines() if ln.startswith("import time:")]
    assert any("prefill_node.runtime.stage_main" in ln for ln in imports)  # the log works
    assert any("prefill_node.tracing" in ln for ln in imports)  # and covers our module
    assert not [ln for ln in imports if "opentelemetry" in ln]


def test_a_request_that_waits_in_the_routers_queue_has_a_queue_span(tmp_path, monkeypatch):
    """A router with one slot per pipeline takes two overlapping requests (each lasts at least
    15 slowed waves): exactly one waits in flow control's queue, and only its trace carries a
    `wavepp.router.queue` span, under its router request span, as long as its wait."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    model = h.model_dir(tmp_path)
    traces = {"a": "0af7651916cd43dd8448eb211c80319c", "b": "1bf7651916cd43dd8448eb211c80319d"}
    prompts = {"a": [(7 * i + 3) % 64 for i in range(480)],
               "b": [(11 * i + 5) % 64 for i in range(480)]}  # fmt: skip
    procs = []
    with OtlpReceiver() as rx:
        try:
            proc, pipeline = h.pipeline(model)
            procs.append(proc)
            proc, router = h.router(model, [pipeline], "--max-inflight-per-pipeline", "1",
                                    "--otlp-endpoint", rx.endpoint)  # fmt: skip
            procs.append(proc)
            with PrefillClient(router) as client, ThreadPoolExecutor(2) as pool:
                wait_until(client.is_ready, 60, "the router ready")
                calls = [pool.submit(client.prefill, prompts[k], request_id=k,
                                     metadata=[("traceparent", f"00-{t}-{CALLER_SPAN}-01")])
                         for k, t in traces.items()]  # fmt: skip
                for call in calls:
                    assert call.result().result.prompt_tokens == 480

            def requests(spans: list[ReceivedSpan]) -> bool:
                return len([s for s in spans if s.name == "wavepp.router.request"]) == 2

            spans = rx.wait_for(requests, 30, "both router request spans")
        finally:
            for proc in reversed(procs):
                terminate(proc)
    queued = [s for s in spans if s.name == "wavepp.router.queue"]
    assert len(queued) == 1, queued
    (queue,) = queued
    waited = next(k for k, t in traces.items() if t == queue.trace_id)
    request = _one([s for s in spans if s.trace_id == queue.trace_id], "wavepp-router",
                   "wavepp.router.request")  # fmt: skip
    assert queue.parent_id == request.span_id
    assert queue.attributes["wavepp.request_id"] == waited
    # it waited for the other's prefill: 15 waves of WAVE_DELAY_S on the slowed pipeline
    assert queue.end_ns - queue.start_ns >= 15 * h.WAVE_DELAY_S * 1e9 * 0.5
    route = _one([s for s in spans if s.trace_id == queue.trace_id], "wavepp-router",
                 "wavepp.router.route")  # fmt: skip
    assert route.start_ns >= queue.end_ns - 1_000_000  # routed once it had its slot
