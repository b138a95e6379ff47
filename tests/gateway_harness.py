"""Real processes for the gateway tests on loopback: a tiny model with a word tokenizer, a
pipeline behind a router, reference decode servers (`wavepp decode --serve`), gateways."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

from prefill_node.model.loader_hf import save_hf_checkpoint
from prefill_node.model.weights import random_weights
from tests.router_harness import spawn
from tests.tiny_models import save_word_tokenizer, tiny_llama

MODEL = tiny_llama("tiny-gateway", max_position_embeddings=512)  # vocab 64
SERVED = "tiny"
BS = 4
WAVE_DELAY_S = 0.05  # per wave: a long prompt's prefill lasts long enough to be cancelled


def model_dir(root: Path) -> Path:
    save_hf_checkpoint(root, MODEL, random_weights(MODEL, seed=5))
    save_word_tokenizer(root, MODEL.vocab_size)
    return root


def pipeline(model: Path, *extra: str):
    """A 2-stage `wavepp serve` with KV hand-off (pull leases), the debug service, and
    ``WAVE_DELAY_S`` added to every wave (32-token chunks); ``extra``: more flags."""
    proc, port, _ = spawn(
        ["serve", "--model", str(model), "--stages", "2", "--num-blocks", "128",
         "--block-size", str(BS), "--max-chunk-tokens", "32", "--host", "127.0.0.1",
         "--port", "0", "--metrics-port", "-1", "--threads", "1", "--log-level", "WARNING",
         "--debug-service", "--debug-wave-delay", str(WAVE_DELAY_S), *extra],
        "wavepp serve:",
    )  # fmt: skip
    return proc, f"127.0.0.1:{port}"


def router(model: Path, pipelines: list[str], *extra: str):
    proc, port, _ = spawn(
        ["router", "--model", str(model), *sum((["--pipeline", a] for a in pipelines), []),
         "--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--poll-interval", "0.2",
         "--log-level", "WARNING", *extra],
        "wavepp router:",
    )  # fmt: skip
    return proc, f"127.0.0.1:{port}"


def decode_server(model: Path, *extra: str):
    return decode_server_on(model, 0, *extra)


def decode_server_on(model: Path, port: int, *extra: str):
    """`wavepp decode --serve` on ``port`` (0: any free one); ``extra``: more flags."""
    proc, port, _ = spawn(
        ["decode", "--serve", "--model", str(model), "--served-model-name", SERVED,
         "--host", "127.0.0.1", "--port", str(port), "--decode-blocks", "64", *extra],
        "wavepp decode:",
    )  # fmt: skip
    return proc, f"127.0.0.1:{port}"


def gateway(model: Path, decode: list[str], *extra: str):
    proc, port, _ = spawn(
        ["gateway", "--model", str(model), "--served-model-name", SERVED,
         *sum((["--decode", d] for d in decode), []), "--host", "127.0.0.1", "--port", "0",
         "--decode-poll-interval", "0.2", "--log-level", "WARNING", *extra],
        "wavepp gateway:",
    )  # fmt: skip
    return proc, f"http://127.0.0.1:{port}"


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def post(url: str, body: dict | bytes) -> tuple[int, dict, dict]:
    """(status, headers, JSON body) of a POST."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, dict(reply.headers), json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


def metric(base: str, name: str) -> dict[str, float]:
    """``{sample line without value: value}`` of the samples starting with ``name``."""
    _, text = get(f"{base}/metrics")
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(name)}  # fmt: skip
