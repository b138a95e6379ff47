"""KVReceiver: the decode-side library: registers the decode KV pool, serves its metadata,
allocates destination blocks and tracks each request's KV arriving from every stage.

Push (registered pools only): ``expect`` returns the PushDestination that travels with the
prefill request; stages WRITE and notify; the request completes when every stage notified.
Pull: ``pull`` READs each stage's blocks named by its manifest, heartbeats the leases, and
releases each lease with the notification that rides on its READ. One thread drives it
(``poll`` / ``wait``).
Block ownership: blocks from ``allocate`` belong to the caller until it calls ``free``;
the receiver never frees them, not even on failure.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kv_transfer.agent import KVAgent
from kv_transfer.convert import KVLayer, layout_of_views
from kv_transfer.errors import (
    InvalidTransferRequest,
    KVInvariantError,
    KVTransferError,
    LayoutMismatch,
    TransferFailed,
    TransferTimeout,
)
from kv_transfer.handshake import LeasePeers, MetadataServer, PeerInfo
from kv_transfer.layout import HybridPool
from kv_transfer.messages import Notification, PushDestination, StageManifest, TransferOutcome
from kv_transfer.plan import PageMap, last_token_blocks
from kv_transfer.transfer import NixlTransfer, start_transfer


@dataclass(frozen=True)
class ReceiverConfig:
    """Metadata endpoint bind address (``advertise_host``: the address peers should dial,
    e.g. the pod IP) and the per-request deadline."""

    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = None
    timeout_s: float = 30.0
    handshake_timeout_s: float = 2.0


class PartReceived(NamedTuple):
    """A streamed push's "part" as decode saw it: tokens below ``end_token`` of global
    layers ``[layer_start, layer_end)`` of ``stage`` landed, seen at ``at`` (the receiver's
    clock)."""

    request_id: str
    stage: int
    end_token: int
    at: float
    layer_start: int
    layer_end: int


@dataclass
class _Pending:
    request_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    skip_tokens: int
    started: float
    deadline: float
    num_stages: int = 0
    layers: dict[int, tuple[int, int]] = field(default_factory=dict)  # stage -> layer range
    reads: dict[int, tuple[NixlTransfer, StageManifest]] = field(default_factory=dict)
    heartbeat_every: float = 0.0
    last_heartbeat: float = 0.0
    num_tokens: int = 0  # push: the prompt's length
    closing: bool = False  # push: a stage's part reached the last token, or a stage is done


class KVReceiver:
    """Receives whole requests' KV into a decode pool covering all model layers."""

    def __init__(
        self,
        agent: KVAgent,
        kv_caches: Sequence[KVLayer],
        config: ReceiverConfig = ReceiverConfig(),
        clock: Callable[[], float] = time.monotonic,
        registered: bool = True,
        hybrid: HybridPool | None = None,
    ) -> None:
        """``kv_caches``: one tensor per model layer, ``[num_blocks, 2, block_size, kv_heads,
        head_dim]``. ``registered=False``: views NIXL cannot address (any strides, or K and V
        apart: convert.KVLayer; e.g. vLLM's CPU cache): pull only, each READ lands in a
        registered staging buffer and is copied into the views when it completes. ``hybrid``:
        a model with recurrent layers: ``kv_caches`` hold its attention layers only, and
        ``hybrid`` names them and the recurrent layers' state tensors (registered too)."""
        self.agent = agent
        self.config = config
        self.kv_caches = list(kv_caches)
        self.registered = registered
        if hybrid is not None and not registered:
            raise InvalidTransferRequest("a pool with recurrent layers must be registered")
        if registered:
            self.layout = agent.register_kv(0, self.kv_caches, hybrid)
        else:
            self.layout = layout_of_views(0, self.kv_caches)
        self._clock = clock
        self._free: deque[int] = deque(range(self.layout.num_blocks))
        self._used: set[int] = set()
        self._pending: dict[str, _Pending] = {}  # by transfer id
        self._by_request: dict[str, str] = {}  # request id -> transfer id
        # by metadata endpoint: the agent answering there now (a restarted stage comes back
        # at the same address under a new agent name; see ``LeasePeers.peer``)
        self._peers = LeasePeers(agent, config.handshake_timeout_s)
        self._unclaimed: list[TransferOutcome] = []
        self._ids = itertools.count()
        self.ignored_notifications = 0
        self.parts_received = 0  # streamed pushes: "part" notifications of live attempts
        # every "part" of a live attempt, newest last (bounded)
        self.receive_log: deque[PartReceived] = deque(maxlen=4096)
        info = PeerInfo(agent.name, agent.metadata, self.layout)
        self._server = MetadataServer(info, config.host, config.port, config.advertise_host)

    @property
    def endpoint(self) -> str:
        return self._server.endpoint

    @property
    def busy(self) -> bool:
        """A reception is live or an outcome waits for ``poll``: poll until False."""
        return bool(self._pending or self._unclaimed)

    @property
    def due(self) -> bool:
        """A reception should end soon, so a caller that wants to see its end early polls at
        its fastest now: an outcome waits, a READ is in flight, or a push's stage has sent
        its last token (a streamed part reaching the prompt's end, or its "done": the other
        stages' ends follow within about one layer group's compute). A streamed push
        before that point still has chunks to compute; polling it slowly costs nothing."""
        return bool(self._unclaimed) or any(p.reads or p.closing for p in self._pending.values())

    # ----------------------------------------------------------------- blocks
    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, num_blocks: int) -> tuple[int, ...] | None:
        """``num_blocks`` destination blocks, or None when the pool is short (wait)."""
        if num_blocks > len(self._free):
            return None
        blocks = tuple(self._free.popleft() for _ in range(num_blocks))
        self._used.update(blocks)
        return blocks

    def free(self, block_ids: Sequence[int]) -> None:
        for block in block_ids:
            if block not in self._used:
                raise InvalidTransferRequest(f"block {block} is not allocated")
            self._used.remove(block)
            self._free.append(block)

    # ----------------------------------------------------------------- push mode
    def expect(
        self,
        request_id: str,
        block_ids: Sequence[int],
        num_tokens: int,
        skip_tokens: int = 0,
        timeout_s: float | None = None,
    ) -> PushDestination:
        """Register an incoming push; send the returned destination with the prefill request.

        ``block_ids`` (from ``allocate``) receive tokens ``[skip_tokens, num_tokens)``;
        ``skip_tokens`` must be a multiple of the decode block size (a cached prefix is
        whole blocks). With nothing to receive the request ends at once (next ``poll``).
        ``timeout_s`` (default ``config.timeout_s``): the reception fails that long after
        this call. The stages WRITE while the prefill runs, so it must cover the prefill
        call's own deadline plus the transfer: a reception that gives up first fails a
        hand-off the prefill tier then answers OK.
        """
        if not self.registered:
            raise InvalidTransferRequest(
                "this receiver's pool is not registered with NIXL (staged): stages cannot "
                "WRITE into it; pull by the prefill response's manifests instead"
            )
        PageMap(tuple(block_ids), self.layout.block_size, skip_tokens).check_range(
            skip_tokens, num_tokens, "destination"
        )
        pending = self._register(request_id, block_ids, skip_tokens, timeout_s)
        pending.num_tokens = num_tokens
        dest = PushDestination(
            request_id,
            self.endpoint,
            pending.block_ids,
            num_tokens,
            skip_tokens,
            pending.transfer_id,
        )
        if skip_tokens == num_tokens:
            self._end(pending, None, self._unclaimed)
        return dest

    def _register(
        self,
        request_id: str,
        block_ids: Sequence[int],
        skip_tokens: int,
        timeout_s: float | None = None,
    ) -> _Pending:
        if request_id in self._by_request:
            raise InvalidTransferRequest(f"request {request_id} is already being received")
        if skip_tokens < 0 or skip_tokens % self.layout.block_size:
            raise InvalidTransferRequest(
                f"skip_tokens {skip_tokens} must be a non-negative multiple of the decode "
                f"block size {self.layout.block_size}"
            )
        not_mine = [b for b in block_ids if b not in self._used]
        if not_mine:
            raise InvalidTransferRequest(f"blocks {not_mine[:8]} were not allocated here")
        now = self._clock()
        transfer_id = f"{request_id}#{self.agent.name}#{next(self._ids)}"
        pending = _Pending(
            request_id,
            transfer_id,
            tuple(block_ids),
            skip_tokens,
            now,
            now + (self.config.timeout_s if timeout_s is None else timeout_s),
        )
        self._pending[transfer_id] = pending
        self._by_request[request_id] = transfer_id
        return pending

    def _on_done_note(self, note: Notification, outcomes: list[TransferOutcome]) -> None:
        pending = self._pending.get(note.transfer_id)
        if pending is None or pending.reads or note.stage in pending.layers:
            self.ignored_notifications += 1  # late (ended / older attempt) or duplicate
            return
        if pending.num_stages and note.num_stages != pending.num_stages:
            error = TransferFailed(
                f"stages disagree on the pipeline depth ({pending.num_stages} vs "
                f"{note.num_stages}) for {pending.request_id}"
            )
            self._end(pending, error, outcomes)
            return
        pending.num_stages = note.num_stages
        pending.layers[note.stage] = (note.layer_start, note.layer_end)
        pending.closing = True
        if len(pending.layers) == pending.num_stages:
            self._end(pending, self._coverage_error(pending.layers.values()), outcomes)

    def _on_stream_note(self, note: Notification, outcomes: list[TransferOutcome]) -> None:
        """Streamed push: "part" logs progress (the request is ready only once every stage's
        "done" came); "fail" ends the attempt at once, its blocks' contents invalid."""
        pending = self._pending.get(note.transfer_id)
        if pending is None or pending.reads:
            self.ignored_notifications += 1  # late (ended / older attempt) or foreign
            return
        if note.kind == "part":
            self.parts_received += 1
            pending.closing |= note.end_token >= pending.num_tokens
            self.receive_log.append(
                PartReceived(
                    pending.request_id,
                    note.stage,
                    note.end_token,
                    self._clock(),
                    note.layer_start,
                    note.layer_end,
                )
            )
            return
        error = TransferFailed(
            f"prefill stage {note.stage} abandoned the KV push of {pending.request_id}"
        )
        self._end(pending, error, outcomes)

    def _coverage_error(self, ranges: Iterable[tuple[int, int]]) -> LayoutMismatch | None:
        """None when the stages' layer ranges tile the decode model's layers exactly."""
        covered = sorted(ranges)
        position = self.layout.layer_start
        for lo, hi in covered:
            if lo != position:
                break
            position = hi
        else:
            if position == self.layout.layer_end:
                return None
        return LayoutMismatch(
            f"stages shipped layers {covered}, decode needs "
            f"[{self.layout.layer_start}, {self.layout.layer_end})"
        )

    # ----------------------------------------------------------------- pull mode
    def pull(
        self,
        manifests: Sequence[StageManifest],
        block_ids: Sequence[int],
        skip_tokens: int = 0,
    ) -> None:
        """Start READing every stage's blocks of one request (handshakes block, bounded by
        ``handshake_timeout_s``). Start reading and heartbeating within the leases' TTL:
        after expiry prefill may reuse the blocks."""
        if not manifests:
            raise InvalidTransferRequest("pull needs at least one stage manifest")
        request_id = manifests[0].request_id
        stages = sorted(m.stage for m in manifests)
        if any(m.request_id != request_id for m in manifests) or stages != list(
            range(manifests[0].num_stages)
        ):
            raise InvalidTransferRequest(
                f"need one manifest per stage 0..{manifests[0].num_stages - 1} of one request"
            )
        error = self._coverage_error(
            [(m.layout.layer_start, m.layout.layer_end) for m in manifests]
        )
        if error is not None:
            raise error
        num_tokens = manifests[0].num_tokens
        if any(m.num_tokens != num_tokens for m in manifests):
            raise InvalidTransferRequest("stage manifests disagree on the prompt length")
        PageMap(tuple(block_ids), self.layout.block_size, skip_tokens).check_range(
            skip_tokens, num_tokens, "destination"
        )
        pending = self._register(request_id, block_ids, skip_tokens)
        pending.num_stages = len(manifests)
        pending.heartbeat_every = min(m.lease_ttl_s for m in manifests) / 3
        pending.last_heartbeat = self._clock()
        local_pages = PageMap(pending.block_ids, self.layout.block_size, skip_tokens)
        try:
            for m in manifests:
                peer = self._peers.peer(m.endpoint, m.agent_name)
                read = start_transfer(
                    self.agent,
                    "READ",
                    peer.agent_name,
                    Notification("rel", lease_id=m.lease_id).encode(),
                    local_layers=self.kv_caches,
                    local_layout=self.layout,
                    local_pages=local_pages,
                    remote_layout=m.layout,
                    remote_pages=PageMap(m.block_ids, m.layout.block_size),
                    start=skip_tokens,
                    end=m.num_tokens,
                    state_slots=_final_state_slots(m, local_pages, skip_tokens),
                )
                pending.reads[m.stage] = (read, m)
                if read.num_bytes == 0:  # nothing to read rode no notification: release now
                    self._peers.notify([m], "rel")
                pending.layers[m.stage] = (m.layout.layer_start, m.layout.layer_end)
        except KVTransferError as exc:
            self._end(pending, exc, self._unclaimed, manifests)

    # ----------------------------------------------------------------- driving
    def poll(self) -> list[TransferOutcome]:
        """Advance all requests; returns the ones that ended (each exactly once)."""
        outcomes, self._unclaimed = self._unclaimed, []
        for messages in self.agent.nixl.get_new_notifs().values():
            for raw in messages:
                note = Notification.decode(raw)
                if note is not None and note.kind == "done":
                    self._on_done_note(note, outcomes)
                elif note is not None and note.kind in ("part", "fail"):
                    self._on_stream_note(note, outcomes)
                else:
                    self.ignored_notifications += 1
        now = self._clock()
        for pending in list(self._pending.values()):
            error: KVTransferError | None = None
            if pending.reads:
                try:
                    if all(read.check() for read, _ in pending.reads.values()):
                        self._end(pending, None, outcomes)
                        continue
                except KVTransferError as exc:
                    error = exc
                if error is None and now - pending.last_heartbeat >= pending.heartbeat_every:
                    pending.last_heartbeat = now
                    live = [m for read, m in pending.reads.values() if not read.done]
                    self._peers.notify(live, "hb")
            if error is None and now >= pending.deadline:
                error = TransferTimeout(
                    f"KV of {pending.request_id} incomplete after "
                    f"{pending.deadline - pending.started:g}s "
                    f"(stages done: {sorted(pending.layers) if not pending.reads else 'pull'})"
                )
            if error is not None:
                self._end(pending, error, outcomes)
        return outcomes

    def wait(self, request_id: str, timeout_s: float | None = None) -> TransferOutcome:
        """Poll until ``request_id`` ends; other outcomes stay queued for ``poll``."""
        limit = time.monotonic() + (timeout_s or self.config.timeout_s + 1.0)
        while time.monotonic() < limit:
            for outcome in self.poll():
                if outcome.request_id == request_id:
                    return outcome
                self._unclaimed.append(outcome)
            if request_id not in self._by_request:
                raise InvalidTransferRequest(f"nothing pending for {request_id}")
            time.sleep(0)  # yield; a real loop polls once per iteration instead
        raise TransferTimeout(f"wait for {request_id} exceeded {timeout_s}s")

    def cancel(self, request_id: str) -> bool:
        transfer_id = self._by_request.get(request_id)
        if transfer_id is None:
            return False
        self._end(self._pending[transfer_id], None, [])
        return True

    def _end(
        self,
        pending: _Pending,
        error: KVTransferError | None,
        outcomes: list[TransferOutcome],
        manifests: Sequence[StageManifest] = (),
    ) -> None:
        del self._pending[pending.transfer_id]
        del self._by_request[pending.request_id]
        num_bytes = 0
        for read, _ in pending.reads.values():
            num_bytes += read.num_bytes
            read.abort()
        if error is not None:
            unread = list(manifests) or [m for read, m in pending.reads.values() if not read.done]
            self._peers.notify(unread, "rel")
        outcomes.append(
            TransferOutcome(
                pending.request_id, -1, num_bytes, self._clock() - pending.started, error
            )
        )

    def check_integrity(self) -> None:
        if len(self._free) + len(self._used) != self.layout.num_blocks or self._used & set(
            self._free
        ):
            raise KVInvariantError(
                f"{len(self._free)} free + {len(self._used)} used != {self.layout.num_blocks}"
            )
        if set(self._by_request.values()) != set(self._pending):
            raise KVInvariantError("request index and pending table disagree")

    def close(self) -> None:
        for request_id in list(self._by_request):
            self.cancel(request_id)
        self._server.close()
        self.agent.close()


def _final_state_slots(
    m: StageManifest, local_pages: PageMap, skip_tokens: int
) -> tuple[int, int] | None:
    """A stage with recurrent layers: (its block, ours) holding the prompt's last token,
    whose state slots carry the state after it; None when there is nothing to read."""
    if not m.layout.states or m.num_tokens <= skip_tokens:
        return None
    stage_pages = PageMap(m.block_ids, m.layout.block_size)
    return last_token_blocks(stage_pages, local_pages, m.num_tokens)
