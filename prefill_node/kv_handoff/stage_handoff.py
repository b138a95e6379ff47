"""StageKVHandoff: one prefill stage's half of the KV hand-off to decode, over its KVSender.

Two layers: ``kv_transfer.KVSender`` moves bytes over NIXL (WRITEs, leases, notifications);
this object is the stage's hand-off on top of it: which blocks a request hands over and
when, who holds a reference to them, and each request's outcome, reported to the leader.

Per request (push or pull), right after its last chunk ran on this stage, the stage
completes it with its blocks kept pinned (``StageAdmission.complete(keep_pinned=True)``, so
the stage's ``check_integrity`` stays exact) and calls ``ship``: push WRITEs the stage's
layers into decode's blocks and notifies it; pull leases the blocks for decode to READ.

Block contract, through the owner (``HandoffOwner``: the stage's cache, under its own lock):
- a shipped request's pins are given back exactly once, ``owner.release(request_id)``, when
  its WRITE ended (success or failure), its lease was released, expired or was revoked, on
  ``cancel`` or ``close``;
- streaming (push, ``KVHandoffConfig.stream``): before the last chunk, the blocks whose KV
  just became final are pinned once more (``owner.pin_final``) and WRITten at once, at most
  ``stream_max_inflight`` ranges per stage in flight (more queue and coalesce; a queue still
  waiting at the end rides the final push, and so do ranges the sender has not posted
  yet); each range's references come back once through ``owner.release_transfer``,
  independent of the request's own pins, so an abort mid-stream never frees a block a
  WRITE still reads. The final push then WRITEs only the rest and carries the "done"
  notification (kv_transfer/sender.py orders it after the ranges). The last chunk goes
  layer group by layer group from inside its forward (``layer_hook``): each finished
  group's layers of every token not yet handed over (the partial last block included) are
  WRITten; those ranges start only once every all-layer range is posted, so the final push
  is one rectangle: the layers no group covered, from where the all-layer ranges stopped.
  A failed range fails the request at once (its outcome is the error; in-flight ranges
  are aborted and decode hears "fail").

Prefix fetch between pipelines (docs/router.md): on the source, ``lend`` leases cached
blocks a LEND round pinned (``StageAdmission.pin_cached``) for another pipeline's stages to
READ; their transfer pins come back through ``owner.release_transfer`` when the lease is
released, expires or is revoked. On the target, ``fetch`` READs this stage's layers of such
blocks into blocks a FETCH round reserved, and ``release_sources`` ends those leases.

Reused request ids: a request id may come back (a client retry) while this stage still
ships the previous request of that id; admission holds one reservation per id, so the
owner first ``supersede``s it: the old hand-off is disowned (its pins dropped at once
through ``owner.release``, its WRITE / lease cancelled, and the later end of that WRITE
absorbed here instead of releasing anything). ``cancel`` stops a request; later stream and
ship calls of that id are dropped (their references given back, no outcome) until it is
admitted again (``supersede``).

Outcomes: each request's outcome on this stage, exactly once, as a ``HandoffOutcome``,
handed to the ``report_to`` sink as soon as the sender reports it (in batches of what one
poll brought; the runtime sends them to the leader on its reports plane). Outcomes from
before a sink was set wait for it.

Threading: NIXL is not thread-safe, and a stage's LOOP blocks on the data plane between
waves, so the hand-off runs on a thread of its own: it owns the sender (every sender call
happens there), runs what the other threads hand it, and polls every ``poll_interval_s``
while a WRITE or a lease is live (a push must finish and a lease must see decode's
heartbeats while the pipeline is idle). Every public method may be called from any thread.
With ``own_thread=False`` the caller's thread is the hand-off's: calls run at once and the
caller drives ``poll`` (tests that order each step).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from functools import partial
from typing import NamedTuple, Protocol

from kv_transfer.agent import KVAgent
from kv_transfer.errors import (
    InvalidTransferRequest,
    KVInvariantError,
    KVTransferError,
    TransferTimeout,
)
from kv_transfer.fetch import start_fetch, wait_fetch
from kv_transfer.handshake import LeasePeers, split_endpoint
from kv_transfer.lease import PullLease, ReleaseReason
from kv_transfer.messages import PushDestination, StageManifest, TransferOutcome
from kv_transfer.plan import PageMap
from kv_transfer.sender import KVSender
from prefill_node import tracing
from prefill_node.core.block import KVBlock
from prefill_node.core.execution_results import BlockTable
from prefill_node.core.stage_admission import FinalBlocks
from prefill_node.engine.types import KVPullDestination, KVPushDestination, StageKVManifest
from prefill_node.errors import InvalidKVDestinationError, InvariantError
from prefill_node.kv_handoff.command_loop import CommandLoop
from prefill_node.kv_handoff.config import KVHandoffConfig
from prefill_node.model.latent_cache import StageCache
from prefill_node.model.partition import LayerRange
from prefill_node.wire.kv_handoff import engine_manifest, hybrid_pool, stage_push_destination

log = logging.getLogger(__name__)
Destination = KVPushDestination | KVPullDestination
# a prefix fetch's READs land at least this long before the source's leases expire (clock
# skew between hosts, the release's own trip)
LEASE_MARGIN_S = 0.5


@dataclass(frozen=True)
class HandoffOutcome:
    """One stage's outcome of one request's KV hand-off (reported to the leader as it happens).

    Success: ``manifest`` (push: ``pushed=True``, the WRITE landed and decode was notified;
    pull: the lease manifest). Failure: ``manifest`` is None, ``error`` is the cause's type
    and message, ``invalid_destination`` when the destination itself was rejected (caller's
    fault, INVALID_ARGUMENT) rather than unreachable or slow (UNAVAILABLE).
    """

    request_id: str
    stage: int
    manifest: StageKVManifest | None
    error: str = ""
    invalid_destination: bool = False

    @property
    def ok(self) -> bool:
        return self.manifest is not None


class KVHeld(NamedTuple):
    """What a stage's hand-off holds: WRITEs in flight, live pull leases, and their blocks."""

    pushes: int = 0
    leases: int = 0
    blocks: int = 0


