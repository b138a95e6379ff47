"""What travels on the planes: wave headers and results (data plane), round envelopes (rounds)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch

from prefill_node.core.block_pool import PoolStats
from prefill_node.core.kv_events import KVEvent
from prefill_node.core.request import RequestSpec
from prefill_node.engine.types import (
    KVPullDestination,
    KVPushDestination,
    StageKVManifest,
    StageLoad,
)

StageEventBatch = tuple[int, tuple[KVEvent, ...]]
"""(stage, the events its block pool buffered since its previous wave), in that stage's order."""


@dataclass(frozen=True)
class RequestOptions:
    """What every stage needs of a request's options, sent once, with its first chunk: the
    last stage's top-k, and where each stage hands its layers' KV (None: no hand-off),
    after the last chunk, or, streaming a push, also after earlier ones. A stage keeps them
    until the request's last chunk left it or the request is gone (``PipelineStageCompute``)."""

    top_logprobs: int = 1
    kv_destination: KVPushDestination | KVPullDestination | None = None


@dataclass(frozen=True)
class WaveChunk:
    """One scheduled chunk: tokens [start, start + length) of ``request_id``.

    ``is_last``: this chunk ends the prompt, so the last stage computes logits for its final
    row and every stage completes the request (index its new blocks, unpin) after it.
    ``options``: on the request's first chunk only (``RequestOptions``); later chunks use
    what the stage kept. ``traceparent``: the request's leader span (W3C) on every chunk of
    a traced request ("" while tracing is off), for each stage's span of the chunk.
    """

    request_id: str
    start: int
    length: int
    is_last: bool
    options: RequestOptions | None = None
    traceparent: str = ""


@dataclass(frozen=True)
class WaveHeader:
    """A wave as it travels stage s -> s+1: its chunks, in row order of the activations.

    ``failed`` maps request id -> message for requests some earlier stage could not run; their
    rows are still present (zeros) so shapes stay simple, and later stages skip them.
    ``manifests``: (request id, manifest) of each stage a request's last chunk has left.
    ``kv_events``: each stage's KV event batch drained after this wave (only when the
    pipeline publishes KV events; kv_event_feed.py).
    ``stop``: the shutdown sentinel, forwarded down the pipeline and back to the leader.
    ``new_requests`` and ``forgets`` (``trtllm`` only: rank 0 admits alone, so the wave
    carries its decisions): the prompts whose first chunk is in this wave, each to be taken
    at that chunk's start (``StageAdmission.follow``), and the requests stages > 0 drop
    first (aborted or failed). Stage 0 already holds both from its own admission.
    """

    wave_id: int
    chunks: tuple[WaveChunk, ...]
    failed: tuple[tuple[str, str], ...] = ()
    manifests: tuple[tuple[str, StageKVManifest], ...] = ()
    stop: bool = False
    kv_events: tuple[StageEventBatch, ...] = ()
    new_requests: tuple[RequestSpec, ...] = ()
    forgets: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(c.length for c in self.chunks)


@dataclass(frozen=True)
class RequestOutput:
    """The last stage's product for one finished request: the last position's top logprobs,
    and its fp32 logits [vocab] where the stage keeps them (in-process pipelines only: they
    never cross a process boundary)."""

    request_id: str
    top_logprobs: tuple[tuple[int, float], ...]
    logits: torch.Tensor | None = None


@dataclass(frozen=True)
class WaveResult:
    """Last stage -> leader after each wave: finished requests and failures along the way.
    ``held_s``: how long the last stage held the result after the wave's forward ended (the
    logits, and the KV hand-off started before them); the leader dates the chunk's end by it
    on its own clock (stage clocks may differ), short by the result's transit."""

    wave_id: int
    outputs: tuple[RequestOutput, ...] = ()
    failed: tuple[tuple[str, str], ...] = ()
    manifests: tuple[tuple[str, StageKVManifest], ...] = ()
    stop: bool = False
    kv_events: tuple[StageEventBatch, ...] = ()
    held_s: float = 0.0


class RoundKind(enum.Enum):
    """What a rounds-plane message asks of every stage."""

    ADMIT = "admit"  # payload: the admission coordinator's round message
    TICK = "tick"  # nothing to do; keeps idle stages' rounds plane alive
    STATS = "stats"  # reply: StageStats
    CHECK = "check"  # run check_integrity(); reply: None or the error text
    DUMP_KV = "dump_kv"  # payload: request id; reply: captured KV (tests only)
    KV_CANCEL = "kv_cancel"  # payload: request ids; abort their WRITEs / revoke their leases
    FETCH = "fetch"  # payload: FetchOrder; reply: FetchReply
    LEND = "lend"  # payload: LendOrder; reply: the stage's StageKVManifest or None
    STOP = "stop"  # leave the WAVE loop


@dataclass(frozen=True)
class FetchOrder:
    """Copy a prefix another pipeline holds: ``spec`` is the prefix (whole blocks, under an
    id of its own), ``manifests`` its stages' pull leases of it (one per stage there), the
    first of which expires at ``lease_expiry_unix_s`` (wall clock)."""

    spec: RequestSpec
    manifests: tuple[Any, ...]  # kv_transfer.messages.StageManifest
    lease_expiry_unix_s: float


@dataclass(frozen=True)
class LendOrder:
    """Lease the longest run of ``spec``'s full blocks each stage holds cached, for another
    pipeline to READ (``lease_ttl_s``: None, the hand-off's default TTL)."""

    spec: RequestSpec
    lease_ttl_s: float | None = None


@dataclass(frozen=True)
class FetchReply:
    """One stage's part of a fetch: ``cached_blocks`` of the prefix it copied and cached;
    0 when the copy failed (``error``) or it copied nothing (``skipped``: a ``FetchSkip``
    value, e.g. "held")."""

    stage: int
    cached_blocks: int = 0
    bytes_read: int = 0
    read_s: float = 0.0
    error: str = ""
    skipped: str = ""


@dataclass(frozen=True)
class RoundMessage:
    kind: RoundKind
    payload: Any = None


@dataclass(frozen=True)
class StageStats:
    """One stage's counters since start: wall time executing waves (``busy_s``), CPU time
    of the executing thread meanwhile (``cpu_s``; below busy_s when the core is shared),
    waves and tokens executed, and the stage's block pool counts (``pool``).

    The STATS round's reply; ``load`` is the part of it GetLoad reports. Both engines
    build their ``StageLoad``s through ``load``: the multi-process one from a STATS round,
    the in-process one from its workers directly."""

    stage: int
    busy_s: float
    cpu_s: float
    waves: int
    tokens: int
    uptime_s: float
    pool: PoolStats
    kv_held_blocks: int = 0  # block references the stage's KV hand-off holds (WRITEs, leases)
    kv_pushes: int = 0  # WRITEs to decode workers in flight
    kv_leases: int = 0  # pull leases not yet released, expired or revoked
    wide_layers: int = 0  # layers run with idle neighbours' cores (runtime/core_share.py)

    def load(self) -> StageLoad:
        """The stage's occupancy as GetLoad reports it (``PoolStats.used``: escrowed
        victims count as used) and its busy share of the wall time since start."""
        p = self.pool
        busy = self.busy_s / self.uptime_s if self.uptime_s > 0 else 0.0
        return StageLoad(
            self.stage,
            p.unclaimed_free,
            p.unclaimed_cached,
            p.used,
            p.total,
            busy_fraction=busy,
            wide_layers=self.wide_layers,
        )
