"""A stock vLLM decode instance continues from our prefill tier's KV (real processes, real NIXL).

`wavepp serve` (2 stages, float32, the default SmolLM2 model) prefills chat prompts in pull
mode; a vLLM CPU instance (prefix caching on; the peer environment's python running
tests_vllm/vllm_decode_driver.py) with WavePPConnector READs each stage's leased blocks
into its paged cache and decodes greedily. Each continuation must equal vLLM's own greedy
continuation of the same prompt computed locally (run first), token for token. The
connector's counters must show that every prompt token vLLM did not already hold in whole
blocks came over NIXL (the long prompt's first block is a local hit after the reference
run), and vLLM's own count of cached prompt tokens must agree. A load from a stage that
cannot be reached, or for other token ids than the prefill's, follows vLLM's failure policy
("fail": the request errors, nothing is decoded from partial or foreign KV) and the instance
keeps serving.

Not part of the default suite (it needs the vLLM peer environment): run it with
``scripts/setup_vllm_peer.sh`` then ``.venv/bin/python -m pytest tests_vllm``. The peer
environment is ``$VLLM_PEER_ENV`` (the setup script's default: ``.venv-vllm`` in the repo).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from kv_transfer.layout import KVLayout, MemoryRegion
from kv_transfer.messages import StageManifest
from kv_transfer.vllm_decode.params import LOADED_KEY, pull_params
from prefill_node.cli.options import parse_listening
from prefill_node.client.prefill_client import PrefillClient
from prefill_node.engine.types import KVPullDestination
from prefill_node.model.default_model import default_model_dir
from prefill_node.model.tokenizer import Tokenizer
from prefill_node.process_tree import LineReader
from prefill_node.wire.kv_handoff import wire_manifest

REPO = Path(__file__).resolve().parents[1]
NEW_TOKENS = 24
PROMPTS = [
    "What is the capital of France?",
    "Name three colours and one thing of each colour.",
    # longer than one vLLM block (128 tokens): the READ spans several decode blocks
    "Summarise this for a child: "
    + " ".join(
        f"Step {i}: the water cycle moves water from the sea to clouds, rain and rivers."
        for i in range(1, 9)
    ),
]


def _peer_python() -> Path:
    env = Path(os.environ.get("VLLM_PEER_ENV") or REPO / ".venv-vllm")
    python = env / "bin" / "python"
    if not python.is_file():
        pytest.fail(
            f"the vLLM peer environment is missing ({python} not found): build it with "
            "`bash scripts/setup_vllm_peer.sh` (or point VLLM_PEER_ENV at one)"
        )
    return python


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Driver:
    """The vLLM process: one JSON line per request, every wait bounded."""

    def __init__(self, model: Path, log: Path, failure_policy: str = "fail") -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_CPU_KVCACHE_SPACE="1")
        self.proc = subprocess.Popen(
            [str(_peer_python()), str(REPO / "tests_vllm" / "vllm_decode_driver.py"),
             str(model), "--failure-policy", failure_policy, "--timeout", "20"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("w"),
            text=True, env=env,
        )  # fmt: skip
        self.log = log
        self.lines = LineReader(self.proc.stdout, "vllm-driver-stdout")
        self.stdout_tail: collections.deque[str] = collections.deque(maxlen=40)  # vLLM's log

    def read(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.next_line(left)
            except TimeoutError:
                break
            if line is None:
                break
            if line.startswith("{"):
                return json.loads(line)
            self.stdout_tail.append(line)
        raise AssertionError(
            f"vLLM driver gave no answer in {timeout_s} s (rc {self.proc.poll()}); stdout:\n"
            + "".join(self.stdout_tail)
            + f"stderr:\n{self.log.read_text()[-3000:]}"
        )

    def generate(self, prompt_ids: list[int], params: dict | None = None) -> dict:
        job = {"prompt_ids": prompt_ids, "max_tokens": NEW_TOKENS, "kv_transfer_params": params}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        started = time.monotonic()
        result = self.read(180)
        kind = "ours" if params else "local"
        print(f"  vLLM {kind} {len(prompt_ids)} tokens: {time.monotonic() - started:.1f} s",
              file=sys.stderr)  # fmt: skip
        return result

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def serve_pipeline(model: Path, err: Path) -> tuple[subprocess.Popen, str]:
    """A 2-stage `wavepp serve` of ``model`` (float32, KV hand-off on) on loopback, its
    stderr in ``err``: (process, gRPC address), once it announces it (every tests_vllm file
    starts its pipeline here)."""
    server = subprocess.Popen(
        [sys.executable, "-m", "prefill_node.cli.main", "serve", "--model", str(model),
         "--stages", "2", "--dtype", "float32", "--host", "127.0.0.1", "--port", "0",
         "--metrics-port", "-1", "--threads", "1", "--log-level", "WARNING"],
        stdout=subprocess.PIPE, stderr=err.open("w"), text=True,
    )  # fmt: skip
    line = LineReader(server.stdout, "serve-stdout").next_line(240)
    listening = parse_listening(line or "")
    assert listening, f"first line {line!r}; stderr: {err.read_text()[-2000:]}"
    return server, listening.target


def _kv_bytes_per_token(model: Path) -> int:
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * heads * head_dim * 4  # K and V, float32


def test_vllm_decodes_from_our_kv_exactly_as_from_its_own_prefill(tmp_path):
    model = default_model_dir()
    tokenizer = Tokenizer.from_dir(model)
    started = time.monotonic()
    driver = Driver(model, tmp_path / "vllm.log")  # starts first: it takes the longest
    server, target = serve_pipeline(model, tmp_path / "serve.err")
    try:
        ready = driver.read(420)
        print(f"  vLLM ready after {time.monotonic() - started:.0f} s", file=sys.stderr)
        assert ready["ready"], ready
        block_size = ready["block_size"]
        with PrefillClient(target) as client:

            def prefill(ids: list[int]) -> tuple[list, int]:
                request_id = uuid.uuid4().hex[:12]
                remote = client.prefill(
                    ids, request_id=request_id, kv_destination=KVPullDestination(), deadline_s=60
                )
                manifests = remote.result.stage_manifests
                return [wire_manifest(m, request_id, len(manifests)) for m in manifests], (
                    remote.result.first_token_id
                )

            reads = []  # (prompt tokens, of them cached locally in vLLM)
            for text in PROMPTS:
                ids = tokenizer.encode_chat([{"role": "user", "content": text}])
                manifests, first_token = prefill(ids)
                assert len(manifests) == 2  # one per stage, each READ on its own
                # vLLM's own run first (nothing cached: it computes the whole prompt); its
                # whole blocks then stay in vLLM's prefix cache, so ours READs only the rest
                local = driver.generate(ids)
                ours = driver.generate(ids, pull_params(manifests, ids))
                local_hit = (len(ids) - 1) // block_size * block_size
                assert ours.get("finish_reason") in ("length", "stop"), ours
                assert (ours["token_ids"], ours["finish_reason"]) == (
                    local["token_ids"],
                    local["finish_reason"],
                ), text
                assert ours["token_ids"][0] == first_token  # our tier's logits agree too
                loaded = ours["kv_transfer_params"][LOADED_KEY]
                assert loaded == {
                    "tokens": len(ids) - local_hit,
                    "bytes": (len(ids) - local_hit) * _kv_bytes_per_token(model),
                    "ok": True,
                    "error": None,
                }
                reads.append((len(ids), local_hit))
                if text == PROMPTS[0]:
                    reference_first = local["token_ids"]
                # vLLM's own accounting: the prompt was cached (external), not computed
                assert ours["num_cached_tokens"] >= len(ids) - 1, ours
                assert local["num_cached_tokens"] == 0 and local["kv_transfer_params"] is None

            # a stage that cannot be reached: vLLM's "fail" policy ends the request with an
            # error instead of decoding from partial KV; stage 0's lease is released
            ids = tokenizer.encode_chat([{"role": "user", "content": PROMPTS[0]}])
            manifests, _ = prefill(ids)
            manifests[1] = dataclasses.replace(manifests[1], endpoint=f"127.0.0.1:{_closed_port()}")
            failed = driver.generate(ids, pull_params(manifests, ids))
            assert failed.get("finish_reason") == "error" or "error" in failed, failed
            assert not failed.get("token_ids"), failed
            # other token ids of the same length: the KV is not theirs, nothing is loaded
            manifests, _ = prefill(ids)
            other = driver.generate(ids[:-2] + ids[-1:] + ids[-2:-1], pull_params(manifests, ids))
            assert other.get("finish_reason") == "error" and not other.get("token_ids"), other
            # ... and the instance keeps serving from our KV
            manifests, _ = prefill(ids)
            again = driver.generate(ids, pull_params(manifests, ids))
            assert again["token_ids"] == reference_first
            assert again["kv_transfer_params"][LOADED_KEY]["tokens"] == len(ids)
        driver.close()
        assert driver.proc.returncode == 0, driver.log.read_text()[-3000:]
        server.terminate()
        assert server.wait(timeout=60) == 0
    finally:
        for proc in (driver.proc, server):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert any(hit for _, hit in reads) and any(not hit for _, hit in reads), reads
    print(
        f"vLLM e2e: {len(PROMPTS)} prompts token-exact, (prompt, vLLM-cached) tokens {reads}, "
        f"failed load -> {failed}, "
        f"{time.monotonic() - started:.0f} s",
        file=sys.stderr,
    )


def test_a_failed_load_under_the_recompute_policy_computes_the_prompt_itself(tmp_path):
    """No prefill tier at all: both stages' endpoints refuse. vLLM ("recompute") computes the
    prompt itself and answers exactly as without the connector; the counters say 0 loaded."""
    model = default_model_dir()
    tokenizer = Tokenizer.from_dir(model)
    ids = tokenizer.encode_chat([{"role": "user", "content": PROMPTS[1]}])
    cfg = json.loads((model / "config.json").read_text())
    layers, heads = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    dead = f"127.0.0.1:{_closed_port()}"
    manifests = []
    for stage, (lo, hi) in enumerate([(0, layers // 2), (layers // 2, layers)]):
        region = MemoryRegion(1 << 20, 4 * 2 * 16 * heads * head_dim * 4)
        layout = KVLayout(lo, hi, 4, 16, heads, head_dim, "float32", (region,) * (hi - lo))
        blocks = tuple(range(-(-len(ids) // 16)))
        manifests.append(StageManifest("gone", stage, 2, dead, f"stage{stage}", layout,
                                       blocks, len(ids), f"lease{stage}", 30.0))  # fmt: skip
    driver = Driver(model, tmp_path / "vllm.log", failure_policy="recompute")
    try:
        assert driver.read(420)["ready"]
        local = driver.generate(ids)
        ours = driver.generate(ids, pull_params(manifests, ids))
        driver.close()
    finally:
        if driver.proc.poll() is None:
            driver.proc.kill()
            driver.proc.wait()
    assert (ours["token_ids"], ours["finish_reason"]) == (
        local["token_ids"],
        local["finish_reason"],
    )
    loaded = ours["kv_transfer_params"][LOADED_KEY]
    assert (loaded["ok"], loaded["tokens"], loaded["bytes"]) == (False, 0, 0)
    assert loaded["error"].startswith("DecodeUnreachable"), loaded