class HandoffOwner(Protocol):
    """The stage's cache as the hand-off sees it; each call takes the owner's own lock."""

    def pin_final(
        self, request_id: str, start: int, end: int, *, to_prompt_end: bool = False
    ) -> FinalBlocks | None:
        """``StageAdmission.pin_final``."""
        ...

    def release(self, request_id: str) -> None:
        """Drop the pins a shipped request kept (``StageAdmission.unpin``)."""
        ...

    def release_transfer(self, blocks: Sequence[KVBlock]) -> None:
        """Give back streamed references (``StageAdmission.unpin_transfer``)."""
        ...


class ChunkRange(NamedTuple):
    """A chunk of a wave as the hand-off sees it: tokens ``[start, end)`` of a request,
    its KV destination (None: no hand-off), whether it is the request's last."""

    request_id: str
    start: int
    end: int
    destination: Destination | None
    is_last: bool


class _Part(NamedTuple):
    """A streamed range handed to the sender: whose, its references, its first token and
    its layers (None: all of the stage's)."""

    request_id: str
    blocks: list[KVBlock]
    start: int
    layers: tuple[int, int] | None


@dataclass
class _Held:
    blocks: list[KVBlock]
    manifest: StageKVManifest
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
    failed: bool = False  # a range failed; its outcome (the error) is reported
    stopped: bool = False  # its other ranges aborted, decode told


def _take_one(counts: Counter[str], key: str) -> bool:
    """Take one off ``counts[key]`` (forgetting the key at 0); False when it had none."""
    if counts[key] <= 0:
        return False
    counts[key] -= 1
    if not counts[key]:
        del counts[key]
    return True


def _after(ready: Callable[[], object], work: Callable[[], object]) -> None:
    try:
        ready()
    finally:  # the references go to the hand-off either way (a failed forward cancels)
        work()


