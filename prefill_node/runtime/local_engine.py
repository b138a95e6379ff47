"""LocalEngine: the Engine protocol in ONE process, P pipeline stages simulated in-process.

Each stage is a StageExecutor: its layers, KV memory and the core's ``StageAdmission``
(stages may differ in capacity). A request runs to completion inside ``submit``:

1. admission: one round of the core's ``AdmissionCoordinator`` over the stages
   (``core/round_driver.py``), the same messages the multi-process leader sends over its
   rounds plane: LOOKUP (the minimum of the stages' hints), RESERVE (lease under the
   collision guard + escrow for the suffix), COMMIT at the common boundary.
2. compute: chunks of at most ``max_chunk_tokens`` pass stage 0 -> P-1 in order; each
   stage materialises a chunk's blocks from its escrow just before the forward.
3. completion: once the last chunk left a stage, it caches the request's new full blocks
   and unpins them, or, for a request with a ``kv_destination``, keeps them pinned and its
   ``StageShipping`` thread ships them (the same per-stage thread a runtime stage runs) while
   the next stages compute; the answer waits for every stage's outcome. The last stage's
   logits give the greedy first token and the top logprobs.

Decisions: requests are serialised by a lock (one in flight), so ``submit`` returns an
already completed future. ``abort`` (from another thread: the server on a client cancel)
stops a request queued behind the lock before it starts, and a running one at its next
chunk boundary, dropping it on every stage (abort_registry.py). With one request in flight
admission never waits once ``NeverFitsError`` has been ruled out (a stage too small for a
wholly cached prompt plus the copy of its last block reuses one block less:
``StageAdmission._reuse_limit``), so it reports the same ``cached_tokens`` as a pipeline.
The stage manifests describe where the KV sat at completion; no lease holds it afterwards
unless the request shipped it (``kv_shipping`` given).
"""

from __future__ import annotations

import operator
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from prefill_node.core.admission_messages import Admitted
from prefill_node.core.coordinator import AdmissionCoordinator, CoordinatorConfig
from prefill_node.core.hashing import ExtraKeys, model_cache_id
from prefill_node.core.request import RequestSpec
from prefill_node.core.round_driver import run_round
from prefill_node.engine.types import (
    CacheIdentity,
    EngineHealth,
    EngineLoad,
    KVPushDestination,
    PrefillOptions,
    PrefillResult,
    PrefillTimings,
    StageKVManifest,
)
from prefill_node.errors import (
    InvalidKVDestinationError,
    InvalidPromptError,
    InvalidRequestError,
    InvariantError,
    KVHandoffError,
    NeverFitsError,
    RequestAbortedError,
    UnavailableError,
)
from prefill_node.kv_shipping.stage_shipping import StageHandoff
from prefill_node.model.config import ModelConfig
from prefill_node.model.partition import split_layers
from prefill_node.model.stage_model import StageModel
from prefill_node.runtime.abort_registry import AbortFlag, AbortRegistry
from prefill_node.runtime.kv_event_feed import KVEventFeed
from prefill_node.runtime.leader_handoff import handoff_error
from prefill_node.runtime.stage_executor import ChunkWork, StageExecutor

if TYPE_CHECKING:
    from prefill_node.kv_shipping.shipper import KVShippingConfig
    from prefill_node.runtime.kv_event_feed import KVEventSink

MAX_TOP_LOGPROBS = 20


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[tuple[int, float], ...]:
    """The ``k`` most likely next tokens as (token id, log probability), best first."""
    if k == 0:
        return ()
    top = torch.topk(torch.log_softmax(logits.float(), dim=-1), k)
    return tuple((int(i), float(v)) for v, i in zip(top.values, top.indices, strict=True))


