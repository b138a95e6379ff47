"""The pipeline's start-up description, validated once and shared with every stage as JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any

from prefill_node.core.planner import PlannerMode
from prefill_node.core.policy import (
    POLICY_NAMES,
    Policy,
    PolicyKind,
    parse_policy_kind,
    sync_admission_policy,
    trtllm_policy,
    wave_policy,
)
from prefill_node.errors import InvalidRequestError

DTYPES = ("float32", "bfloat16", "float16")  # weights and KV
DEVICES = ("cpu", "cuda")


class InvalidPipelineSpecError(InvalidRequestError):
    """A pipeline option is out of range or inconsistent; the message names the option."""


@dataclass(frozen=True)
class ModelSource:
    """Where every stage gets its weights: a checkpoint directory visible to all stages
    (``path``), or a random-init model from an HF-style ``config`` dict and ``seed`` (tests,
    benchmarks). Every stage materialises the same weights and keeps only its own slice."""

    path: str | None = None
    config: dict[str, Any] | None = None
    seed: int = 0
    name: str = ""

    def __post_init__(self) -> None:
        if (self.path is None) == (self.config is None):
            raise InvalidPipelineSpecError("give exactly one of model path or random config")


@dataclass(frozen=True)
class PipelineSpec:
    """Everything a stage needs to build itself; the leader publishes it in the store.

    ``layer_ranges``: (start, end) per stage, contiguous, covering the model (uneven allowed).
    ``stage_blocks``: KV blocks per stage (uneven allowed: stages can diverge). ``max_wave_tokens``
    is M, ``min_wave_tokens`` b_min, ``wave_overhead_tokens`` the planner's drain bound k (0:
    none). ``capture_kv`` keeps a copy of each finished request's KV
    per stage for ``debug_dump_kv`` (tests only: it costs memory). ``kv_events``: stages
    report their block pools' stored / removed events to the leader with every wave.
    ``debug_wave_delay_s`` (tests only, 0 = off): every stage sleeps this long before each
    wave's forward, so that a request on a tiny model stays in flight long enough to cancel,
    expire or kill a stage under it deterministically.
    """

    model: ModelSource | None  # None: the stages' models are built in-process (LocalEngine)
    layer_ranges: tuple[tuple[int, int], ...]
    stage_blocks: tuple[int, ...]
    block_size: int = 16
    policy: str = "wave"
    max_wave_tokens: int = 512
    min_wave_tokens: int = 64
    wave_overhead_tokens: int = 0  # the drain bound's k; 0: off
    max_batch: int = 128
    max_requests_per_round: int = 32
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    dtype: str = "float32"
    device: str = "cpu"
    capture_kv: bool = False
    kv_events: bool = False  # every stage's pool buffers KV events for the leader's feed
    heartbeat_s: float = 1.0
    dead_after_s: float = 5.0
    tick_s: float = 2.0
    debug_wave_delay_s: float = 0.0

    def __post_init__(self) -> None:
        p = len(self.layer_ranges)
        if p < 1:
            raise InvalidPipelineSpecError("a pipeline needs >= 1 stage")
        if len(self.stage_blocks) != p:
            raise InvalidPipelineSpecError(
                f"stage_blocks has {len(self.stage_blocks)} entries for {p} stages"
            )
        prev_end = 0
        for s, (a, b) in enumerate(self.layer_ranges):
            if a != prev_end or b <= a:
                raise InvalidPipelineSpecError(
                    f"layer ranges must be contiguous and non-empty from 0; stage {s} is [{a}, {b})"
                )
            prev_end = b
        if any(n < 2 for n in self.stage_blocks):
            raise InvalidPipelineSpecError(f"every stage needs >= 2 KV blocks: {self.stage_blocks}")
        if self.policy not in POLICY_NAMES:
            raise InvalidPipelineSpecError(
                f"policy must be one of {POLICY_NAMES}, got {self.policy!r}"
            )
        if self.block_size < 1 or self.max_wave_tokens < self.block_size:
            raise InvalidPipelineSpecError("need block_size >= 1 and max_wave_tokens >= block_size")
        if not 0 < self.min_wave_tokens <= self.max_wave_tokens:
            raise InvalidPipelineSpecError("need 0 < min_wave_tokens <= max_wave_tokens")
        if self.max_wave_tokens % self.block_size or self.min_wave_tokens % self.block_size:
            raise InvalidPipelineSpecError(
                f"max_wave_tokens and min_wave_tokens must be multiples of block_size "
                f"{self.block_size}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise InvalidPipelineSpecError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.wave_overhead_tokens < 0:
            raise InvalidPipelineSpecError(
                f"wave_overhead_tokens must be >= 0, got {self.wave_overhead_tokens}"
            )
        if not 0.0 <= self.debug_wave_delay_s <= 10.0:
            raise InvalidPipelineSpecError(
                f"debug_wave_delay_s must be in [0, 10], got {self.debug_wave_delay_s}"
            )
        if self.max_batch < 1 or self.max_requests_per_round < 1:
            raise InvalidPipelineSpecError("max_batch and max_requests_per_round must be >= 1")
        if self.dtype not in DTYPES:
            raise InvalidPipelineSpecError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise InvalidPipelineSpecError(f"device must be one of {DEVICES}, got {self.device!r}")

    @property
    def num_stages(self) -> int:
        return len(self.layer_ranges)

    @property
    def num_layers(self) -> int:
        return self.layer_ranges[-1][1]

    @cached_property
    def scheduling_policy(self) -> Policy:
        """The core policy this pipeline runs, parsed once. The runtime has no chunk cost
        model, so its wave policy plans with plain MPU."""
        kind = parse_policy_kind(self.policy)
        if kind is PolicyKind.TRTLLM:
            return trtllm_policy(self.num_stages, self.max_requests_per_round)
        if kind is PolicyKind.SYNC_ADMISSION:
            return sync_admission_policy(self.num_stages, self.max_requests_per_round)
        return wave_policy(self.num_stages, PlannerMode.MPU, self.max_requests_per_round)

    @property
    def ring(self) -> int:
        """Waves in flight: the policy's ring (R = 2P under ``wave``, P under ``trtllm`` and
        ``sync-admission``)."""
        return self.scheduling_policy.ring_size

    def headroom_blocks(self, stage: int) -> int:
        """Stage ``stage``'s lease/escrow headroom, by the policy's one rule."""
        return self.scheduling_policy.headroom_blocks(
            self.stage_blocks[stage], self.block_size, self.max_wave_tokens
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> PipelineSpec:
        d = json.loads(text)
        d["model"] = ModelSource(**d["model"]) if d["model"] is not None else None
        d["layer_ranges"] = tuple(tuple(r) for r in d["layer_ranges"])
        d["stage_blocks"] = tuple(d["stage_blocks"])
        return cls(**d)
