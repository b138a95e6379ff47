"""`vllm serve` (the CPU build's OpenAI server, WavePPConnector as kv_consumer, KV events on;
started by bench/vllm_server.py)
behind `wavepp gateway`, with our tier (`wavepp serve` 2 stages behind `wavepp router`),
all real processes on loopback.

Through the gateway, each answer equals `vllm serve`'s own greedy answer to the same request
sent to it directly, token for token; the gateway's ids are the ones vLLM computes from the
same messages; `wavepp_loaded` shows the prompt came over NIXL when the decision was remote;
and a prompt whose prefix the decode instance already holds (learnt from vLLM's own KV
events) is prefilled there under `auto`.

Not part of the default suite (it needs the vLLM peer environment, ``$VLLM_PEER_ENV`` or
``.venv-vllm``): ``.venv/bin/python -m pytest tests_vllm``.
"""

from __future__ import annotations

import subprocess

import openai
import pytest

from bench.vllm_server import VllmServer
from prefill_node.model.default_model import default_model_dir
from prefill_node.model.tokenizer import Tokenizer
from prefill_node.process_tree import terminate
from tests.grpc_harness import wait_until
from tests.router_harness import spawn
from tests_vllm.test_vllm_decode_e2e import _peer_python, serve_pipeline

pytestmark = [pytest.mark.timeout(900)]

SERVED = "smollm2"
NEW_TOKENS = 16
SYSTEM = ("You are a concise assistant for a European rail company. Answer in one sentence. "
          "Prefer trains to planes for trips under six hours. Mention the currency when asked "
          "about prices, and never invent timetables.")  # fmt: skip
QUESTIONS = ["What is the capital of France?", "Name three colours.",
             "Is the train from Paris to Lyon faster than the plane?"]  # fmt: skip
DOCUMENT = " ".join(f"Step {i}: the water cycle moves water from the sea to clouds, rain and "
                    "rivers." for i in range(1, 15))  # fmt: skip


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    model = default_model_dir()
    events = f"ipc://{logs}/decode-kv-events.ipc"  # vLLM binds it, the gateway connects
    vllm = VllmServer(_peer_python(), model, logs / "vllm.log", served_model_name=SERVED,
                      decode=True, events_endpoint=events)  # fmt: skip
    procs: list[subprocess.Popen] = []
    try:
        serve, pipeline = serve_pipeline(model, logs / "serve.log")
        procs.append(serve)
        router, router_port, _ = spawn(
            ["router", "--pipeline", pipeline, "--host", "127.0.0.1", "--port", "0",
             "--metrics-port", "-1", "--log-level", "WARNING"], "wavepp router:")  # fmt: skip
        procs.append(router)
        vllm.wait_ready()
        decode = vllm.url.removeprefix("http://")
        direct = openai.OpenAI(base_url=f"{vllm.url}/v1", api_key="none", max_retries=0)
        gateway, gw_port, _ = spawn(
            ["gateway", "--served-model-name", SERVED, "--router", f"127.0.0.1:{router_port}",
             "--decode", decode, "--decode-kv-events", events,
             "--local-max-tokens", "32", "--host", "127.0.0.1", "--port", "0",
             "--decode-poll-interval", "0.2", "--log-level", "WARNING"],
            "wavepp gateway:",
        )  # fmt: skip
        procs.append(gateway)
        base = f"http://127.0.0.1:{gw_port}"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        wait_until(lambda: _health(base), 60, "the gateway ready")
        yield {"client": client, "direct": direct, "base": base, "decode": decode,
               "model": model, "pipeline": pipeline, "logs": logs}  # fmt: skip
    finally:
        for proc in reversed(procs):
            terminate(proc)
        vllm.stop()


def _health(base: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{base}/health", timeout=5) as reply:
            return reply.status == 200
    except OSError:
        return False


def _chat(client, question: str, **extra):
    return client.chat.completions.with_raw_response.create(
        model=SERVED, max_tokens=NEW_TOKENS, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        extra_body={"return_token_ids": True, **extra},
    )  # fmt: skip


def test_answers_through_the_gateway_equal_vllm_serve_alone(stack):
    tokenizer = Tokenizer.from_dir(stack["model"])
    for question in QUESTIONS:
        raw = _chat(stack["client"], question)
        assert raw.headers["x-wavepp-prefill"] == "remote", raw.headers
        ours = raw.parse()
        loaded = ours.model_extra["kv_transfer_params"]["wavepp_loaded"]
        assert loaded["ok"] and loaded["tokens"] > 0, loaded
        reference = _chat(stack["direct"], question).parse()
        assert ours.choices[0].model_extra["token_ids"] == reference.choices[0].model_extra[
            "token_ids"]  # fmt: skip
        assert ours.choices[0].message.content == reference.choices[0].message.content
        ids = tokenizer.encode_chat([{"role": "system", "content": SYSTEM},
                                     {"role": "user", "content": question}])  # fmt: skip
        assert ours.model_extra["prompt_token_ids"] == ids  # the gateway's ids are vLLM's
    prompt = f"{SYSTEM} {QUESTIONS[0]}"
    for stream in (False, True):
        raw = stack["client"].completions.with_raw_response.create(
            model=SERVED, prompt=prompt + " " * stream, max_tokens=NEW_TOKENS, temperature=0,
            stream=stream)  # fmt: skip
        assert raw.headers["x-wavepp-prefill"] == "remote"
        answer = raw.parse()
        text = "".join(c.choices[0].text for c in answer if c.choices) if stream else (
            answer.choices[0].text)  # fmt: skip
        reference = stack["direct"].completions.create(
            model=SERVED, prompt=prompt + " " * stream, max_tokens=NEW_TOKENS, temperature=0
        )
        assert text == reference.choices[0].text


def test_a_prefix_the_decode_instance_holds_is_prefilled_there(stack):
    direct, base = stack["direct"], stack["base"]
    direct.completions.create(model=SERVED, prompt=DOCUMENT, max_tokens=1)  # vLLM caches it
    key = f'wavepp_gateway_decode_indexed_blocks{{instance="{stack["decode"]}"}}'
    wait_until(lambda: _metric(base, key) >= 2, 30, "vLLM's KV events indexed")
    raw = stack["client"].completions.with_raw_response.create(
        model=SERVED, prompt=DOCUMENT + " Summarise.", max_tokens=NEW_TOKENS, temperature=0
    )
    assert raw.headers["x-wavepp-prefill"] == "local", raw.headers
    assert raw.headers["x-wavepp-prefill-reason"] == "short_suffix"
    assert int(raw.headers["x-wavepp-cached-tokens"]) >= 256
    reference = direct.completions.create(model=SERVED, prompt=DOCUMENT + " Summarise.",
                                          max_tokens=NEW_TOKENS, temperature=0)  # fmt: skip
    assert raw.parse().choices[0].text == reference.choices[0].text


def _metric(base: str, key: str) -> float:
    import urllib.request

    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(key + " "):
                return float(line.rsplit(" ", 1)[1])
    return 0.0
