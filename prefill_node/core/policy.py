"""The scheduling policy: every knob the leader's scheduling reads, in one frozen value.

One ``Policy`` is built once, at the edge (``PipelineSpec.scheduling_policy`` in the
runtime, ``wave_policy`` / ``trtllm_policy`` / ``sync_admission_policy`` in the simulator), and
every consumer reads
its knobs from it: the wave scheduler (ring depth, chunks in flight per request), the
planner (mode, fragment rule) and every stage's admission (escrow headroom).

- ``WAVE`` (WavePP): admission rounds run ahead of execution on their own thread or
  timeline; ``R = 2P`` waves in flight; a request may have chunks in several in-flight
  waves; the planner sizes waves (MPU, or an ablation) under the fragment rule.
- ``TRTLLM`` (the baseline: TensorRT-LLM's PP executor, ``PyExecutor._executor_loop_pp``):
  admission runs on the executor loop before each wave, and rank 0 decides it ALONE from its
  own cache view (no cross-stage negotiation); the other ranks take the decision from the
  wave and re-check it against their own caches (``StageAdmission.follow``), retrying while
  KV hand-offs drain and failing the request otherwise. ``P`` waves in flight (TRT-LLM's
  ``num_micro_batches = pp_size``); at most one chunk of a request in flight
  (``inflight_req_ids``); a fixed budget of ``M`` filled to the brim (no fragment rule).
- ``SYNC_ADMISSION`` (an ablation, not a baseline): the knobs of ``TRTLLM``, but admission is
  WavePP's own cross-stage round, run synchronously on stage 0's loop before each
  wave. It isolates what running admission ahead of execution buys; it is not how
  TensorRT-LLM schedules.

Lease/escrow headroom (WAVEPP.md 2): while other requests hold reservations, a stage admits
a new one only within ``num_blocks - headroom`` blocks, so pins never leave nothing
evictable. The headroom is about ``2 * P * M`` tokens, capped at a QUARTER of the stage's
blocks. The runtime and the simulator once disagreed (a quarter vs a half); the quarter is
kept because the runtime is what the simulator is validated against
(``bench/sim_vs_pipeline.py``), and a quarter still keeps an evictable reserve on a tiny
cache while admitting more concurrent work than a half would. On the paper's caches the
cap never binds: ``2 * P * M`` tokens is far below a quarter of a stage.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from prefill_node.core.planner import DEFAULT_PLANNER_MODE, PlannerConfig, PlannerMode
from prefill_node.errors import InvalidRequestError

HEADROOM_CACHE_FRACTION = 4  # the headroom is at most 1/4 of a stage's blocks


class UnknownPolicyError(InvalidRequestError):
    """A policy or planner name is not one of the known ones; the message lists them."""


class PolicyKind(enum.Enum):
    WAVE = "wave"
    TRTLLM = "trtllm"
    SYNC_ADMISSION = "sync-admission"


POLICY_NAMES = tuple(kind.value for kind in PolicyKind)  # what --policy accepts


@dataclass(frozen=True)
class Policy:
    """How admission is scheduled against execution and how waves are formed (see the module
    docstring). Build it with ``wave_policy`` / ``trtllm_policy`` /
    ``sync_admission_policy``."""

    kind: PolicyKind
    num_stages: int  # P
    planner_mode: PlannerMode
    ring_size: int  # waves in flight at most
    pipelined_chunks: bool  # may a request have chunks in several in-flight waves
    fragment_rule: bool
    max_round_requests: int = 32
    # admission shares a prefix an admitted request is computing, promised or waited for
    # (CoordinatorConfig); an admission mechanism, not WavePP's: every policy has it
    share_inflight_prefix: bool = True

    def __post_init__(self) -> None:
        if self.num_stages < 1 or self.ring_size < 1 or self.max_round_requests < 1:
            raise UnknownPolicyError(
                f"policy needs num_stages, ring_size and max_round_requests >= 1: {self}"
            )

    @property
    def name(self) -> str:
        if self.kind is PolicyKind.WAVE:
            return f"wave[{self.planner_mode.value}]"
        return self.kind.value

    @property
    def admission_on_loop(self) -> bool:
        """True when admission stalls the executor loop (``trtllm``, ``sync-admission``)."""
        return self.kind is not PolicyKind.WAVE

    @property
    def rank0_decides(self) -> bool:
        """True when stage 0 admits from its own cache alone and the other stages follow
        (``trtllm``); False when the stages negotiate each admission (a round)."""
        return self.kind is PolicyKind.TRTLLM

    @property
    def max_chunks_in_flight(self) -> int | None:
        """Chunks of one request in flight at once: None (no limit) or 1."""
        return None if self.pipelined_chunks else 1

    def headroom_blocks(self, num_blocks: int, block_size: int, max_wave_tokens: int) -> int:
        """A stage's lease/escrow headroom: ``ceil(2 * P * M / B)`` blocks, at most a quarter
        of its ``num_blocks``."""
        want = -(-2 * self.num_stages * max_wave_tokens // block_size)
        return min(want, num_blocks // HEADROOM_CACHE_FRACTION)

    def planner_config(
        self,
        *,
        max_wave_tokens: int,
        min_wave_tokens: int,
        block_size: int,
        max_wave_requests: int,
        fill_factor: int = 2,
        wave_overhead_tokens: int = 0,
    ) -> PlannerConfig:
        """The planner's settings under this policy (mode and fragment rule from here)."""
        return PlannerConfig(
            num_stages=self.num_stages,
            max_wave_tokens=max_wave_tokens,
            min_wave_tokens=min_wave_tokens,
            block_size=block_size,
            fill_factor=fill_factor,
            max_wave_requests=max_wave_requests,
            mode=self.planner_mode,
            fragment_rule=self.fragment_rule,
            wave_overhead_tokens=wave_overhead_tokens if self.pipelined_chunks else 0,
        )


