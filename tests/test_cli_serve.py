"""`wavepp serve` and `wavepp prefill --server` as real processes on a tiny checkpoint: token
ids over gRPC, and text prompts sent as text and tokenised by the server (chat template)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from prefill_node.client.prefill_client import PrefillClient
from prefill_node.engine.types import PrefillOptions
from prefill_node.model.loader_hf import save_hf_checkpoint
from prefill_node.model.tokenizer import Tokenizer
from prefill_node.model.weights import random_weights
from prefill_node.runtime.dist_env import REVISION_ENV, free_local_port
from prefill_node.runtime.engine_config import EngineConfig
from prefill_node.runtime.local_engine import LocalEngine
from prefill_node.runtime.stage_main import EXIT_REVISION_MISMATCH
from tests.grpc_harness import TINY_CONFIG, wait_until
from tests.tiny_models import save_word_tokenizer

CLI = [sys.executable, "-m", "prefill_node.cli.main"]


def _start_serve(model_dir, *extra, env=None):
    """A real `wavepp serve` (2-stage multi-process pipeline) on a free port -> (proc, port)."""
    server = subprocess.Popen(
        [*CLI, "serve", "--model", str(model_dir), "--stages", "2", "--num-blocks", "64",
         "--block-size", "4", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1",
         "--threads", "1", "--log-level", "WARNING", "--no-kv-shipping", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )  # fmt: skip
    line = server.stdout.readline()
    match = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
    if not match:
        server.kill()
        raise AssertionError(f"unexpected first line {line!r}; stderr: {server.stderr.read()}")
    return server, int(match.group(1))


def _stop(server) -> None:
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            assert server.wait(timeout=30) == 0
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()


def _stage_children(pid: int) -> list[int]:
    """Pids of the stage processes ``pid`` launched (from any of its threads)."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    cmdline = lambda c: Path(f"/proc/{c}/cmdline").read_bytes()
    return [c for c in children if b"prefill_node.runtime.stage_main" in cmdline(c)]


def _kill_a_stage_and_check_the_server_answers(server, port: int) -> None:
    """SIGKILL the stage process: readiness and liveness NOT_SERVING (only a restart brings
    the pipeline back); with --no-exit-on-pipeline-lost the process stays until restarted and
    refuses prefills with UNAVAILABLE saying why."""
    (stage,) = _stage_children(server.pid)
    os.kill(stage, signal.SIGKILL)
    with PrefillClient(f"127.0.0.1:{port}") as client:
        wait_until(lambda: not client.is_ready(), 15, "readiness NOT_SERVING")
        wait_until(lambda: not client.is_live(), 5, "liveness NOT_SERVING")
        assert server.poll() is None
        with pytest.raises(grpc.RpcError) as err:
            client.prefill([1, 2, 3])
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert err.value.details().startswith("the pipeline is not ready (")


def _prefill_json(*args) -> list[dict]:
    client = subprocess.run(
        [*CLI, "prefill", "--json", *args], capture_output=True, text=True, timeout=120
    )
    assert client.returncode == 0, client.stderr
    return [json.loads(x) for x in client.stdout.splitlines() if x.startswith("{")]


@pytest.mark.slow
def test_prefill_server_sends_text_for_the_server_to_tokenise(tmp_path):
    """Text goes to the server as text (chat template + system there, no model on the
    client); afterwards a killed stage leaves a `wavepp serve --no-exit-on-pipeline-lost`
    process up, not ready."""
    save_hf_checkpoint(tmp_path, TINY_CONFIG, random_weights(TINY_CONFIG, seed=4))
    save_word_tokenizer(tmp_path)
    text, system = "what is the capital of france ?", "be brief"
    server, port = _start_serve(tmp_path, "--no-exit-on-pipeline-lost")
    try:
        target = ["--server", f"127.0.0.1:{port}", "--top-logprobs", "2"]  # no --model here
        chat = _prefill_json(*target, "--system", system, "--repeat", "2", text)
        plain = _prefill_json(*target, "--no-chat", "--cache-salt", "plain", text)
        _kill_a_stage_and_check_the_server_answers(server, port)
        _stop(server)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    tokenizer = Tokenizer.from_dir(tmp_path)
    chat_ids = tokenizer.encode_chat(
        [{"role": "system", "content": system}, {"role": "user", "content": text}]
    )
    plain_ids = tokenizer.encode(text)
    assert len(chat_ids) == 12 and len(plain_ids) == 7  # the template and system were applied
    direct = LocalEngine.from_model_dir(
        EngineConfig(model_dir=tmp_path, stages=2, num_blocks=64, block_size=4)
    )
    for rows, ids in ((chat, chat_ids), (plain, plain_ids)):
        want = direct.submit(ids, PrefillOptions(top_logprobs=2)).result()
        assert {r["first_token_id"] for r in rows} == {want.first_token_id}
        assert [t for t, _ in rows[0]["top_logprobs"]] == [t for t, _ in want.top_logprobs]
        assert rows[0]["prompt_tokens"] == len(ids) and rows[0]["cached_tokens"] == 0
    # the repeat reuses the server's KV: all 3 full blocks, the last token recomputed
    assert [r["cached_tokens"] for r in chat] == [0, 11]
    assert chat[0]["first_token_text"] is None  # no --model: the client has no tokenizer


