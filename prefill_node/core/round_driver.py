"""In-process driver of admission rounds: the leader's loop with direct calls, no network."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from prefill_node.core.admission_messages import (
    AdmissionOutcome,
    Rejected,
    RoundRequest,
    RoundResult,
    StageReply,
)
from prefill_node.core.request import RequestSpec
from prefill_node.core.stage_admission import StageAdmission


class RoundLeader(Protocol):
    """What runs rounds: ``AdmissionCoordinator`` alone, or ``leader.LeaderCore`` (which
    also schedules what a round admits)."""

    def enqueue(self, spec: RequestSpec) -> Rejected | None: ...

    def begin_round(self) -> RoundRequest | None: ...

    def finish_phase(self, replies: Sequence[StageReply]) -> RoundRequest | RoundResult: ...


def run_round(
    coordinator: RoundLeader,
    stages: Sequence[StageAdmission],
    new_requests: Iterable[RequestSpec] = (),
) -> tuple[AdmissionOutcome, ...]:
    """Submit ``new_requests`` and run one admission round to its end.

    Returns the immediate rejections of ``new_requests`` followed by the round's outcomes
    (empty when there was nothing to do). Both engines' leader (``runtime/leader.py``) runs
    the same loop over its rounds plane: a broadcast of each ``RoundRequest`` and an
    all-gather of the ``StageReply``s (across processes, or between threads in the
    in-process ``LocalEngine``). Callers of this direct-call form: the simulator (its
    ``LeaderCore``), ``sim/core_port.py`` and tests.
    """
    rejected = tuple(r for r in (coordinator.enqueue(spec) for spec in new_requests) if r)
    msg = coordinator.begin_round()
    while msg is not None:
        step = coordinator.finish_phase([stage.handle(msg) for stage in stages])
        if isinstance(step, RoundResult):
            return rejected + step.outcomes
        msg = step
    return rejected
