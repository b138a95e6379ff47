"""mTLS on both sides of the router: a client with a signed certificate reaches the router, the
router reaches an mTLS-only pipeline with its own client certificate, and an anonymous client
is refused. Real processes, certificates made by the real openssl CLI."""

from __future__ import annotations

import shutil

import grpc
import pytest

from prefill_node.client.prefill_client import ClientTLS, PrefillClient
from prefill_node.model.loader_hf import save_hf_checkpoint
from prefill_node.model.weights import random_weights
from tests.grpc_harness import wait_until
from tests.router_harness import MODEL, SYSTEM, spawn, stop
from tests.test_grpc_tls import _make_pki

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(180),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl"),
]


def test_mutual_tls_from_client_to_router_to_pipeline(tmp_path):
    pki, model_dir = tmp_path / "pki", tmp_path / "model"
    pki.mkdir()
    model_dir.mkdir()
    _make_pki(pki)
    save_hf_checkpoint(model_dir, MODEL, random_weights(MODEL, seed=2))
    server_tls = ["--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
                  "--tls-client-ca", str(pki / "ca.pem")]  # fmt: skip
    common = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1",
              "--log-level", "WARNING"]  # fmt: skip
    pipeline, port, _ = spawn(
        ["serve", "--model", str(model_dir), "--stages", "2", "--num-blocks", "64",
         "--block-size", "4", "--threads", "1", "--no-kv-shipping", *common, *server_tls],
        "wavepp serve:",
    )  # fmt: skip
    router = None
    try:
        router, router_port, _ = spawn(
            ["router", "--model", str(model_dir), "--pipeline", f"127.0.0.1:{port}",
             "--pipeline-ca", str(pki / "ca.pem"), "--pipeline-cert", str(pki / "client.pem"),
             "--pipeline-key", str(pki / "client.key"), "--poll-interval", "0.2", *common,
             *server_tls],
            "wavepp router:",
        )  # fmt: skip
        signed = ClientTLS(pki / "ca.pem", pki / "client.pem", pki / "client.key")
        with PrefillClient(f"127.0.0.1:{router_port}", tls=signed) as client:
            wait_until(client.is_ready, 30, "the router ready behind mTLS")
            result = client.prefill([*SYSTEM, 1], deadline_s=30).result
            assert result.prompt_tokens == len(SYSTEM) + 1
            assert result.served_by == f"127.0.0.1:{port}"
        anonymous = PrefillClient(f"127.0.0.1:{router_port}", tls=ClientTLS(pki / "ca.pem"))
        with anonymous, pytest.raises(grpc.RpcError) as err:
            anonymous.prefill([1, 2, 3], deadline_s=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        if router is not None:
            stop(router)
        stop(pipeline)
