"""The leader's sans-IO state: admission coordinator + the core's wave scheduler, in wire types."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prefill_node.core.admission_messages import Admitted, Rejected, RoundRequest
from prefill_node.core.coordinator import (
    AdmissionCoordinator,
    CoordinatorConfig,
    DuplicateRequestError,
)
from prefill_node.core.hashing import ExtraKeys, model_cache_id
from prefill_node.core.planner import WavePlanner
from prefill_node.core.request import RequestSpec
from prefill_node.core.wave_scheduler import WaveScheduler
from prefill_node.engine.types import KVPullDestination, KVPushDestination
from prefill_node.errors import NeverFitsError, WaveppError
from prefill_node.runtime.messages import WaveChunk, WaveHeader, WaveResult
from prefill_node.runtime.spec import PipelineSpec

# top-k, KV destination, W3C traceparent ("" untraced): what each chunk of a request carries
ChunkOptions = tuple[int, KVPushDestination | KVPullDestination | None, str]
"""A request's ``top_k`` and KV destination, as every one of its chunks carries them."""


@dataclass(frozen=True)
class AdmissionVerdict:
    """A request left the admission queue: admitted with ``cached_tokens`` reused on every
    stage, or refused with ``error`` (e.g. NeverFitsError)."""

    request_id: str
    cached_tokens: int = 0
    error: WaveppError | None = None


@dataclass(frozen=True)
class CoreCounts:
    queue_depth: int  # submitted, not yet admitted
    inflight_requests: int  # admitted, not finished
    inflight_tokens: int  # tokens of admitted requests still to compute


