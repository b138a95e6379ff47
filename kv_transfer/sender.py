"""KVSender: one prefill stage ships its layers' KV blocks to decode (push) or leases them (pull).

Non-blocking: ``push`` starts a shipment and returns; the stage's loop calls ``poll`` (cheap)
to advance handshakes and transfers, expire leases and serve decode's pull notifications.
Every push ends exactly once, through ``on_complete(outcome)`` and ``poll``'s return value:
the stage unpins the request's blocks there, on success and on failure alike.

Streaming (push mode): ``stream`` WRITEs a range of tokens whose KV is final while the stage
still computes the rest; each range's WRITE carries a "part" notification (progress, never
"ready") and ends exactly once through ``on_part_end``. The request's ``push`` then WRITEs
the remaining tokens; it is posted only after every earlier range of the request landed, so
its "done" notification, which NIXL delivers after its own data, comes after all of them.
A range may cover only some of the stage's layers (``layers``: the last chunk shipped layer
group by layer group while its forward still runs); the final push then WRITEs from
``first_layer`` on, and its "done" still names all of the stage's layers.
A push attempt given up (``cancel``, or a failed push) after any of its WRITEs was posted
sends decode a "fail" notification: the attempt's blocks hold nothing valid.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kv_transfer.agent import KVAgent
from kv_transfer.errors import (
    InvalidTransferRequest,
    KVInvariantError,
    KVTransferError,
    TransferFailed,
    TransferTimeout,
)
from kv_transfer.handshake import MetadataServer, PeerInfo, fetch_peer, split_endpoint
from kv_transfer.layout import HybridPool
from kv_transfer.lease import PullLease, PullLeaseTable, ReleaseReason
from kv_transfer.messages import Notification, PushDestination, StageManifest, TransferOutcome
from kv_transfer.plan import PageMap, last_token_blocks
from kv_transfer.prepared import prepared_fits, start_prepared_write
from kv_transfer.sender_config import SenderConfig
from kv_transfer.transfer import NixlTransfer, drive, start_transfer


@dataclass
class _Push:
    dest: PushDestination
    src_pages: PageMap
    num_tokens: int
    started: float
    deadline: float
    host_ok: bool
    start: int  # first token to WRITE
    layers: tuple[int, int]  # global layers [lo, hi) it WRITEs
    transfer: NixlTransfer | None = None
    part: int = -1  # a streamed range's id (``stream``), -1 for a request's final push


class KVSender:
    """Ships one stage's layers. Owns no blocks: the stage pins them before ``push`` /
    ``lease`` and unpins in ``on_complete`` / ``on_lease_end``."""

    def __init__(
        self,
        agent: KVAgent,
        kv_caches: Sequence[torch.Tensor],
        layer_start: int,
        config: SenderConfig,
        on_complete: Callable[[TransferOutcome], None] | None = None,
        on_lease_end: Callable[[PullLease, ReleaseReason], None] | None = None,
        on_part_end: Callable[[str, int, KVTransferError | None], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        hybrid: HybridPool | None = None,
    ) -> None:
        """``hybrid``: the stage's recurrent layers and their state tensors (a model with
        linear-attention layers); ``kv_caches`` then hold its attention layers only."""
        self.agent = agent
        self.config = config
        self.kv_caches = list(kv_caches)
        self.layout = agent.register_kv(layer_start, self.kv_caches, hybrid)
        self._on_complete = on_complete or (lambda outcome: None)
        self._clock = clock
        self.leases = PullLeaseTable(
            config.lease_ttl_s,
            on_lease_end or (lambda lease, reason: None),
            clock,
            id_prefix=f"{agent.name}-lease",
        )
        self._on_part_end = on_part_end or (lambda request_id, part, error: None)
        self._pushes: dict[str, _Push] = {}
        self._parts: dict[int, _Push] = {}  # streamed ranges in flight, by part id
        self._part_ids = itertools.count()
        self._posted: dict[str, tuple[str, str]] = {}  # request -> (endpoint, transfer id)
        self._broken: set[str] = set()  # requests a streamed range of which failed
        self._dst_pages: tuple[PushDestination, object, PageMap] | None = None  # the last one
        self._peers: dict[str, PeerInfo] = {}
        self._host_ok: dict[str, bool] = {}  # endpoint -> allowed by CIDR (else: by name)
        self._handshakes: dict[str, Future[PeerInfo]] = {}
        self._executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-handshake")
        self.ignored_notifications = 0
        self.writes_posted = 0  # WRITEs posted so far, ranges and final pushes (observability)
        self.prepared_posted = 0  # of those, from prepared descriptor lists
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

    @property
    def parts_inflight(self) -> int:
        return len(self._parts)

    # ----------------------------------------------------------------- push mode
    def push(
        self,
        dest: PushDestination,
        block_ids: Sequence[int],
        num_tokens: int,
        start: int | None = None,
        first_layer: int | None = None,
    ) -> None:
        """Start writing this stage's layers of tokens ``[start, num_tokens)`` (``start``:
        default ``dest.skip_tokens``; after ``stream`` ranges, where they stopped), from
        global layer ``first_layer`` on (default: all; after layer-group ranges, the rest).

        ``block_ids`` is the request's block table on this stage (tokens from 0). Raises
        InvalidTransferRequest / DestinationNotAllowed at once for bad input; everything
        that happens later (unreachable, timeout, peer death) arrives as an outcome.
        """
        if dest.request_id in self._pushes:
            raise InvalidTransferRequest(f"request {dest.request_id} is already being shipped")
        if dest.num_tokens != num_tokens:
            raise InvalidTransferRequest(
                f"decode expects a {dest.num_tokens}-token prompt, this one has {num_tokens}"
            )
        lo = self.layout.layer_start if first_layer is None else first_layer
        start = dest.skip_tokens if start is None else start
        push = self._new_push(dest, block_ids, start, layers=(lo, self.layout.layer_end))
        self._pushes[dest.request_id] = push
        self._ensure_handshake(dest.endpoint)
        # its ranges still in flight (the last layer group, usually) land now, so the poll
        # that follows posts the push instead of the one a poll interval later
        mine = [p.transfer for p in self._parts.values() if p.dest.request_id == dest.request_id]
        drive(*[t for t in mine if t is not None])

    def stream(
        self,
        dest: PushDestination,
        block_ids: Sequence[int],
        start: int,
        end: int,
        layers: tuple[int, int] | None = None,
    ) -> int:
        """WRITE tokens ``[start, end)`` of global layers ``layers`` (default: all of the
        stage's) of a request whose final ``push`` comes later; the range's end is reported
        once through ``on_part_end(request_id, part_id, error)``. Returns the part id."""
        if dest.request_id in self._pushes:
            raise InvalidTransferRequest(f"request {dest.request_id} is already being shipped")
        if end > dest.num_tokens:
            raise InvalidTransferRequest(f"tokens to {end} past the {dest.num_tokens}-token prompt")
        layers = layers or (self.layout.layer_start, self.layout.layer_end)
        push = self._new_push(dest, block_ids, start, end, next(self._part_ids), layers)
        self._parts[push.part] = push
        self._ensure_handshake(dest.endpoint)
        return push.part

    def posted(self, part_id: int) -> bool:
        """True once streamed range ``part_id``'s WRITE is posted, or when it is over."""
        part = self._parts.get(part_id)
        return part is None or part.transfer is not None

    def withdraw(self, part_id: int) -> bool:
        """Take back streamed range ``part_id`` if its WRITE is not posted yet (it was handed
        over since the last ``poll``): it is forgotten, without ``on_part_end``. False when
        it is posted or over. The caller's final ``push`` then covers its tokens / layers."""
        part = self._parts.get(part_id)
        if part is None or part.transfer is not None:
            return False
        del self._parts[part_id]
        return True

    def _new_push(
        self,
        dest: PushDestination,
        block_ids: Sequence[int],
        start: int,
        end: int | None = None,
        part: int = -1,
        layers: tuple[int, int] = (0, 0),
    ) -> _Push:
        num_tokens = dest.num_tokens if end is None else end
        lo, hi = layers
        if not self.layout.layer_start <= lo < hi <= self.layout.layer_end:
            raise InvalidTransferRequest(
                f"layers [{lo}, {hi}) are not a non-empty part of this stage's "
                f"[{self.layout.layer_start}, {self.layout.layer_end})"
            )
        if not dest.skip_tokens <= start <= num_tokens:
            raise InvalidTransferRequest(
                f"cannot WRITE tokens [{start}, {num_tokens}) to decode, which holds the "
                f"first {dest.skip_tokens} already"
            )
        self.layout.check_block_ids(block_ids)
        src_pages = PageMap(tuple(block_ids), self.layout.block_size)
        src_pages.check_range(0, num_tokens, "source")
        host_ok = self._host_ok.get(dest.endpoint)
        if host_ok is None:  # resolve once per endpoint, not per request
            host_ok = self.config.allow.check_host(split_endpoint(dest.endpoint)[0])
            self._host_ok[dest.endpoint] = host_ok
        now = self._clock()
        deadline = now + self.config.transfer_timeout_s
        return _Push(dest, src_pages, num_tokens, now, deadline, host_ok, start, layers, part=part)

    def _ensure_handshake(self, endpoint: str) -> None:
        """Fetch the peer's metadata in the background unless it is known or on its way."""
        if endpoint not in self._peers and endpoint not in self._handshakes:
            self._handshakes[endpoint] = self._executor.submit(
                fetch_peer, endpoint, self.config.handshake_timeout_s
            )

    def cancel(self, request_id: str) -> bool:
        """Abort a push and its streamed ranges (the request was aborted); no outcome and no
        ``on_part_end`` is reported. Decode hears "fail" if any of its WRITEs was posted."""
        push = self._pushes.pop(request_id, None)
        self._broken.discard(request_id)
        parts = [p for p in self._parts.values() if p.dest.request_id == request_id]
        for p in parts:
            del self._parts[p.part]
        for p in [push, *parts]:
            if p is not None and p.transfer is not None:
                p.transfer.abort()
        self._notify_fail(request_id)
        return push is not None or bool(parts)

    def _notify_fail(self, request_id: str) -> None:
        posted = self._posted.pop(request_id, None)
        peer = self._peers.get(posted[0]) if posted is not None else None
        if posted is None or peer is None:
            return
        note = Notification("fail", posted[1], self.config.stage, self.config.num_stages)
        try:
            self.agent.nixl.send_notif(peer.agent_name, note.encode())
        except Exception:  # noqa: BLE001 - best effort: decode's deadline still ends it
            self._peers.pop(posted[0], None)

    def poll(self) -> list[TransferOutcome]:
        """Advance everything; returns (and reports via on_complete) the pushes that ended."""
        outcomes: list[TransferOutcome] = []
        self._finish_handshakes(outcomes)
        now = self._clock()
        # ranges that landed are seen before ``_post_ready``: a final push waiting on them
        # goes in this same poll, not one poll interval later; their ``on_part_end`` (the
        # stage gives their blocks back) runs after it, off the final push's way
        landed: list[_Push] = []
        for part in list(self._parts.values()):
            error: KVTransferError | None = None
            try:
                if part.transfer is not None and part.transfer.check():
                    del self._parts[part.part]
                    landed.append(part)
                    continue
            except KVTransferError as exc:
                error = exc
            if error is None and now >= part.deadline:
                error = TransferTimeout(f"a streamed WRITE to {part.dest.endpoint} timed out")
            if error is not None:
                self._end_part(part, error)
        self._post_ready(outcomes)
        for part in landed:
            self._on_part_end(part.dest.request_id, part.part, None)
        for request_id, push in list(self._pushes.items()):
            error = None
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
            try:
                peer = future.result()
                self.agent.load_remote(peer.agent_name, peer.metadata)
                self._peers[endpoint] = peer
            except KVTransferError as exc:
                for part in [p for p in self._parts.values() if p.dest.endpoint == endpoint]:
                    self._end_part(part, exc)
                for push in [p for p in self._pushes.values() if p.dest.endpoint == endpoint]:
                    self._end(push.dest.request_id, exc, outcomes)

    def _post_ready(self, outcomes: list[TransferOutcome]) -> None:
        """Post every WRITE whose peer is known; a final push only once its request's
        streamed ranges all landed (its "done" must come after their data)."""
        streaming = {p.dest.request_id for p in self._parts.values()}
        for push in [*self._parts.values(), *self._pushes.values()]:
            if push.transfer is not None or (push.part < 0 and push.dest.request_id in streaming):
                continue  # running, or a final push waiting for its streamed ranges to land
            peer = self._peers.get(push.dest.endpoint)
            if peer is None:  # its peer was dropped after another push to it failed
                self._ensure_handshake(push.dest.endpoint)
                continue
            self._start(push, peer, outcomes)
            if push.part >= 0 and push.transfer is not None and push.transfer.done:
                self._end_part(push, None)  # nothing to move: ends now
            elif push.part < 0 and push.transfer is not None:
                drive(push.transfer)

    def _start(self, push: _Push, peer: PeerInfo, outcomes: list[TransferOutcome]) -> None:
        request_id = push.dest.request_id
        if push.part < 0 and request_id in self._broken:
            self._end(
                request_id, TransferFailed(f"a streamed WRITE of {request_id} failed"), outcomes
            )
            return
        final, (lo, hi) = push.part < 0, push.layers
        first = lo - self.layout.layer_start
        note = Notification(
            "done" if final else "part",
            push.dest.transfer_id or request_id,
            self.config.stage,
            self.config.num_stages,
            self.layout.layer_start if final else lo,  # "done": all of the stage's layers
            self.layout.layer_end if final else hi,
            end_token=0 if final else push.num_tokens,
        )
        try:
            self.config.allow.check_agent(push.host_ok, peer.agent_name)
            dst_pages = self._pages_at(push.dest, peer)
            end, pages = push.num_tokens, (push.src_pages, dst_pages)
            if self.config.prepared_writes and prepared_fits(
                self.layout, peer.layout, push.layers, *pages, push.start, end
            ):
                push.transfer = start_prepared_write(
                    self.agent, peer.agent_name, note.encode(), local_layout=self.layout,
                    layers=push.layers, remote_layout=peer.layout, src=pages[0], dst=pages[1],
                    start=push.start, end=end,
                )  # fmt: skip
                self.prepared_posted += 1
            else:
                push.transfer = start_transfer(
                    self.agent, "WRITE", peer.agent_name, note.encode(),
                    local_layers=self.kv_caches[first : first + hi - lo],
                    local_layout=self.layout.layer_slice(lo, hi), local_pages=pages[0],
                    remote_layout=peer.layout, remote_pages=pages[1], start=push.start, end=end,
                    state_slots=self._final_state_slots(push, dst_pages),
                    state_layout=self.layout,  # every recurrent layer's state (layer groups)
                )  # fmt: skip
            if push.num_tokens > push.start:
                self._posted[request_id] = (push.dest.endpoint, note.transfer_id)
                self.writes_posted += 1
        except KVTransferError as exc:
            if push.part >= 0:
                self._end_part(push, exc)
            else:
                self._end(request_id, exc, outcomes)

    def _pages_at(self, dest: PushDestination, peer: PeerInfo) -> PageMap:
        """Decode's page map of ``dest``, checked once for a request's ranges in a row."""
        if self._dst_pages is None or self._dst_pages[:2] != (dest, peer.layout):
            peer.layout.check_block_ids(dest.block_ids)
            pages = PageMap(dest.block_ids, peer.layout.block_size, dest.skip_tokens)
            self._dst_pages = (dest, peer.layout, pages)
        return self._dst_pages[2]

    def _final_state_slots(self, push: _Push, dst_pages: PageMap) -> tuple[int, int] | None:
        """A final push from a pool with recurrent layers: (this stage's block, decode's
        block) holding the prompt's last token, whose state slots carry the state after it."""
        if push.part >= 0 or not self.layout.states or push.num_tokens <= push.start:
            return None
        return last_token_blocks(push.src_pages, dst_pages, push.num_tokens)

    def _end_part(self, part: _Push, error: KVTransferError | None) -> None:
        if self._parts.pop(part.part, None) is None:
            return  # cancelled meanwhile
        if error is not None:
            self._broken.add(part.dest.request_id)  # its final push must not leave a gap
            if part.transfer is not None:
                part.transfer.abort()
        self._on_part_end(part.dest.request_id, part.part, error)

    def _end(
        self, request_id: str, error: KVTransferError | None, outcomes: list[TransferOutcome]
    ) -> None:
        push = self._pushes.pop(request_id)
        self._broken.discard(request_id)
        num_bytes = 0
        if error is None:
            self._posted.pop(request_id, None)
        else:
            self._notify_fail(request_id)
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
    def lease(
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
        for part_id, part in self._parts.items():
            if part.part != part_id:
                raise KVInvariantError(f"part table key {part_id} holds part {part.part}")

    def close(self) -> None:
        """Abort pushes (no outcomes), revoke leases, stop the endpoint, deregister."""
        for request_id in {
            p.dest.request_id for p in [*self._pushes.values(), *self._parts.values()]
        }:
            self.cancel(request_id)
        self.leases.revoke_all()
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._server is not None:
            self._server.close()
        self.agent.close()
