"""The two policies the simulator compares: ``wave`` (WavePP) and ``lockstep`` (TRT-LLM PP).

- WAVE: admission rounds run on their own timeline, concurrently with execution: a round
  starts as soon as requests are pending and the previous round is over, and packs up to
  ``max_round_requests`` of them. Waves are planned by the MPU planner (or an ablation),
  a request's successive chunks may be in flight in successive waves (each stage handles
  waves in order, so chunk k+1 on stage s always runs after chunk k on stage s), and up to
  ``R = 2P`` waves are in flight.
- LOCKSTEP: the TensorRT-LLM PP executor loop (``PyExecutor._executor_loop_pp``): before
  each wave the leader runs the admission round synchronously on the executor loop, so
  stage 0 stalls for the round's latency and the stall propagates down the pipeline. Fixed
  chunk budget ``M`` filled to the brim (no fragment rule), ``P`` micro-batches in flight
  (``num_micro_batches = pp_size``) and at most one chunk of a request in flight (TRT-LLM
  skips requests in ``inflight_req_ids``). The round's latency is charged to the leader
  only: the other stages are assumed to answer round messages at no cost to their loops,
  a lower bound on the real stall, so lockstep is modelled generously.

Both policies drive the same admission core, with the same rounds and the same costs; only
when the rounds run and how waves are formed differ.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from prefill_node.core.planner import DEFAULT_PLANNER_MODE, PlannerMode
from prefill_node.errors import InvalidRequestError


class UnknownPolicyError(InvalidRequestError):
    """A policy or planner name is not one of the known ones; the message lists them."""


class PolicyKind(enum.Enum):
    WAVE = "wave"
    LOCKSTEP = "lockstep"


@dataclass(frozen=True)
class Policy:
    """How admission is scheduled against execution and how waves are formed."""

    kind: PolicyKind
    planner_mode: PlannerMode
    ring_size: int  # waves in flight at most
    pipelined_chunks: bool  # may a request have chunks in several in-flight waves
    fragment_rule: bool
    max_round_requests: int = 32

    @property
    def name(self) -> str:
        if self.kind is PolicyKind.LOCKSTEP:
            return "lockstep"
        return f"wave[{self.planner_mode.value}]"

    @property
    def admission_on_loop(self) -> bool:
        """True when rounds stall the executor loop (lockstep)."""
        return self.kind is PolicyKind.LOCKSTEP


def wave_policy(num_stages: int, planner_mode: PlannerMode = DEFAULT_PLANNER_MODE) -> Policy:
    """WavePP: admission ahead of execution, ``R = 2P`` waves in flight, pipelined chunks."""
    return Policy(
        kind=PolicyKind.WAVE,
        planner_mode=planner_mode,
        ring_size=2 * num_stages,
        pipelined_chunks=True,
        fragment_rule=True,
    )


def lockstep_policy(num_stages: int) -> Policy:
    """The TensorRT-LLM PP baseline: rounds on the loop, fixed M, P micro-batches."""
    return Policy(
        kind=PolicyKind.LOCKSTEP,
        planner_mode=PlannerMode.FIXED,
        ring_size=num_stages,
        pipelined_chunks=False,
        fragment_rule=False,
    )


def parse_planner_mode(name: str) -> PlannerMode:
    """``fixed`` / ``mpu`` / ``mpu-nohyst`` / ``cost`` -> PlannerMode (typed error otherwise)."""
    for mode in PlannerMode:
        if mode.value == name:
            return mode
    valid = ", ".join(m.value for m in PlannerMode)
    raise UnknownPolicyError(f"unknown planner {name!r}; choose one of {valid}")