class LeaderCore:
    """Admission coordinator + ``core.wave_scheduler.WaveScheduler``, for the leader's threads.

    The scheduling itself (progress, waves, completion, deferred abort) is the core's, the
    same object the simulator drives; this class adds the coordinator's rounds and turns the
    core's waves into the data plane's ``WaveHeader``. A request's ``top_k`` and KV
    destination ride on every chunk (stages complete and ship on the last, and may stream
    push KV after earlier ones); ``chunk_options(request_id)`` reads them from the
    request's one record (``LeaderRequest``), so this class keeps no per-request copy.

    Sans-IO and not thread-safe: the ``Leader`` calls it under its lock. Contracts:

    - ``submit`` queues a request; ``begin_round`` / ``finish_phase`` run admission rounds
      (the caller broadcasts each message and gathers the replies). A round runs only when
      something may have changed (new request, completion, abort, or the last round admitted
      someone), so requests waiting for capacity do not spin the rounds plane.
    - ``next_wave`` packs admitted work (FCFS) into the next wave; ``wave_done`` accounts
      its result. Under ``sync-admission`` a request with a chunk in flight is skipped until that
      chunk returns (TensorRT-LLM's PP executor skips ``inflight_req_ids``), so a request's
      chunks never overlap in the pipeline; under ``wave`` they do. A request's stages
      complete it on their own when its last chunk passes.
    - ``abort`` of an admitted request defers the stage-side cleanup (the coordinator's
      ``forgets``) until none of its chunks is still in flight, so a stage never frees blocks
      that a forward is writing.
    - Under ``trtllm`` (``Policy.rank0_decides``) the coordinator knows stage 0 alone, so a
      round is rank 0's decision from its own cache; ``next_wave`` carries each admitted
      prompt with its first chunk and the stage-side cleanups since the last wave
      (``WaveHeader.new_requests`` / ``forgets``) to the stages that follow.
    """

    def __init__(
        self,
        spec: PipelineSpec,
        model_config: Any,
        chunk_options: Callable[[str], ChunkOptions] = lambda _rid: (1, None, ""),
    ):
        policy = spec.scheduling_policy
        self._rank0_decides = policy.rank0_decides
        self._coordinator = AdmissionCoordinator(
            CoordinatorConfig(
                spec.block_size,
                spec.stage_blocks[:1] if self._rank0_decides else spec.stage_blocks,
                policy.max_round_requests,
                share_inflight_prefix=policy.share_inflight_prefix,
            )
        )
        planner = WavePlanner(
            policy.planner_config(
                max_wave_tokens=spec.max_wave_tokens,
                min_wave_tokens=spec.min_wave_tokens,
                block_size=spec.block_size,
                max_wave_requests=spec.max_batch,
            )
        )
        self._scheduler = WaveScheduler(policy, planner)
        self.model_id = model_cache_id(model_config.name, spec.dtype)
        self._chunk_options = chunk_options
        self._dirty = False
        self._to_follow: dict[str, RequestSpec] = {}  # trtllm: admitted, first chunk not sent
        self._stage_forgets: list[str] = []  # trtllm: cleanups not yet sent to stages > 0

    # -- admission -----------------------------------------------------------------------------
    def check_fits(self, num_tokens: int) -> None:
        """NeverFitsError if a prompt of ``num_tokens`` exceeds some stage's whole cache."""
        rejected = self._coordinator.check_fits("", num_tokens)
        if rejected is not None:
            raise NeverFitsError(f"the prompt can never fit: {rejected.reason}")

    def submit(self, request_id: str, token_ids: tuple[int, ...], salt: str | None) -> None:
        """Queue a request. DuplicateRequestError while the id is still known (queued, or an
        aborted request whose stage-side cleanup waits for its in-flight chunks)."""
        if request_id in self._scheduler:
            raise DuplicateRequestError(
                f"request id {request_id!r} is still in the pipeline; use a fresh id"
            )
        spec = RequestSpec(request_id, token_ids, ExtraKeys(self.model_id, salt))
        rejected = self._coordinator.submit(spec)
        if rejected is not None:
            raise NeverFitsError(f"the prompt can never fit: {rejected.reason}")
        if self._rank0_decides:
            self._to_follow[request_id] = spec
        self._dirty = True

    def has_round_work(self) -> bool:
        return self._dirty and self._coordinator.has_work()

    def begin_round(self) -> RoundRequest | None:
        if not self.has_round_work():
            return None
        self._dirty = False
        return self._coordinator.begin_round()

    def finish_phase(
        self, replies: list[Any]
    ) -> tuple[RoundRequest | None, list[AdmissionVerdict]]:
        """The next phase's message, or None and the requests that left the queue."""
        step = self._coordinator.finish_phase(replies)
        if isinstance(step, RoundRequest):
            return step, []
        verdicts: list[AdmissionVerdict] = []
        for out in step.outcomes:
            if isinstance(out, Admitted):
                self._scheduler.admit(out.request_id, out.cached_len, out.num_tokens)
                verdicts.append(AdmissionVerdict(out.request_id, out.cached_len))
                self._dirty = True  # progress: try the next queued requests
            elif isinstance(out, Rejected):
                self._to_follow.pop(out.request_id, None)
                verdicts.append(AdmissionVerdict(out.request_id, error=NeverFitsError(out.reason)))
        for rid, positions in self._coordinator.take_cuts().items():  # waiters' prefix ends
            for position in positions:
                self._scheduler.cut(rid, position)
        return None, verdicts

    def abort(self, request_id: str) -> bool:
        """Stop scheduling the request (stage cleanup waits for its chunks in flight); True
        when it had been admitted, False when it was still queued (or unknown)."""
        self._dirty = True
        admitted = request_id in self._scheduler
        if self._scheduler.abort(request_id):
            self._forget(request_id)
        return admitted

    def _forget(self, request_id: str) -> None:
        """Every stage drops the request: stage 0 through the coordinator's next round, the
        stages that follow (``trtllm``) through the next wave."""
        self._coordinator.abort(request_id)
        if self._rank0_decides:
            self._stage_forgets.append(request_id)
            self._to_follow.pop(request_id, None)

    # -- waves ---------------------------------------------------------------------------------
    def next_wave(self) -> WaveHeader | None:
        """The next wave in wire form, or None (ring full, or nothing to run)."""
        wave = self._scheduler.next_wave()
        if wave is None:
            return None
        chunks = []
        new_requests = []
        for c in wave.chunks:
            last = self._scheduler.is_last(c)
            top_k, dest, trace = self._chunk_options(c.request_id)  # every chunk: may stream
            chunks.append(WaveChunk(c.request_id, c.start, c.length, last, top_k, dest, trace))
            spec = self._to_follow.pop(c.request_id, None)
            if spec is not None:
                new_requests.append(spec)
        forgets, self._stage_forgets = tuple(self._stage_forgets), []
        return WaveHeader(
            wave.wave_id, tuple(chunks), new_requests=tuple(new_requests), forgets=forgets
        )

    def wave_done(self, result: WaveResult) -> None:
        """Account a returned wave: finished, failed and aborted requests leave the core."""
        done = self._scheduler.wave_done(result.wave_id, {rid for rid, _ in result.failed})
        for rid in done.dropped:  # aborted or failed: every stage drops what it still holds
            self._forget(rid)
        for rid in done.finished:
            self._coordinator.finished(rid)
        if done.dropped or done.finished:
            self._dirty = True  # capacity freed: waiting requests may fit now
        for rid, end in done.computed:  # every stage cached these chunks' full blocks
            self._dirty |= self._coordinator.computed(rid, end)

    def counts(self) -> CoreCounts:
        return CoreCounts(
            self._coordinator.num_queued,
            self._scheduler.num_running,
            self._scheduler.remaining_tokens,
        )

    @property
    def waves_in_flight(self) -> int:
        return self._scheduler.waves_in_flight

    @property
    def idle(self) -> bool:
        """No admitted work and no wave in flight."""
        return self._scheduler.idle
