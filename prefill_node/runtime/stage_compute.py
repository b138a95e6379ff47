"""One stage's model slice, paged KV and admission state, as the runtime's threads drive them."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from prefill_node.core.admission_messages import ReserveStatus, RoundRequest, StageReply
from prefill_node.core.block import KVBlock
from prefill_node.core.block_pool import BlockPool, PoolStats
from prefill_node.core.execution_results import BlockTable, MismatchReason, StageStateMismatch
from prefill_node.core.stage_admission import (
    FetchSkip,
    FinalBlocks,
    StageAdmission,
    StageConfig,
)
from prefill_node.engine.types import StageKVManifest
from prefill_node.errors import InvariantError
from prefill_node.kv_handoff.config import KVHandoffConfig
from prefill_node.kv_handoff.stage_handoff import (
    ChunkRange,
    HandoffOutcome,
    KVHeld,
    StageKVHandoff,
)
from prefill_node.model.batch import ChunkBatch, ChunkSpec
from prefill_node.model.config import ModelConfig
from prefill_node.model.latent_cache import StageCache, stage_cache
from prefill_node.model.partition import LayerRange
from prefill_node.model.stage_model import StageModel
from prefill_node.runtime.core_share import CoreShare
from prefill_node.runtime.messages import (
    FetchOrder,
    FetchReply,
    LendOrder,
    RequestOptions,
    RequestOutput,
    StageEventBatch,
    WaveChunk,
    WaveHeader,
)
from prefill_node.runtime.spec import PipelineSpec
from prefill_node.runtime.stage_worker import StepOutput

log = logging.getLogger(__name__)
_NO_OPTIONS = RequestOptions()  # a request whose first chunk carried none (aborted before)

# a spec's / config's dtype name -> torch (``runtime.spec.DTYPES``)
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# trtllm: a stage short of capacity for rank 0's decision retries this often while its KV
# hand-offs (the counterpart of TensorRT-LLM's disaggregated cache transfers) release blocks
FOLLOW_RETRIES = 20
FOLLOW_RETRY_S = 0.05


@dataclass(frozen=True)
class CapturedKV:
    """A finished request's KV on one stage (``capture_kv`` only): per local layer, K and V
    [num_tokens, kv_heads, head_dim], in global layer order from ``layer_start`` (a
    recurrent layer: its final state as k and its conv tail as v)."""

    stage: int
    layer_start: int
    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...]


def stage_device(spec: PipelineSpec, stage: int) -> torch.device:
    """CPU, or on CUDA one GPU per stage: ``cuda:(stage mod visible GPUs)`` (one pod per stage
    sees one GPU, so every stage uses ``cuda:0`` there). Also makes it the current device,
    which NCCL needs."""
    if spec.device != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", stage % max(1, torch.cuda.device_count()))
    torch.cuda.set_device(device)
    return device


def kv_manifest(
    stage: int, kv: StageCache, block_ids: tuple[int, ...], num_tokens: int
) -> StageKVManifest:
    """Where stage ``stage`` holds a request's KV: its layers' ``block_ids`` in prompt order."""
    return StageKVManifest(
        stage=stage,
        layer_start=kv.layer_range.start,
        layer_end=kv.layer_range.end,
        block_ids=block_ids,
        block_size=kv.block_size,
        num_tokens=num_tokens,
        num_kv_heads=kv.num_kv_heads,
        head_dim=kv.head_dim,
        dtype=str(kv.dtype).removeprefix("torch."),
        planes=kv.planes,
        entry_parts=kv.entry_parts,
    )


def load_stage_model(spec: PipelineSpec, stage: int) -> StageModel:
    """This stage's slice of the model named by ``spec.model`` (only its own weights)."""
    if spec.model is None:
        raise InvariantError("a spec without a model source cannot load a stage")
    a, b = spec.layer_ranges[stage]
    layer_range = LayerRange(a, b)
    dtype = TORCH_DTYPES[spec.dtype]
    device = stage_device(spec, stage)
    if spec.model.path is not None:
        from prefill_node.model.loader_hf import load_stage_model as load_hf

        return load_hf(spec.model.path, layer_range, dtype, device)
    config = ModelConfig.from_hf_config(spec.model.config or {}, name=spec.model.name)
    return StageModel.random_init(config, layer_range, spec.model.seed, dtype, device)


