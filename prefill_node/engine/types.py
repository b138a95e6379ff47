"""Engine-boundary types: what a caller submits to a prefill engine and what it gets back.

Every engine (the in-process ``LocalEngine`` and the multi-process pipeline on the leader)
implements ``Engine``; the gRPC servicer converts proto messages to and from these types only.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class PrefillOptions:
    """Per-request options. ``cache_salt`` isolates prefix reuse between tenants."""

    request_id: str | None = None  # engine assigns one when None
    cache_salt: str | None = None
    top_logprobs: int = 5
    deadline_s: float | None = None  # absolute time.monotonic() deadline, None = none


@dataclass(frozen=True)
class StageKVManifest:
    """Where one stage holds (or shipped) a request's KV: its layers' blocks, in prompt order."""

    stage: int
    layer_start: int
    layer_end: int
    block_ids: tuple[int, ...]
    block_size: int
    num_tokens: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name, e.g. "float32", "bfloat16"


@dataclass(frozen=True)
class PrefillTimings:
    """Seconds spent in each phase of one request (monotonic clock)."""

    queue_s: float = 0.0  # submit -> admitted
    admission_s: float = 0.0  # admission rounds (lookup, lease, escrow)
    compute_s: float = 0.0  # first chunk start -> last chunk done on the last stage
    total_s: float = 0.0  # submit -> result


@dataclass(frozen=True)
class PrefillResult:
    """The outcome of one prefill: first token of the continuation and where the KV lives."""

    request_id: str
    first_token_id: int
    top_logprobs: tuple[tuple[int, float], ...]  # (token id, logprob), best first
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    timings: PrefillTimings
    stage_manifests: tuple[StageKVManifest, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class StageLoad:
    """Cache occupancy of one stage, in blocks."""

    stage: int
    free_blocks: int
    cached_blocks: int
    used_blocks: int
    total_blocks: int


@dataclass(frozen=True)
class EngineLoad:
    """Queue and cache state, as the router and GetLoad see it."""

    queue_depth: int
    inflight_requests: int
    inflight_tokens: int
    stages: tuple[StageLoad, ...]


@dataclass(frozen=True)
class EngineHealth:
    """``ready``: all stages up and serving. ``detail`` says what is wrong when not."""

    live: bool
    ready: bool
    detail: str = ""


class Engine(Protocol):
    """What the gRPC layer needs from a pipeline.

    Contract: ``submit`` validates its input synchronously (raising InvalidRequestError or
    NeverFitsError) and returns a future that resolves to a PrefillResult or fails with a
    WaveppError (RequestAbortedError after ``abort``; UnavailableError when a stage died).
    A failing request never takes the engine down and always releases its blocks.
    """

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_model_len(self) -> int: ...

    def submit(
        self, token_ids: Sequence[int], options: PrefillOptions
    ) -> Future[PrefillResult]: ...

    def abort(self, request_id: str) -> bool: ...

    def load(self) -> EngineLoad: ...

    def health(self) -> EngineHealth: ...

    def shutdown(self) -> None: ...
