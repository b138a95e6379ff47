"""The simulator's TensorRT-LLM trtllm issue path: rank 0's loop fetches, admits, plans.

A mixin of ``Simulator`` (simulator.py owns the state it reads and writes): the executor
loops' timing lives in ``executor_loops.py``, this is only where the event-driven
simulation asks it when rank 0 may fetch and schedule, which prompts the fetch broadcasts,
what the planned wave costs every rank, and when a parked wave may start on its stage.
"""

from __future__ import annotations

from prefill_node.core.wave import Wave
from prefill_node.sim.executor_loops import ExecutorLoops, WaveHostWork, wave_host_work


class TrtllmIssue:
    """``Simulator`` methods of the ``trtllm`` policy (see the module docstring).

    Only ``Simulator`` derives from it; the attributes these methods use are its own.
    """

    def _try_issue_trtllm(self, loops: ExecutorLoops) -> None:
        """Rank 0's loop iteration: fetch, admit (capacity), schedule one wave, charge loops.

        Runs when rank 0's loop is at the top of its iteration (``leader_free_at``) and
        fewer than ``P`` waves are in flight (``num_micro_batches = pp_size``, the sample
        state ring). The fetch broadcasts the prompts that arrived by then (later ones wait
        for the next iteration) and may wait for rank 1's loop (``fetch_done_at``). The
        admission round is applied at once (its effect is TRT-LLM's capacity decision); its
        time is the loop work the wave causes on every rank (executor_loops.py), which also
        gates each stage's GPU in ``_start_on_stage``.
        """
        free_at = loops.leader_free_at()
        if free_at is None or self.leader.scheduler.ring_full:
            return  # GPU 0 / the ring will call again when a wave finishes
        if free_at > self.now:
            self._wake_leader(free_at)
            return
        if self._fetch_cut is None:  # the fetch starts now: an idle loop restarts here
            self._fetch_cut = self.now if self._leader_idle else free_at
        cutoff = self._fetch_cut
        cut = 0
        while cut < len(self._unfetched) and self._unfetched[cut][0] <= cutoff:
            cut += 1
        new_tokens = sum(self._unfetched[i][1] for i in range(cut))
        ready = loops.fetch_done_at(new_tokens, cutoff)
        if ready is None:
            return  # rank 1's loop has not reached this iteration; a GPU event calls again
        if ready > self.now:
            self._wake_leader(ready)
            return
        for _ in range(cut):
            self._unfetched.popleft()
        self._fetched_until = cutoff
        self._submit_pending()
        ids = self.core.next_round_ids()
        if self._round_wanted and ids:
            self._round_wanted = False
            self._num_rounds += 1
            self._round_requests += len(ids)
            self._apply_outcomes(self._run_round())
        wave = self.leader.next_wave()
        self._leader_idle, self._fetch_cut = wave is None, None
        if wave is None:
            return  # nothing to run: the loop spins, fetching whatever arrives next
        k, launch = loops.begin(self.now, self._host_work(wave, new_tokens), cutoff)
        self._loop_index[wave.wave_id] = k
        self._count(wave)
        self._wake_leader(launch)
        self._on_wave_at_stage(0, wave)
        self._retry_parked()

    def _host_work(self, wave: Wave, new_tokens: int) -> WaveHostWork:
        """What ``wave`` costs every rank's loop. The scheduler pass walks
        every admitted request not yet finished (in flight ones included: they stay
        ``CONTEXT_INIT`` on rank 0 until retired) and the queue's head (walked, refused)."""
        live = [(r.cached_len, r.end) for r in self.leader.scheduler.running()]
        waiting = self.core.next_round_ids()
        if waiting:
            head = self._submitted[waiting[0]][0]
            live.append((head.seeded_len, head.num_tokens))
        runs = ((c, self.leader.scheduler.request(c.request_id)) for c in wave.chunks)
        return wave_host_work(
            live, [(c.start, c.end, r.cached_len, r.end) for c, r in runs], new_tokens
        )

    def _retry_parked(self) -> None:
        """Start the waves whose rank's launch no longer waits on another rank's GPU."""
        for stage in sorted(self._parked):
            wave, since = self._parked[stage]
            if self.loops.launch_time(stage, self._loop_index[wave.wave_id]) is None:
                continue
            del self._parked[stage]
            self._loop_stall_s += self.now - since
            self._stage_busy[stage] = False
            self._start_on_stage(stage, wave)
