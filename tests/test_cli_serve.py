"""`wavepp serve` and `wavepp prefill --server` as real processes on a tiny checkpoint."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

import pytest

from prefill_node.engine.local_engine import LocalEngine, LocalEngineConfig
from prefill_node.engine.types import PrefillOptions
from prefill_node.model.loader_hf import save_hf_checkpoint
from prefill_node.model.weights import random_weights
from tests.grpc_harness import TINY_CONFIG

CLI = [sys.executable, "-m", "prefill_node.cli.main"]


@pytest.mark.slow
def test_serve_then_prefill_over_grpc_shows_reuse_and_matches_in_process(tmp_path):
    save_hf_checkpoint(tmp_path, TINY_CONFIG, random_weights(TINY_CONFIG, seed=9))
    shape = ["--stages", "2", "--num-blocks", "64", "--block-size", "4"]
    server = subprocess.Popen(
        [*CLI, "serve", "--model", str(tmp_path), *shape, "--host", "127.0.0.1",
         "--port", "0", "--metrics-port", "-1", "--threads", "1", "--log-level", "WARNING"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        line = server.stdout.readline()
        match = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
        assert match, f"unexpected first line {line!r}; stderr: {server.stderr.read()}"
        ids = "1,2,3,4,5,6,7,8,9"
        client = subprocess.run(
            [*CLI, "prefill", "--server", f"127.0.0.1:{match.group(1)}", "--model", str(tmp_path),
             "--ids", ids, "--repeat", "2", "--json", "--top-logprobs", "2"],
            capture_output=True,
            text=True,
            timeout=120,
        )  # fmt: skip
        assert client.returncode == 0, client.stderr
        rows = [json.loads(x) for x in client.stdout.splitlines() if x.startswith("{")]
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    config = LocalEngineConfig(num_stages=2, num_blocks=64, block_size=4)
    direct = LocalEngine.from_model_dir(tmp_path, config)
    want = direct.submit([int(x) for x in ids.split(",")], PrefillOptions(top_logprobs=2)).result()
    assert [(r["prompt_tokens"], r["cached_tokens"]) for r in rows] == [(9, 0), (9, 8)]
    assert {r["first_token_id"] for r in rows} == {want.first_token_id}
    assert [t for t, _ in rows[0]["top_logprobs"]] == [t for t, _ in want.top_logprobs]
