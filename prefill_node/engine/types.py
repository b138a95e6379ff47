"""Engine-boundary types: what a caller submits to a prefill engine and what it gets back.

Every engine (the in-process ``LocalEngine`` and the multi-process pipeline on the leader)
implements ``Engine``; the gRPC servicer converts proto messages to and from these types only.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

MAX_TOP_LOGPROBS = 20  # the most alternatives a request may ask for, on every engine


@dataclass(frozen=True)
class MemoryRegionSpec:
    """One registered KV memory region (one layer's KV tensor) of a NIXL agent."""

    layer: int
    address: int
    length: int
    device_id: int = 0
    kind: str = "dram"  # "dram" | "vram"


@dataclass(frozen=True)
class StateRegionSpec:
    """One registered recurrent-state tensor of a recurrent (linear-attention) layer: one
    ``slot_bytes`` slot per block id, slot b holding the state after block b's last token
    written. ``part``: "matrix" (the recurrent state) or "conv" (the short-conv tail)."""

    layer: int
    part: str
    address: int
    length: int
    slot_bytes: int
    dtype: str  # torch dtype name
    device_id: int = 0
    kind: str = "dram"  # "dram" | "vram"


@dataclass(frozen=True)
class KVLayoutSpec:
    """Layout of a paged KV pool: per layer ``[num_blocks, planes, block_size, kv_heads,
    head_dim]``; ``planes`` 2 = K and V, 1 = whole per-token entries (MLA latent caches)."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name, e.g. "float32", "bfloat16"
    num_layers: int = 0
    block_bytes: int = 0
    regions: tuple[MemoryRegionSpec, ...] = ()
    planes: int = 2
    states: tuple[StateRegionSpec, ...] = ()  # hybrid models: recurrent layers' state


@dataclass(frozen=True)
class KVPushDestination:
    """Push mode: decode pre-allocated ``block_ids`` (one per prompt block, valid for every
    layer) or per-stage ``stage_block_ids``; each stage WRITEs its layers into them."""

    agent_name: str
    metadata_endpoint: str = ""  # "host:port" serving the decode agent's metadata
    agent_metadata: bytes = b""  # or the metadata inline
    block_ids: tuple[int, ...] = ()
    stage_block_ids: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (stage, block ids)
    layout: KVLayoutSpec | None = None  # decode's layout; None: same as prefill's
    decode_cached_tokens: int = 0  # prefix decode already holds: not sent
    transfer_id: str = ""  # decode's id of this attempt (kv_transfer PushDestination.transfer_id)


@dataclass(frozen=True)
class KVPullDestination:
    """Pull mode: blocks stay pinned under a lease; decode READs them, then releases."""

    lease_ttl_s: float | None = None  # None: the engine's default TTL


@dataclass(frozen=True)
class PrefillOptions:
    """Per-request options. ``cache_salt`` isolates prefix reuse between tenants."""

    request_id: str | None = None  # engine assigns one when None
    cache_salt: str | None = None
    top_logprobs: int = 5
    deadline_s: float | None = None  # absolute time.monotonic() deadline, None = none
    kv_destination: KVPushDestination | KVPullDestination | None = None  # None: KV stays here
    priority: int = 0  # a router serves waiting requests of higher priority first
    tenant: str | None = None  # whose turn it waits for at a router; None: its cache_salt
    # W3C traceparent of the span this request runs under ("" while tracing is off): the
    # server's request span; the engine records its own spans under it (docs/tracing.md)
    traceparent: str = ""


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
    agent_name: str = ""  # this stage's NIXL agent ("" when KV is not shipped)
    metadata_endpoint: str = ""
    regions: tuple[MemoryRegionSpec, ...] = ()
    lease_id: str = ""  # pull mode: renew / release with this id
    lease_expiry_unix_s: float = 0.0  # pull mode: wall-clock expiry (time.time())
    pushed: bool = False  # push mode: this stage's WRITE completed and was notified
    lease_ttl_s: float = 0.0  # pull mode: heartbeat within this to keep the lease
    planes: int = 2  # 2: K and V planes; 1: one plane of whole per-token entries (MLA)
    entry_parts: tuple[int, ...] = ()  # MLA: widths of (latent, rotated key, indexer key)
    # hybrid models: the recurrent layers' state tensors; ``regions`` then name only the
    # attention layers (the recurrent layers have no paged tensor)
    states: tuple[StateRegionSpec, ...] = ()


@dataclass(frozen=True)
class PrefillTimings:
    """Seconds spent in each phase of one request (monotonic clock)."""

    queue_s: float = 0.0  # submit -> admitted
    admission_s: float = 0.0  # admission rounds (lookup, lease, escrow)
    compute_s: float = 0.0  # first chunk start -> last chunk done on the last stage
    total_s: float = 0.0  # submit -> result
    handoff_s: float = 0.0  # KV: last chunk done on the last stage -> every stage shipped
    fetch_s: float = 0.0  # prefix_source: asking the source and copying (before submit)


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
    served_by: str = ""  # set by a router: the pipeline that served the request
    fetched_tokens: int = 0  # of cached_tokens, copied from another pipeline first


@dataclass(frozen=True)
class PrefixFetchResult:
    """A prefix copied from another pipeline's stages (``Engine.fetch_prefix``).

    ``copied_blocks``: per stage, the blocks it READ and cached (0: it held them all, had no
    room, or its copy failed); ``bytes_read`` over all stages; ``read_s``: the slowest
    stage's copy; ``errors``: each failed stage's cause (empty: none failed). Whatever a
    stage copied is cached like computed blocks; a request then reuses what every stage
    holds.
    """

    copied_blocks: tuple[int, ...]
    bytes_read: int
    read_s: float
    errors: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()  # per stage: why it copied nothing ("held", "no_room")

    @property
    def ok(self) -> bool:
        return not self.errors


@dataclass(frozen=True)
class StageLoad:
    """Cache occupancy of one stage, in blocks, as GetLoad and the router see it:
    ``free + cached + used == total``, where ``used`` counts blocks referenced or escrowed
    for admitted requests. Built from the stage pool's ``core.block_pool.PoolStats`` (the
    finer counts the stage's own invariants use) by ``runtime.messages.StageStats.load``;
    a separate type because it is the engine boundary's (and the proto's) view."""

    stage: int
    free_blocks: int
    cached_blocks: int
    used_blocks: int
    total_blocks: int
    busy_fraction: float = 0.0  # share of recent wall time spent computing
    wide_layers: int = 0  # layers run with idle neighbours' cores since start (core sharing)


@dataclass(frozen=True)
class PipelineLoad:
    """A router's view of one pipeline behind it (GetLoad on a router)."""

    pipeline_id: str
    address: str
    ready: bool
    queue_depth: int  # from the pipeline's last GetLoad
    inflight_requests: int  # routed there by this router, not answered yet
    inflight_tokens: int  # from the pipeline's last GetLoad
    indexed_blocks: int  # prefix blocks the router's index holds for it
    stages: tuple[StageLoad, ...] = ()