class PipelineStageCompute:
    """Stage ``stage``: ``StageModel`` + its paged cache + ``StageAdmission`` (its cache core).

    Locking: ``_lock`` guards the admission state; the WAVE thread holds it while answering a
    round phase, the LOOP while materialising and completing - never during the forward. The
    forward only touches KV memory of blocks the wave's requests own (materialised from their
    escrow), which admission never hands to anyone else before ``complete`` / ``abort``.

    Failure: a chunk whose local state does not match (StageStateMismatch) fails its request
    (reported to the leader in the wave's ``failed``); an exception in the forward fails every
    request of that wave, one in the logits the requests finishing in it; the stage keeps
    serving either way.

    KV hand-off (``kv_handoff`` given): a request whose last chunk carries a destination is
    completed with its blocks kept pinned and handed to the stage's ``StageKVHandoff``, whose
    thread drops the pins (``release``) when the WRITE ended or the lease did. That happens
    right after the forward, before the last stage computes the logits, so the last WRITE
    overlaps the LM head. The hand-off also streams (push): after each earlier chunk
    (``stream_chunks``) and layer group by layer group from inside the last chunk's forward
    (``layer_hook``); it pins what it streams through ``pin_final`` / ``release_transfer``.
    This object is its ``HandoffOwner``: those three calls take ``_lock``.
    KV events (``spec.kv_events``): the pool buffers them; each wave drains them after its
    completions, so a batch holds everything since the previous wave (admission evictions too).
    """

    def __init__(
        self,
        spec: PipelineSpec,
        stage: int,
        model: StageModel,
        kv_handoff: KVHandoffConfig | None = None,
        *,
        keep_logits: bool = False,
        cores: CoreShare | None = None,
    ):
        """``keep_logits``: the last stage's outputs carry the fp32 logits (in-process);
        ``cores``: borrow idle local neighbours' cores while computing (core_share.py)."""
        self.stage = stage
        self.keep_logits = keep_logits
        self.spec = spec
        self.model = model
        self.model_config = model.config
        self.admission = StageAdmission(
            StageConfig(
                stage=stage,
                num_blocks=spec.stage_blocks[stage],
                block_size=spec.block_size,
                num_layers=len(model.layer_range),
                snapshot_interval_blocks=model.config.snapshot_interval_blocks,
                headroom_blocks=spec.headroom_blocks(stage),
                enable_kv_events=spec.kv_events,
            )
        )
        self.kv = stage_cache(
            model.config,
            model.layer_range,
            spec.stage_blocks[stage],
            spec.block_size,
            model.dtype,
            model.device,
        )
        self._lock = threading.Lock()
        self._options: dict[str, RequestOptions] = {}  # sent with a first chunk (_lock)
        self._wave_options: dict[str, RequestOptions] = {}  # the running wave's (LOOP)
        self._captured: dict[str, CapturedKV] = {}
        self.cores = cores
        self.handoff: StageKVHandoff | None = None
        if kv_handoff is not None:
            self.handoff = StageKVHandoff(stage, spec.num_stages, self.kv, kv_handoff, self)

    # -- KV hand-off: its HandoffOwner side (hand-off / LOOP / WAVE threads) ----------------
    def pin_final(
        self, request_id: str, start: int, end: int, *, to_prompt_end: bool = False
    ) -> FinalBlocks | None:
        with self._lock:
            return self.admission.pin_final(request_id, start, end, to_prompt_end=to_prompt_end)

    def release(self, request_id: str) -> None:
        with self._lock:
            self.admission.unpin(request_id)  # False when an abort released it already

    def release_transfer(self, blocks: list[KVBlock]) -> None:
        with self._lock:
            self.admission.unpin_transfer(blocks)

    def report_handoffs(self, sink: Callable[[tuple[HandoffOutcome, ...]], object]) -> None:
        """Where this stage's KV hand-off outcomes go as they happen (no-op without one)."""
        if self.handoff is not None:
            self.handoff.report_to(sink)

    def kv_cancel(self, request_ids: tuple[str, ...]) -> None:
        if self.handoff is not None:
            for rid in request_ids:
                self.handoff.cancel(rid)

    def kv_held(self) -> KVHeld:
        return self.handoff.held() if self.handoff is not None else KVHeld()

    def close(self) -> None:
        """Stop the hand-off (WRITEs aborted, leases revoked, pins dropped); idempotent. The
        stage stays checkable afterwards (``check``)."""
        handoff, self.handoff = self.handoff, None
        if handoff is not None:
            handoff.close()

    # -- WAVE thread ---------------------------------------------------------------------------
    def admit(self, message: RoundRequest) -> StageReply:
        if self.handoff is not None:  # a reused id supersedes its predecessor's hand-off
            self.handoff.supersede(spec.request_id for spec in message.new_requests)
        with self._lock:
            reply = self.admission.handle(message)
            self._sweep_options()
            return reply

    def lend(self, order: LendOrder) -> StageKVManifest | None:
        """The source side of a prefix fetch (WAVE thread): pin the cached run of the
        prefix's blocks here and lease it for the other pipeline's stages to READ; None
        when none is cached here or this stage has no KV agent."""
        if self.handoff is None:
            return None
        with self._lock:
            held = self.admission.pin_cached(order.spec)
        if held is None:
            return None
        try:
            return self.handoff.lend(order.spec.request_id, held, order.lease_ttl_s).result()
        except Exception:  # noqa: BLE001 - the pins came back; the fetch gets less
            log.warning("stage %d: could not lease a cached prefix", self.stage, exc_info=True)
            return None

    def fetch(self, order: FetchOrder) -> FetchReply:
        """This stage's part of a prefix fetch (WAVE thread): hold room for the blocks it
        lacks (``StageAdmission.begin_fetch``), READ its layers of them from the other
        pipeline's stages (the hand-off thread), then cache them as if computed, or give
        them back when the READ failed. Waves keep running meanwhile."""
        rid, handoff = order.spec.request_id, self.handoff
        if handoff is None:  # before any block is reserved
            return FetchReply(self.stage, error="this stage has no KV agent (--no-kv-shipping)")
        with self._lock:
            table = self.admission.begin_fetch(order.spec)
        if isinstance(table, FetchSkip):
            return FetchReply(self.stage, skipped=table.value)
        landed, error, read, began = False, "", 0, time.perf_counter()
        try:
            read = handoff.fetch(order.manifests, table, order.lease_expiry_unix_s).result()
            landed = True
        except Exception as exc:  # the blocks go back; the request computes the prefix
            error = f"{type(exc).__name__}: {exc}"
        finally:
            with self._lock:
                cached = self.admission.end_fetch(rid, landed)
        return FetchReply(self.stage, cached, read, time.perf_counter() - began, error)

    def check(self) -> None:
        with self._lock:
            self.admission.check_integrity()
        if self.handoff is not None:
            self.handoff.check_integrity()

    def dump_kv(self, request_id: str) -> CapturedKV | None:
        return self._captured.get(request_id)

    def pool_stats(self) -> PoolStats:
        """The pool's block counts (any thread)."""
        with self._lock:
            return self.admission.pool.stats()

    @property
    def pool(self) -> BlockPool:
        return self.admission.pool

    # -- LOOP thread ---------------------------------------------------------------------------
    def run_wave(self, header: WaveHeader, hidden: torch.Tensor | None) -> StepOutput:
        cores = self.cores
        if cores is None:
            return self._run_wave(header, hidden)
        cores.computing(True)  # the idle neighbours' cores are ours until it ends
        try:
            return self._run_wave(header, hidden)
        finally:
            cores.computing(False)

    def _follow(self, header: WaveHeader, skip: set[str]) -> list[tuple[str, str]]:
        """``trtllm``, stages > 0: drop the requests rank 0 dropped, then take rank 0's
        admission of each new prompt (``StageAdmission.follow``) at its first chunk's start.

        As in TensorRT-LLM's ``_pp_retry_until_can_schedule``: when this stage lacks the
        capacity, it retries only while its KV hand-offs are releasing blocks (up to
        ``FOLLOW_RETRIES`` times); otherwise, or when its cache lacks part of the prefix rank
        0 reused, it raises, here as a failure of that request (TensorRT-LLM's executor
        raises out of its loop). Returns the failures."""
        with self._lock:
            for request_id in header.forgets:
                self.admission.abort(request_id)
        starts = {c.request_id: c.start for c in header.chunks}
        failed: list[tuple[str, str]] = []
        for spec in header.new_requests:
            rid = spec.request_id
            if rid in skip:
                continue
            for attempt in range(FOLLOW_RETRIES + 1):
                with self._lock:
                    status = self.admission.follow(spec, starts[rid])
                held = self.handoff.held().blocks if self.handoff is not None else 0
                if status is not ReserveStatus.NO_CAPACITY or held == 0:
                    break
                if attempt < FOLLOW_RETRIES:
                    time.sleep(FOLLOW_RETRY_S)
            if status is not ReserveStatus.OK:
                detail = f"rank 0 reuses {starts[rid]} tokens; here: {status.value}"
                mismatch = StageStateMismatch(rid, self.stage, MismatchReason.CANNOT_FOLLOW, detail)
                failed.append((rid, str(mismatch.to_error())))
        return failed

    # -- each request's options: sent once, with its first chunk --------------------------------
    def _sweep_options(self) -> None:
        """Under ``_lock``: forget the options of requests that no longer run here."""
        gone = [rid for rid in self._options if self.admission.reservation(rid) is None]
        for rid in gone:
            del self._options[rid]

    def _request_options(self, request_id: str) -> RequestOptions:
        """The options of a chunk of the running wave (LOOP thread)."""
        return self._wave_options.get(request_id, _NO_OPTIONS)

    @property
    def options_held(self) -> int:
        """Requests whose options this stage keeps (observability, tests)."""
        with self._lock:
            return len(self._options)

    def _run_wave(self, header: WaveHeader, hidden: torch.Tensor | None) -> StepOutput:
        """Keep the options first chunks carry, run the wave, then forget the options of
        requests that ended here (their last chunk ran, or they are gone). The wave reads
        its own copy: the WAVE thread's sweep (``admit``) may drop a request's entry once
        ``complete`` released its reservation, before its logits are computed."""
        with self._lock:
            for chunk in header.chunks:
                if chunk.options is not None:
                    self._options[chunk.request_id] = chunk.options
            self._wave_options = {
                c.request_id: self._options.get(c.request_id, _NO_OPTIONS) for c in header.chunks
            }
        try:
            return self._run_chunks(header, hidden)
        finally:
            with self._lock:
                for chunk in header.chunks:
                    if chunk.is_last:
                        self._options.pop(chunk.request_id, None)
                self._sweep_options()
            self._wave_options = {}

    def _run_chunks(self, header: WaveHeader, hidden: torch.Tensor | None) -> StepOutput:
        already_failed = {rid for rid, _ in header.failed}
        failed: list[tuple[str, str]] = []
        if self.stage > 0 and (header.new_requests or header.forgets):
            failed = self._follow(header, already_failed)
            already_failed |= {rid for rid, _ in failed}
        tables: list[tuple[int, WaveChunk, BlockTable]] = []
        rows = 0
        with self._lock:
            for chunk in header.chunks:
                if chunk.request_id not in already_failed:
                    table = self.admission.materialise(chunk.request_id, chunk.start, chunk.length)
                    if isinstance(table, StageStateMismatch):
                        failed.append((chunk.request_id, str(table.to_error())))
                        self.admission.abort(chunk.request_id)
                    else:
                        if table.copy_block is not None:  # a wholly cached prompt
                            self.kv.copy_block(*table.copy_block)
                        tables.append((rows, chunk, table))
                rows += chunk.length
        out = None
        if not self.model.is_last:
            out = torch.zeros(
                rows,
                self.model_config.hidden_size,
                dtype=self.model.dtype,
                device=self.model.device,
            )
        if not tables:
            return StepOutput(out, failed=tuple(failed), kv_events=self._drain_events())
        if self.spec.debug_wave_delay_s > 0:  # tests only: see PipelineSpec
            time.sleep(self.spec.debug_wave_delay_s)
        ranges = self._chunk_ranges(tables)  # what the KV hand-off streams of this wave
        try:
            hidden_ok = self._forward(tables, hidden, ranges)
        except Exception as exc:  # a bug in one wave must not take the stage down
            log.exception("stage %d: wave %d failed", self.stage, header.wave_id)
            with self._lock:
                for _, chunk, _ in tables:
                    self.admission.abort(chunk.request_id)
            msg = f"stage {self.stage}: wave {header.wave_id} failed: {exc!r}"
            failed.extend((chunk.request_id, msg) for _, chunk, _ in tables)
            return StepOutput(out, failed=tuple(failed), kv_events=self._drain_events())
        computed_at = time.monotonic()
        # the KV is final: ship it before the logits, so the last WRITE overlaps the LM head
        if self.handoff is not None:
            self.handoff.stream_chunks(ranges, before=self._kv_written)
        manifests = self._complete(tables, failed)
        if self.model.is_last:
            outputs = self._outputs(header, tables, hidden_ok, failed)
            events = self._drain_events()
            return StepOutput(None, outputs, tuple(failed), manifests, events, computed_at)
        events = self._drain_events()
        if out is None:
            raise InvariantError("a non-last stage without an output buffer")
        offset = 0
        for row, chunk, _ in tables:
            out[row : row + chunk.length] = hidden_ok[offset : offset + chunk.length]
            offset += chunk.length
        return StepOutput(out, (), tuple(failed), manifests, events)

    def _outputs(
        self,
        header: WaveHeader,
        tables: list[tuple[int, WaveChunk, BlockTable]],
        hidden: torch.Tensor,
        failed: list[tuple[str, str]],
    ) -> tuple[RequestOutput, ...]:
        """The finished requests' logits. They run after ``_complete``: a failure here fails
        only those requests (their KV is complete; the leader cancels their hand-off)."""
        try:
            return self._logits(tables, hidden)
        except Exception as exc:  # a bug in one wave must not take the stage down
            log.exception("stage %d: logits of wave %d failed", self.stage, header.wave_id)
            msg = f"stage {self.stage}: wave {header.wave_id} failed: {exc!r}"
            failed.extend((c.request_id, msg) for _, c, _ in tables if c.is_last)
            return ()

    def _drain_events(self) -> tuple[StageEventBatch, ...]:
        if not self.spec.kv_events:
            return ()
        with self._lock:
            events = tuple(self.admission.drain_events())
        return ((self.stage, events),) if events else ()

    def _forward(
        self,
        tables: list[tuple[int, WaveChunk, BlockTable]],
        hidden: torch.Tensor | None,
        ranges: list[ChunkRange],
    ) -> torch.Tensor:
        batch = ChunkBatch(tuple(ChunkSpec(c.start, c.length, t.block_ids) for _, c, t in tables))
        if self.model.is_first:
            ids: list[int] = []
            for _, chunk, _ in tables:
                rsv = self.admission.reservation(chunk.request_id)
                if rsv is None:  # aborted between materialise and here: a leader bug
                    raise InvariantError(f"request {chunk.request_id!r} vanished mid-wave")
                ids.extend(rsv.prompt.spec.token_ids[chunk.start : chunk.start + chunk.length])
            inputs = torch.tensor(ids, dtype=torch.long, device=self.model.device)
        else:
            if hidden is None:
                raise InvariantError("a non-first stage got a wave without activations")
            if hidden.shape[0] == batch.total_tokens:  # no failed rows to skip
                inputs = hidden
            else:
                inputs = torch.cat([hidden[r : r + c.length] for r, c, _ in tables])
        return self.model(inputs, batch, self.kv, after_layer=self._layer_hook(ranges))

    def _layer_hook(self, ranges: list[ChunkRange]) -> Callable[[int], None] | None:
        """The forward's per-layer hook: the KV hand-off's (``StageKVHandoff.layer_hook``),
        and with core sharing, the thread count for the next layer (``CoreShare.adjust``)."""
        handoff, cores = self.handoff, self.cores
        group = None
        if handoff is not None:
            group = handoff.layer_hook(ranges, self.model.layer_range, self._fence)
        if cores is None:
            return group
        cores.adjust()  # the first layer's
        last = self.model.layer_range.end - 1

        def after_layer(layer: int) -> None:
            if group is not None:
                group(layer)
            if layer < last:
                cores.adjust()

        return after_layer

    def _logits(
        self, tables: list[tuple[int, WaveChunk, BlockTable]], hidden: torch.Tensor
    ) -> tuple[RequestOutput, ...]:
        finals, rows, offset = [], [], 0
        for _, chunk, _ in tables:
            offset += chunk.length
            if chunk.is_last:
                finals.append(chunk)
                rows.append(offset - 1)
        if not finals:
            return ()
        logits = self.model.compute_logits(hidden[rows])
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        outputs = []
        for i, chunk in enumerate(finals):
            top = self._request_options(chunk.request_id).top_logprobs
            k = min(max(1, top), logprobs.shape[-1])
            values, ids = torch.topk(logprobs[i], k)
            pairs = tuple(zip(ids.tolist(), values.tolist(), strict=True))
            kept = logits[i].float() if self.keep_logits else None
            outputs.append(RequestOutput(chunk.request_id, pairs, kept))
        return tuple(outputs)

    def _chunk_ranges(self, tables: list[tuple[int, WaveChunk, BlockTable]]) -> list[ChunkRange]:
        """The wave's chunks as the KV hand-off sees them (with their requests' destinations)."""
        return [
            ChunkRange(
                c.request_id,
                c.start,
                c.start + c.length,
                self._request_options(c.request_id).kv_destination,
                c.is_last,
            )
            for _, c, _ in tables
        ]

    def _fence(self) -> Callable[[], object] | None:
        """At a layer group's end: what its WRITE waits for (on CUDA, that group's kernels)."""
        if self.model.device.type != "cuda":
            return None
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.model.device))
        return ready.synchronize

    def _kv_written(self) -> None:
        """Before a WRITE reads this wave's KV: on CUDA, wait for the forward's kernels."""
        if self.model.device.type == "cuda":
            torch.cuda.current_stream(self.model.device).synchronize()

    def _complete(
        self, tables: list[tuple[int, WaveChunk, BlockTable]], failed: list[tuple[str, str]]
    ) -> tuple[tuple[str, StageKVManifest], ...]:
        manifests = []
        for _, chunk, table in tables:
            if not chunk.is_last:  # reusable before the prompt ends (waiting requests)
                with self._lock:
                    self.admission.cache_computed(chunk.request_id, table.end)
                continue
            if self.spec.capture_kv:
                self._capture(chunk.request_id, table)
            dest = None
            if self.handoff is not None:
                dest = self._request_options(chunk.request_id).kv_destination
            with self._lock:
                done = self.admission.complete(chunk.request_id, keep_pinned=dest is not None)
            if isinstance(done, StageStateMismatch):
                failed.append((chunk.request_id, str(done.to_error())))
                continue
            manifest = kv_manifest(self.stage, self.kv, done.block_ids, table.end)
            if dest is not None and self.handoff is not None:
                self._kv_written()
                blocks = [self.admission.pool.block(b) for b in done.block_ids]
                self.handoff.ship(chunk.request_id, blocks, manifest, dest, chunk.traceparent)
            manifests.append((chunk.request_id, manifest))
        return tuple(manifests)

    def _capture(self, request_id: str, table: BlockTable) -> None:
        ks, vs = [], []
        for layer in self.kv.layer_range:
            planes = self.kv.read_planes(layer, table.block_ids, table.end)
            ks.append(planes[0].cpu().clone())  # K, or an MLA cache's whole entries
            vs.append(planes[-1].cpu().clone() if len(planes) == 2 else planes[0][:, :0].cpu())
        self._captured[request_id] = CapturedKV(
            self.stage, self.kv.layer_range.start, tuple(ks), tuple(vs)
        )


def build_stage_compute(
    spec: PipelineSpec,
    stage: int,
    kv_handoff: KVHandoffConfig | None = None,
    cores: CoreShare | None = None,
) -> PipelineStageCompute:
    """Load stage ``stage``'s slice and allocate its KV (what each stage process does once);
    with ``kv_handoff``, also create its NIXL agent and register the KV tensors; with
    ``cores``, borrow idle neighbours' cores (core_share.py)."""
    torch.manual_seed(0)
    model = load_stage_model(spec, stage)
    return PipelineStageCompute(spec, stage, model, kv_handoff, cores=cores)
