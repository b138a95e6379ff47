"""Metadata handshake: a tiny HTTP endpoint serving an agent's NIXL metadata and KV layout.

The decode worker (push) and every prefill stage (pull) run one; a peer fetches it once and
caches it. GET ``/kv/v1/agent`` returns JSON ``{"agent_name", "metadata" (base64),
"layout"}``. The server thread only serves a bytes snapshot: it never touches NIXL.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

from kv_transfer.errors import (
    DecodeUnreachable,
    InvalidTransferRequest,
    TransferFailed,
    TransferTimeout,
)
from kv_transfer.layout import KVLayout
from kv_transfer.messages import Notification, StageManifest

if TYPE_CHECKING:
    from kv_transfer.agent import KVAgent

PATH = "/kv/v1/agent"


@dataclass(frozen=True)
class PeerInfo:
    """What a peer announces: its agent name, NIXL metadata blob and KV pool layout."""

    agent_name: str
    metadata: bytes
    layout: KVLayout

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "agent_name": self.agent_name,
                "metadata": base64.b64encode(self.metadata).decode(),
                "layout": self.layout.to_dict(),
            }
        ).encode()

    @classmethod
    def from_json(cls, body: bytes) -> PeerInfo:
        try:
            data = json.loads(body)
            return cls(
                agent_name=str(data["agent_name"]),
                metadata=base64.b64decode(data["metadata"]),
                layout=KVLayout.from_dict(data["layout"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, InvalidTransferRequest):
                raise
            raise InvalidTransferRequest(f"malformed peer metadata: {exc!r}") from exc


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``"host:port"`` (IPv6 as ``"[::1]:port"``) -> (host, port)."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidTransferRequest(f"endpoint must be host:port, got {endpoint!r}")
    return host.strip("[]"), int(port)


WILDCARDS = ("0.0.0.0", "::", "")
POD_IP_ENV = "POD_IP"  # Kubernetes' status.podIP, which the chart puts in every container


def wildcard_advertise_host() -> str:
    """The address peers dial for a server bound to every address: ``$POD_IP`` when set (the
    pod's own IP, IPv4 or IPv6, as the cluster routes it), else this machine's hostname
    resolved to its first address of either family."""
    pod_ip = os.environ.get(POD_IP_ENV, "").strip()
    if pod_ip:
        return pod_ip
    name = socket.gethostname()
    try:
        return str(socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)[0][4][0])
    except OSError:
        return name


class _ThreadingHTTPServerV6(ThreadingHTTPServer):
    address_family = socket.AF_INET6


class MetadataServer:
    """Serves ``PeerInfo`` over HTTP on a daemon thread until ``close``."""

    def __init__(
        self,
        info: PeerInfo,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
    ) -> None:
        """Bind ``host:port`` (port 0: any free one; an IPv6 ``host`` such as ``::`` binds
        IPv6). ``endpoint`` names ``advertise_host`` when given, else the bound address, and
        for a wildcard bind ``wildcard_advertise_host()``."""
        self._body = info.to_json()
        if advertise_host is None and host in WILDCARDS:
            advertise_host = wildcard_advertise_host()
        self._advertise = advertise_host
        body_ref = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server naming
                if self.path != PATH:
                    self.send_error(404)
                    return
                body = body_ref._body
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:  # keep the hot path quiet
                pass

        server_class = _ThreadingHTTPServerV6 if ":" in host else ThreadingHTTPServer
        self._server = server_class((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="kv-metadata", daemon=True
        )
        self._thread.start()

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        host = self._advertise or host
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"

    def update(self, info: PeerInfo) -> None:
        """Serve a new snapshot (after a registration changed the metadata)."""
        self._body = info.to_json()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def fetch_peer(endpoint: str, timeout_s: float) -> PeerInfo:
    """GET a peer's PeerInfo. Refused / unroutable -> DecodeUnreachable; silent peer ->
    TransferTimeout after ``timeout_s``; garbage -> InvalidTransferRequest."""
    host, port = split_endpoint(endpoint)
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("GET", PATH)
        response = conn.getresponse()
        body = response.read()
    except TimeoutError as exc:
        raise TransferTimeout(f"peer {endpoint} did not answer within {timeout_s}s") from exc
    except OSError as exc:
        raise DecodeUnreachable(f"peer {endpoint} unreachable: {exc}") from exc
    except http.client.HTTPException as exc:
        raise DecodeUnreachable(f"peer {endpoint} broke the handshake: {exc!r}") from exc
    finally:
        conn.close()
    if response.status != 200:
        raise DecodeUnreachable(f"peer {endpoint} answered HTTP {response.status}")
    return PeerInfo.from_json(body)


class LeasePeers:
    """The stage agents a pulling side READs from, by metadata endpoint, and the
    notifications it sends to their leases ("hb", "rel").

    ``peer`` handshakes when the agent known at an endpoint is another one: a stage
    restarted at the same address is a new agent (names are unique per start), and the old
    one's metadata is forgotten, so the first pull after a restart succeeds."""

    def __init__(self, agent: KVAgent, handshake_timeout_s: float) -> None:
        self.agent = agent
        self.handshake_timeout_s = handshake_timeout_s
        self._peers: dict[str, PeerInfo] = {}

    def peer(self, endpoint: str, agent_name: str) -> PeerInfo:
        """The peer agent ``agent_name`` at ``endpoint`` (loaded into the agent);
        TransferFailed when the endpoint serves another agent."""
        peer = self._peers.get(endpoint)
        if peer is not None and peer.agent_name == agent_name:
            return peer
        fresh = fetch_peer(endpoint, self.handshake_timeout_s)
        if peer is not None:
            del self._peers[endpoint]
            if peer.agent_name != fresh.agent_name:
                self.agent.forget_remote(peer.agent_name)
        if fresh.agent_name != agent_name:
            raise TransferFailed(f"{endpoint} is {fresh.agent_name}, not {agent_name}")
        self.agent.load_remote(fresh.agent_name, fresh.metadata)
        self._peers[endpoint] = fresh
        return fresh

    def notify(self, manifests: Sequence[StageManifest], kind: str) -> None:
        """Send ``kind`` to each manifest's lease whose agent is known here; best effort
        (an unsent "rel" or "hb" ends in the lease's expiry)."""
        for m in manifests:
            peer = self._peers.get(m.endpoint)
            if peer is not None and peer.agent_name == m.agent_name:
                try:
                    self.agent.nixl.send_notif(
                        m.agent_name, Notification(kind, lease_id=m.lease_id).encode()
                    )
                except Exception:  # noqa: BLE001 - best effort: the lease expires anyway
                    self._peers.pop(m.endpoint, None)
