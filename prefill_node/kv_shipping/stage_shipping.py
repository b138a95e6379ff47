"""StageShipping: one stage process's KV hand-off thread around its StageKVShipper.

Why a thread of its own: a stage's LOOP blocks on the data plane between waves (and its WAVE
thread on the rounds plane), so neither can poll NIXL while the pipeline is idle; a push must
still finish and a pull lease must still see decode's heartbeats and release. The shipping
thread owns the shipper (NIXL is not thread-safe: every shipper call happens there), runs the
commands the other threads queue, and polls every ``poll_interval_s`` while a WRITE or a
lease is live.

Block contract: the LOOP completes a shipped request with ``complete(keep_pinned=True)``
(its reservation keeps one pin per block, so the stage's ``check_integrity`` stays exact),
then calls ``ship``. When the shipper gives the blocks back (WRITE ended, lease released,
expired or revoked, ``cancel``, ``close``), ``release(request_id)`` runs on this thread;
the owner (PipelineStageCompute) drops the pins under its own lock there.

Reused request ids: a request id may come back (a client retry) while this stage still ships
the previous request of that id; admission holds one reservation per id, so the owner first
``disown``s the old hand-off (its pins are dropped at once, its WRITE / lease cancelled) and
the shipper's later unpin of those blocks is absorbed here instead of releasing anything.

Streaming (``KVShippingConfig.stream``, push only): before the last chunk, the LOOP takes one
extra reference on each block whose KV just became final (``StageAdmission.pin_for_transfer``)
and calls ``stream``; the shipper gives them back through ``release_streamed`` (the owner's
``unpin_transfer`` under its lock), independent of the request's own pins, so an abort
mid-stream never frees a block a WRITE still reads. The last chunk streams layer group by
layer group from inside its forward (``stream_final_blocks`` with ``layer_end``, called by
the forward's per-layer hook): each time, every block from the chunk on (the partial last
one too) is pinned once more for that group's WRITE.

Results: each request's outcome on this stage, exactly once, as a ``StageHandoff``, handed
to the ``report_to`` sink from the shipping thread as soon as the shipper reports it (in
batches of what one poll brought; the runtime sends them to the leader on its reports plane).
Outcomes from before a sink was set wait for it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial

from kv_transfer.errors import InvalidTransferRequest
from prefill_node import tracing
from prefill_node.core.block import KVBlock
from prefill_node.core.stage_admission import StageAdmission
from prefill_node.engine.types import KVPullDestination, KVPushDestination, StageKVManifest
from prefill_node.errors import InvalidKVDestinationError, InvariantError
from prefill_node.kv_shipping.command_loop import CommandLoop
from prefill_node.kv_shipping.shipper import (
    KVHeld,
    KVShippingConfig,
    StageKVShipper,
    StageShipResult,
)
from prefill_node.model.latent_cache import StageCache

log = logging.getLogger(__name__)
Destination = KVPushDestination | KVPullDestination


@dataclass(frozen=True)
class StageHandoff:
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


def stream_final_blocks(
    shipping: StageShipping,
    admission: StageAdmission,
    lock: threading.Lock,
    request_id: str,
    start: int,
    end: int,
    destination: KVPushDestination,
    layer_end: int | None = None,
    ready: Callable[[], object] | None = None,
) -> None:
    """After a non-last chunk ``[start, end)`` ran on this stage: pin the blocks that
    became final since the previous chunk (one reference each, under the owner's ``lock``)
    and stream them. The block holding the prompt's last token is left to the final push
    (it carries "done", and a partial block is sent once, when final); the first chunk also
    streams the prefix the stage reused. A no-op when streaming is off.
    ``layer_end`` (the last chunk, during its forward): the layers below it are final, for
    every token from ``start`` to the prompt's end; they are streamed, blocks from the
    chunk's first one to the last one pinned. ``ready``: the shipping thread calls it
    before the WRITE (on CUDA: waits for the kernels that wrote the KV)."""
    if not shipping.config.stream:
        return
    bs = admission.config.block_size
    with lock:
        rsv = admission.reservation(request_id)
        if rsv is None or rsv.completed:
            return
        num_tokens = rsv.prompt.num_tokens
        keep = (num_tokens - 1) // bs  # the last block's index
        last = min(end // bs, keep) if layer_end is None else keep + 1
        first = 0 if start == rsv.cached_len else min(start // bs, keep)  # first chunk: prefix
        if last <= first:
            return
        blocks = admission.pin_for_transfer(request_id, first, last)
        block_ids = rsv.block_ids()
    end_token = min(last * bs, num_tokens)
    shipping.stream(
        request_id, blocks, block_ids, destination, num_tokens, first * bs, end_token,
        layer_end, ready,
    )  # fmt: skip


def _after(ready: Callable[[], object], work: Callable[[], object]) -> None:
    try:
        ready()
    finally:  # the references go to the shipper either way (a failed forward cancels)
        work()


def handoff_of(result: StageShipResult) -> StageHandoff:
    """The picklable, narrow form of a shipper result (exceptions become text + a flag)."""
    err = result.error
    if err is None:
        return StageHandoff(result.request_id, result.stage, result.manifest)
    invalid = isinstance(err, InvalidTransferRequest | InvalidKVDestinationError)
    return StageHandoff(
        result.request_id,
        result.stage,
        None,
        error=f"{type(err).__name__}: {err}",
        invalid_destination=invalid,
    )


class StageShipping:
    """Stage ``stage``'s shipper on its own thread. Every public method is thread-safe."""

    def __init__(
        self,
        stage: int,
        num_stages: int,
        kv: StageCache,
        config: KVShippingConfig,
        release: Callable[[str], None],
        release_streamed: Callable[[Sequence[KVBlock]], None] | None = None,
        poll_interval_s: float = 0.0005,
        idle_interval_s: float = 1.0,
    ) -> None:
        """Creates the agent and registers ``kv``'s tensors (on the new thread; waits)."""
        self.stage = stage
        self.config = config
        self._release = release
        self._release_streamed = release_streamed
        self._loop = CommandLoop(f"stage {stage} KV shipping", poll_interval_s, idle_interval_s)
        self._outcomes: list[StageHandoff] = []  # not yet reported (shipping thread)
        self._report: Callable[[tuple[StageHandoff, ...]], object] | None = None
        # block-id table -> request ids pinned with it (a shipper unpin names blocks only),
        # and how many of its unpins to absorb (disowned requests); guarded by _pin_lock
        self._pin_lock = threading.Lock()
        self._pinned: dict[tuple[int, ...], list[str]] = {}
        self._absorb: dict[tuple[int, ...], int] = {}
        self._spans: dict[str, object] = {}  # traced hand-offs in flight (shipping thread)
        self._shipper: StageKVShipper | None = None
        self._thread = threading.Thread(target=self._run, name=f"stage{stage}-kv", daemon=True)
        self._thread.start()
        build = partial(
            StageKVShipper,
            stage,
            num_stages,
            kv,
            config,
            self._on_unpin,
            unpin_streamed=release_streamed,
        )
        self._shipper = self._loop.call(build).result(timeout=60)

    @property
    def agent_name(self) -> str:
        return self._running().agent_name

    def _running(self) -> StageKVShipper:
        if self._shipper is None:
            raise InvariantError(f"stage {self.stage}: KV shipping is not running")
        return self._shipper

    # -- LOOP / WAVE threads -------------------------------------------------------------------
    def ship(
        self,
        request_id: str,
        blocks: Sequence[KVBlock],
        manifest: StageKVManifest,
        destination: Destination,
        traceparent: str = "",
    ) -> None:
        """Start the hand-off of a request completed with ``keep_pinned``; returns at once.
        With ``traceparent`` (tracing on), the hand-off is a span until its outcome."""
        key = tuple(b.block_id for b in blocks)
        with self._pin_lock:  # at once, so that a ``disown`` right after finds it
            self._pinned.setdefault(key, []).append(request_id)
        span = None
        if traceparent and tracing.enabled():
            mode = "pull" if isinstance(destination, KVPullDestination) else "push"
            span = tracing.start_span("wavepp.stage.kv_send", traceparent, {
                tracing.REQUEST_ID: request_id, tracing.STAGE: self.stage,
                "wavepp.kv_mode": mode, "wavepp.kv_blocks": len(blocks)})  # fmt: skip
        start = partial(self._start, request_id, list(blocks), manifest, destination, span)
        self._loop.call(start)

    def stream(
        self,
        request_id: str,
        blocks: Sequence[KVBlock],
        block_ids: tuple[int, ...],
        destination: KVPushDestination,
        num_tokens: int,
        start: int,
        end: int,
        layer_end: int | None = None,
        ready: Callable[[], object] | None = None,
    ) -> None:
        """Tokens ``[start, end)`` are final (of the layers below ``layer_end``, if given):
        WRITE them now (``blocks``: one reference each from ``pin_for_transfer``, returned
        through ``release_streamed``; ``ready`` runs first on the shipping thread); returns
        at once."""
        if self._release_streamed is None:
            raise InvariantError(f"stage {self.stage}: streaming needs a release_streamed")
        stream = partial(
            self._running().stream,
            request_id,
            list(blocks),
            block_ids,
            destination,
            num_tokens,
            start,
            end,
            layer_end,
        )
        self._loop.call(stream if ready is None else partial(_after, ready, stream))

    def cancel(self, request_id: str) -> None:
        """Abort the request's WRITE or revoke its lease here (no-op when none); async."""
        self._loop.call(partial(self._cancel, request_id))

    def disown(self, request_id: str) -> bool:
        """Stop owning ``request_id``'s pins (the caller drops them now) and cancel its
        hand-off; False when it has none here. Any thread."""
        with self._pin_lock:
            key = next((k for k, rids in self._pinned.items() if request_id in rids), None)
            if key is None:
                return False
            self._pinned[key].remove(request_id)
            if not self._pinned[key]:
                del self._pinned[key]
            self._absorb[key] = self._absorb.get(key, 0) + 1
        self.cancel(request_id)
        return True

    def supersede(self, request_ids: Iterable[str], unpin: Callable[[str], object]) -> None:
        """New requests reuse these ids: each one this stage still ships is disowned and its
        pins dropped at once through ``unpin`` (the owner's locked ``unpin``), so admission
        can reserve the id again. Any thread."""
        request_ids = tuple(request_ids)
        for request_id in request_ids:
            if self.disown(request_id):
                unpin(request_id)
        if request_ids:  # after any cancel: the new requests' streams and pushes are live
            self._loop.call(partial(self._revive, request_ids))

    def report_to(self, sink: Callable[[tuple[StageHandoff, ...]], object]) -> None:
        """From now on, hand each batch of outcomes to ``sink`` (on the shipping thread; it
        must not block for long). Any thread."""
        self._report = sink

    def held(self) -> KVHeld:
        return self._loop.call(lambda: self._running().held).result(timeout=10)

    def check_integrity(self) -> None:
        self._loop.call(lambda: self._running().check_integrity()).result(timeout=10)

    def close(self) -> None:
        """Abort WRITEs, revoke leases (releasing their pins), free the agent, stop."""
        if not self._thread.is_alive():
            return
        try:
            self._loop.call(lambda: self._running().close()).result(timeout=30)
        finally:
            self._loop.stop()
            self._thread.join(timeout=10)

    # -- the shipping thread ---------------------------------------------------------------------
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
        shipper = self._running()
        if isinstance(destination, KVPullDestination):
            shipper.publish(request_id, blocks, manifest, destination.lease_ttl_s)
        else:
            shipper.push(request_id, blocks, manifest, destination)
            shipper.poll()  # its final push goes now, not after the commands queued behind it

    def _cancel(self, request_id: str) -> None:
        self._running().cancel(request_id)

    def _revive(self, request_ids: tuple[str, ...]) -> None:
        for request_id in request_ids:
            self._running().revive(request_id)

    def _on_unpin(self, blocks: Sequence[KVBlock]) -> None:
        key = tuple(b.block_id for b in blocks)
        with self._pin_lock:
            # Requests sharing one block table hold identical pins, so which one an unpin
            # stands for does not matter: absorb a disowned one first, else release the oldest.
            if self._absorb.get(key, 0) > 0:
                self._absorb[key] -= 1
                if not self._absorb[key]:
                    del self._absorb[key]
                return
            owners = self._pinned.get(key)
            if not owners:
                raise InvariantError(f"stage {self.stage}: shipper unpinned blocks nobody pinned")
            request_id = owners.pop(0)
            if not owners:
                del self._pinned[key]
            self._release(request_id)  # under _pin_lock: a concurrent disown sees it done

    def _run(self) -> None:
        while not self._loop.stopped:
            self._loop.run_pending()
            shipper = self._shipper
            if shipper is not None:
                try:
                    shipper.poll()
                except Exception:  # a bug in one poll must not stop the stage's shipping
                    log.exception("stage %d KV shipper poll failed", self.stage)
                for result in shipper.take_results():
                    if self._spans:
                        span = self._spans.pop(result.request_id, None)
                        tracing.end(span, error=result.error)
                    self._outcomes.append(handoff_of(result))
            if self._outcomes and self._report is not None:
                batch, self._outcomes = tuple(self._outcomes), []
                try:
                    self._report(batch)
                except Exception:  # the leader is gone: this stage is ending
                    log.warning("stage %d: KV hand-off outcomes not reported", self.stage,
                                exc_info=True)  # fmt: skip
            self._loop.pause(busy=shipper is not None and shipper.busy)
