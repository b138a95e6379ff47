"""An idle tier idles: a 2-stage `wavepp serve` with KV hand-off on (each stage owns a NIXL
agent) and an idle decode worker process stay far below a core once ready. Before the NIXL
progress mode `event`, every agent's progress thread spun a full core here."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest

from prefill_node.client.prefill_client import PrefillClient
from prefill_node.decode.worker_process import DecodeWorkerProcess, DecodeWorkerSpec
from prefill_node.model.loader_hf import save_hf_checkpoint
from prefill_node.model.weights import random_weights
from prefill_node.process_tree import ProcessTree
from tests.grpc_harness import TINY_CONFIG, wait_until

CLI = [sys.executable, "-m", "prefill_node.cli.main"]
WINDOW_S = 10.0
BUDGET = 0.10  # generous: measured about 0.01 of a core for the whole server tree


@pytest.mark.slow
def test_idle_server_and_decode_worker_use_almost_no_cpu(tmp_path):
    save_hf_checkpoint(tmp_path, TINY_CONFIG, random_weights(TINY_CONFIG, seed=1))
    server = subprocess.Popen(
        [*CLI, "serve", "--model", str(tmp_path), "--stages", "2", "--num-blocks", "32",
         "--block-size", "4", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1",
         "--threads", "1", "--log-level", "WARNING"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )  # fmt: skip
    spec = DecodeWorkerSpec(model_config=TINY_CONFIG, num_blocks=16, block_size=4, timeout_s=5)
    try:
        with DecodeWorkerProcess(spec) as decode:
            match = re.search(r"listening on (127\.0\.0\.1:\d+)", server.stdout.readline())
            assert match, "serve did not start"
            with PrefillClient(match.group(1)) as client:
                wait_until(client.is_ready, 60, "the pipeline ready")  # KV hand-off is on
            trees = {"serve": ProcessTree(server.pid), "decode": ProcessTree(decode.process.pid)}
            assert len(trees["serve"].pids()) == 2  # the leader and stage 1
            time.sleep(1.0)  # let start-up work (imports, first collectives) drain
            before = {name: tree.cpu_s() for name, tree in trees.items()}
            time.sleep(WINDOW_S)
            used = {name: (tree.cpu_s() - before[name]) / WINDOW_S for name, tree in trees.items()}
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        finally:
            if server.poll() is None:
                server.kill()
    assert used["serve"] < BUDGET, f"idle serve used {used['serve']:.3f} of a core"
    assert used["decode"] < BUDGET, f"idle decode worker used {used['decode']:.3f} of a core"
