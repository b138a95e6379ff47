"""`wavepp decode --serve` over HTTP with the openai SDK (real processes, real NIXL, loopback).

`wavepp serve` (2 stages, float32, the default SmolLM2 model) prefills in pull mode; the
decode server READs the stages' leased blocks named by a request's ``kv_transfer_params``
(built by ``pull_params``, exactly as for the vLLM connector), or computes the prompt itself
without them. Every greedy answer over HTTP, streamed or not, completions or chat, remote or
local prefill, must equal the reference DecodeWorker fed directly in this process with the
same pipeline's KV and first token. Bad requests get OpenAI's error JSON, a client that goes
away mid-answer stops its request, a failed KV load is recomputed and says so, and no block
stays allocated on the decode server (its own /metrics, read under vLLM's names).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
import uuid

import httpx
import openai
import pytest

from kv_transfer.vllm_decode.params import LOADED_KEY, pull_params
from prefill_node.cli.options import parse_listening
from prefill_node.client.prefill_client import PrefillClient
from prefill_node.decode.decode_worker import DecodeWorker
from prefill_node.engine.types import KVPullDestination
from prefill_node.model.tokenizer import Tokenizer
from prefill_node.process_tree import LineReader, terminate
from prefill_node.wire.kv_handoff import wire_manifest

CLI = [sys.executable, "-m", "prefill_node.cli.main"]
NEW = 20
NAME = "smol"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
TEXT = "The three primary colours are"


def _start(args: list[str], env: dict, err_path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [*CLI, *args], stdout=subprocess.PIPE, stderr=err_path.open("w"), text=True, env=env
    )
    lines = LineReader(proc.stdout, f"{args[0]}-stdout")
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        line = lines.next_line(max(deadline - time.monotonic(), 0.1))
        if line is None:
            break
        if (listening := parse_listening(line)) is not None:
            return proc, listening.target
    terminate(proc, 5)
    raise AssertionError(f"{args[0]} did not start: {err_path.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def system(default_model_cache, tmp_path_factory):
    cache_dir, converted = default_model_cache
    model = converted.path
    logs = tmp_path_factory.mktemp("decode-serve")
    env = {**os.environ, "WAVEPP_CACHE_DIR": str(cache_dir)}
    prefill, target = _start(
        ["serve", "--model", str(model), "--stages", "2", "--dtype", "float32",
         "--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--threads", "1",
         "--log-level", "WARNING"], env, logs / "serve.err",
    )  # fmt: skip
    try:
        decode, address = _start(
            ["decode", "--serve", "--model", str(model), "--served-model-name", NAME,
             "--host", "127.0.0.1", "--port", "0", "--decode-blocks", "128",
             "--timeout", "20"], env, logs / "decode.err",
        )  # fmt: skip
    except BaseException:
        terminate(prefill, 10)
        raise
    reference = DecodeWorker.from_model_dir(model, num_blocks=64, block_size=16)
    http = httpx.Client(base_url=f"http://{address}", trust_env=False, timeout=120)
    client = openai.OpenAI(
        base_url=f"http://{address}/v1", api_key="none", max_retries=0,
        http_client=httpx.Client(trust_env=False, timeout=120),
    )  # fmt: skip
    try:
        with PrefillClient(target) as prefill_client:
            yield _System(model, Tokenizer.from_dir(model), prefill_client, reference, client,
                          http, logs)  # fmt: skip
        assert terminate(decode, 30) == 0, (logs / "decode.err").read_text()[-3000:]
    finally:
        reference.close()
        http.close()
        for proc in (decode, prefill):
            terminate(proc, 10)


@dataclasses.dataclass
class _System:
    model: object
    tokenizer: Tokenizer
    prefill_client: PrefillClient
    reference: DecodeWorker
    client: openai.OpenAI
    http: httpx.Client
    logs: object

    def prefill(self, ids: list[int]) -> tuple[list, int]:
        """Pull-mode prefill on the pipeline: wire manifests (leased) and the first token."""
        request_id = uuid.uuid4().hex[:12]
        remote = self.prefill_client.prefill(
            ids, request_id=request_id, kv_destination=KVPullDestination(), deadline_s=60
        )
        stages = remote.result.stage_manifests
        wire = [wire_manifest(m, request_id, len(stages)) for m in stages]
        return wire, remote.result.first_token_id

    def expected(self, ids: list[int]) -> list[int]:
        """The reference worker fed directly: the pipeline's KV and first token."""
        wire, first = self.prefill(ids)
        request_id = wire[0].request_id
        self.reference.pull_wire(request_id, ids, wire)
        try:
            self.reference.wait_kv(request_id, 30)
            eos = self.tokenizer.eos_token_ids
            return list(self.reference.generate(request_id, first, NEW, eos))
        finally:
            self.reference.release(request_id)

    def text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def metrics(self) -> dict[str, float]:
        """The decode server's samples: ``name{label="value",...}`` without model_name."""
        from prometheus_client.parser import text_string_to_metric_families

        out = {}
        for family in text_string_to_metric_families(self.http.get("/metrics").text):
            for sample in family.samples:
                assert sample.labels.pop("model_name") == NAME
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}"] = sample.value
        return out

    def settled(self, timeout_s: float = 30) -> dict[str, float]:
        """Metrics once nothing runs or waits; the KV pool must then be empty."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            idle = (m['vllm:num_requests_running{engine="0"}'],
                    m['vllm:num_requests_waiting{engine="0"}'])  # fmt: skip
            if idle == (0, 0) or time.monotonic() > deadline:
                assert idle == (0, 0), m
                assert m['vllm:kv_cache_usage_perc{engine="0"}'] == 0, m
                return m
            time.sleep(0.05)


def _completion(system: _System, ids: list[int], params: dict | None, stream: bool):
    """Token ids, text, finish reason and kv_transfer_params of one completions call."""
    extra = {"return_token_ids": True}
    if params is not None:
        extra["kv_transfer_params"] = params
    kw = dict(model=NAME, prompt=ids, max_tokens=NEW, temperature=0, extra_body=extra)
    if not stream:
        body = system.client.completions.create(**kw).model_dump()
        choice = body["choices"][0]
        return choice["token_ids"], choice["text"], choice["finish_reason"], body[
            "kv_transfer_params"]  # fmt: skip
    tokens, text, finish, kv, usage = [], "", None, None, None
    for chunk in system.client.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}
    ):
        body = chunk.model_dump()
        if body.get("usage"):
            usage = body["usage"]
        for choice in body["choices"]:
            tokens += choice.get("token_ids") or []
            text += choice["text"]
            finish = choice["finish_reason"] or finish
        kv = body.get("kv_transfer_params") or kv
    counts = {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    assert counts == {"prompt_tokens": len(ids), "completion_tokens": len(tokens),
                      "total_tokens": len(ids) + len(tokens)}  # fmt: skip
    return tokens, text, finish, kv


def _bytes_per_token(model) -> int:
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * 4


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_remote_prefill_over_http_answers_as_the_reference_worker_fed_directly(system, stream):
    ids = system.tokenizer.encode_chat(CHAT)
    expected = system.expected(ids)
    wire, _ = system.prefill(ids)
    tokens, text, finish, kv = _completion(system, ids, pull_params(wire, ids), stream)
    assert tokens == expected
    assert text == system.text(expected)
    assert finish == ("stop" if expected[-1] in system.tokenizer.eos_token_ids else "length")
    # the whole prompt came over NIXL from both stages
    assert kv == {LOADED_KEY: {"tokens": len(ids), "bytes": len(ids) * _bytes_per_token(
        system.model), "ok": True, "error": None}}  # fmt: skip
    system.settled()


@pytest.mark.slow
def test_local_prefill_over_http_answers_as_the_reference_worker(system):
    """No kv_transfer_params: the decode server computes the prompt; completions with text
    and chat with messages (its template, streamed and not) give the reference's tokens."""
    before = system.settled()
    ids = system.tokenizer.encode(TEXT)
    expected = system.expected(ids)
    body = system.client.completions.create(
        model=NAME, prompt=TEXT, max_tokens=NEW, temperature=0,
        extra_body={"return_token_ids": True},
    ).model_dump()  # fmt: skip
    assert body["choices"][0]["prompt_token_ids"] == ids
    assert body["choices"][0]["token_ids"] == expected
    assert body["kv_transfer_params"] is None
    chat_ids = system.tokenizer.encode_chat(CHAT)
    expected_chat = system.text(system.expected(chat_ids))
    answer = system.client.chat.completions.create(
        model=NAME, messages=CHAT, max_tokens=NEW, temperature=0
    )
    assert answer.choices[0].message.content == expected_chat
    assert answer.usage.prompt_tokens == len(chat_ids)
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in system.client.chat.completions.create(
            model=NAME, messages=CHAT, max_tokens=NEW, temperature=0, stream=True
        )
        if chunk.choices
    )
    assert streamed == expected_chat
    after = system.settled()
    local = 'vllm:prompt_tokens_by_source_total{engine="0",source="local_compute"}'
    assert after[local] - before[local] == len(ids) + 2 * len(chat_ids)