@dataclass(frozen=True)
class EngineLoad:
    """Queue and cache state, as the router and GetLoad see it. From a router: ``pipelines``
    holds one entry per pipeline and the totals are their sums (``stages`` is empty)."""

    queue_depth: int
    inflight_requests: int
    inflight_tokens: int
    stages: tuple[StageLoad, ...]
    lease_conflicts: int = 0  # cumulative: lease boundaries that shrank on re-check
    escrow_conflicts: int = 0  # cumulative: escrow victims replaced at commit
    pipelines: tuple[PipelineLoad, ...] = ()


@dataclass(frozen=True)
class ScoreReport:
    """A router's dry run for one prompt (the Score RPC): where a Prefill would go now
    (``pipeline_id`` empty: nowhere, see ``reason``), what it would find cached there, and
    the estimated seconds queued ahead of it and of its uncached suffix's compute."""

    pipeline_id: str
    reason: str
    prompt_tokens: int
    cached_tokens: int
    queued_s: float
    prefill_s: float
    ready_pipelines: int


@dataclass(frozen=True)
class EngineHealth:
    """``ready``: all stages up and serving. ``detail`` says what is wrong when not."""

    live: bool
    ready: bool
    detail: str = ""


@dataclass(frozen=True)
class CacheIdentity:
    """What decides whether two servers' block hashes can be compared: the model identity
    hashed into every block (``ExtraKeys.model_id``) and the block size in tokens; and how
    far a cached prefix is reusable: ``snapshot_interval_blocks`` (models with recurrent
    layers) makes reuse stop at a snapshot boundary, before the prompt's last token."""

    model_id: str
    block_size: int
    snapshot_interval_blocks: int | None = None


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

    @property
    def cache_identity(self) -> CacheIdentity: ...

    def submit(
        self, token_ids: Sequence[int], options: PrefillOptions
    ) -> Future[PrefillResult]: ...

    def abort(self, request_id: str) -> bool: ...

    def load(self) -> EngineLoad: ...

    def health(self) -> EngineHealth: ...

    def shutdown(self) -> None: ...
