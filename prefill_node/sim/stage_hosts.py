"""The executor-loop host of every stage under ``wave``: what WavePP's loops still pay.

WavePP runs on the same executor as the baseline, so each stage's loop still does, per
wave, the iteration's fixed work and the prompt-to-list conversion of every chunk
(``executor_loops.loop_work_s``, the same function and constants the trtllm policy's loops use),
and, when a request's last chunk leaves the stage, the retire walks (store its blocks, free
the sequence). What WavePP moves off the loop (request transport, request creation,
admission) is charged on its rounds timeline by the simulator; what it removes (scheduler
prefix walks, the per-rank replay) is listed with its mechanism in
``trtllm_costs.HOST_COST_CHARGES``.

Timing: the leader forwards a wave's schedule (ids and positions, no activations) to stage
``s`` ``s`` hops after planning it, so a stage's host prepares a wave while its GPU still
runs earlier ones; the GPU starts the wave when its activations have arrived, the GPU is
free, and its host has prepared it. Each stage's host does its work serially, in the order
it learns of it (schedules at planning time, retire work when the GPU finishes).
"""

from __future__ import annotations

from prefill_node.errors import InvariantError
from prefill_node.sim.executor_loops import LoopCosts, WaveHostWork, loop_work_s


class StageHosts:
    """Host timelines of ``num_stages`` stage loops. Contract: ``plan`` every wave once when
    the leader plans it, ``ready_at`` / ``launched`` when its GPU may start it on a stage,
    ``retire`` when a stage's GPU finishes requests' last chunks."""

    def __init__(self, num_stages: int, costs: LoopCosts) -> None:
        if num_stages < 1:
            raise InvariantError(f"num_stages must be >= 1, got {num_stages}")
        self.num_stages, self.costs = num_stages, costs
        self._free = [0.0] * num_stages
        self._ready: dict[tuple[int, int], float] = {}
        self.host_busy_s = [0.0] * num_stages

    def plan(self, wave_id: int, now: float, work: WaveHostWork) -> None:
        """The leader planned ``wave_id`` at ``now``: every stage's host prepares it."""
        busy = loop_work_s(self.costs.trtllm, work)
        for s in range(self.num_stages):
            start = max(self._free[s], now + s * self.costs.hop_s)
            self._free[s] = start + busy
            self._ready[s, wave_id] = self._free[s]
            self.host_busy_s[s] += busy

    def ready_at(self, stage: int, wave_id: int) -> float:
        """When stage ``stage``'s host has prepared ``wave_id``."""
        try:
            return self._ready[stage, wave_id]
        except KeyError:
            raise InvariantError(f"wave {wave_id} was never planned (stage {stage})") from None

    def launched(self, stage: int, wave_id: int) -> None:
        del self._ready[stage, wave_id]

    def retire(self, stage: int, now: float, prompt_tokens: int) -> None:
        """Stage ``stage``'s GPU finished the last chunks of requests of ``prompt_tokens``
        tokens in all at ``now``: its host walks each prompt ``retire_walks`` times."""
        busy = self.costs.retire_s_per_token * prompt_tokens
        if busy:
            self._free[stage] = max(self._free[stage], now) + busy
            self.host_busy_s[stage] += busy