@pytest.mark.slow
def test_bad_requests_get_openai_errors_and_leave_nothing_allocated(system):
    ids = system.tokenizer.encode_chat(CHAT)
    c = system.client
    cases = {
        "temperature": dict(prompt=ids, temperature=0.7),
        "n": dict(prompt=ids, n=2),
        "logprobs": dict(prompt=ids, logprobs=2),
        "stop": dict(prompt=ids, stop=["."]),
        "prompt": dict(prompt=[10**9]),
        "max_tokens": dict(prompt=ids, max_tokens=10**6),
    }
    for param, kw in cases.items():
        with pytest.raises(openai.BadRequestError) as caught:
            c.completions.create(model=NAME, **{"max_tokens": 4, **kw})
        error = caught.value.body
        assert (error["param"], error["code"], error["type"]) == (param, 400, "BadRequestError")
        assert error["message"]
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="other", prompt=ids, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="kv_transfer_params"):
        c.completions.create(model=NAME, prompt=ids, max_tokens=4,
                             extra_body={"kv_transfer_params": {"wavepp_pull": "x"}})  # fmt: skip
    raw = system.http.post("/v1/completions", content=b"{not json",
                           headers={"content-type": "application/json"})  # fmt: skip
    assert raw.status_code == 400 and raw.json()["error"]["code"] == 400
    with pytest.raises(openai.BadRequestError, match="messages"):
        c.chat.completions.create(model=NAME, messages=[], max_tokens=4)
    system.settled()


