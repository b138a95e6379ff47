"""`wavepp gateway` in front of a real tier (a 2-stage pipeline behind `wavepp router`) and
real reference decode servers (`wavepp decode --serve`), all processes on loopback, driven
by the openai SDK and raw HTTP: answers equal to decode fed directly, remote and local
decisions, and every failure case (client gone mid-stream, tier down under auto and under
remote, a decode instance dead before the first token, bad requests leaving nothing held)."""

from __future__ import annotations

import http.server
import json
import shutil
import signal
import socket
import threading

import httpx
import openai
import pytest

from prefill_node.client.prefill_client import PrefillClient
from prefill_node.process_tree import terminate
from tests import gateway_harness as h
from tests.grpc_harness import wait_until
from tests.router_harness import spawn
from tests.test_grpc_tls import _make_pki

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

LONG = "what is the capital of france ? " * 6  # 42 tokens: remote under --local-max-tokens 8
LEASE_TTL_S = 60  # far longer than any test waits: a lease that ends was given back
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": LONG}]


@pytest.fixture(scope="module")
def tier(tmp_path_factory):
    model = h.model_dir(tmp_path_factory.mktemp("tiny-gateway"))
    procs = []
    try:
        proc, pipeline = h.pipeline(model, "--kv-lease-ttl", str(LEASE_TTL_S))
        procs.append(proc)
        proc, router = h.router(model, [pipeline])
        procs.append(proc)
        decodes = []
        for _ in range(2):
            proc, address = h.decode_server(model)
            procs.append(proc)
            decodes.append(address)
        proc, gateway = h.gateway(model, decodes, "--router", router, "--local-max-tokens", "8")
        procs.append(proc)
        with PrefillClient(router) as client:
            wait_until(lambda: client.is_ready(), 60, "the router ready")
        wait_until(lambda: h.get(f"{gateway}/health")[0] == 200, 30, "the gateway ready")
        wait_until(lambda: sum(h.metric(gateway, "wavepp_gateway_decode_ready").values()) == 2,
                   30, "both decode instances ready")  # fmt: skip
        yield {"model": model, "pipeline": pipeline, "router": router, "decodes": decodes,
               "gateway": gateway}  # fmt: skip
    finally:
        for proc in reversed(procs):
            terminate(proc)


def sdk(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)


def integrity(pipeline: str):
    """The pipeline's own check: (every stage's invariants hold, nothing used or leased)."""
    with PrefillClient(pipeline) as client:
        report = client.check_integrity()
    idle = all(s.used_blocks == 0 and s.kv_leases == 0 for s in report.stages)
    return report.ok, idle and report.inflight_requests == 0


def test_completions_and_chat_through_the_gateway_equal_decode_fed_directly(tier):
    gateway, direct = sdk(tier["gateway"]), [sdk(f"http://{d}") for d in tier["decodes"]]
    asks = {
        "completions": lambda c, **kw: c.completions.with_raw_response.create(
            model=h.SERVED, prompt=LONG, max_tokens=12, temperature=0, **kw),
        "chat": lambda c, **kw: c.chat.completions.with_raw_response.create(
            model=h.SERVED, messages=CHAT, max_tokens=12, temperature=0, **kw),
    }  # fmt: skip
    for route, ask in asks.items():
        expected = {_text(route, ask(c).parse()) for c in direct}  # local prefill there
        assert len(expected) == 1
        raw = ask(gateway)
        assert raw.headers["x-wavepp-prefill"] == "remote", route
        assert raw.headers["x-wavepp-prefill-pipeline"] == tier["pipeline"]
        assert raw.headers["x-wavepp-decode"] in tier["decodes"]
        answer = raw.parse()
        assert _text(route, answer) == expected.pop() and answer.usage.completion_tokens == 12
        loaded = answer.model_extra["kv_transfer_params"]["wavepp_loaded"]
        assert loaded["ok"] and loaded["tokens"] == answer.usage.prompt_tokens
        stream = ask(gateway, stream=True)
        assert stream.headers["x-wavepp-prefill"] == "remote"
        assert stream.headers["content-type"].startswith("text/event-stream")
        pieces = [_delta(route, chunk) for chunk in stream.parse()]
        assert "".join(pieces) == _text(route, answer) and len([p for p in pieces if p]) > 1
    assert integrity(tier["pipeline"]) == (True, True)  # every lease released by the pulls
    # the reference server reports its KV load in the body, and in a stream's last event
    assert h.metric(tier["gateway"], "wavepp_gateway_kv_loads_total") == {
        'wavepp_gateway_kv_loads_total{outcome="ok"}': 4.0}  # fmt: skip
    # each streamed remote prefill was a sample of the tier's hand-off (auto's prediction)
    handoff = h.metric(tier["gateway"], "wavepp_gateway_tier_handoff_seconds")
    assert handoff["wavepp_gateway_tier_handoff_seconds"] != 0.0


