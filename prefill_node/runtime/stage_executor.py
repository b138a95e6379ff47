"""One in-process pipeline stage: its StageModel, its paged KV memory and its StageAdmission.

A StageExecutor is the in-process counterpart of the runtime's ``PipelineStageCompute``: the
cache and admission state are the core's ``StageAdmission`` (leases, escrow, the collision
guard, the reuse rule), the same object every runtime stage and the simulator drive. The
LocalEngine's leader talks to it only through admission-round messages (``handle``) and
chunks; it never touches the block pool itself.

Request life cycle on a stage (the engine drives it, in this order):

1. ``handle(msg)`` answers every phase of the admission round that reserves the request
   (``core/round_driver.py``); after an ``Admitted`` outcome the stage holds its lease and
   escrow.
2. ``execute(chunks, inputs)``: each chunk is materialised first (escrowed victims become
   real blocks, a wholly cached prompt's shared last block is copied into a private one),
   then the forward runs. A chunk that does not continue the request's KV raises.
3. ``complete(request_id)``: caches the new full blocks, returns the KV manifest and drops
   the request's pins (the KV stays cached until evicted). ``abort(request_id)`` drops
   everything without caching (abort / failure). Exactly one of the two, once.

KV hand-off (``kv_shipping`` given): the stage owns a ``StageShipping`` thread, the same one
a runtime stage process runs. ``complete(request_id, destination)`` keeps the request's
blocks pinned in its reservation and ships them; the shipping thread drops the pins
(``_release_shipped``) when the WRITE ended or the lease did. ``stream(...)`` after an
earlier chunk streams a push request's final blocks (``stream_final_blocks``; docs/
kv_streaming.md). ``_lock`` guards the admission state against that thread; the forward runs
outside it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from prefill_node.core.admission_messages import RoundRequest, StageReply
from prefill_node.core.block import KVBlock
from prefill_node.core.block_pool import BlockPool
from prefill_node.core.execution_results import Completion, StageStateMismatch
from prefill_node.core.stage_admission import StageAdmission, StageConfig
from prefill_node.engine.types import (
    KVPullDestination,
    KVPushDestination,
    StageKVManifest,
    StageLoad,
)
from prefill_node.errors import InvariantError
from prefill_node.kv_shipping.shipper import KVShippingConfig
from prefill_node.kv_shipping.stage_shipping import StageShipping, stream_final_blocks
from prefill_node.model.batch import ChunkBatch, ChunkSpec
from prefill_node.model.latent_cache import stage_cache
from prefill_node.model.stage_model import StageModel
from prefill_node.runtime.stage_compute import kv_manifest


@dataclass(frozen=True)
class ChunkWork:
    """Compute positions [start, start + length) of request ``request_id`` in one forward."""

    request_id: str
    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class StageStep:
    """Output of one forward: the residual stream for the next stage and, on the last stage,
    the fp32 logits [k, vocab] of the last prompt token of each chunk in ``completed``."""

    hidden: torch.Tensor
    completed: tuple[int, ...]  # indices into the chunk list that finished their prompt
    logits: torch.Tensor | None


class StageExecutor:
    """Stage ``stage`` of a pipeline. Not thread-safe: one caller (the engine) at a time."""

    def __init__(
        self,
        stage: int,
        model: StageModel,
        num_blocks: int,
        block_size: int,
        *,
        events: bool = False,
        num_stages: int = 1,
        kv_shipping: KVShippingConfig | None = None,
    ) -> None:
        """``kv_shipping``: create this stage's NIXL agent (on its shipping thread) and
        register its KV tensors; None: requests with a KV destination are refused."""
        self.stage = stage
        self.model = model
        self.kv = stage_cache(
            model.config, model.layer_range, num_blocks, block_size, model.dtype, model.device
        )
        self.admission = StageAdmission(
            StageConfig(
                stage=stage,
                num_blocks=num_blocks,
                block_size=block_size,
                num_layers=len(model.layer_range),
                snapshot_interval_blocks=model.config.snapshot_interval_blocks,
                enable_kv_events=events,
            )
        )
        self._lock = threading.Lock()
        self.shipping: StageShipping | None = None
        if kv_shipping is not None:
            self.shipping = StageShipping(
                stage,
                num_stages,
                self.kv,
                kv_shipping,
                self._release_shipped,
                release_streamed=self._release_streamed,
            )

    @property
    def pool(self) -> BlockPool:
        return self.admission.pool

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def is_first(self) -> bool:
        return self.model.is_first

    @property
    def is_last(self) -> bool:
        return self.model.is_last

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a sequence of ``num_tokens`` occupies."""
        return -(-num_tokens // self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a prompt of ``num_tokens`` fits this stage's cache when nothing else runs."""
        return self.blocks_for(num_tokens) <= self.num_blocks

    # ---- admission -----------------------------------------------------------------

    def handle(self, msg: RoundRequest) -> StageReply:
        """This stage's answer to one phase of an admission round."""
        if self.shipping is not None:  # a reused id supersedes its predecessor's hand-off
            new_ids = (spec.request_id for spec in msg.new_requests)
            self.shipping.supersede(new_ids, self._release_shipped)
        with self._lock:
            return self.admission.handle(msg)

    def complete(
        self,
        request_id: str,
        destination: KVPushDestination | KVPullDestination | None = None,
    ) -> StageKVManifest:
        """The request's last chunk passed: cache its new full blocks and return where its
        KV sat at completion. Its pins are dropped now, or, with a ``destination``, kept
        while the stage's shipping thread WRITEs (push) or leases (pull) the blocks."""
        if destination is not None and self.shipping is None:
            raise InvariantError(f"stage {self.stage}: a KV destination without KV shipping")
        with self._lock:
            num_tokens = self._num_tokens(request_id)
            done = self.admission.complete(request_id, keep_pinned=destination is not None)
            if not isinstance(done, Completion):
                raise _mismatch_error(done)
            manifest = kv_manifest(self.stage, self.kv, done.block_ids, num_tokens)
            blocks = [self.pool.block(b) for b in done.block_ids]
        if destination is not None and self.shipping is not None:
            self.shipping.ship(request_id, blocks, manifest, destination)
        return manifest

    def stream(self, request_id: str, start: int, end: int, destination: KVPushDestination) -> None:
        """Chunk ``[start, end)`` (not the last) ran here: stream the blocks it made final."""
        if self.shipping is not None and self.shipping.config.stream:
            if self.model.device.type == "cuda":  # the chunk's KV is written before a WRITE
                torch.cuda.current_stream(self.model.device).synchronize()
            stream_final_blocks(
                self.shipping, self.admission, self._lock, request_id, start, end, destination
            )

    def abort(self, request_id: str) -> bool:
        """Drop whatever this stage holds for the request; False if it held nothing. A
        request this stage ships is given up there (WRITEs aborted, lease revoked); its pins
        drop when the shipper lets the blocks go (``_release_shipped``, ``_release_streamed``),
        a moment later."""
        with self._lock:
            rsv = self.admission.reservation(request_id)
            shipped = rsv is not None and rsv.completed and self.shipping is not None
            held = shipped or self.admission.abort(request_id)
        if self.shipping is not None:  # also stops a stream of a request not completed yet
            self.shipping.cancel(request_id)
        return held

    def _release_shipped(self, request_id: str) -> None:
        with self._lock:
            self.admission.unpin(request_id)  # False when an abort released it already

    def _release_streamed(self, blocks: Sequence[KVBlock]) -> None:
        with self._lock:
            self.admission.unpin_transfer(blocks)

    def drain_events(self) -> list:
        """The pool's buffered KV events since the last call."""
        with self._lock:
            return self.pool.drain_events()

    def close(self) -> None:
        """Stop shipping (WRITEs aborted, leases revoked, pins dropped); idempotent."""
        shipping, self.shipping = self.shipping, None
        if shipping is not None:
            shipping.close()

    def _num_tokens(self, request_id: str) -> int:
        rsv = self.admission.reservation(request_id)
        if rsv is None:
            raise InvariantError(f"stage {self.stage}: no reservation for {request_id!r}")
        return rsv.prompt.num_tokens

    def load(self) -> StageLoad:
        """Block counts, where ``used`` includes the victims escrowed for a running request:
        they are its capacity from admission on, although it materialises them chunk by
        chunk. Safe to call from any thread."""
        with self._lock:
            stats = self.pool.stats()
            escrowed = [self.pool.block(i) for i in range(stats.total)]
            escrowed = [b for b in escrowed if b.claimed_by is not None and b.ref_cnt == 0]
        cached = sum(b.is_cached for b in escrowed)
        return StageLoad(
            self.stage,
            stats.free - (len(escrowed) - cached),
            stats.cached - cached,
            stats.in_use + len(escrowed),
            stats.total,
        )

    def check_integrity(self) -> None:
        """The pool's, the admission state's and the shipper's invariants (raises otherwise)."""
        with self._lock:
            self.admission.check_integrity()
        if self.shipping is not None:
            self.shipping.check_integrity()

    # ---- execution -----------------------------------------------------------------

    def execute(self, chunks: Sequence[ChunkWork], inputs: torch.Tensor) -> StageStep:
        """Materialise ``chunks`` and run this stage's layers on them (rows concatenated in
        chunk order).

        ``inputs``: token ids [T] on the first stage, else the previous stage's hidden [T, H].
        Each chunk must continue its request where this stage's KV stops (InvariantError
        otherwise: a stage never computes on a cache state that does not match the schedule).
        """
        specs: list[ChunkSpec] = []
        completed: list[int] = []
        with self._lock:
            for i, work in enumerate(chunks):
                table = self.admission.materialise(work.request_id, work.start, work.length)
                if isinstance(table, StageStateMismatch):
                    raise _mismatch_error(table)
                if table.copy_block is not None:
                    self.kv.copy_block(*table.copy_block)
                specs.append(ChunkSpec(work.start, work.length, table.block_ids))
                if work.end == self._num_tokens(work.request_id):
                    completed.append(i)
        batch = ChunkBatch(tuple(specs))
        hidden = self.model(inputs.to(self.model.device), batch, self.kv)
        logits = None
        if self.is_last and completed:
            rows = batch.last_token_rows(self.model.device)[completed]
            logits = self.model.compute_logits(hidden.index_select(0, rows))
        return StageStep(hidden, tuple(completed), logits)


def _mismatch_error(mismatch: StageStateMismatch) -> InvariantError:
    return InvariantError(
        f"stage {mismatch.stage}: request {mismatch.request_id!r} does not continue its KV "
        f"here ({mismatch.reason.value}: {mismatch.detail})"
    )
