"""StageKVShipper: one prefill stage's half of the KV hand-off, push (WRITE) or pull (lease).

The per-stage code both engines share: every stage, in-process (LocalEngine) or in its own
process (the runtime), owns one inside a ``StageShipping`` thread (stage_shipping.py), which
calls ``poll``. Each stage owns its NIXL agent and registers its KV tensors exactly once, at
construction. Per request, a stage: right after the request's last chunk ran there,
completes it with its blocks kept pinned
(``StageAdmission.complete(keep_pinned=True)``), then ``push`` (or ``publish``); its
``take_results()`` reach the leader, which answers the request once all P stages reported
success, or calls ``cancel`` on every stage when one failed.

Block contract: ``push`` / ``publish`` take over ONE reference per block that the caller
keeps pinned for the shipper and give it back exactly once through the
``unpin`` callback: when the WRITE ended (success or failure), when decode released the lease,
when it expired, or on ``cancel`` / ``close``. The callback runs on the thread that called
``poll`` / ``cancel`` / ``close``; the caller decides when the pool sees it.

Streaming (push, ``KVShippingConfig.stream``): while a request still runs, ``stream`` hands
over the blocks of a token range whose KV is final on this stage (one extra reference per
block, the caller's ``pin_for_transfer``); they are WRITten at once, at most
``stream_max_inflight`` ranges per stage in flight (more queue and coalesce; a queue still
waiting at the end rides the final ``push``, and so do ranges the sender has not posted yet),
and each range's references come back once
through ``unpin_streamed``. The final ``push`` then WRITEs only the rest and carries the
"done" notification (kv_transfer/sender.py orders it after the ranges).
The last chunk goes layer group by layer group (``stream`` with ``layer_end``): while its
forward still runs, each finished group's layers of every token not yet handed over (the
partial last block included: it is final) are WRITten; those ranges start only once every
all-layer range is posted, so the final push is one rectangle: the layers no group
covered, from where the all-layer ranges stopped. A failed range fails the request at once
(its result is the error; in-flight ranges are aborted and decode hears "fail"); ``cancel``
stops the stream, and later ``stream`` / ``push`` calls of that request id are dropped
(their blocks given back, no result) until ``revive`` (the id is admitted again).

Threading: not thread-safe; one thread makes every call (NIXL is created without a listener).
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from kv_transfer.agent import KVAgent
from kv_transfer.errors import KVInvariantError, KVTransferError
from kv_transfer.lease import PullLease, ReleaseReason
from kv_transfer.messages import PushDestination, TransferOutcome
from kv_transfer.sender import KVSender
from prefill_node.core.block import KVBlock
from prefill_node.engine.types import KVPushDestination, StageKVManifest
from prefill_node.kv_shipping.config import KVShippingConfig
from prefill_node.model.latent_cache import StageCache
from prefill_node.wire.kv_handoff import (
    engine_manifest,
    hybrid_pool,
    stage_push_destination,
)


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


class _Part(NamedTuple):
    """A streamed range handed to the sender: whose, its references, its first token and
    its layers (None: all of the stage's)."""

    request_id: str
    blocks: list[KVBlock]
    start: int
    layers: tuple[int, int] | None


class KVHeld(NamedTuple):
    """What a stage's shipper holds: WRITEs in flight, live pull leases, and their blocks."""

    pushes: int = 0
    leases: int = 0
    blocks: int = 0


@dataclass
class _Held:
    blocks: list[KVBlock]
    manifest: StageKVManifest
    started: float
    streamed: list[KVBlock] = field(default_factory=list)  # queued range refs it carries


@dataclass
class _Stream:
    """A request streaming on this stage: where to, the latest block table, the all-layer
    range handed over but not yet posted (``queued``: [posted_to, ready_to) and its
    references), and the last chunk's layer groups (tokens [ready_to, num_tokens) of
    layers [first layer, ``layers_ready``), posted up to ``layers_posted``)."""

    wire: PushDestination
    layers_posted: int
    block_ids: tuple[int, ...] = ()
    posted_to: int = 0
    ready_to: int = 0
    queued: list[KVBlock] = field(default_factory=list)
    layers_ready: int = -1  # -1: no layer group handed over yet
    group_queued: list[KVBlock] = field(default_factory=list)
    failed: bool = False  # a range failed; its result (the error) is reported
    stopped: bool = False  # its other ranges aborted, decode told


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
        unpin_streamed: Callable[[Sequence[KVBlock]], None] | None = None,
    ) -> None:
        self.stage = stage
        self.config = config
        self._unpin = unpin
        self._unpin_streamed = unpin_streamed or unpin
        self._block_size = kv.block_size
        self._layers = (kv.layer_range.start, kv.layer_range.end)
        self._entry_parts = kv.entry_parts
        name = agent_name or f"{config.agent_prefix}-stage{stage}-{uuid.uuid4().hex[:8]}"
        self.sender = KVSender(
            KVAgent(name, progress=config.progress),
            kv.tensors,
            kv.layer_range.start,
            config.sender_config(stage, num_stages),
            on_complete=self._on_push_end,
            on_lease_end=self._on_lease_end,
            on_part_end=self._on_part_end,
            hybrid=hybrid_pool(kv),  # a hybrid model's recurrent layers ship their state
        )
        self._pushing: dict[str, _Held] = {}  # request id -> blocks of an in-flight WRITE
        self._leased: dict[str, tuple[str, list[KVBlock]]] = {}  # lease id -> (request, blocks)
        self._results: dict[str, StageShipResult] = {}
        self._streams: dict[str, _Stream] = {}
        self._parts: dict[int, _Part] = {}  # streamed ranges handed to the sender, by id
        self._dead: OrderedDict[str, None] = OrderedDict()  # cancelled ids (capped)
        self.parts_posted = 0  # streamed WRITEs posted so far (observability, tests)

    @property
    def agent_name(self) -> str:
        return self.sender.agent.name

    @property
    def busy(self) -> bool:
        """A WRITE or a lease is live: poll often (transfers, heartbeats, releases)."""
        return bool(self._pushing or self._leased or self._parts)

    @property
    def held_blocks(self) -> int:
        """Block references this shipper holds now (in-flight WRITEs and live leases)."""
        pushing = sum(len(h.blocks) + len(h.streamed) for h in self._pushing.values())
        streaming = sum(len(p.blocks) for p in self._parts.values())
        queued = sum(len(st.queued) + len(st.group_queued) for st in self._streams.values())
        return pushing + streaming + queued + sum(len(b) for _, b in self._leased.values())

    @property
    def held(self) -> KVHeld:
        """What this shipper holds now: WRITEs in flight, live leases, their blocks."""
        return KVHeld(len(self._pushing), len(self._leased), self.held_blocks)

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
        if self.config.debug_post_before_push and request_id in self._streams:
            self._post_streamed(request_id, self._streams[request_id])
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            held.streamed = stream.queued + stream.group_queued
            stream.queued, stream.group_queued = [], []
        if request_id in self._dead or (stream is not None and stream.failed):
            self._unpin(held.blocks)  # cancelled, or failed and reported already
            self._give_back_streamed(held.streamed)
            if stream is not None and not stream.stopped:  # failed since the last poll
                self.sender.cancel(request_id)
                self._drop_parts(request_id)
            return
        if stream is not None:
            held.streamed += self._withdraw_unposted(request_id, stream)
        try:
            if stream is None:
                wire = stage_push_destination(
                    dest, request_id, self.stage, manifest.num_tokens, self._block_size
                )
                start, first_layer = None, None
            else:  # the layer groups post only after every all-layer range: one rectangle
                wire, start, first_layer = stream.wire, stream.posted_to, stream.layers_posted
            self.sender.push(wire, manifest.block_ids, manifest.num_tokens, start, first_layer)
        except (KVTransferError, ValueError) as exc:
            self._unpin(held.blocks)
            self._give_back_streamed(held.streamed)
            self.sender.cancel(request_id)  # its streamed ranges, if any
            self._drop_parts(request_id)
            self._results[request_id] = StageShipResult(request_id, self.stage, None, exc)
            return
        self._pushing[request_id] = held

    def stream(
        self,
        request_id: str,
        blocks: Sequence[KVBlock],
        block_ids: tuple[int, ...],
        dest: KVPushDestination,
        num_tokens: int,
        start: int,
        end: int,
        layer_end: int | None = None,
    ) -> None:
        """Streaming: tokens ``[start, end)`` of the ``num_tokens``-token prompt are final
        here; ``blocks`` hold them (one reference each, back through ``unpin_streamed``);
        ``block_ids``: the request's block table so far. Ranges come in token order.
        ``layer_end`` (the last chunk, ``end == num_tokens``): only the layers below global
        layer ``layer_end`` are final yet (groups come in layer order; the stage's last
        group is the final push's)."""
        blocks = list(blocks)
        stream = self._streams.get(request_id)
        if request_id in self._dead or (stream is not None and stream.failed):
            self._give_back_streamed(blocks)
            return
        if stream is None:
            try:
                wire = stage_push_destination(
                    dest, request_id, self.stage, num_tokens, self._block_size
                )
            except (KVTransferError, ValueError) as exc:
                self._give_back_streamed(blocks)
                wire = PushDestination(request_id, "", (), 0)
                self._streams[request_id] = _Stream(wire, 0, failed=True, stopped=True)
                self._results[request_id] = StageShipResult(request_id, self.stage, None, exc)
                return
            skip = wire.skip_tokens
            stream = _Stream(wire, self._layers[0], posted_to=skip, ready_to=skip)
            self._streams[request_id] = stream
        stream.block_ids = block_ids
        if end <= stream.ready_to:  # all in decode's cached prefix
            self._give_back_streamed(blocks)
            return
        if start > stream.ready_to or (layer_end is None and stream.layers_ready >= 0):
            raise KVInvariantError(
                f"{request_id}: streamed ranges skip [{stream.ready_to}, {start}), or an "
                "all-layer range comes after a layer group"
            )
        if layer_end is None:
            stream.queued.extend(blocks)
            stream.ready_to = end
        else:
            after = max(stream.layers_posted, stream.layers_ready)
            if end != num_tokens or not after < layer_end < self._layers[1]:
                raise KVInvariantError(
                    f"{request_id}: layer groups must end the prompt, come in layer order and "
                    f"leave the stage's last layers [{layer_end}, {self._layers[1]}) to the "
                    "final push"
                )
            stream.group_queued.extend(blocks)
            stream.layers_ready = layer_end
        self._post_queued()

    def _post_queued(self) -> None:
        """Post queued ranges, oldest request first, while the in-flight bound allows: a
        request's all-layer range first, its layer groups once that one is posted."""
        for request_id, stream in self._streams.items():
            while len(self._parts) < self.config.stream_max_inflight and not stream.failed:
                if stream.posted_to < stream.ready_to:
                    end, layers, refs = stream.ready_to, None, stream.queued
                elif stream.layers_posted < stream.layers_ready:
                    end = stream.wire.num_tokens
                    layers, refs = (stream.layers_posted, stream.layers_ready), stream.group_queued
                else:
                    break
                try:
                    part = self.sender.stream(
                        stream.wire, stream.block_ids, stream.posted_to, end, layers
                    )
                except KVTransferError as exc:
                    self._fail_stream(request_id, stream, exc)
                    break
                self._parts[part] = _Part(request_id, refs, stream.posted_to, layers)
                if layers is None:
                    stream.queued, stream.posted_to = [], stream.ready_to
                else:
                    stream.group_queued, stream.layers_posted = [], stream.layers_ready
                self.parts_posted += 1
            if len(self._parts) >= self.config.stream_max_inflight:
                return

    def _post_streamed(self, request_id: str, stream: _Stream) -> None:
        """``debug_post_before_push``: poll until every range of the request handed over so
        far is posted (decode's metadata fetched, an in-flight slot free), its stream
        failed, or ``wait_limit_s`` passed."""
        deadline = time.monotonic() + self.config.wait_limit_s
        while not stream.failed and time.monotonic() < deadline:
            self.poll()
            queued = (
                stream.posted_to < stream.ready_to or stream.layers_posted < stream.layers_ready
            )
            mine = [p for p, entry in self._parts.items() if entry.request_id == request_id]
            if not queued and all(self.sender.posted(p) for p in mine):
                return
            time.sleep(0.0005)

    def _withdraw_unposted(self, request_id: str, stream: _Stream) -> list[KVBlock]:
        """At the final push: the request's ranges the sender has not posted yet (handed
        over since its last poll, e.g. the layer group streamed just before the forward
        ended) ride the final push instead of going first and making it wait for them to
        land. Newest first, so what is left stays one rectangle: a group widens its layers
        down, an all-layer range (once no group is left) moves its first token back.
        Returns their references (the final push now holds them)."""
        refs: list[KVBlock] = []
        mine = sorted((p for p, e in self._parts.items() if e.request_id == request_id))
        for part in reversed(mine):
            if not self.sender.withdraw(part):
                break  # posted: the ones before it are too (the sender posts in order)
            entry = self._parts.pop(part)
            refs += entry.blocks
            if entry.layers is not None:
                stream.layers_posted = entry.layers[0]
            else:
                stream.posted_to = entry.start
            self.parts_posted -= 1
        return refs

    def _on_part_end(self, request_id: str, part: int, error: KVTransferError | None) -> None:
        self._give_back_streamed(self._parts.pop(part).blocks)
        stream = self._streams.get(request_id)
        if error is not None and stream is not None and not stream.failed:
            self._fail_stream(request_id, stream, error)
        # after the final ``push`` (stream popped) the sender fails that push instead

    def _fail_stream(self, request_id: str, stream: _Stream, error: KVTransferError) -> None:
        """A streamed range failed: report the error now; the rest is stopped in ``poll``."""
        stream.failed = True
        self._give_back_streamed(stream.queued + stream.group_queued)
        stream.queued, stream.group_queued = [], []
        self._results[request_id] = StageShipResult(request_id, self.stage, None, error)

    def _drop_parts(self, request_id: str) -> None:
        """Give back the references of ``request_id``'s ranges the sender dropped."""
        for part, entry in list(self._parts.items()):
            if entry.request_id == request_id:
                del self._parts[part]
                self._give_back_streamed(entry.blocks)

    def _give_back_streamed(self, blocks: Sequence[KVBlock]) -> None:
        if blocks:
            self._unpin_streamed(blocks)

    def revive(self, request_id: str) -> None:
        """``request_id`` was admitted again: its new stream and push are live."""
        self._dead.pop(request_id, None)

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
        """Advance WRITEs, serve decode's heartbeats / releases, expire leases; stop failed
        streams (abort their other ranges, tell decode) and post queued ranges."""
        self.sender.poll()
        for request_id, stream in self._streams.items():
            if stream.failed and not stream.stopped:
                stream.stopped = True
                self.sender.cancel(request_id)
                self._drop_parts(request_id)
        self._post_queued()

    def take_results(self) -> list[StageShipResult]:
        """Results known since the last call (each request's exactly once), then forgotten."""
        results, self._results = list(self._results.values()), {}
        return results

    def cancel(self, request_id: str) -> None:
        """Give up the request here: abort its WRITE or revoke its lease, unpin its blocks."""
        self._results.pop(request_id, None)
        self._dead[request_id] = None
        while len(self._dead) > 4096:
            self._dead.popitem(last=False)
        held = self._pushing.pop(request_id, None)
        stream = self._streams.pop(request_id, None)
        self.sender.cancel(request_id)  # WRITEs and streamed ranges; decode hears "fail"
        self._drop_parts(request_id)
        if stream is not None:
            self._give_back_streamed(stream.queued + stream.group_queued)
        if held is not None:
            self._unpin(held.blocks)
            self._give_back_streamed(held.streamed)
        for lease_id, (owner, _) in list(self._leased.items()):
            if owner == request_id:
                self.sender.leases.release(lease_id, ReleaseReason.REVOKED)

    def _on_push_end(self, outcome: TransferOutcome) -> None:
        held = self._pushing.pop(outcome.request_id, None)
        if held is None:
            raise KVInvariantError(f"push outcome for unknown request {outcome.request_id}")
        self._unpin(held.blocks)
        self._give_back_streamed(held.streamed)
        manifest = replace(held.manifest, agent_name=self.agent_name, pushed=outcome.ok)
        self._results[outcome.request_id] = StageShipResult(
            outcome.request_id,
            self.stage,
            manifest if outcome.ok else None,
            outcome.error,
            outcome.num_bytes,
            outcome.seconds,
        )

    def _on_lease_end(self, lease: PullLease, reason: ReleaseReason) -> None:
        entry = self._leased.pop(lease.lease_id, None)
        if entry is None:
            raise KVInvariantError(f"lease {lease.lease_id} ended but holds no blocks here")
        self._unpin(entry[1])

    def check_integrity(self) -> None:
        """Raise KVInvariantError unless the sender's pushes and leases match what is held."""
        self.sender.check_integrity()
        if self.sender.parts_inflight != len(self._parts):
            raise KVInvariantError(
                f"stage {self.stage}: {self.sender.parts_inflight} streamed WRITEs in flight, "
                f"{len(self._parts)} held"
            )
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
        for request_id in {*self._pushing, *self._streams}:
            self.cancel(request_id)
        self.sender.close()  # revokes leases -> _on_lease_end unpins
        self._results.clear()