def _text(route, answer) -> str:
    choice = answer.choices[0]
    return choice.text if route == "completions" else choice.message.content


def _delta(route, chunk) -> str:
    if not chunk.choices:
        return ""
    choice = chunk.choices[0]
    return (choice.text if route == "completions" else choice.delta.content) or ""


def test_a_cached_prefix_is_reported_and_a_short_prompt_stays_on_decode(tier):
    gateway = sdk(tier["gateway"])
    prompt = "spain is the capital of spain ? " * 5  # 35 tokens
    ask = lambda: gateway.completions.with_raw_response.create(  # noqa: E731
        model=h.SERVED, prompt=prompt, max_tokens=2, temperature=0)  # fmt: skip
    assert ask().headers["x-wavepp-cached-tokens"] == "0"
    again = ask().headers
    assert (again["x-wavepp-prefill"], again["x-wavepp-cached-tokens"]) == ("remote", "32")
    short = gateway.completions.with_raw_response.create(model=h.SERVED, prompt="what is the",
                                                         max_tokens=2)  # fmt: skip
    assert short.headers["x-wavepp-prefill"] == "local"
    assert short.headers["x-wavepp-prefill-reason"] == "short_suffix"
    assert "x-wavepp-prefill-pipeline" not in short.headers
    streamed = gateway.completions.with_raw_response.create(
        model=h.SERVED, prompt="what is the", max_tokens=2, stream=True)  # fmt: skip
    assert streamed.headers["x-wavepp-prefill"] == "local" and list(streamed.parse())
    # its first byte was a sample of that instance's prefill rate (auto's prediction)
    rates = h.metric(tier["gateway"], "wavepp_gateway_decode_prefill_rate")
    instance = streamed.headers["x-wavepp-decode"]
    assert rates[f'wavepp_gateway_decode_prefill_rate{{instance="{instance}"}}'] > 0
    decisions = h.metric(tier["gateway"], "wavepp_gateway_prefill_decisions_total")
    assert (
        decisions['wavepp_gateway_prefill_decisions_total{prefill="local",reason="short_suffix"}']
        >= 1
    )  # noqa: E501
    models = gateway.models.list()
    assert [m.id for m in models.data] == [h.SERVED]


def test_a_client_gone_mid_stream_stops_decode_and_leaves_the_tier_clean(tier):
    base = tier["gateway"]
    body = {"model": h.SERVED, "prompt": LONG, "max_tokens": 400, "temperature": 0,
            "stream": True}  # fmt: skip
    url = f"{base}/v1/completions"
    cancelled = _cancelled(base)
    with httpx.Client(timeout=30) as client, client.stream("POST", url, json=body) as reply:
        assert reply.status_code == 200
        decode = reply.headers["x-wavepp-decode"]
        before = _aborts(decode)
        next(reply.iter_raw())  # the first token came; then the client goes away
    wait_until(lambda: _aborts(decode) == before + 1, 30, "decode aborting the request")
    wait_until(lambda: _cancelled(base) == cancelled + 1, 10, "the gateway counting it")
    assert integrity(tier["pipeline"]) == (True, True)
    running = h.metric(f"http://{decode}", "vllm:num_requests_running")
    assert sum(running.values()) == 0


def test_a_client_gone_during_the_prefill_aborts_it_on_every_stage(tier):
    served, cancelled = _requests_served(tier["decodes"]), _cancelled(tier["gateway"])
    prompt = " ".join(["what"] * 460)  # 15 chunks of 32 tokens: about a second of waves
    body = json.dumps({"model": h.SERVED, "prompt": prompt, "max_tokens": 4}).encode()
    host, port = tier["gateway"].removeprefix("http://").split(":")
    with PrefillClient(tier["pipeline"]) as pipeline:
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: "
                         b"application/json\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(body), body))  # fmt: skip
            wait_until(lambda: pipeline.load().inflight_requests == 1, 10, "the prefill running")
        # the client is gone while its prompt is still computing on the pipeline
        wait_until(lambda: pipeline.load().inflight_requests == 0, 10, "the prefill aborted")
    wait_until(lambda: _cancelled(tier["gateway"]) == cancelled + 1, 10, "the gateway counting it")
    assert integrity(tier["pipeline"]) == (True, True)
    assert _requests_served(tier["decodes"]) == served  # decode never got it