def _pod_env(rank: int, master_port: int, revision: str = "r1") -> dict[str, str]:
    """The rendezvous variables a pipeline pod gets (torchrun style, and the chart's
    revision), on loopback."""
    rendezvous = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port)}
    return {**os.environ, **rendezvous, "RANK": str(rank), REVISION_ENV: revision}


@pytest.mark.slow
def test_a_leader_whose_stage_pod_dies_drains_and_exits(tmp_path):
    """Leader and stage started as separate processes from the rendezvous environment, as
    in two pods: SIGKILL of the stage makes the leader exit by itself (code 5), so a
    pipeline restarts whatever its probes are (TCP probes under TLS never see the loss)."""
    save_hf_checkpoint(tmp_path, TINY_CONFIG, random_weights(TINY_CONFIG, seed=5))
    master_port = free_local_port()
    stage = subprocess.Popen(
        [*CLI, "stage", "--connect-timeout", "60"],
        env=_pod_env(1, master_port),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    server = None
    try:
        server, port = _start_serve(tmp_path, "--stage-wait", "60", env=_pod_env(0, master_port))
        with PrefillClient(f"127.0.0.1:{port}") as client:
            assert client.prefill([1, 2, 3, 4, 5]).result.prompt_tokens == 5
        stage.kill()
        assert server.wait(timeout=30) == 5
        assert "the pipeline is lost" in server.stdout.read()
        assert "stage 1" in server.stderr.read()
    finally:
        for proc in (stage, server):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_leader_whose_stages_never_join_exits_after_the_stage_wait(tmp_path):
    """--stage-wait bounds the leader's wait for its stage pods: it exits with an error
    naming the missing stage instead of waiting for a probe to kill it."""
    save_hf_checkpoint(tmp_path, TINY_CONFIG, random_weights(TINY_CONFIG, seed=6))
    leader = subprocess.run(
        [*CLI, "serve", "--model", str(tmp_path), "--stages", "2", "--num-blocks", "64",
         "--block-size", "4", "--port", "0", "--metrics-port", "-1", "--no-kv-shipping",
         "--stage-wait", "2"],
        env=_pod_env(0, free_local_port()),
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert leader.returncode == 1, leader.stderr
    assert "stages not ready after 2s" in leader.stderr and "wavepp/ready/1" in leader.stderr


def test_a_stage_never_joins_a_leader_of_another_revision(tmp_path):
    """A StatefulSet roll replaces stage pods before their leader: a stage of the new
    revision must not join the old leader (a pipeline of mixed versions); it exits without
    joining, and the leader, its stage missing, gives up after --stage-wait."""
    save_hf_checkpoint(tmp_path, TINY_CONFIG, random_weights(TINY_CONFIG, seed=7))
    master_port = free_local_port()
    leader = subprocess.Popen(
        [*CLI, "serve", "--model", str(tmp_path), "--stages", "2", "--num-blocks", "64",
         "--block-size", "4", "--port", "0", "--metrics-port", "-1", "--no-kv-shipping",
         "--stage-wait", "20"],
        env=_pod_env(0, master_port, "r1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        stage = subprocess.run(
            [*CLI, "stage", "--connect-timeout", "60"],
            env=_pod_env(1, master_port, "r2"),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert stage.returncode == EXIT_REVISION_MISMATCH, stage.stderr
        assert "revision 'r2', the leader at 127.0.0.1 runs 'r1'" in stage.stderr
        assert leader.wait(timeout=60) == 1
        assert "stages not ready after 20s" in leader.stderr.read()
    finally:
        if leader.poll() is None:
            leader.kill()
            leader.wait()


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
        text = subprocess.run(
            [*CLI, "prefill", "--server", f"127.0.0.1:{match.group(1)}", "hello"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert text.returncode == 2 and "has no tokenizer" in text.stderr, text.stderr
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    config = EngineConfig(model_dir=tmp_path, stages=2, num_blocks=64, block_size=4)
    direct = LocalEngine.from_model_dir(config)
    want = direct.submit([int(x) for x in ids.split(",")], PrefillOptions(top_logprobs=2)).result()
    assert [(r["prompt_tokens"], r["cached_tokens"]) for r in rows] == [(9, 0), (9, 8)]
    assert {r["first_token_id"] for r in rows} == {want.first_token_id}
    assert [t for t, _ in rows[0]["top_logprobs"]] == [t for t, _ in want.top_logprobs]
