"""Per-rank executor loops of the TensorRT-LLM PP baseline: when each rank's host launches a wave.

In TensorRT-LLM's PyTorch backend every PP rank runs its own executor loop
(``PyExecutor._executor_loop_pp``) and does its host work for a micro-batch serially on
that loop, before it launches the micro-batch's forward. This module is the timing model
of those loops; the simulator asks it when rank ``s`` has launched wave ``k`` and keeps
stage ``s``'s GPU idle until then. Read from NVIDIA/TensorRT-LLM at commit 0004396720054f
(``tensorrt_llm/_torch/pyexecutor/py_executor.py``, ``resource_manager.py``) and
``cpp/tensorrt_llm/batch_manager/capacityScheduler.cpp`` at commit 02a10fed0dbf5d.

Per wave ``k`` (one loop iteration, every rank, in wave order):

1. Scheduler pass (``_pp_schedule_and_propagate``): rank 0 runs ``_schedule()``; its
   capacity scheduler (``GuaranteedNoEvictScheduler::impl``, the default policy) calls
   ``beneficialToSkip`` -> ``findNewContextBlock`` for every admitted context request that
   is still in its context phase (``prefillWithChunkedContextsAlreadyExecuting`` for the
   ones already chunking, and the pending ones up to the first that does not fit), and
   that walks the request's cached prefix block by block in the radix tree. Cost:
   ``walk_s_per_token`` per matched-prefix token walked (``pass_walk_tokens``). Rank 0 then
   ``isend_object``s the schedule to rank 1; each rank ``recv_object``s it (blocking) from
   its predecessor at the top of its own iteration and forwards it at once: one ``hop_s``
   per rank.
2. Ranks > 0 re-check and replay the pass on their own caches: ``_pp_retry_until_can_schedule``
   -> ``scheduler.can_schedule(batch)`` walks the wave's first-chunk requests
   (``batch_walk_tokens``), then ``scheduler.schedule_request(active_requests, ...)`` ("run
   scheduler locally because scheduler may change llm requests' state") walks the same set
   as rank 0's pass.
3. Every rank: ``resource_manager.prepare_resources(batch)`` -> ``KVCacheManager.
   prepare_resources`` -> ``impl.add_sequence`` for each first-chunk context request:
   block keys of the whole prompt, prefix match against THIS rank's tree, pin and
   allocate. Cost: ``add_s_per_token`` per prompt token (``first_chunk_tokens``), the same
   per-token admission cost a WavePP stage pays once per request in its rounds.
4. Launch the forward (asynchronous), then "Stage 1.2: sync previous sampler event": the
   loop blocks until its GPU has finished wave ``k - 1`` before it starts iteration
   ``k + 1``. So a rank's host runs at most one wave ahead of its GPU, and its host work
   for wave ``k + 1`` overlaps only the GPU's execution of wave ``k``.

Hence, with ``L``/``D`` launch/GPU-done times and ``R`` the time rank ``s`` has the schedule:
``H(s,k) = max(L(s,k-1), D(s,k-2))``; ``R(0,k) = H(0,k) + walk*pass``;
``R(s,k) = max(H(s,k), R(s-1,k) + hop)``; ``L(0,k) = R(0,k) + add*first``;
``L(s,k) = R(s,k) + walk*(batch + pass) + add*first``. Not modelled (they only add to the
baseline's loop time): the request broadcast and the executed-batch-count chain along the
same ranks, the sample-state ring's host relays, pickling of schedules.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefill_node.errors import InvariantError


@dataclass(frozen=True)
class LoopCosts:
    """Per-token host costs of one executor-loop iteration (seconds)."""

    walk_s_per_token: float  # capacity-scheduler prefix walk, per matched-prefix token
    add_s_per_token: float  # add_sequence in prepare_resources, per prompt token
    hop_s: float  # one host-to-host object send between adjacent ranks

    def __post_init__(self) -> None:
        if min(self.walk_s_per_token, self.add_s_per_token, self.hop_s) < 0:
            raise InvariantError(f"loop costs must be >= 0: {self}")


@dataclass(frozen=True)
class WaveHostWork:
    """Tokens of host work one wave causes on every rank's loop (see the module docstring)."""

    pass_walk_tokens: int  # matched prefixes the scheduler pass walks (every rank)
    batch_walk_tokens: int  # matched prefixes of the wave's first chunks (can_schedule, ranks > 0)
    first_chunk_tokens: int  # prompts whose first chunk is in the wave (add_sequence, every rank)


