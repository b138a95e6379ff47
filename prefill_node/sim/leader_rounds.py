"""Phases of an admission round that the ``sync-admission`` leader runs on stage 0's loop.

This is the ``sync-admission`` ablation of OUR runtime (``prefill_node/runtime/leader.py``
``Leader.next_wave`` and ``stage_worker.py`` ``StageWorker.answer``), which the
``cpu-bench`` preset is compared on with the real CPU pipeline; the ``trtllm`` policy models
TensorRT-LLM's executor loops instead (``executor_loops.py``). Per call of ``next_wave`` on
stage 0's execution thread:

1. If the leader's core has round work (something arrived, finished, or the last round
   admitted someone), run one admission round, synchronously on that thread, so stage 0
   computes nothing meanwhile: the leader's host work for the requests the round sees for
   the first time (``host_s_per_token`` per prompt token, paid once per request), then
   ``phases`` phases, each a broadcast + all-gather on the rounds plane. A stage ``s > 0``
   answers a phase under its execution lock: a phase that reaches it mid-wave waits until
   that wave ends, and once answered, the stage's next queued wave takes the lock again
   (so the following phase may wait for that one too). ``one_way_s`` (half the phase
   latency) each way.
2. Then plan one wave (fixed budget M, at most one chunk of a request in flight) if fewer
   than ``P`` waves are in flight, and execute it on stage 0. If no wave can be planned, the
   loop waits, and runs a further round first when there is round work.

This class only keeps the phase state; the simulator turns its answers into events.
"""

from __future__ import annotations

from prefill_node.errors import InvariantError


class LeaderRounds:
    """State of the (at most one) round the leader is running on stage 0's loop.

    Contract: ``begin`` starts phase 1; for each stage ``s > 0`` the simulator delivers the
    phase message (``arrive``), which is answered at once when the stage is idle or parked
    until ``stage_free(s)``; each answer comes back through ``reply``, which says when the
    phase is complete; ``next_phase`` then says whether another phase follows.
    """

    def __init__(self, num_stages: int, phases: int, phase_latency_s: float) -> None:
        if num_stages < 1 or phases < 1 or phase_latency_s < 0:
            raise InvariantError(f"bad leader rounds: {num_stages=} {phases=} {phase_latency_s=}")
        self.num_stages, self.phases = num_stages, phases
        self.one_way_s = phase_latency_s / 2
        self.phase = 0  # 1-based phase in progress; 0 when no round runs
        self._awaiting: set[int] = set()
        self._parked: set[int] = set()

    @property
    def active(self) -> bool:
        return self.phase > 0

    def begin(self) -> None:
        if self.active:
            raise InvariantError("the leader began a round while one was running")
        self.phase = 1
        self._awaiting = set(range(1, self.num_stages))

    def arrive(self, stage: int, stage_busy: bool) -> bool:
        """The phase message reached ``stage``; True when it answers now, False if parked."""
        if stage not in self._awaiting:
            raise InvariantError(f"stage {stage} got a phase it does not owe")
        if stage_busy:
            self._parked.add(stage)
            return False
        return True

    def stage_free(self, stage: int) -> bool:
        """``stage`` finished its wave: True when a parked phase is answered now."""
        if stage in self._parked:
            self._parked.discard(stage)
            return True
        return False

    def reply(self, stage: int) -> bool:
        """``stage``'s answer reached the leader; True when every stage has answered."""
        self._awaiting.discard(stage)
        return not self._awaiting

    def next_phase(self) -> bool:
        """Advance after a complete phase; False (and no round running) after the last."""
        if self._awaiting or self._parked:
            raise InvariantError("the leader advanced a phase that is still owed")
        if self.phase >= self.phases:
            self.phase = 0
            return False
        self.phase += 1
        self._awaiting = set(range(1, self.num_stages))
        return True
