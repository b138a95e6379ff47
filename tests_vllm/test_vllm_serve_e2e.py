"""vLLM's stock OpenAI server continues from our prefill tier's KV (real processes, real NIXL).

`wavepp serve` (2 stages, float32, the default SmolLM2 model) prefills in pull mode; vLLM's
OpenAI server (the peer environment's CPU build: float32, enforce-eager, prefix caching on,
WavePPConnector as kv_consumer, KV events published over ZMQ on loopback) gets each prompt
as token ids with ``kv_transfer_params`` (``pull_params``) in the /v1/completions body. Its
greedy tokens must equal the same server's answer without kv_transfer_params, token for
token; the response's ``wavepp_loaded`` must count every prompt token vLLM did not hold
(all of them, or the part after the long prompt's first 128-token block, which its own run
left in vLLM's prefix cache), and vLLM's own count of cached prompt tokens must agree.
Streaming, chat (vLLM applies the template; the ids match ours) and a failed load under the
default "recompute" policy must answer the same too. vLLM's load gauges are checked under
the names and labels our decode server exports.

The server is started by bench/vllm_server.py (``python -m vllm.entrypoints.openai.api_server``,
the app ``vllm serve`` runs).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import uuid

import httpx
import pytest

from kv_transfer.vllm_decode.params import LOADED_KEY, pull_params
from prefill_node.client.prefill_client import PrefillClient
from prefill_node.engine.types import KVPullDestination
from prefill_node.model.default_model import default_model_dir
from prefill_node.model.tokenizer import Tokenizer
from prefill_node.process_tree import terminate
from prefill_node.runtime.dist_env import free_local_port
from prefill_node.wire.kv_handoff import wire_manifest
from tests_vllm.test_vllm_decode_e2e import (
    PROMPTS,
    REPO,
    _closed_port,
    _kv_bytes_per_token,
    _peer_python,
    serve_pipeline,
)

sys.path.insert(0, str(REPO / "bench"))
from vllm_server import VllmServer  # noqa: E402

NEW_TOKENS = 24
NAME = "smol"
VLLM_BLOCK = 128  # vLLM's CPU cache block size


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    logs = tmp_path_factory.mktemp("vllm-serve")
    model = default_model_dir()
    started = time.monotonic()
    vllm = VllmServer(  # first: it takes the longest
        _peer_python(), model, logs / "vllm.log", served_model_name=NAME, decode=True,
        events_endpoint=f"tcp://127.0.0.1:{free_local_port()}",
    )  # fmt: skip
    prefill = None
    http = httpx.Client(base_url=vllm.url, trust_env=False, timeout=180)
    try:
        prefill, target = serve_pipeline(model, logs / "serve.err")
        vllm.wait_ready()
        print(f"  vLLM serving after {time.monotonic() - started:.0f} s", file=sys.stderr)
        with PrefillClient(target) as client:
            yield _System(Tokenizer.from_dir(model), client, http, _kv_bytes_per_token(model))
    finally:
        http.close()
        vllm.stop()
        if prefill is not None:
            terminate(prefill, 30)


@dataclasses.dataclass
class _System:
    tokenizer: Tokenizer
    prefill_client: PrefillClient
    http: httpx.Client
    bytes_per_token: int

    def prefill(self, ids: list[int]) -> tuple[list, int]:
        request_id = uuid.uuid4().hex[:12]
        remote = self.prefill_client.prefill(
            ids, request_id=request_id, kv_destination=KVPullDestination(), deadline_s=60
        )
        stages = remote.result.stage_manifests
        assert len(stages) == 2
        return [wire_manifest(m, request_id, len(stages)) for m in stages], (
            remote.result.first_token_id
        )

    def complete(self, ids: list[int], params: dict | None, stream: bool = False) -> dict:
        """``token_ids``, ``finish_reason``, ``kv_transfer_params``, ``cached`` (vLLM's
        cached prompt tokens; non-streaming only) of one /v1/completions call."""
        body = {"model": NAME, "prompt": ids, "max_tokens": NEW_TOKENS, "temperature": 0,
                "return_token_ids": True, "stream": stream}  # fmt: skip
        if params is not None:
            body["kv_transfer_params"] = params
        if not stream:
            response = self.http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            answer = response.json()
            choice = answer["choices"][0]
            details = answer["usage"].get("prompt_tokens_details") or {}
            return {"token_ids": choice["token_ids"], "finish_reason": choice["finish_reason"],
                    "kv_transfer_params": answer["kv_transfer_params"],
                    "cached": details.get("cached_tokens")}  # fmt: skip
        tokens, finish = [], None
        with self.http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        tokens += choice.get("token_ids") or []
                        finish = choice["finish_reason"] or finish
        return {"token_ids": tokens, "finish_reason": finish}


def test_vllm_serve_decodes_from_our_kv_as_it_does_alone(system):
    started = time.monotonic()
    reads = []
    for text in PROMPTS:
        ids = system.tokenizer.encode_chat([{"role": "user", "content": text}])
        alone = system.complete(ids, None)  # first: nothing cached, vLLM computes it all
        wire, first_token = system.prefill(ids)
        ours = system.complete(ids, pull_params(wire, ids))
        assert ours["finish_reason"] in ("stop", "length"), ours
        assert (ours["token_ids"], ours["finish_reason"]) == (
            alone["token_ids"],
            alone["finish_reason"],
        ), text
        assert ours["token_ids"][0] == first_token  # our tier's logits agree too
        local_hit = (len(ids) - 1) // VLLM_BLOCK * VLLM_BLOCK  # whole blocks of its own run
        assert ours["kv_transfer_params"] == {
            LOADED_KEY: {"tokens": len(ids) - local_hit, "ok": True, "error": None,
                         "bytes": (len(ids) - local_hit) * system.bytes_per_token}
        }  # fmt: skip
        assert alone["kv_transfer_params"] is None and alone["cached"] in (0, None)
        assert ours["cached"] >= len(ids) - 1, ours  # vLLM's own count: cached, not computed
        reads.append((len(ids), local_hit))
    assert any(hit for _, hit in reads) and any(not hit for _, hit in reads), reads

    # streamed: the same tokens (vLLM's stream carries no kv_transfer_params)
    ids = system.tokenizer.encode_chat([{"role": "user", "content": PROMPTS[1]}])
    alone = system.complete(ids, None)
    wire, _ = system.prefill(ids)
    streamed = system.complete(ids, pull_params(wire, ids), stream=True)
    assert streamed == {"token_ids": alone["token_ids"], "finish_reason": alone["finish_reason"]}

    # chat: vLLM renders the template itself; its ids are ours, so the load is accepted
    messages = [{"role": "user", "content": PROMPTS[0]}]
    chat_ids = system.tokenizer.encode_chat(messages)
    wire, _ = system.prefill(chat_ids)
    body = {"model": NAME, "messages": messages, "max_tokens": NEW_TOKENS, "temperature": 0,
            "kv_transfer_params": pull_params(wire, chat_ids)}  # fmt: skip
    chat = system.http.post("/v1/chat/completions", json=body).json()
    assert chat["kv_transfer_params"][LOADED_KEY]["ok"] is True, chat
    expected = system.tokenizer.decode(
        system.complete(chat_ids, None)["token_ids"], skip_special_tokens=True
    )
    assert chat["choices"][0]["message"]["content"] == expected

    # a stage that cannot be reached: "recompute" answers as vLLM alone, and says so
    wire, _ = system.prefill(ids)
    wire[1] = dataclasses.replace(wire[1], endpoint=f"127.0.0.1:{_closed_port()}")
    failed = system.complete(ids, pull_params(wire, ids))
    assert failed["token_ids"] == alone["token_ids"]
    loaded = failed["kv_transfer_params"][LOADED_KEY]
    assert (loaded["ok"], loaded["tokens"]) == (False, 0) and "Unreachable" in loaded["error"]

    # vLLM's load gauges: the names and labels `wavepp decode --serve` exports too
    from prometheus_client.parser import text_string_to_metric_families

    samples = {
        s.name: s.labels
        for family in text_string_to_metric_families(system.http.get("/metrics").text)
        for s in family.samples
    }
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc"):  # fmt: skip
        assert samples[name] == {"model_name": NAME, "engine": "0"}, (name, samples.get(name))
    print(f"vllm serve e2e: (prompt, vLLM-cached) {reads}, {time.monotonic() - started:.0f} s",
          file=sys.stderr)  # fmt: skip