class ExecutorLoops:
    """Launch times of each wave on each rank's executor loop, computed lazily in wave order.

    Contract: rank 0 starts iteration ``k`` with ``begin`` (only at or after
    ``leader_free_at()``); ``launch_time(s, k)`` for ``s > 0`` may be asked once wave ``k``
    has started on stage ``s - 1`` and wave ``k - 1`` on stage ``s`` (the simulator runs
    each stage's waves in order, so this always holds); ``gpu_done`` records when stage
    ``s`` finished wave ``k``. Entries older than three waves are dropped.
    """

    def __init__(self, num_stages: int, costs: LoopCosts) -> None:
        if num_stages < 1:
            raise InvariantError(f"num_stages must be >= 1, got {num_stages}")
        self.num_stages, self.costs = num_stages, costs
        self._launch: list[dict[int, float]] = [{} for _ in range(num_stages)]
        self._recv: list[dict[int, float]] = [{} for _ in range(num_stages)]
        self._done: list[dict[int, float]] = [{} for _ in range(num_stages)]
        self._work: dict[int, WaveHostWork] = {}
        self.next_index = 0
        self.host_busy_s = [0.0] * num_stages  # host work charged per rank

    def leader_free_at(self) -> float | None:
        """When rank 0 may start its next iteration; None while GPU 0 still owes wave k-2."""
        return self._host_start(0, self.next_index)

    def _host_start(self, stage: int, k: int) -> float | None:
        start = self._launch[stage].get(k - 1, 0.0) if k >= 1 else 0.0
        if k >= 1 and k - 1 not in self._launch[stage]:
            return None
        if k >= 2:
            done = self._done[stage].get(k - 2)
            if done is None:
                return None
            start = max(start, done)
        return start

    def begin(self, now: float, work: WaveHostWork) -> tuple[int, float]:
        """Rank 0 starts iteration ``k`` at ``now``; returns ``(k, rank 0's launch time)``."""
        k = self.next_index
        start = self._host_start(0, k)
        if start is None or start > now:
            raise InvariantError(f"rank 0 began wave {k} at {now} before its loop was free")
        c = self.costs
        self._work[k] = work
        self._recv[0][k] = now + c.walk_s_per_token * work.pass_walk_tokens
        self._launch[0][k] = self._recv[0][k] + c.add_s_per_token * work.first_chunk_tokens
        self.host_busy_s[0] += self._launch[0][k] - now
        self.next_index = k + 1
        return k, self._launch[0][k]

    def launch_time(self, stage: int, k: int) -> float:
        """When rank ``stage`` has launched wave ``k`` (computed on first request)."""
        known = self._launch[stage].get(k)
        if known is not None:
            return known
        if stage == 0 or k not in self._work:
            raise InvariantError(f"wave {k} was never begun on rank 0 (asked for rank {stage})")
        start = self._host_start(stage, k)
        upstream = self._recv[stage - 1].get(k)
        if start is None or upstream is None:
            raise InvariantError(f"rank {stage} asked for wave {k} out of order")
        c, w = self.costs, self._work[k]
        recv = max(start, upstream + c.hop_s)
        work = c.walk_s_per_token * (w.batch_walk_tokens + w.pass_walk_tokens)
        work += c.add_s_per_token * w.first_chunk_tokens
        self._recv[stage][k] = recv
        self._launch[stage][k] = recv + work
        self.host_busy_s[stage] += work
        return recv + work

    def gpu_done(self, stage: int, k: int, at: float) -> None:
        """Stage ``stage``'s GPU finished wave ``k`` at ``at``; prunes old entries."""
        self._done[stage][k] = at
        if stage == self.num_stages - 1:  # every rank is past wave k - 1 by now
            self._work.pop(k - 3, None)
            for s in range(self.num_stages):
                for table in (self._launch[s], self._recv[s], self._done[s]):
                    table.pop(k - 3, None)