def wave_policy(
    num_stages: int,
    planner_mode: PlannerMode = DEFAULT_PLANNER_MODE,
    max_round_requests: int = 32,
) -> Policy:
    """WavePP: admission ahead of execution, ``R = 2P`` waves in flight, pipelined chunks."""
    return Policy(
        kind=PolicyKind.WAVE,
        num_stages=num_stages,
        planner_mode=planner_mode,
        ring_size=2 * num_stages,
        pipelined_chunks=True,
        fragment_rule=True,
        max_round_requests=max_round_requests,
    )


def trtllm_policy(num_stages: int, max_round_requests: int = 32) -> Policy:
    """The TensorRT-LLM PP baseline: rank 0 admits alone on its loop, fixed M, P micro-batches."""
    return _on_loop(PolicyKind.TRTLLM, num_stages, max_round_requests)


def sync_admission_policy(num_stages: int, max_round_requests: int = 32) -> Policy:
    """The ablation: WavePP's cross-stage rounds on stage 0's loop, TRT-LLM's other knobs."""
    return _on_loop(PolicyKind.SYNC_ADMISSION, num_stages, max_round_requests)


def _on_loop(kind: PolicyKind, num_stages: int, max_round_requests: int) -> Policy:
    return Policy(
        kind=kind,
        num_stages=num_stages,
        planner_mode=PlannerMode.FIXED,
        ring_size=num_stages,
        pipelined_chunks=False,
        fragment_rule=False,
        max_round_requests=max_round_requests,
    )


def parse_policy_kind(name: str) -> PolicyKind:
    """``wave`` / ``trtllm`` / ``sync-admission`` -> PolicyKind (typed error otherwise)."""
    for kind in PolicyKind:
        if kind.value == name:
            return kind
    valid = ", ".join(k.value for k in PolicyKind)
    raise UnknownPolicyError(f"unknown policy {name!r}; choose one of {valid}")


def parse_planner_mode(name: str) -> PlannerMode:
    """``fixed`` / ``mpu`` / ``mpu-nohyst`` / ``cost`` -> PlannerMode (typed error otherwise)."""
    for mode in PlannerMode:
        if mode.value == name:
            return mode
    valid = ", ".join(m.value for m in PlannerMode)
    raise UnknownPolicyError(f"unknown planner {name!r}; choose one of {valid}")
