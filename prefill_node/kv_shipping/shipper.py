"""StageKVShipper: one prefill stage's half of the KV hand-off, push (WRITE) or pull (lease).

The per-stage code both engines share: every stage, in-process (LocalEngine) or in its own
process (the runtime), owns one inside a ``StageShipping`` thread (stage_shipping.py), which
calls ``poll``. Each stage owns its NIXL agent and registers its KV
tensors exactly once, at construction. Per request, a stage: right after the request's last
chunk ran there, completes it with its blocks kept pinned
(``StageAdmission.complete(keep_pinned=True)``), then ``push`` (or ``publish``); its
``take_results()`` reach the leader, which answers the request once all P stages reported
success, or calls ``cancel`` on every stage when one failed.

Block contract: ``push`` / ``publish`` take over ONE reference per block that the caller
keeps pinned for the shipper and give it back exactly once through the
``unpin`` callback: when the WRITE ended (success or failure), when decode released the lease,
when it expired, or on ``cancel`` / ``close``. The callback runs on the thread that called
``poll`` / ``cancel`` / ``close``; the caller decides when the pool sees it.

Threading: not thread-safe; one thread makes every call (NIXL is created without a listener).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from kv_transfer.agent import KVAgent
from kv_transfer.allowlist import AllowList
from kv_transfer.errors import KVInvariantError, KVTransferError
from kv_transfer.lease import Lease, ReleaseReason
from kv_transfer.messages import TransferOutcome
from kv_transfer.progress import KVProgress
from kv_transfer.sender import KVSender, SenderConfig
from prefill_node.core.block import KVBlock
from prefill_node.engine.types import KVPushDestination, StageKVManifest
from prefill_node.errors import InvalidRequestError
from prefill_node.kv_shipping.kv_wire import engine_manifest, stage_push_destination
from prefill_node.model.latent_cache import StageCache


@dataclass(frozen=True)
class KVShippingConfig:
    """Settings of every stage's shipper. ``allow``: decode destinations a stage may write to
    (CIDRs or agent names; default loopback only). ``lease_ttl_s``: pull leases (renewed by
    decode's heartbeats). ``progress``: how each stage's NIXL agent progresses (``KVProgress``;
    the default sleeps until traffic arrives)."""

    allow: AllowList = field(default_factory=AllowList.loopback)
    transfer_timeout_s: float = 30.0
    handshake_timeout_s: float = 2.0
    lease_ttl_s: float = 30.0
    metadata_host: str = "127.0.0.1"
    agent_prefix: str = "wavepp"
    progress: KVProgress = KVProgress.EVENT

    def __post_init__(self) -> None:
        if min(self.transfer_timeout_s, self.handshake_timeout_s, self.lease_ttl_s) <= 0:
            raise InvalidRequestError(
                "KV shipping timeouts and lease TTL must be positive, got "
                f"{self.transfer_timeout_s}, {self.handshake_timeout_s}, {self.lease_ttl_s}"
            )
        if not self.agent_prefix:
            raise InvalidRequestError("KV shipping agent_prefix must be non-empty")

    def sender_config(self, stage: int, num_stages: int) -> SenderConfig:
        return SenderConfig(
            stage,
            num_stages,
            self.allow,
            transfer_timeout_s=self.transfer_timeout_s,
            handshake_timeout_s=self.handshake_timeout_s,
            lease_ttl_s=self.lease_ttl_s,
            metadata_host=self.metadata_host,
        )

    @property
    def wait_limit_s(self) -> float:
        """Upper bound on how long one push can take before its outcome is reported."""
        return self.handshake_timeout_s + self.transfer_timeout_s + 1.0


@dataclass(frozen=True)
class StageShipResult:
    """How one stage's part of one request's hand-off went. Push: ``manifest.pushed`` after
    the WRITE landed and decode was notified. Pull: the lease manifest, at once."""

    request_id: str
    stage: int
    manifest: StageKVManifest | None
    error: Exception | None = None
    num_bytes: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class _Held:
    blocks: list[KVBlock]
    manifest: StageKVManifest
    started: float


class StageKVShipper:
    """Ships stage ``stage``'s layers (the tensors of ``kv``) for finished requests."""

    def __init__(
        self,
        stage: int,
        num_stages: int,
        kv: StageCache,
        config: KVShippingConfig,
        unpin: Callable[[Sequence[KVBlock]], None],
        agent_name: str | None = None,
    ) -> None:
        self.stage = stage
        self.config = config
        self._unpin = unpin
        self._block_size = kv.block_size
        self._entry_parts = kv.entry_parts
        name = agent_name or f"{config.agent_prefix}-stage{stage}-{uuid.uuid4().hex[:8]}"
        self.sender = KVSender(
            KVAgent(name, progress=config.progress),
            kv.tensors,
            kv.layer_range.start,
            config.sender_config(stage, num_stages),
            on_complete=self._on_push_end,
            on_lease_end=self._on_lease_end,
        )
        self._pushing: dict[str, _Held] = {}  # request id -> blocks of an in-flight WRITE
        self._leased: dict[str, tuple[str, list[KVBlock]]] = {}  # lease id -> (request, blocks)
        self._results: dict[str, StageShipResult] = {}

    @property
    def agent_name(self) -> str:
        return self.sender.agent.name

    @property
    def busy(self) -> bool:
        """A WRITE or a lease is live: poll often (transfers, heartbeats, releases)."""
        return bool(self._pushing or self._leased)

    @property
    def held_blocks(self) -> int:
        """Block references this shipper holds now (in-flight WRITEs and live leases)."""
        pushing = sum(len(h.blocks) for h in self._pushing.values())
        return pushing + sum(len(b) for _, b in self._leased.values())

    def push(
        self,
        request_id: str,
        blocks: Sequence[KVBlock],
        manifest: StageKVManifest,
        dest: KVPushDestination,
    ) -> None:
        """Start WRITing the request's KV of this stage's layers to decode's blocks.

        ``manifest`` is the stage's local manifest of the request (block table, token count).
        Bad destinations do not raise: the result (``take_result``) carries the error.
        """
        now = time.monotonic()
        held = _Held(list(blocks), manifest, now)
        try:
            wire = stage_push_destination(
                dest, request_id, self.stage, manifest.num_tokens, self._block_size
            )
            self.sender.push(wire, manifest.block_ids, manifest.num_tokens)
        except (KVTransferError, ValueError) as exc:
            self._unpin(held.blocks)
            self._results[request_id] = StageShipResult(request_id, self.stage, None, exc)
            return
        self._pushing[request_id] = held

    def publish(
        self,
        request_id: str,
        blocks: Sequence[KVBlock],
        manifest: StageKVManifest,
        lease_ttl_s: float | None = None,
    ) -> None:
        """Pull: lease the blocks for decode to READ; the result holds the lease manifest.
        ``lease_ttl_s``: this request's lease TTL (None: ``KVShippingConfig.lease_ttl_s``)."""
        try:
            wire = self.sender.publish(
                request_id, manifest.block_ids, manifest.num_tokens, lease_ttl_s
            )
        except KVTransferError as exc:
            self._unpin(list(blocks))
            self._results[request_id] = StageShipResult(request_id, self.stage, None, exc)
            return
        self._leased[wire.lease_id] = (request_id, list(blocks))
        self._results[request_id] = StageShipResult(
            request_id, self.stage, engine_manifest(wire, entry_parts=self._entry_parts)
        )

    def poll(self) -> None:
        """Advance WRITEs, serve decode's heartbeats / releases, expire leases."""
        self.sender.poll()

    def take_results(self) -> list[StageShipResult]:
        """Results known since the last call (each request's exactly once), then forgotten."""
        results, self._results = list(self._results.values()), {}
        return results

    def cancel(self, request_id: str) -> None:
        """Give up the request here: abort its WRITE or revoke its lease, unpin its blocks."""
        self._results.pop(request_id, None)
        held = self._pushing.pop(request_id, None)
        if held is not None:
            self.sender.cancel(request_id)
            self._unpin(held.blocks)
        for lease_id, (owner, _) in list(self._leased.items()):
            if owner == request_id:
                self.sender.leases.release(lease_id, ReleaseReason.REVOKED)

    def _on_push_end(self, outcome: TransferOutcome) -> None:
        held = self._pushing.pop(outcome.request_id, None)
        if held is None:
            raise KVInvariantError(f"push outcome for unknown request {outcome.request_id}")
        self._unpin(held.blocks)
        manifest = replace(held.manifest, agent_name=self.agent_name, pushed=outcome.ok)
        self._results[outcome.request_id] = StageShipResult(
            outcome.request_id,
            self.stage,
            manifest if outcome.ok else None,
            outcome.error,
            outcome.num_bytes,
            outcome.seconds,
        )

    def _on_lease_end(self, lease: Lease, reason: ReleaseReason) -> None:
        entry = self._leased.pop(lease.lease_id, None)
        if entry is None:
            raise KVInvariantError(f"lease {lease.lease_id} ended but holds no blocks here")
        self._unpin(entry[1])

    def check_integrity(self) -> None:
        """Raise KVInvariantError unless the sender's pushes and leases match what is held."""
        self.sender.check_integrity()
        if self.sender.inflight != len(self._pushing):
            raise KVInvariantError(
                f"stage {self.stage}: {self.sender.inflight} pushes in flight, "
                f"{len(self._pushing)} held"
            )
        if len(self.sender.leases) != len(self._leased):
            raise KVInvariantError(
                f"stage {self.stage}: {len(self.sender.leases)} leases, {len(self._leased)} held"
            )

    def close(self) -> None:
        """Abort WRITEs and revoke leases (unpinning everything), then free the NIXL agent."""
        for request_id in list(self._pushing):
            self.cancel(request_id)
        self.sender.close()  # revokes leases -> _on_lease_end unpins
        self._results.clear()