def _cancelled(base: str) -> float:
    key = 'wavepp_gateway_requests_total{outcome="cancelled",route="completions"}'
    return h.metric(base, "wavepp_gateway_requests_total").get(key, 0.0)


def _aborts(decode: str) -> float:
    counts = h.metric(f"http://{decode}", "vllm:request_success_total")
    return sum(v for k, v in counts.items() if 'finished_reason="abort"' in k)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "gpt-4", "prompt": LONG}, 404, "model"),
        (b'{"model": "tiny", "prompt": ', 400, None),
        ({"model": h.SERVED, "prompt": LONG * 20}, 400, "prompt"),
        ({"model": h.SERVED, "prompt": LONG, "max_tokens": 600}, 400, "prompt"),
        ({"model": h.SERVED, "prompt": LONG, "temperature": -1}, 400, "temperature"),
        ({"model": h.SERVED, "prompt": LONG, "top_p": 7}, 400, "top_p"),
    ],
)
def test_bad_requests_get_openai_errors_and_hold_nothing(tier, body, status, param):
    served = _requests_served(tier["decodes"])
    code, headers, answer = h.post(f"{tier['gateway']}/v1/completions", body)
    assert code == status and headers["content-type"] == "application/json"
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert (answer["error"]["code"], answer["error"]["param"]) == (status, param)
    assert _requests_served(tier["decodes"]) == served  # decode never saw it
    assert integrity(tier["pipeline"]) == (True, True)


def test_a_request_no_decode_instance_can_hold_is_400_before_the_tier_sees_it(tier):
    proc, base = h.gateway(
        tier["model"], tier["decodes"], "--router", tier["router"], "--max-model-len", "4096"
    )  # more than the decode servers take
    try:
        wait_until(lambda: h.get(f"{base}/health")[0] == 200, 30, "gateway ready")
        served = _requests_served(tier["decodes"])
        body = {"model": h.SERVED, "prompt": LONG, "max_tokens": 600}
        code, _, answer = h.post(f"{base}/v1/completions", body)
        assert (code, answer["error"]["param"]) == (400, "prompt")
        assert "take at most 512" in answer["error"]["message"]  # from their /v1/models
        assert _requests_served(tier["decodes"]) == served
        assert integrity(tier["pipeline"]) == (True, True)
        body["max_tokens"] = 4
        assert h.post(f"{base}/v1/completions", body)[0] == 200
    finally:
        terminate(proc)


def _requests_served(decodes) -> float:
    return sum(sum(h.metric(f"http://{d}", "vllm:request_success_total").values())
               for d in decodes)  # fmt: skip


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tier_down_is_local_under_auto_and_503_under_remote(tier):
    dead = f"127.0.0.1:{_closed_port()}"
    procs = []
    try:
        for mode in ("auto", "remote"):
            procs.append(h.gateway(tier["model"], tier["decodes"][:1], "--router", dead,
                                   "--prefill", mode, "--local-max-tokens", "8"))  # fmt: skip
        (_, auto), (_, remote) = procs
        for base in (auto, remote):
            wait_until(lambda b=base: h.get(f"{b}/health")[0] == 200, 30, "gateway ready")
        body = {"model": h.SERVED, "prompt": LONG, "max_tokens": 4, "temperature": 0}
        code, headers, answer = h.post(f"{auto}/v1/completions", body)
        assert code == 200 and answer["choices"][0]["text"]
        assert (headers["x-wavepp-prefill"], headers["x-wavepp-prefill-reason"]) == (
            "local", "tier_unavailable")  # fmt: skip
        code, _, answer = h.post(f"{remote}/v1/completions", body)
        assert code == 503 and answer["error"]["type"] == "ServiceUnavailableError"
        errors = h.metric(remote, "wavepp_gateway_prefill_errors_total")
        assert errors == {'wavepp_gateway_prefill_errors_total{status="UNAVAILABLE"}': 1.0}
    finally:
        for proc, _ in procs:
            terminate(proc)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
