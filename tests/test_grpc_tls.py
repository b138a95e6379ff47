"""TLS and mutual TLS from PEM files, with certificates made by the real openssl CLI."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

from prefill_node.client.prefill_client import ClientTLS, PrefillClient
from prefill_node.server.server import ServerConfig, TLSConfig
from tests.grpc_harness import ServerThread
from tests.grpc_toy_engine import ToyEngine, expected_first_token

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _make_pki(d: Path) -> None:
    """ca.pem signs server.pem (SAN 127.0.0.1) and client.pem."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=ca",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=d)  # fmt: skip
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1"), ("client", "")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)  # fmt: skip
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext",
                 "-out", f"{name}.pem", cwd=d)  # fmt: skip


def test_mutual_tls_accepts_a_signed_client_and_rejects_an_anonymous_one(tmp_path):
    _make_pki(tmp_path)
    tls = TLSConfig(tmp_path / "server.pem", tmp_path / "server.key", tmp_path / "ca.pem")
    engine = ToyEngine(vocab_size=100)
    try:
        with ServerThread(engine, ServerConfig(host="127.0.0.1", port=0, tls=tls)) as srv:
            signed = ClientTLS(
                tmp_path / "ca.pem", tmp_path / "client.pem", tmp_path / "client.key"
            )
            with PrefillClient(srv.target, tls=signed) as client:
                got = client.prefill([5, 6, 7])
            assert got.result.first_token_id == expected_first_token([5, 6, 7], 100)
            anonymous = PrefillClient(srv.target, tls=ClientTLS(tmp_path / "ca.pem"))
            with anonymous, pytest.raises(grpc.RpcError) as err:
                anonymous.prefill([5, 6, 7], deadline_s=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            with PrefillClient(srv.target) as plaintext, pytest.raises(grpc.RpcError):
                plaintext.prefill([5, 6, 7], deadline_s=5)
    finally:
        engine.shutdown()


def test_missing_tls_file_is_reported_by_name(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.pem"):
        TLSConfig(tmp_path / "nope.pem", tmp_path / "nope.key").credentials()