@dataclass(frozen=True)
class LocalEngineConfig:
    """Shape of the simulated pipeline. ``num_blocks``: one int for every stage, or one per
    stage. ``max_model_len`` None = the model's ``max_position_embeddings``."""

    num_stages: int = 1
    num_blocks: int | tuple[int, ...] = 512
    block_size: int = 16
    max_chunk_tokens: int = 512
    max_model_len: int | None = None
    dtype: torch.dtype = torch.float32
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise InvalidRequestError(f"num_stages must be >= 1, got {self.num_stages}")
        if self.block_size < 1 or self.max_chunk_tokens < 1:
            raise InvalidRequestError("block_size and max_chunk_tokens must be >= 1")
        if not isinstance(self.num_blocks, int) and len(self.num_blocks) != self.num_stages:
            raise InvalidRequestError(
                f"num_blocks lists {len(self.num_blocks)} stages; the pipeline has "
                f"{self.num_stages}"
            )
        if min(self.stage_num_blocks) < 1:
            raise InvalidRequestError(f"every stage needs >= 1 block, got {self.num_blocks}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise InvalidRequestError(f"max_model_len must be >= 1, got {self.max_model_len}")

    @property
    def stage_num_blocks(self) -> tuple[int, ...]:
        if isinstance(self.num_blocks, int):
            return (self.num_blocks,) * self.num_stages
        return tuple(self.num_blocks)


@dataclass(frozen=True)
class LocalPrefill:
    """A finished prefill plus the fp32 logits [vocab] of the last prompt token."""

    result: PrefillResult
    logits: torch.Tensor


class LocalEngine:
    """In-process pipeline of ``StageExecutor``s implementing ``Engine``. Thread-safe."""

    def __init__(
        self,
        model_config: ModelConfig,
        stages: Sequence[StageExecutor],
        config: LocalEngineConfig,
        *,
        kv_events: KVEventSink | None = None,
    ) -> None:
        """The stages ship each request's KV to the decode worker named by
        ``PrefillOptions.kv_destination`` when they were built with ``kv_shipping``.
        ``kv_events``: receives the pipeline's KV events (blocks resident on ALL stages;
        kv_event_feed.py) after every request, e.g. ``KVEventHub.publish``; the stages'
        pools must buffer events (``from_*`` constructors arrange it)."""
        if len(stages) != config.num_stages:
            raise InvariantError(f"{len(stages)} stage executors for {config.num_stages} stages")
        self.model_config = model_config
        self.stages = tuple(stages)
        self.config = config
        self.model_id = model_cache_id(model_config.name, str(config.dtype))
        self._coordinator = AdmissionCoordinator(
            CoordinatorConfig(config.block_size, config.stage_num_blocks, max_requests_per_round=1)
        )
        self._lock = threading.Lock()
        self._inflight_tokens = 0
        self._aborts = AbortRegistry()
        self._closed = False
        self._shipping = all(stage.shipping is not None for stage in self.stages)
        self._kv_feed = KVEventFeed.for_stages(self.stages, kv_events) if kv_events else None
        self._wait_limit_s = 60.0

    @classmethod
    def from_stage_models(
        cls,
        models: Sequence[StageModel],
        config: LocalEngineConfig,
        kv_shipping: KVShippingConfig | None = None,
        *,
        kv_events: KVEventSink | None = None,
    ) -> LocalEngine:
        """``kv_shipping``: every stage gets a NIXL agent and ships the KV of requests with a
        ``kv_destination``; None: such requests are refused."""
        stages = [
            StageExecutor(
                s,
                m,
                n,
                config.block_size,
                events=kv_events is not None,
                num_stages=config.num_stages,
                kv_shipping=kv_shipping,
            )
            for s, (m, n) in enumerate(zip(models, config.stage_num_blocks, strict=True))
        ]
        engine = cls(models[0].config, stages, config, kv_events=kv_events)
        if kv_shipping is not None:
            engine._wait_limit_s = kv_shipping.wait_limit_s + 5.0
        return engine

    @classmethod
    def from_weights(
        cls,
        model_config: ModelConfig,
        weights: dict[str, torch.Tensor],
        config: LocalEngineConfig,
        kv_shipping: KVShippingConfig | None = None,
        *,
        kv_events: KVEventSink | None = None,
    ) -> LocalEngine:
        """Build from one HF-named weight dict (e.g. ``random_weights`` in tests)."""
        models = []
        for layer_range in split_layers(model_config.num_layers, config.num_stages):
            model = StageModel(model_config, layer_range, config.dtype, config.device)
            model.load_weights(weights)
            models.append(model)
        return cls.from_stage_models(models, config, kv_shipping, kv_events=kv_events)

    @classmethod
    def from_model_dir(
        cls,
        path: str | Path,
        config: LocalEngineConfig,
        kv_shipping: KVShippingConfig | None = None,
        *,
        kv_events: KVEventSink | None = None,
    ) -> LocalEngine:
        """Build from a Hugging Face checkpoint directory; each stage loads only its slice."""
        from prefill_node.model.loader_hf import load_hf_config, load_stage_model

        model_config = load_hf_config(path)
        models = [
            load_stage_model(path, layer_range, config.dtype, config.device)
            for layer_range in split_layers(model_config.num_layers, config.num_stages)
        ]
        return cls.from_stage_models(models, config, kv_shipping, kv_events=kv_events)

    def kv_held_blocks(self) -> tuple[int, ...]:
        """Per stage: block references its shipper holds now (in-flight WRITEs, live leases)."""
        return tuple(s.shipping.held().blocks if s.shipping else 0 for s in self.stages)

    # ---- Engine protocol -----------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        return min(limit, self.config.max_model_len or limit)

    @property
    def cache_identity(self) -> CacheIdentity:
        return CacheIdentity(
            self.model_id,
            self.config.block_size,
            self.model_config.snapshot_interval_blocks,
        )

    def submit(self, token_ids: Sequence[int], options: PrefillOptions) -> Future[PrefillResult]:
        """Validate (raising), run the prefill now, return a completed future."""
        future: Future[PrefillResult] = Future()
        try:
            future.set_result(self.prefill(token_ids, options).result)
        except (InvalidRequestError, NeverFitsError):
            raise
        except Exception as exc:  # a failed request fails its future, never the engine
            future.set_exception(exc)
        return future

    def abort(self, request_id: str) -> bool:
        """Stop ``request_id`` if it is queued or running (see the module docstring); its
        ``submit`` then fails with RequestAbortedError. False: no such request in flight."""
        return self._aborts.abort(request_id)

    def load(self) -> EngineLoad:
        tokens = self._inflight_tokens
        running = int(tokens > 0)
        stages = tuple(stage.load() for stage in self.stages)
        return EngineLoad(
            queue_depth=max(0, len(self._aborts) - running),
            inflight_requests=running,
            inflight_tokens=tokens,
            stages=stages,
        )

    def health(self) -> EngineHealth:
        if self._closed:
            return EngineHealth(live=False, ready=False, detail="engine shut down")
        return EngineHealth(live=True, ready=True)

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            for stage in self.stages:
                stage.close()

    def check_integrity(self) -> None:
        """Every stage's block pool and shipper is consistent (raises otherwise)."""
        for stage in self.stages:
            stage.check_integrity()

    # ---- the prefill ---------------------------------------------------------------

    def validate(self, token_ids: Sequence[int], options: PrefillOptions) -> tuple[int, ...]:
        """The prompt as a tuple of ints; InvalidRequestError / NeverFitsError saying why not."""
        try:
            ids = tuple(operator.index(t) for t in token_ids)
        except TypeError as exc:
            raise InvalidPromptError(f"token ids must be integers: {exc}") from None
        if not ids:
            raise InvalidPromptError("the prompt is empty; send at least one token")
        for pos, tok in enumerate(ids):
            if not 0 <= tok < self.vocab_size:
                raise InvalidPromptError(
                    f"token id {tok} at position {pos} is outside the vocabulary "
                    f"[0, {self.vocab_size})"
                )
        if len(ids) > self.max_model_len:
            raise InvalidPromptError(
                f"the prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len}"
            )
        if not 0 <= options.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {options.top_logprobs}"
            )
        if options.kv_destination is not None and not self._shipping:
            raise InvalidKVDestinationError(
                "this engine has no KV shipping configured; omit kv_destination"
            )
        for stage in self.stages:
            if not stage.can_ever_fit(len(ids)):
                raise NeverFitsError(
                    f"the prompt needs {stage.blocks_for(len(ids))} blocks of {stage.block_size} "
                    f"tokens; stage {stage.stage} has only {stage.num_blocks}"
                )
        return ids

    def prefill(self, token_ids: Sequence[int], options: PrefillOptions) -> LocalPrefill:
        """Synchronous prefill (what ``submit`` runs), also returning the full last logits."""
        t_submit = time.monotonic()
        ids = self.validate(token_ids, options)
        request_id = options.request_id or uuid.uuid4().hex
        with self._aborts.track(request_id) as aborted, self._lock:
            if self._closed:
                raise UnavailableError("the engine has been shut down")
            aborted.check("before it started")
            t_start = time.monotonic()
            self._inflight_tokens = len(ids)
            admitted = False
            try:
                cached = self._admit(request_id, ids, options)
                admitted = True
                t_admitted = time.monotonic()
                logits, manifests = self._compute(request_id, ids, cached, options, aborted)
                t_computed = time.monotonic()
                if options.kv_destination is not None:  # every stage's WRITE / lease
                    manifests = self._await_handoff(request_id)
                admitted = False
            finally:
                if admitted:  # failed or aborted: every stage drops it, hand-off included
                    for stage in self.stages:
                        stage.abort(request_id)
                self._inflight_tokens = 0
                if self._kv_feed is not None:  # evictions of a failed request count too
                    self._kv_feed.publish_from_stages(self.stages)
        t_done = time.monotonic()
        result = PrefillResult(
            request_id=request_id,
            first_token_id=int(torch.argmax(logits).item()),
            top_logprobs=top_logprobs(logits, options.top_logprobs),
            prompt_tokens=len(ids),
            cached_tokens=cached,
            computed_tokens=len(ids) - cached,
            timings=PrefillTimings(
                queue_s=t_start - t_submit,
                admission_s=t_admitted - t_start,
                compute_s=t_computed - t_admitted,
                total_s=t_done - t_submit,
                handoff_s=t_done - t_computed if options.kv_destination is not None else 0.0,
            ),
            stage_manifests=manifests,
        )
        return LocalPrefill(result, logits)

    def _admit(self, request_id: str, ids: tuple[int, ...], options: PrefillOptions) -> int:
        """Reserve the request on every stage in one admission round (the core's coordinator
        and stages' ``StageAdmission``); the tokens reused on every stage."""
        spec = RequestSpec(request_id, ids, ExtraKeys(self.model_id, options.cache_salt))
        outcomes = run_round(self._coordinator, self.stages, [spec])
        outcome = next(o for o in outcomes if o.request_id == request_id)
        if isinstance(outcome, Admitted):
            return outcome.cached_len
        self._coordinator.abort(request_id)
        for stage in self.stages:
            stage.abort(request_id)
        raise InvariantError(f"no room for {request_id!r} although it fits every stage: {outcome}")

    def _compute(
        self,
        request_id: str,
        ids: tuple[int, ...],
        start: int,
        options: PrefillOptions,
        aborted: AbortFlag | None = None,
    ) -> tuple[torch.Tensor, tuple[StageKVManifest, ...]]:
        """Run the uncached suffix from ``start`` chunk by chunk through every stage, each
        completing the request as its last chunk leaves it; the last logits and the
        stages' manifests."""
        device = self.stages[0].model.device
        logits: torch.Tensor | None = None
        manifests: list[StageKVManifest] = []
        while start < len(ids):
            if options.deadline_s is not None and time.monotonic() > options.deadline_s:
                raise RequestAbortedError(f"deadline passed after {start}/{len(ids)} tokens")
            if aborted is not None:
                aborted.check(f"after {start}/{len(ids)} tokens")
            length = min(self.config.max_chunk_tokens, len(ids) - start)
            x = torch.tensor(ids[start : start + length], dtype=torch.long, device=device)
            last = start + length == len(ids)
            dest = options.kv_destination
            for stage in self.stages:
                step = stage.execute([ChunkWork(request_id, start, length)], x)
                x = step.hidden
                if last:
                    manifests.append(stage.complete(request_id, dest))
                elif isinstance(dest, KVPushDestination):  # streamed while the rest runs
                    stage.stream(request_id, start, start + length, dest)
            logits = step.logits
            start += length
        if logits is None:
            raise InvariantError("the last stage returned no logits for a finished prompt")
        return logits[0], tuple(manifests)

    def _await_handoff(self, request_id: str) -> tuple[StageKVManifest, ...]:
        """Every stage's shipped manifest (push: WRITE landed; pull: lease published), in
        stage order; the typed error of the first failed stage, or a timeout, otherwise."""
        deadline = time.monotonic() + self._wait_limit_s
        outcomes: dict[int, StageHandoff] = {}
        while len(outcomes) < len(self.stages) and time.monotonic() < deadline:
            for stage in self.stages:
                if stage.shipping is not None:
                    for h in stage.shipping.take_outcomes():
                        if h.request_id == request_id:
                            outcomes.setdefault(h.stage, h)
            if any(not h.ok for h in outcomes.values()):
                break
            time.sleep(0.0005)
        failed = [h for h in outcomes.values() if not h.ok]
        if failed:
            raise handoff_error(request_id, failed[0])
        if len(outcomes) < len(self.stages):
            missing = sorted(set(range(len(self.stages))) - set(outcomes))
            raise KVHandoffError(
                f"KV hand-off of {request_id} timed out: stages {missing} did not report"
            )
        return tuple(outcomes[s].manifest for s in range(len(self.stages)))  # type: ignore[misc]