def test_the_gateway_reaches_an_mtls_router_with_its_certificate_and_not_without(tier, tmp_path):
    """--router-ca / -cert / -key: a router that requires client certificates prefills for
    the gateway that presents one; without it the handshake fails and --prefill remote
    answers 503 (the chart mounts these files, tests/test_helm_gateway.py)."""
    pki = tmp_path / "pki"
    pki.mkdir()
    _make_pki(pki)
    procs = []
    try:
        router, port, _ = spawn(
            ["router", "--model", str(tier["model"]), "--pipeline", tier["pipeline"],
             "--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1",
             "--poll-interval", "0.2", "--log-level", "WARNING",
             "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
             "--tls-client-ca", str(pki / "ca.pem")],
            "wavepp router:",
        )  # fmt: skip
        procs.append((router, None))
        address = f"127.0.0.1:{port}"
        signed = ["--router-ca", str(pki / "ca.pem"), "--router-cert", str(pki / "client.pem"),
                  "--router-key", str(pki / "client.key")]  # fmt: skip
        for certs in (signed, signed[:2]):
            procs.append(h.gateway(tier["model"], tier["decodes"][:1], "--router", address,
                                   "--prefill", "remote", *certs))  # fmt: skip
        (_, with_cert), (_, without) = procs[1:]
        for base in (with_cert, without):
            wait_until(lambda b=base: h.get(f"{b}/health")[0] == 200, 30, "gateway ready")
        body = {"model": h.SERVED, "prompt": LONG, "max_tokens": 4, "temperature": 0}
        code, headers, answer = h.post(f"{with_cert}/v1/completions", body)
        assert code == 200 and answer["choices"][0]["text"], answer
        assert headers["x-wavepp-prefill"] == "remote"
        assert headers["x-wavepp-prefill-pipeline"] == tier["pipeline"]
        code, _, answer = h.post(f"{without}/v1/completions", body)
        assert code == 503 and answer["error"]["type"] == "ServiceUnavailableError"
    finally:
        for proc, _ in reversed(procs):
            terminate(proc)