class StageKVHandoff:
    """Stage ``stage``'s hand-off of its layers (the tensors of ``kv``) to decode."""

    def __init__(
        self,
        stage: int,
        num_stages: int,
        kv: StageCache,
        config: KVHandoffConfig,
        owner: HandoffOwner,
        *,
        agent_name: str | None = None,
        own_thread: bool = True,
        poll_interval_s: float = 0.0005,
        idle_interval_s: float = 1.0,
    ) -> None:
        """Creates the NIXL agent and registers ``kv``'s tensors, on the hand-off's thread
        (waits for it)."""
        self.stage = stage
        self.config = config
        self._owner = owner
        self._kv = kv
        self._num_stages = num_stages
        self._agent_name = agent_name
        # -- the hand-off thread's state ---------------------------------------------------
        self.sender: KVSender | None = None
        self._sources: LeasePeers | None = None  # other pipelines' stages it fetched from
        self._pushing: dict[str, _Held] = {}  # request id -> blocks of an in-flight WRITE
        self._leased: dict[str, tuple[str, list[KVBlock]]] = {}  # lease id -> (request, blocks)
        # lease id -> (key, cached blocks another pipeline READs): a prefix fetch's source
        # side, transfer pins
        self._lent: dict[str, tuple[str, list[KVBlock]]] = {}
        self._outcomes: dict[str, HandoffOutcome] = {}  # not yet reported
        self._streams: dict[str, _Stream] = {}
        self._parts: dict[int, _Part] = {}  # streamed ranges handed to the sender, by id
        self._dead: OrderedDict[str, None] = OrderedDict()  # cancelled ids (capped)
        self._spans: dict[str, object] = {}  # traced hand-offs in flight
        self.parts_posted = 0  # streamed WRITEs posted so far (observability, tests)
        # -- any thread --------------------------------------------------------------------
        self._report: Callable[[tuple[HandoffOutcome, ...]], object] | None = None
        # shipped requests whose pins this hand-off owns (count per id), and how many of
        # an id's pin ends to absorb (disowned requests); guarded by _pin_lock
        self._pin_lock = threading.Lock()
        self._owned: Counter[str] = Counter()
        self._absorb: Counter[str] = Counter()
        self._loop: CommandLoop | None = None
        self._thread: threading.Thread | None = None
        if not own_thread:
            self._build()
            return
        self._loop = CommandLoop(f"stage {stage} KV hand-off", poll_interval_s, idle_interval_s)
        self._thread = threading.Thread(target=self._run, name=f"stage{stage}-kv", daemon=True)
        self._thread.start()
        self._loop.call(self._build).result(timeout=60)

    @property
    def agent_name(self) -> str:
        return self._sender().agent.name

    @property
    def busy(self) -> bool:
        """A WRITE or a lease is live: poll often (transfers, heartbeats, releases)."""
        return bool(self._pushing or self._leased or self._lent or self._parts)

    @property
    def held_blocks(self) -> int:
        """Block references held now (in-flight WRITEs, queued ranges, live leases)."""
        pushing = sum(len(h.blocks) + len(h.streamed) for h in self._pushing.values())
        streaming = sum(len(p.blocks) for p in self._parts.values())
        queued = sum(len(st.queued) + len(st.group_queued) for st in self._streams.values())
        lent = sum(len(b) for _, b in self._lent.values())
        return pushing + streaming + queued + lent + sum(len(b) for _, b in self._leased.values())

    # -- any thread ----------------------------------------------------------------------------
    def ship(
        self,
        request_id: str,
        blocks: Sequence[KVBlock],
        manifest: StageKVManifest,
        destination: Destination,
        traceparent: str = "",
    ) -> None:
        """Start the hand-off of a request completed with ``keep_pinned`` (``manifest``:
        this stage's block table and token count); returns at once. A bad destination
        does not raise: the outcome carries the error. With ``traceparent`` (tracing on),
        the hand-off is a span until its outcome."""
        with self._pin_lock:  # at once, so that a ``supersede`` right after finds it
            self._owned[request_id] += 1
        span = None
        if traceparent and tracing.enabled():
            mode = "pull" if isinstance(destination, KVPullDestination) else "push"
            span = tracing.start_span("wavepp.stage.kv_send", traceparent, {
                tracing.REQUEST_ID: request_id, tracing.STAGE: self.stage,
                "wavepp.kv_mode": mode, "wavepp.kv_blocks": len(blocks)})  # fmt: skip
        self._call(partial(self._start, request_id, list(blocks), manifest, destination, span))

    def stream(
        self,
        request_id: str,
        start: int,
        end: int,
        destination: KVPushDestination,
        layer_end: int | None = None,
        ready: Callable[[], object] | None = None,
    ) -> None:
        """Tokens ``[start, end)`` of the request just ran here: pin the blocks that became
        final (``owner.pin_final``) and WRITE them; returns at once. ``layer_end`` (the
        last chunk, during its forward): only the layers below it are final yet, for every
        token to the prompt's end. ``ready`` runs first, on the hand-off's thread (on CUDA:
        waits for the kernels that wrote the KV). A no-op when streaming is off."""
        if not self.config.stream:
            return
        final = self._owner.pin_final(request_id, start, end, to_prompt_end=layer_end is not None)
        if final is None:
            return
        work = partial(self._stream, request_id, final, destination, layer_end)
        self._call(work if ready is None else partial(_after, ready, work))

    def stream_chunks(
        self, chunks: Iterable[ChunkRange], before: Callable[[], object] | None = None
    ) -> None:
        """After a wave's forward: stream what each non-last chunk of a push request made
        final (decode's cached prefix is skipped). ``before`` runs once, first, when there
        is any (on CUDA: waits for the forward's kernels)."""
        if not self.config.stream:
            return
        todo = [c for c in chunks if not c.is_last and isinstance(c.destination, KVPushDestination)]
        if todo and before is not None:
            before()
        for chunk in todo:
            self.stream(chunk.request_id, chunk.start, chunk.end, chunk.destination)

    def layer_hook(
        self,
        chunks: Iterable[ChunkRange],
        layers: LayerRange,
        fence: Callable[[], Callable[[], object] | None] | None = None,
    ) -> Callable[[int], None] | None:
        """The forward's per-layer hook streaming the last chunks of push requests layer
        group by layer group (``KVHandoffConfig.layer_group_ends`` of this stage's
        ``layers``; a wave holds at most one chunk per request, so a last chunk's earlier
        chunks were streamed already). None when there are none or the stage's layers
        form one group. ``fence``, called at each group's end on the forward's thread,
        returns what the WRITE waits for (on CUDA: that group's kernels). A stage with
        recurrent layers streams their groups' paged layers alike; the final push carries
        every recurrent layer's state slot."""
        tails = [c for c in chunks if c.is_last and isinstance(c.destination, KVPushDestination)]
        ends = self.config.layer_group_ends(layers.start, layers.end)
        if not tails or not ends:
            return None

        def after_layer(layer: int) -> None:
            if layer + 1 not in ends:
                return
            ready = fence() if fence is not None else None
            for c in tails:
                self.stream(c.request_id, c.start, c.end, c.destination, layer + 1, ready)

        return after_layer

    def fetch(
        self, manifests: Sequence[StageManifest], table: BlockTable, lease_expiry_unix_s: float
    ) -> Future:
        """READ this stage's layers of tokens ``[table.start, table.end)`` of a prefix another
        pipeline's stages hold under pull leases (``manifests``, one per stage there) into
        ``table``'s blocks. Runs on the hand-off thread, which it holds until every READ
        landed or was aborted (at most ``transfer_timeout_s``), so no READ is left writing
        into the blocks once the future is done. Every READ must land ``LEASE_MARGIN_S``
        before the leases expire (wall clock, ``lease_expiry_unix_s``): after that the
        source may reuse the blocks. Result: the bytes read; a KVTransferError (e.g.
        DestinationNotAllowed for a source outside ``allow``, TransferTimeout) when they
        did not land in time. The leases stay held: ``release_sources`` once every stage is
        done."""
        return self._call(partial(self._fetch, tuple(manifests), table, lease_expiry_unix_s))

    def lend(self, key: str, held: FinalBlocks, lease_ttl_s: float | None = None) -> Future:
        """Lease cached blocks (pinned by ``StageAdmission.pin_cached``: ``held``) for
        another pipeline's stages to READ (a prefix fetch's source side). The future's
        result: the lease manifest; the pins come back through the owner's
        ``release_transfer`` when the lease is released, expires or is revoked (``cancel``
        of ``key``), or at once when the lease cannot be granted (the future raises)."""
        return self._call(partial(self._lend, key, held, lease_ttl_s))

    def release_sources(self, manifests: Sequence[StageManifest]) -> Future:
        """Release the other pipeline's leases of a fetch (best effort: an unsent release
        ends in the lease's expiry)."""
        return self._call(partial(self._release_sources, tuple(manifests)))

    def cancel(self, request_id: str) -> None:
        """Abort the request's WRITE or revoke its lease here (no-op when none); async."""
        self._call(partial(self._cancel, request_id))

    def supersede(self, request_ids: Iterable[str]) -> None:
        """New requests reuse these ids: each one this stage still ships is disowned (its
        pins dropped at once through ``owner.release``, so admission can reserve the id
        again) and its hand-off cancelled; the ids' new streams and pushes are live."""
        request_ids = tuple(request_ids)
        for request_id in request_ids:
            with self._pin_lock:
                disowned = _take_one(self._owned, request_id)
                if disowned:
                    self._absorb[request_id] += 1
            if disowned:
                self._owner.release(request_id)
                self.cancel(request_id)
        if request_ids:  # after any cancel
            self._call(partial(self._revive, request_ids))

    def report_to(self, sink: Callable[[tuple[HandoffOutcome, ...]], object]) -> None:
        """From now on, hand each batch of outcomes to ``sink`` (on the hand-off's thread;
        it must not block for long)."""
        self._report = sink
        if self._loop is not None:
            self._loop.wake()

    def held(self) -> KVHeld:
        """What this hand-off holds now: WRITEs in flight, live leases, their blocks."""

        def held() -> KVHeld:
            leases = len(self._leased) + len(self._lent)
            return KVHeld(len(self._pushing), leases, self.held_blocks)

        return self._call(held).result(timeout=10)

    def check_integrity(self) -> None:
        """Raise KVInvariantError unless the sender's pushes and leases match what is held."""
        self._call(self._check).result(timeout=10)

    def poll(self) -> None:
        """``own_thread=False`` only: advance WRITEs, serve decode's heartbeats and releases,
        expire leases, post queued ranges, report outcomes."""
        if self._loop is not None:
            raise InvariantError(f"stage {self.stage}: the KV hand-off polls on its own thread")
        self._step()

    def close(self) -> None:
        """Abort WRITEs, revoke leases (releasing their pins), free the agent, stop."""
        if self._loop is None:
            if self.sender is not None:
                self._close()
            return
        if self._thread is None or not self._thread.is_alive():
            return
        try:
            self._loop.call(self._close).result(timeout=30)
        finally:
            self._loop.stop()
            self._thread.join(timeout=10)

    def _call(self, work: Callable[[], object]) -> Future:
        if self._loop is not None:
            return self._loop.call(work)
        future: Future = Future()
        try:
            future.set_result(work())
        except Exception as exc:  # the caller's .result() raises it
            future.set_exception(exc)
        return future

    # -- the hand-off's thread -----------------------------------------------------------------
    def _build(self) -> None:
        config, kv = self.config, self._kv
        name = self._agent_name or f"{config.agent_prefix}-stage{self.stage}-{uuid.uuid4().hex[:8]}"
        self.sender = KVSender(
            KVAgent(name, progress=config.progress),
            kv.tensors,
            kv.layer_range.start,
            config.sender_config(self.stage, self._num_stages),
            on_complete=self._on_push_end,
            on_lease_end=self._on_lease_end,
            on_part_end=self._on_part_end,
            hybrid=hybrid_pool(kv),  # a hybrid model's recurrent layers ship their state
        )
        self._sources = LeasePeers(self.sender.agent, config.handshake_timeout_s)

    def _fetch(
        self, manifests: tuple[StageManifest, ...], table: BlockTable, lease_expiry_unix_s: float
    ) -> int:
        left = lease_expiry_unix_s - time.time() - LEASE_MARGIN_S
        if left <= 0:
            raise TransferTimeout("the source's leases expire before a copy could land")
        sender, sources = self._sender(), self._sources
        if sources is None:
            raise InvariantError(f"stage {self.stage}: the KV hand-off is not running")
        allow = self.config.allow
        for m in manifests:
            host_ok = allow.check_host(split_endpoint(m.endpoint)[0])
            allow.check_agent(host_ok, m.agent_name)
        reads = start_fetch(
            sender.agent,
            sources,
            self._kv.tensors,
            sender.layout,
            PageMap(table.block_ids, sender.layout.block_size),
            manifests,
            table.start,
            table.end,
        )
        wait_fetch(reads, min(self.config.transfer_timeout_s, left))
        return sum(read.num_bytes for read in reads)

    def _lend(self, key: str, held: FinalBlocks, lease_ttl_s: float | None) -> StageKVManifest:
        try:
            wire = self._sender().lease(key, held.block_ids, held.num_tokens, lease_ttl_s)
        except BaseException:
            self._give_back_transfer(held.blocks)
            raise
        self._lent[wire.lease_id] = (key, held.blocks)
        return engine_manifest(wire, entry_parts=self._kv.entry_parts)

    def _release_sources(self, manifests: tuple[StageManifest, ...]) -> None:
        if self._sources is not None:
            for m in manifests:  # a source this stage did not read from is known now
                try:
                    self._sources.peer(m.endpoint, m.agent_name)
                except KVTransferError:
                    continue  # gone or restarted: its lease went with it
            self._sources.notify(manifests, "rel")

    def _sender(self) -> KVSender:
        if self.sender is None:
            raise InvariantError(f"stage {self.stage}: the KV hand-off is not running")
        return self.sender

    def _run(self) -> None:
        loop = self._loop
        if loop is None:
            raise InvariantError("the hand-off thread without its command loop")
        while not loop.stopped:
            loop.run_pending()
            self._step()
            loop.pause(busy=self.busy)

    def _step(self) -> None:
        if self.sender is not None:
            try:
                self._poll()
            except Exception:  # a bug in one poll must not stop the stage's hand-off
                log.exception("stage %d KV hand-off poll failed", self.stage)
        if self._outcomes and self._report is not None:
            batch = tuple(self._outcomes.values())
            self._outcomes.clear()
            for outcome in batch:
                if self._spans:
                    span = self._spans.pop(outcome.request_id, None)
                    tracing.end(span, error=outcome.error or None)
            try:
                self._report(batch)
            except Exception:  # the leader is gone: this stage is ending
                log.warning("stage %d: KV hand-off outcomes not reported", self.stage,
                            exc_info=True)  # fmt: skip

    def _done(self, request_id: str, manifest: StageKVManifest | None, error=None) -> None:
        """Record the request's outcome here (reported by the next ``_step``)."""
        if error is None:
            self._outcomes[request_id] = HandoffOutcome(request_id, self.stage, manifest)
            return
        invalid = isinstance(error, InvalidTransferRequest | InvalidKVDestinationError)
        self._outcomes[request_id] = HandoffOutcome(
            request_id, self.stage, None, f"{type(error).__name__}: {error}", invalid
        )

    def _unpin(self, request_id: str) -> None:
        """A shipped request's pins end here: release them, unless it was disowned."""
        with self._pin_lock:  # the release under it: a concurrent supersede sees it done
            if _take_one(self._absorb, request_id):
                return
            if not _take_one(self._owned, request_id):
                raise InvariantError(f"stage {self.stage}: {request_id!r} unpinned, not shipped")
            self._owner.release(request_id)

    def _give_back_transfer(self, blocks: Sequence[KVBlock]) -> None:
        if blocks:
            self._owner.release_transfer(blocks)

    def _start(
        self,
        request_id: str,
        blocks: list[KVBlock],
        manifest: StageKVManifest,
        destination: Destination,
        span: object = None,
    ) -> None:
        if span is not None:
            self._spans[request_id] = span
        if isinstance(destination, KVPullDestination):
            self._lease(request_id, blocks, manifest, destination.lease_ttl_s)
        else:
            self._push(request_id, blocks, manifest, destination)
            self._poll()  # its final push goes now, not after the commands queued behind it

    def _push(
        self,
        request_id: str,
        blocks: list[KVBlock],
        manifest: StageKVManifest,
        dest: KVPushDestination,
    ) -> None:
        """WRITE the request's KV of this stage's layers (what its stream did not) into
        decode's blocks, then notify decode."""
        sender = self._sender()
        held = _Held(blocks, manifest)
        if self.config.debug_post_before_push and request_id in self._streams:
            self._post_streamed(request_id, self._streams[request_id])
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            held.streamed = stream.queued + stream.group_queued
            stream.queued, stream.group_queued = [], []
        if request_id in self._dead or (stream is not None and stream.failed):
            self._unpin(request_id)  # cancelled, or failed and reported already
            self._give_back_transfer(held.streamed)
            if stream is not None and not stream.stopped:  # failed since the last poll
                sender.cancel(request_id)
                self._drop_parts(request_id)
            return
        if stream is not None:
            held.streamed += self._withdraw_unposted(request_id, stream)
        try:
            if stream is None:
                wire = stage_push_destination(
                    dest, request_id, self.stage, manifest.num_tokens, self._kv.block_size
                )
                start, first_layer = None, None
            else:  # the layer groups post only after every all-layer range: one rectangle
                wire, start, first_layer = stream.wire, stream.posted_to, stream.layers_posted
            sender.push(wire, manifest.block_ids, manifest.num_tokens, start, first_layer)
        except (KVTransferError, ValueError) as exc:
            self._unpin(request_id)
            self._give_back_transfer(held.streamed)
            sender.cancel(request_id)  # its streamed ranges, if any
            self._drop_parts(request_id)
            self._done(request_id, None, exc)
            return
        self._pushing[request_id] = held

    def _stream(
        self,
        request_id: str,
        final: FinalBlocks,
        dest: KVPushDestination,
        layer_end: int | None = None,
    ) -> None:
        """Tokens ``final.start`` to ``final.end`` are final here (of the layers below
        ``layer_end``, if given); ranges come in token order, layer groups in layer order
        and only at the prompt's end (the stage's last group is the final push's)."""
        blocks, start, end, num_tokens = final.blocks, final.start, final.end, final.num_tokens
        stream = self._streams.get(request_id)
        if request_id in self._dead or (stream is not None and stream.failed):
            self._give_back_transfer(blocks)
            return
        if stream is None:
            try:
                wire = stage_push_destination(
                    dest, request_id, self.stage, num_tokens, self._kv.block_size
                )
            except (KVTransferError, ValueError) as exc:
                self._give_back_transfer(blocks)
                wire = PushDestination(request_id, "", (), 0)
                self._streams[request_id] = _Stream(wire, 0, failed=True, stopped=True)
                self._done(request_id, None, exc)
                return
            skip = wire.skip_tokens
            first_layer = self._kv.layer_range.start
            stream = _Stream(wire, first_layer, posted_to=skip, ready_to=skip)
            self._streams[request_id] = stream
        stream.block_ids = final.block_ids
        if end <= stream.ready_to:  # all in decode's cached prefix
            self._give_back_transfer(blocks)
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
            last_layer = self._kv.layer_range.end
            if end != num_tokens or not after < layer_end < last_layer:
                raise KVInvariantError(
                    f"{request_id}: layer groups must end the prompt, come in layer order and "
                    f"leave the stage's last layers [{layer_end}, {last_layer}) to the "
                    "final push"
                )
            stream.group_queued.extend(blocks)
            stream.layers_ready = layer_end
        self._post_queued()

    def _post_queued(self) -> None:
        """Post queued ranges, oldest request first, while the in-flight bound allows: a
        request's all-layer range first, its layer groups once that one is posted."""
        sender = self._sender()
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
                    part = sender.stream(
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
        sender = self._sender()
        deadline = time.monotonic() + self.config.wait_limit_s
        while not stream.failed and time.monotonic() < deadline:
            self._poll()
            queued = (
                stream.posted_to < stream.ready_to or stream.layers_posted < stream.layers_ready
            )
            mine = [p for p, entry in self._parts.items() if entry.request_id == request_id]
            if not queued and all(sender.posted(p) for p in mine):
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
            if not self._sender().withdraw(part):
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
        self._give_back_transfer(self._parts.pop(part).blocks)
        stream = self._streams.get(request_id)
        if error is not None and stream is not None and not stream.failed:
            self._fail_stream(request_id, stream, error)
        # after the final push (stream popped) the sender fails that push instead

    def _fail_stream(self, request_id: str, stream: _Stream, error: KVTransferError) -> None:
        """A streamed range failed: report the error now; the rest is stopped in ``_poll``."""
        stream.failed = True
        self._give_back_transfer(stream.queued + stream.group_queued)
        stream.queued, stream.group_queued = [], []
        self._done(request_id, None, error)

    def _drop_parts(self, request_id: str) -> None:
        """Give back the references of ``request_id``'s ranges the sender dropped."""
        for part, entry in list(self._parts.items()):
            if entry.request_id == request_id:
                del self._parts[part]
                self._give_back_transfer(entry.blocks)

    def _revive(self, request_ids: tuple[str, ...]) -> None:
        for request_id in request_ids:  # admitted again: its new stream and push are live
            self._dead.pop(request_id, None)

    def _lease(
        self,
        request_id: str,
        blocks: list[KVBlock],
        manifest: StageKVManifest,
        lease_ttl_s: float | None = None,
    ) -> None:
        """Pull: lease the blocks for decode to READ; the outcome holds the lease manifest.
        ``lease_ttl_s``: this request's lease TTL (None: ``KVHandoffConfig.lease_ttl_s``)."""
        sender = self._sender()
        if request_id in self._dead:
            self._unpin(request_id)
            return
        try:
            wire = sender.lease(request_id, manifest.block_ids, manifest.num_tokens, lease_ttl_s)
        except KVTransferError as exc:
            self._unpin(request_id)
            self._done(request_id, None, exc)
            return
        self._leased[wire.lease_id] = (request_id, blocks)
        self._done(request_id, engine_manifest(wire, entry_parts=self._kv.entry_parts))

    def _poll(self) -> None:
        """Advance WRITEs, serve decode's heartbeats / releases, expire leases; stop failed
        streams (abort their other ranges, tell decode) and post queued ranges."""
        sender = self._sender()
        sender.poll()
        for request_id, stream in self._streams.items():
            if stream.failed and not stream.stopped:
                stream.stopped = True
                sender.cancel(request_id)
                self._drop_parts(request_id)
        self._post_queued()

    def _cancel(self, request_id: str) -> None:
        """Give up the request here: abort its WRITE or revoke its lease, unpin its blocks."""
        sender = self._sender()
        self._outcomes.pop(request_id, None)
        self._dead[request_id] = None
        while len(self._dead) > 4096:
            self._dead.popitem(last=False)
        held = self._pushing.pop(request_id, None)
        stream = self._streams.pop(request_id, None)
        sender.cancel(request_id)  # WRITEs and streamed ranges; decode hears "fail"
        self._drop_parts(request_id)
        if stream is not None:
            self._give_back_transfer(stream.queued + stream.group_queued)
        if held is not None:
            self._unpin(request_id)
            self._give_back_transfer(held.streamed)
        for lease_id, (owner, _) in [*self._leased.items(), *self._lent.items()]:
            if owner == request_id:
                sender.leases.release(lease_id, ReleaseReason.REVOKED)

    def _on_push_end(self, outcome: TransferOutcome) -> None:
        held = self._pushing.pop(outcome.request_id, None)
        if held is None:
            raise KVInvariantError(f"push outcome for unknown request {outcome.request_id}")
        self._unpin(outcome.request_id)
        self._give_back_transfer(held.streamed)
        if outcome.ok:
            manifest = replace(held.manifest, agent_name=self.agent_name, pushed=True)
            self._done(outcome.request_id, manifest)
        else:
            self._done(outcome.request_id, None, outcome.error)

    def _on_lease_end(self, lease: PullLease, reason: ReleaseReason) -> None:
        lent = self._lent.pop(lease.lease_id, None)
        if lent is not None:
            self._give_back_transfer(lent[1])
            return
        entry = self._leased.pop(lease.lease_id, None)
        if entry is None:
            raise KVInvariantError(f"lease {lease.lease_id} ended but holds no blocks here")
        self._unpin(entry[0])

    def _check(self) -> None:
        sender = self._sender()
        sender.check_integrity()
        if sender.parts_inflight != len(self._parts):
            raise KVInvariantError(
                f"stage {self.stage}: {sender.parts_inflight} streamed WRITEs in flight, "
                f"{len(self._parts)} held"
            )
        if sender.inflight != len(self._pushing):
            raise KVInvariantError(
                f"stage {self.stage}: {sender.inflight} pushes in flight, {len(self._pushing)} held"
            )
        if len(sender.leases) != len(self._leased) + len(self._lent):
            raise KVInvariantError(
                f"stage {self.stage}: {len(sender.leases)} leases, "
                f"{len(self._leased) + len(self._lent)} held"
            )

    def _close(self) -> None:
        """Abort WRITEs and revoke leases (unpinning everything), then free the NIXL agent."""
        for request_id in {*self._pushing, *self._streams}:
            self._cancel(request_id)
        self._sender().close()  # revokes leases -> _on_lease_end unpins
        self._outcomes.clear()