@pytest.mark.slow
def test_a_client_gone_mid_answer_stops_it_and_frees_its_blocks(system):
    """ignore_eos and 1,000 tokens: only a disconnect ends these requests early."""
    before = system.settled()
    ids = system.tokenizer.encode_chat(CHAT)
    body = {"model": NAME, "prompt": ids, "max_tokens": 1000, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with system.http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        got = [line for line, _ in zip(lines, range(8), strict=False) if line.startswith("data")]
        assert len(got) >= 3
    # the same without streaming: the client gives up waiting
    with pytest.raises(httpx.ReadTimeout):
        system.http.post("/v1/completions", json={**body, "stream": False}, timeout=1.0)
    after = system.settled()
    aborted = 'vllm:request_success_total{engine="0",finished_reason="abort"}'
    generated = 'vllm:generation_tokens_total{engine="0"}'
    assert after[aborted] - before[aborted] == 2
    assert after[generated] - before[generated] < 2000


@pytest.mark.slow
def test_a_failed_kv_load_is_recomputed_and_says_so(system):
    """A stage that cannot be reached, and manifests of another prompt: the default policy
    (recompute) answers as the reference would, and wavepp_loaded / the metric say so."""
    before = system.settled()
    ids = system.tokenizer.encode_chat(CHAT)
    expected = system.expected(ids)
    wire, _ = system.prefill(ids)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    wire[1] = dataclasses.replace(wire[1], endpoint=closed)
    tokens, _, _, kv = _completion(system, ids, pull_params(wire, ids), stream=False)
    assert tokens == expected
    assert kv[LOADED_KEY]["ok"] is False and kv[LOADED_KEY]["tokens"] == 0
    assert kv[LOADED_KEY]["error"]
    other = system.tokenizer.encode_chat([{"role": "user", "content": "Name a colour."}])
    wire, _ = system.prefill(other)
    tokens, _, _, kv = _completion(system, ids, pull_params(wire, other), stream=True)
    assert tokens == expected
    assert "not the ones the prefill" in kv[LOADED_KEY]["error"]
    after = system.settled()
    key = 'wavepp_decode_kv_loads_total{engine="0",outcome="failed_recomputed"}'
    assert after[key] - before[key] == 2


@pytest.mark.slow
def test_a_failed_kv_load_under_the_fail_policy_is_an_error_and_holds_nothing(
    system, default_model_cache, tmp_path
):
    """`--kv-load-failure-policy fail`: the request ends with OpenAI's 500 (streamed: an
    error event, then [DONE]), as vLLM answers a request finished with "error"."""
    env = {**os.environ, "WAVEPP_CACHE_DIR": str(default_model_cache[0])}
    decode, address = _start(
        ["decode", "--serve", "--model", str(system.model), "--served-model-name", NAME,
         "--host", "127.0.0.1", "--port", "0", "--decode-blocks", "32",
         "--kv-load-failure-policy", "fail"], env, tmp_path / "decode-fail.err",
    )  # fmt: skip
    try:
        http = httpx.Client(base_url=f"http://{address}", trust_env=False, timeout=60)
        ids = system.tokenizer.encode_chat(CHAT)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            closed = f"127.0.0.1:{s.getsockname()[1]}"
        for stream in (False, True):
            wire, _ = system.prefill(ids)
            wire = [dataclasses.replace(m, endpoint=closed) for m in wire]
            body = {"model": NAME, "prompt": ids, "max_tokens": 8, "stream": stream,
                    "kv_transfer_params": pull_params(wire, ids)}  # fmt: skip
            response = http.post("/v1/completions", json=body)
            if not stream:
                assert response.status_code == 500, response.text
                error = response.json()["error"]
            else:
                assert response.status_code == 200
                events = [line[6:] for line in response.text.splitlines() if line]
                assert events[-1] == "[DONE]" and len(events) == 2, events
                error = json.loads(events[0])["error"]
            assert (error["type"], error["code"]) == ("InternalServerError", 500)
            assert "KV load failed" in error["message"] and "Unreachable" in error["message"]
        metrics = http.get("/metrics").text
        assert 'outcome="failed"} 2.0' in metrics
        assert 'vllm:kv_cache_usage_perc{engine="0",model_name="smol"} 0.0' in metrics
        http.close()
    finally:
        assert terminate(decode, 30) == 0
