"""A stock `wavepp serve` ships KV over NIXL to `wavepp decode --prefill-server` (real processes).

One server process (2 stages, each with its own NIXL agent), two decode client processes at
once (push, and pull over the leased manifests), decode block size 8 vs prefill 4 (layout
conversion on the way). Every generated id must equal transformers' greedy ``generate`` from
the same checkpoint, for a dense (Llama), a MoE (MiniMax-M2) and an MLA + sparse-attention
(GLM-5: its latent cache entries - latent, rotated key, indexer key - are what ships) family;
the server keeps serving and exits cleanly.
"""

from __future__ import annotations

import argparse
import random
import re
import signal
import subprocess
import sys

import pytest

from prefill_node.cli import serve as serve_cli
from prefill_node.model.loader_hf import save_hf_checkpoint
from prefill_node.model.weights import random_weights
from tests.hf_reference import transformers_greedy
from tests.tiny_models import tiny_glm5, tiny_llama, tiny_minimax_m2

CLI = [sys.executable, "-m", "prefill_node.cli.main"]
# Untied embeddings: a random tied model tends to repeat its last token, which would hide
# wrong KV; these ones' greedy continuations vary.
CONFIGS = {
    "llama": tiny_llama("tiny-untied", tie_word_embeddings=False),
    "minimax-m2-moe": tiny_minimax_m2("tiny-minimax-m2"),
    "glm-5-mla-dsa": tiny_glm5("tiny-glm5"),
}
NEW_TOKENS = 32


def _decode(port: int, model: str, mode: str, prompts: list[list[int]]) -> subprocess.Popen:
    return subprocess.Popen(
        [*CLI, "decode", "--prefill-server", f"127.0.0.1:{port}", "--model", model, "--ids",
         "--no-chat", "--mode", mode, "--decode-block-size", "8", "--decode-blocks", "32",
         "--max-new-tokens", str(NEW_TOKENS), "--timeout", "20",
         *(",".join(map(str, p)) for p in prompts)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


def _ids(stdout: str) -> list[list[int]]:
    """The generated-id lines (``--ids`` prints one per prompt, nothing else on stdout)."""
    return [[int(x) for x in line.split(",")] for line in stdout.splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("family", list(CONFIGS))
def test_decode_against_a_stock_serve_matches_transformers_generate(tmp_path, family):
    config = CONFIGS[family]
    save_hf_checkpoint(tmp_path, config, random_weights(config, seed=0))
    rng = random.Random(6)
    first = [rng.randrange(64) for _ in range(13)]
    second = first[:8] + [rng.randrange(64) for _ in range(6)]  # prefix hit on the prefill tier
    third = [rng.randrange(64) for _ in range(11)]
    server = subprocess.Popen(
        [*CLI, "serve", "--model", str(tmp_path), "--stages", "2", "--num-blocks", "64",
         "--block-size", "4", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1",
         "--threads", "1", "--kv-transfer-timeout", "10", "--log-level", "WARNING"],
        stdout=subprocess.PIPE,
        stderr=(tmp_path / "serve.err").open("w"),
        text=True,
    )  # fmt: skip
    try:
        line = server.stdout.readline()
        match = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
        assert match, f"first line {line!r}; stderr: {(tmp_path / 'serve.err').read_text()}"
        port = int(match.group(1))
        push = _decode(port, str(tmp_path), "push", [first, second])
        pull = _decode(port, str(tmp_path), "pull", [third])
        push_out, push_err = push.communicate(timeout=240)
        pull_out, pull_err = pull.communicate(timeout=240)
        assert push.returncode == 0, push_err
        assert pull.returncode == 0, pull_err
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
    finally:
        for proc in (server, locals().get("push"), locals().get("pull")):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    expected = transformers_greedy(tmp_path, [first, second, third], NEW_TOKENS)
    assert len(set(map(tuple, expected))) == 3  # three different continuations
    assert _ids(push_out) == expected[:2]
    assert _ids(pull_out) == expected[2:]
    assert "(8 cached)" in push_err  # the second prompt reused the first's prefill blocks


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_cli.register(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_serve_kv_flags_build_the_handoff_config():
    config = serve_cli._kv_handoff(
        _serve_args("--kv-allow", "10.0.0.0/8", "--kv-allow", "decode-7", "--kv-allow", "::1",
                    "--kv-transfer-timeout", "3", "--kv-lease-ttl", "9",
                    "--kv-metadata-host", "10.0.0.5")
    )  # fmt: skip
    assert [str(n) for n in config.allow.cidrs] == ["10.0.0.0/8", "::1/128"]
    assert config.allow.agent_names == frozenset({"decode-7"})
    assert (config.transfer_timeout_s, config.lease_ttl_s) == (3.0, 9.0)
    assert config.metadata_host == "10.0.0.5"
    default = serve_cli._kv_handoff(_serve_args())
    assert default.allow.host_allowed("127.0.0.1") and not default.allow.host_allowed("10.0.0.5")
    assert serve_cli._kv_handoff(_serve_args("--no-kv-shipping")) is None
    with pytest.raises(Exception, match="positive"):
        serve_cli._kv_handoff(_serve_args("--kv-lease-ttl", "0"))