def _low_free_port() -> int:
    """A free port in 10000-19999: its address sorts before any ephemeral port's (32768+),
    so among idle instances the gateway tries this one first (ties go to the lower id)."""
    for port in range(10000 + (hash(__file__) % 5000), 20000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port in 10000-19999")


def test_a_decode_instance_dead_before_the_first_token_is_retried_once_elsewhere(tier):
    victim = h.decode_server_on(tier["model"], _low_free_port())
    survivor = tier["decodes"][0]
    proc, base = h.gateway(tier["model"], [victim[1], survivor], "--router", tier["router"],
                           "--local-max-tokens", "8", "--decode-poll-interval", "600")  # fmt: skip
    try:
        ready = 'wavepp_gateway_decode_ready{instance="%s"}'
        wait_until(lambda: all(h.metric(base, "wavepp_gateway_decode_ready").get(ready % i) == 1
                               for i in (victim[1], survivor)), 30, "both ready")  # fmt: skip
        victim[0].send_signal(signal.SIGKILL)
        victim[0].wait(10)
        body = {"model": h.SERVED, "prompt": LONG, "max_tokens": 4, "temperature": 0}
        code, headers, answer = h.post(f"{base}/v1/completions", body)
        assert code == 200 and headers["x-wavepp-decode"] == survivor
        assert headers["x-wavepp-prefill"] == "remote"  # the same leased KV, pulled there
        assert answer["kv_transfer_params"]["wavepp_loaded"]["ok"]
        assert h.metric(base, "wavepp_gateway_decode_retries_total") == {
            "wavepp_gateway_decode_retries_total": 1.0}  # fmt: skip
        errors = h.metric(base, "wavepp_gateway_decode_errors_total")
        assert errors == {
            f'wavepp_gateway_decode_errors_total{{instance="{victim[1]}",kind="connect"}}': 1.0
        }
        code, headers, _ = h.post(f"{base}/v1/completions", body)  # marked down: no retry
        assert code == 200 and headers["x-wavepp-decode"] == survivor
        assert h.metric(base, "wavepp_gateway_decode_retries_total")[
            "wavepp_gateway_decode_retries_total"] == 1.0  # fmt: skip
    finally:
        terminate(proc)
        terminate(victim[0])
    assert integrity(tier["pipeline"]) == (True, True)


class _FailingDecode(http.server.BaseHTTPRequestHandler):
    """A test double of a decode instance that is up (its /metrics reads) but fails every
    request before its first token: a 500, then a stream that ends before any byte."""

    posts = 0

    def do_GET(self):
        body = b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        self.rfile.read(int(self.headers["content-length"]))
        type(self).posts += 1
        if type(self).posts == 1:
            self.send_error(500, "engine dead")
            return
        self.send_response(200)  # a stream that ends before its first event
        self.send_header("content-type", "text/event-stream")
        self.send_header("connection", "close")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_decode_failing_before_the_first_token_is_retried_without_the_used_kv(tier):
    double = http.server.ThreadingHTTPServer(("127.0.0.1", _low_free_port()), _FailingDecode)
    threading.Thread(target=double.serve_forever, daemon=True).start()
    failing = f"127.0.0.1:{double.server_address[1]}"  # sorts first: tried first
    survivor = tier["decodes"][0]
    proc, base = h.gateway(tier["model"], [failing, survivor], "--router", tier["router"],
                           "--local-max-tokens", "8")  # fmt: skip
    try:
        wait_until(lambda: sum(h.metric(base, "wavepp_gateway_decode_ready").values()) == 2,
                   30, "both ready")  # fmt: skip
        body = {"model": h.SERVED, "prompt": LONG, "max_tokens": 4, "temperature": 0}
        code, headers, answer = h.post(f"{base}/v1/completions", body)
        assert code == 200 and headers["x-wavepp-decode"] == survivor
        # the first instance may have taken the leases: the retry computes the prompt
        assert (headers["x-wavepp-prefill"], headers["x-wavepp-prefill-reason"]) == (
            "local", "decode_retry")  # fmt: skip
        assert answer["kv_transfer_params"] is None
        reference = sdk(f"http://{survivor}").completions.create(**body)
        assert answer["choices"][0]["text"] == reference.choices[0].text
        stream = sdk(base).completions.with_raw_response.create(**body, stream=True)
        assert stream.headers["x-wavepp-decode"] == survivor
        text = "".join(c.choices[0].text for c in stream.parse() if c.choices)
        assert text == reference.choices[0].text
        errors = h.metric(base, "wavepp_gateway_decode_errors_total")
        key = 'wavepp_gateway_decode_errors_total{instance="%s",kind="%s"}'
        assert errors == {key % (failing, "http_500"): 1.0, key % (failing, "empty_stream"): 1.0}
        assert _FailingDecode.posts == 2
    finally:
        terminate(proc)
        double.shutdown()


def test_health_and_metrics_speak_the_operators_language(tier):
    code, text = h.get(f"{tier['gateway']}/metrics")
    assert code == 200
    for name in ("wavepp_gateway_decision_cached_tokens_total",
                 "wavepp_gateway_tier_queue_seconds_count",
                 "wavepp_gateway_requests_total", "wavepp_gateway_ttft_seconds_bucket",
                 "wavepp_gateway_e2e_seconds_bucket", "wavepp_gateway_prefill_decisions_total",
                 "wavepp_gateway_decode_running", "wavepp_gateway_kv_loads_total"):  # fmt: skip
        assert name in text, name
    assert h.get(f"{tier['gateway']}/health") == (200, "")
    assert json.loads(h.get(f"{tier['gateway']}/v1/models")[1])["data"][0]["id"] == h.SERVED


def test_a_chat_template_that_differs_on_decode_is_refused_there_never_served_wrong(tier, tmp_path):
    """The gateway renders chat with another template than decode's: the prompt digest in
    kv_transfer_params does not match decode's ids, so decode refuses the KV and computes
    the prompt itself (its recompute policy): the answer is decode's own, the metric says
    the load failed, and the leases it did not use are given back."""
    import shutil

    other = tmp_path / "other-template"
    shutil.copytree(tier["model"], other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["chat_template"] = config["chat_template"].replace("}} {% endfor", "}} ? {% endfor")
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    proc, base = h.gateway(other, tier["decodes"][:1], "--router", tier["router"],
                           "--local-max-tokens", "8")  # fmt: skip
    try:
        wait_until(lambda: h.get(f"{base}/health")[0] == 200, 30, "gateway ready")
        body = {"model": h.SERVED, "messages": CHAT, "max_tokens": 6, "temperature": 0}
        code, headers, answer = h.post(f"{base}/v1/chat/completions", body)
        assert code == 200 and headers["x-wavepp-prefill"] == "remote"
        assert answer["kv_transfer_params"]["wavepp_loaded"]["ok"] is False
        _, _, reference = h.post(f"http://{tier['decodes'][0]}/v1/chat/completions", body)
        assert answer["choices"][0]["message"] == reference["choices"][0]["message"]
        assert h.metric(base, "wavepp_gateway_kv_loads_total") == {
            'wavepp_gateway_kv_loads_total{outcome="failed"}': 1.0}  # fmt: skip
        wait_until(lambda: integrity(tier["pipeline"]) == (True, True), 5,
                   "the refused KV's leases given back")  # fmt: skip
    finally:
        terminate(proc)


class _HeldDecode(http.server.BaseHTTPRequestHandler):
    """A test double of a decode instance that holds its first request (no byte of the
    answer) until ``release`` is set, then answers it; every later one is refused at once
    (a 400, as vLLM refuses a request it cannot take), without touching its KV."""

    bodies: list[dict] = []
    arrived = threading.Event()
    release = threading.Event()

    do_GET = _FailingDecode.do_GET  # its /metrics: idle

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        type(self).bodies.append(body)
        status = 200
        if len(type(self).bodies) == 1:
            type(self).arrived.set()
            type(self).release.wait(60)
            answer = {"id": "cmpl-held", "object": "text_completion", "created": 0,
                      "model": h.SERVED, "kv_transfer_params": None,
                      "choices": [{"index": 0, "text": "x", "logprobs": None,
                                   "finish_reason": "length"}]}  # fmt: skip
        else:
            status = 400
            answer = {"error": {"message": "refused", "type": "BadRequestError",
                                "param": None, "code": 400}}  # fmt: skip
        answer = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


def test_a_prompt_decode_is_still_computing_spends_its_budget_and_the_next_goes_remote(tier):
    double = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HeldDecode)
    threading.Thread(target=double.serve_forever, daemon=True).start()
    held = f"127.0.0.1:{double.server_address[1]}"
    proc, base = h.gateway(tier["model"], [held], "--router", tier["router"],
                           "--local-max-tokens", "64")  # fmt: skip
    pending = f'wavepp_gateway_decode_prefilling_tokens{{instance="{held}"}}'
    try:
        wait_until(lambda: h.get(f"{base}/health")[0] == 200, 30, "the gateway ready")
        body = {"model": h.SERVED, "prompt": LONG, "max_tokens": 1, "temperature": 0}
        first: list = []
        asking = threading.Thread(target=lambda: first.append(
            h.post(f"{base}/v1/completions", body)))  # fmt: skip
        asking.start()
        assert _HeldDecode.arrived.wait(30)  # 42 prompt tokens: within the 64-token budget
        assert h.metric(base, "wavepp_gateway_decode_prefilling_tokens")[pending] == 42
        code, headers, _ = h.post(f"{base}/v1/completions", body)  # 42 + 42 > 64
        assert code == 400  # decode refused it, relayed as it is
        assert (headers["x-wavepp-prefill"], headers["x-wavepp-prefill-reason"]) == (
            "remote", "decode_busy")  # fmt: skip
        assert "wavepp_pull" in _HeldDecode.bodies[1]["kv_transfer_params"]
        # decode never pulled that KV: the gateway gave its leases back through the router
        released = 'wavepp_gateway_prefill_releases_total{outcome="released"}'
        wait_until(lambda: h.metric(base, "wavepp_gateway_prefill_releases_total").get(released)
                   == 1, 10, "the leases released")  # fmt: skip
        wait_until(lambda: integrity(tier["pipeline"]) == (True, True), 5,
                   "every stage revoking them, long before their TTL")  # fmt: skip
        _HeldDecode.release.set()
        asking.join(30)
        code, headers, _ = first[0]
        assert code == 200
        assert (headers["x-wavepp-prefill"], headers["x-wavepp-prefill-reason"]) == (
            "local", "short_suffix")  # fmt: skip
        assert "kv_transfer_params" not in _HeldDecode.bodies[0]
        assert h.metric(base, "wavepp_gateway_decode_prefilling_tokens")[pending] == 0
    finally:
        _HeldDecode.release.set()
        terminate(proc)
        double.shutdown()
