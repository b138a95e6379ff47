"""KVSender: one prefill stage ships its layers' KV blocks to decode (push) or leases them (pull).

Non-blocking: ``push`` starts a shipment and returns; the stage's loop calls ``poll`` (cheap)
to advance handshakes and transfers, expire leases and serve decode's pull notifications.
Every push ends exactly once, through ``on_complete(outcome)`` and ``poll``'s return value:
the stage unpins the request's blocks there, on success and on failure alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kv_transfer.agent import KVAgent
from kv_transfer.allowlist import AllowList
from kv_transfer.errors import (
    InvalidTransferRequest,
    KVInvariantError,
    KVTransferError,
    TransferTimeout,
)
from kv_transfer.handshake import MetadataServer, PeerInfo, fetch_peer, split_endpoint
from kv_transfer.lease import Lease, LeaseTable, ReleaseReason
from kv_transfer.messages import Notification, PushDestination, StageManifest, TransferOutcome
from kv_transfer.plan import PageMap
from kv_transfer.transfer import NixlTransfer, start_transfer


@dataclass(frozen=True)
class SenderConfig:
    """Per-stage settings. ``metadata_host`` None: no endpoint, push mode only; otherwise
    pull manifests name ``metadata_advertise_host`` (or the bound address) as the endpoint.
    ``transfer_timeout_s`` bounds a push from ``push`` to completion, handshake included."""

    stage: int
    num_stages: int
    allow: AllowList
    transfer_timeout_s: float = 30.0
    handshake_timeout_s: float = 2.0
    lease_ttl_s: float = 30.0
    metadata_host: str | None = "127.0.0.1"
    metadata_port: int = 0
    metadata_advertise_host: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.stage < self.num_stages:
            raise InvalidTransferRequest(f"stage {self.stage} not in [0, {self.num_stages})")
        if min(self.transfer_timeout_s, self.handshake_timeout_s, self.lease_ttl_s) <= 0:
            raise InvalidTransferRequest("timeouts and lease TTL must be positive")


@dataclass
class _Push:
    dest: PushDestination
    src_pages: PageMap
    num_tokens: int
    started: float
    deadline: float
    host_ok: bool
    transfer: NixlTransfer | None = None


class KVSender:
    """Ships one stage's layers. Owns no blocks: the stage pins them before ``push`` /
    ``publish`` and unpins in ``on_complete`` / ``on_lease_end``."""

    def __init__(
        self,
        agent: KVAgent,
        kv_caches: Sequence[torch.Tensor],
        layer_start: int,
        config: SenderConfig,
        on_complete: Callable[[TransferOutcome], None] | None = None,
        on_lease_end: Callable[[Lease, ReleaseReason], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.agent = agent
        self.config = config
        self.kv_caches = list(kv_caches)
        self.layout = agent.register_kv(layer_start, self.kv_caches)
        self._on_complete = on_complete or (lambda outcome: None)
        self._clock = clock
        self.leases = LeaseTable(
            config.lease_ttl_s,
            on_lease_end or (lambda lease, reason: None),
            clock,
            id_prefix=f"{agent.name}-lease",
        )
        self._pushes: dict[str, _Push] = {}
        self._peers: dict[str, PeerInfo] = {}
        self._host_ok: dict[str, bool] = {}  # endpoint -> allowed by CIDR (else: by name)
        self._handshakes: dict[str, Future[PeerInfo]] = {}
        self._executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-handshake")
        self.ignored_notifications = 0
        self._server: MetadataServer | None = None
        if config.metadata_host is not None:
            info = PeerInfo(agent.name, agent.metadata, self.layout)
            self._server = MetadataServer(
                info, config.metadata_host, config.metadata_port, config.metadata_advertise_host
            )

    @property
    def endpoint(self) -> str | None:
        return self._server.endpoint if self._server else None

    @property
    def inflight(self) -> int:
        return len(self._pushes)

    # ----------------------------------------------------------------- push mode
    def push(self, dest: PushDestination, block_ids: Sequence[int], num_tokens: int) -> None:
        """Start writing this stage's layers of tokens ``[dest.skip_tokens, num_tokens)``.

        ``block_ids`` is the request's block table on this stage (tokens from 0). Raises
        InvalidTransferRequest / DestinationNotAllowed at once for bad input; everything
        that happens later (unreachable, timeout, peer death) arrives as an outcome.
        """
        if dest.request_id in self._pushes:
            raise InvalidTransferRequest(f"request {dest.request_id} is already being shipped")
        self.layout.check_block_ids(block_ids)
        src_pages = PageMap(tuple(block_ids), self.layout.block_size)
        src_pages.check_range(0, num_tokens, "source")
        if dest.num_tokens != num_tokens:
            raise InvalidTransferRequest(
                f"decode expects a {dest.num_tokens}-token prompt, this one has {num_tokens}"
            )
        host_ok = self._host_ok.get(dest.endpoint)
        if host_ok is None:  # resolve once per endpoint, not per request
            host_ok = self.config.allow.check_host(split_endpoint(dest.endpoint)[0])
            self._host_ok[dest.endpoint] = host_ok
        now = self._clock()
        push = _Push(
            dest, src_pages, num_tokens, now, now + self.config.transfer_timeout_s, host_ok
        )
        self._pushes[dest.request_id] = push
        self._ensure_handshake(dest.endpoint)

    def _ensure_handshake(self, endpoint: str) -> None:
        """Fetch the peer's metadata in the background unless it is known or on its way."""
        if endpoint not in self._peers and endpoint not in self._handshakes:
            self._handshakes[endpoint] = self._executor.submit(
                fetch_peer, endpoint, self.config.handshake_timeout_s
            )

    def cancel(self, request_id: str) -> bool:
        """Abort a push (the request was aborted); its outcome is not reported."""
        push = self._pushes.pop(request_id, None)
        if push is None:
            return False
        if push.transfer is not None:
            push.transfer.abort()
        return True

    def poll(self) -> list[TransferOutcome]:
        """Advance everything; returns (and reports via on_complete) the pushes that ended."""
        outcomes: list[TransferOutcome] = []
        self._finish_handshakes(outcomes)
        now = self._clock()
        for request_id, push in list(self._pushes.items()):
            error: KVTransferError | None = None
            if push.transfer is not None:
                try:
                    if push.transfer.check():
                        self._end(request_id, None, outcomes)
                        continue
                except KVTransferError as exc:
                    error = exc
            if error is None and now >= push.deadline:
                error = TransferTimeout(
                    f"shipping {request_id} to {push.dest.endpoint} took over "
                    f"{self.config.transfer_timeout_s}s"
                )
            if error is not None:
                self._end(request_id, error, outcomes)
        self._serve_notifications()
        self.leases.expire()
        for outcome in outcomes:
            self._on_complete(outcome)
        return outcomes

    def wait(self, request_id: str, timeout_s: float | None = None) -> TransferOutcome:
        """Poll until ``request_id``'s push ends (a convenience for tests and tools)."""
        limit = time.monotonic() + (timeout_s or self.config.transfer_timeout_s + 1.0)
        while time.monotonic() < limit:
            for outcome in self.poll():
                if outcome.request_id == request_id:
                    return outcome
            if request_id not in self._pushes:
                raise InvalidTransferRequest(f"no push in flight for {request_id}")
            time.sleep(0)  # yield; a real loop polls once per iteration instead
        raise TransferTimeout(f"wait for {request_id} exceeded {timeout_s}s")

    def _finish_handshakes(self, outcomes: list[TransferOutcome]) -> None:
        for endpoint, future in list(self._handshakes.items()):
            if not future.done():
                continue
            del self._handshakes[endpoint]
            waiting = [p for p in self._pushes.values() if p.dest.endpoint == endpoint]
            try:
                peer = future.result()
                self.agent.load_remote(peer.agent_name, peer.metadata)
                self._peers[endpoint] = peer
            except KVTransferError as exc:
                for push in waiting:
                    self._end(push.dest.request_id, exc, outcomes)
                continue
            for push in waiting:
                self._start(push, peer, outcomes)
        for push in list(self._pushes.values()):
            if push.transfer is not None:
                continue
            peer = self._peers.get(push.dest.endpoint)
            if peer is not None:
                self._start(push, peer, outcomes)
            else:  # its peer was dropped after another push to it failed
                self._ensure_handshake(push.dest.endpoint)

    def _start(self, push: _Push, peer: PeerInfo, outcomes: list[TransferOutcome]) -> None:
        request_id = push.dest.request_id
        note = Notification(
            "done",
            push.dest.transfer_id or request_id,
            self.config.stage,
            self.config.num_stages,
            self.layout.layer_start,
            self.layout.layer_end,
        )
        try:
            self.config.allow.check_agent(push.host_ok, peer.agent_name)
            dst_pages = PageMap(push.dest.block_ids, peer.layout.block_size, push.dest.skip_tokens)
            peer.layout.check_block_ids(push.dest.block_ids)
            push.transfer = start_transfer(
                self.agent,
                "WRITE",
                peer.agent_name,
                note.encode(),
                local_layers=self.kv_caches,
                local_layout=self.layout,
                local_pages=push.src_pages,
                remote_layout=peer.layout,
                remote_pages=dst_pages,
                start=push.dest.skip_tokens,
                end=push.num_tokens,
            )
        except KVTransferError as exc:
            self._end(request_id, exc, outcomes)

    def _end(
        self, request_id: str, error: KVTransferError | None, outcomes: list[TransferOutcome]
    ) -> None:
        push = self._pushes.pop(request_id)
        num_bytes = 0
        if push.transfer is not None:
            num_bytes = push.transfer.num_bytes
            if error is not None:
                push.transfer.abort()
                self._peers.pop(push.dest.endpoint, None)  # re-handshake: the peer may be new
        outcomes.append(
            TransferOutcome(
                request_id, self.config.stage, num_bytes, self._clock() - push.started, error
            )
        )

    # ----------------------------------------------------------------- pull mode
    def publish(
        self,
        request_id: str,
        block_ids: Sequence[int],
        num_tokens: int,
        lease_ttl_s: float | None = None,
    ) -> StageManifest:
        """Lease this stage's blocks of a finished request for decode to READ.

        The caller pinned ``block_ids``; ``on_lease_end`` unpins them when decode releases,
        the lease expires (no heartbeat for its TTL: ``lease_ttl_s``, default the config's)
        or the sender revokes it.
        """
        if self._server is None:
            raise InvalidTransferRequest("pull mode needs SenderConfig.metadata_host")
        self.layout.check_block_ids(block_ids)
        PageMap(tuple(block_ids), self.layout.block_size).check_range(0, num_tokens, "source")
        lease = self.leases.grant(request_id, tuple(block_ids), lease_ttl_s)
        return StageManifest(
            request_id=request_id,
            stage=self.config.stage,
            num_stages=self.config.num_stages,
            endpoint=self._server.endpoint,
            agent_name=self.agent.name,
            layout=self.layout,
            block_ids=tuple(block_ids),
            num_tokens=num_tokens,
            lease_id=lease.lease_id,
            lease_ttl_s=lease.ttl_s,
        )

    def _serve_notifications(self) -> None:
        for messages in self.agent.nixl.get_new_notifs().values():
            for raw in messages:
                note = Notification.decode(raw)
                if note is not None and note.kind == "hb" and self.leases.renew(note.lease_id):
                    continue
                if note is not None and note.kind == "rel" and self.leases.release(note.lease_id):
                    continue
                self.ignored_notifications += 1  # late, duplicate or foreign

    # ----------------------------------------------------------------- lifecycle
    def check_integrity(self) -> None:
        self.leases.check_integrity()
        for request_id, push in self._pushes.items():
            if push.dest.request_id != request_id:
                raise KVInvariantError(f"push table key {request_id} holds {push.dest}")

    def close(self) -> None:
        """Abort pushes (no outcomes), revoke leases, stop the endpoint, deregister."""
        for request_id in list(self._pushes):
            self.cancel(request_id)
        self.leases.revoke_all()
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._server is not None:
            self._server.close()
        self.agent.close()
