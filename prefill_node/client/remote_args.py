"""Command-line flags for reaching a running server (--server, client TLS); no heavy imports."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds --server and the client TLS flags to a subcommand's parser."""
    g = parser.add_argument_group("remote server (optional)")
    g.add_argument(
        "--server",
        metavar="HOST:PORT",
        help="send the prefills to a running `wavepp serve` instead of running the model here; "
        "text prompts are sent as text and tokenised by the server, token ids as ids",
    )
    g.add_argument("--tls-ca", type=Path, help="CA bundle (PEM) to verify the server; enables TLS")
    g.add_argument("--tls-cert", type=Path, help="client certificate (PEM) for mutual TLS")
    g.add_argument("--tls-key", type=Path, help="client private key (PEM) for mutual TLS")


def add_client_tls_arguments(parser: argparse.ArgumentParser, flags: str, peer: str) -> None:
    """Adds ``--FLAGS-ca`` / ``-cert`` / ``-key``: TLS to ``peer`` (read with ``client_tls``)."""
    g = parser.add_argument_group(f"TLS to {peer} (optional)")
    g.add_argument(
        f"--{flags}-ca", type=Path, help=f"CA bundle (PEM) to verify {peer}; enables TLS"
    )
    g.add_argument(f"--{flags}-cert", type=Path, help="client certificate (PEM), mutual TLS")
    g.add_argument(f"--{flags}-key", type=Path, help="client private key (PEM), mutual TLS")


def client_tls(ca: Path | None, cert: Path | None, key: Path | None, flags: str) -> Any:
    """ClientTLS from a ``--FLAGS-ca`` / ``-cert`` / ``-key`` triple (None without a CA:
    plaintext); a certificate or key without the CA is an error naming the flags."""
    from prefill_node.client.prefill_client import ClientTLS

    if (cert or key) and not ca:
        raise ValueError(f"--{flags}-cert / --{flags}-key need --{flags}-ca")
    return ClientTLS(ca, cert, key) if ca else None


def remote_engine_from_args(args: argparse.Namespace) -> Any:
    """A RemoteEngine for ``args.server`` (connects and fetches the server's info)."""
    from prefill_node.client.remote_engine import RemoteEngine

    return RemoteEngine(
        args.server, tls=client_tls(args.tls_ca, args.tls_cert, args.tls_key, "tls")
    )
