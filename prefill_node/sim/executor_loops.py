"""Per-rank executor loops of the TensorRT-LLM PP baseline: when each rank's host launches a wave.

In TensorRT-LLM's PyTorch backend every PP rank runs its own executor loop
(``PyExecutor._executor_loop_pp``) and does its host work for a micro-batch serially on
that loop, before it launches the micro-batch's forward. This module is the timing model
of those loops; the simulator asks it when rank ``s`` has launched wave ``k`` and keeps
stage ``s``'s GPU idle until then. Read from NVIDIA/TensorRT-LLM at commit 0004396720054f
(``tensorrt_llm/_torch/pyexecutor/py_executor.py``, ``resource_manager.py``),
``executor_request_queue.py`` at 007a7508b8f68d, ``cpp/tensorrt_llm/batch_manager/
capacityScheduler.cpp`` at 02a10fed0dbf5d and cf6abc45df6e34. Per-token costs: ``LoopCosts``
(radix walks: ``bench/trtllm_walk.cpp``; prompt conversions and pickling:
``bench/trtllm_host_costs.py``, see ``trtllm_costs.py``).

Per wave ``k`` (one loop iteration, every rank, in wave order):

0. Finalise (end of the previous iteration, "Stage 3"): the micro-batch whose sample state
   has come round the ring, wave ``k - P``, is retired: ``update_resources`` ->
   ``store_context_blocks`` and, for finished requests, ``free_resources`` ->
   ``remove_sequence``; both walk the whole prompt's block keys (``retire_s_per_token``).
1. Fetch (``_fetch_new_requests`` -> ``_broadcast_new_requests``): rank 0 drains its
   request queue and pickles the new requests (``send_s_per_token`` per prompt token);
   each rank ``s > 0`` blocks in ``recv_object`` until rank ``s - 1`` sends, unpickles
   (``recv_s_per_token``) and, if not last, re-pickles and forwards. The forward is the
   blocking ``send_object`` by default: with new prompts in it, it returns only when the
   next rank has posted its receive at the top of its own iteration ``k``
   (``blocking_request_send``). Then every rank turns the new requests into ``LlmRequest``s
   (``merge_s_per_token``).
2. Schedule (``_pp_schedule_and_propagate``): rank 0 runs ``_schedule()``; its capacity
   scheduler (``GuaranteedNoEvictScheduler``) walks the cached prefix of every active
   context-phase request once (``beneficialToSkip`` / the reuse estimate of
   ``getRemainingBlocksToCompletion``), including the ones in flight (still
   ``CONTEXT_INIT`` on rank 0 until retired), up to the first that does not fit:
   ``walk_s_per_token`` per matched token plus ``walk_base_s_per_token`` per prompt token
   (``pass_*_tokens``). The schedule goes down the ranks one ``hop_s`` each; a rank
   forwards it as soon as it has it.
3. Ranks > 0 re-check and replay: ``_pp_retry_until_can_schedule`` ->
   ``scheduler.can_schedule(batch)`` walks the wave's requests (``batch_*_tokens``), then
   ``scheduler.schedule_request(active_requests, ...)`` repeats rank 0's whole pass.
4. Every rank: ``prepare_resources`` -> ``add_sequence`` per first-chunk prompt token
   (``add_s_per_token``), then the forward's ``_prepare_tp_inputs``, which converts each
   context request's whole prompt to a Python list (``get_tokens(0)``) for every chunk
   (``prepare_s_per_token`` x ``chunk_prompt_tokens``); then it launches the forward.
5. "Sync previous sampler event": the loop blocks until its GPU has finished wave ``k - 1``
   before it starts iteration ``k + 1``: a rank's host runs one wave ahead of its GPU.
   Then ranks ``< P-1`` receive the sample state of wave ``k + 1 - P`` (the ring
   ``P-1 -> 0 -> 1 -> ...``): the last rank sends it in its iteration ``k + 2 - P``, after
   launching that wave and syncing wave ``k + 1 - P``; each rank relays it one hop on.

With ``T``/``F``/``R``/``L`` the times rank ``s`` starts iteration ``k``, has fetched, has
the schedule, and launches, ``D`` GPU-done times, ``n`` the wave's new prompt tokens:
``T(s,k) = max(L(s,k-1), D(s,k-2), ring) + retire(k-P)`` with, for ``s < P-1`` and
``k >= P``, ``ring = max(D(P-1,k-P), L(P-1,k-P+1)) + (s+1)*hop``; ``A(0,k) = T(0,k)``,
``A(s,k) = max(T(s,k), A(s-1,k) + send*n + hop) + recv*n``; rank ``s < P-1`` has sent at
``C = A + send*n``, or with a blocking send and ``n > 0`` at ``max(A + send*n, T(s+1,k)) +
hop``; ``F = C + merge*n`` (the last rank: ``A + merge*n``); ``R(0,k) = F(0,k) + pass``,
``R(s,k) = max(F(s,k), R(s-1,k) + hop)``; ``L(0,k) = R(0,k) + add + prepare``,
``L(s,k) = R(s,k) + batch + pass + add + prepare``
(``prepare`` includes the iteration's fixed ``iteration_s``). So at most ``P`` waves are in flight
(``num_micro_batches = pp_size``; the simulator checks it too). Not
modelled: the per-request Python loops of ``_handle_responses`` / ``_update_requests``
(microseconds per active request), the pickling of schedules and sample states (ids and
one token per request), responses leaving at rank 0's finalise instead of
the last GPU (latency, not throughput, at high concurrency), and
``_pp_retry_until_can_schedule`` failing (both policies take the core's all-stage
capacity decision, so rank 0's schedule always fits).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prefill_node.errors import InvariantError
from prefill_node.sim.trtllm_costs import TrtllmLoopCosts


@dataclass(frozen=True)
class LoopCosts:
    """Host costs of one executor-loop iteration (seconds; per token unless noted)."""

    walk_s_per_token: float  # capacity-scheduler prefix walk, per matched-prefix token
    add_s_per_token: float  # add_sequence in prepare_resources, per prompt token
    hop_s: float  # one host-to-host object send between adjacent ranks (per message)
    trtllm: TrtllmLoopCosts = TrtllmLoopCosts()  # prompt moves, pickling, retire walks
    scheduler_walk_scale: float = 1.0  # the scheduler walks' share of the constants (ablation)

    def __post_init__(self) -> None:
        costs = (self.walk_s_per_token, self.add_s_per_token, self.hop_s)
        if min(*costs, self.scheduler_walk_scale) < 0:
            raise InvariantError(f"loop costs must be >= 0: {self}")

    @property
    def retire_s_per_token(self) -> float:
        return self.trtllm.retire_walks * self.walk_s_per_token

    def walk_s(self, matched: int, prompt: int) -> float:
        """One scheduler walk over prompts of ``prompt`` tokens, ``matched`` of them cached
        (the retire walks are not scheduler walks: ``scheduler_walk_scale`` leaves them)."""
        walk = self.walk_s_per_token * matched + self.trtllm.walk_base_s_per_token * prompt
        return self.scheduler_walk_scale * walk


@dataclass(frozen=True)
class WaveHostWork:
    """Tokens of host work one wave causes on every rank's loop (see the module docstring)."""

    pass_walk_tokens: int  # matched prefixes the scheduler pass walks (every rank)
    batch_walk_tokens: int  # matched prefixes of the wave's requests (can_schedule, ranks > 0)
    first_chunk_tokens: int  # prompts whose first chunk is in the wave (add_sequence, every rank)
    pass_prompt_tokens: int = 0  # whole prompts the pass walks (walk base cost)
    batch_prompt_tokens: int = 0  # whole prompts can_schedule walks
    new_request_tokens: int = 0  # prompts broadcast at this iteration's fetch
    chunk_prompt_tokens: int = 0  # whole prompt of every context chunk in the wave (get_tokens)
    retire_tokens: int = 0  # prompts whose last chunk is in the wave (retired P waves later)


def wave_host_work(
    live: Iterable[tuple[int, int]],
    chunks: Iterable[tuple[int, int, int, int]],
    new_request_tokens: int,
) -> WaveHostWork:
    """The host work of a wave from ``(cached, prompt)`` of every request the scheduler pass
    walks (``live``) and ``(start, end, cached, prompt)`` of each of the wave's chunks."""
    walked = list(live)
    chunks = list(chunks)
    return WaveHostWork(
        pass_walk_tokens=sum(c for c, _ in walked),
        batch_walk_tokens=sum(c for _, _, c, _ in chunks),
        first_chunk_tokens=sum(p for s, _, c, p in chunks if s == c),
        pass_prompt_tokens=sum(p for _, p in walked),
        batch_prompt_tokens=sum(p for *_, p in chunks),
        new_request_tokens=new_request_tokens,
        chunk_prompt_tokens=sum(p for *_, p in chunks),
        retire_tokens=sum(p for _, e, _, p in chunks if e == p),
    )


def loop_work_s(costs: TrtllmLoopCosts, work: WaveHostWork) -> float:
    """Host seconds every rank's loop spends on ``work`` under BOTH policies before launching
    it: the iteration's fixed cost and the whole prompt of each chunk made a Python list
    (``trtllm_costs.HOST_COST_CHARGES``)."""
    return costs.iteration_s + costs.prepare_s_per_token * work.chunk_prompt_tokens


class ExecutorLoops:
    """Times of each wave on each rank's executor loop, computed lazily in wave order.

    Contract: the simulator asks ``leader_free_at()`` (top of rank 0's next iteration),
    then ``fetch_done_at(n, restart)`` (when rank 0 has broadcast ``n`` new prompt tokens,
    its iteration starting at ``restart`` if later: an idle loop picking up an arrival; it
    may depend on rank 1 reaching that iteration), and calls ``begin`` at or after it;
    ``launch_time(s, k)`` for ``s > 0`` once wave ``k`` has begun; ``gpu_done`` records
    when stage ``s`` finished wave ``k``. Every query returns None while it depends on a
    GPU-done time not yet recorded (ask again after the next ``gpu_done``); answers never
    change once given. Entries older than ``2P + 4`` waves are dropped.
    """

    def __init__(self, num_stages: int, costs: LoopCosts) -> None:
        if num_stages < 1:
            raise InvariantError(f"num_stages must be >= 1, got {num_stages}")
        self.num_stages, self.costs = num_stages, costs
        self._top: list[dict[int, float]] = [{} for _ in range(num_stages)]
        self._arrive: list[dict[int, float]] = [{} for _ in range(num_stages)]
        self._recv: list[dict[int, float]] = [{} for _ in range(num_stages)]
        self._launch: list[dict[int, float]] = [{} for _ in range(num_stages)]
        self._done: list[dict[int, float]] = [{} for _ in range(num_stages)]
        self._work: dict[int, WaveHostWork] = {}
        self.next_index = 0
        self.host_busy_s = [0.0] * num_stages  # host work charged per rank (waits excluded)

    # ---- rank 0 -------------------------------------------------------------------

    def leader_free_at(self) -> float | None:
        """When rank 0 starts its next iteration; None while its GPU still owes wave k-2."""
        return self._top_of(0, self.next_index)

    def fetch_done_at(self, new_tokens: int, restart: float = 0.0) -> float | None:
        """When rank 0 has fetched and forwarded ``new_tokens`` new prompt tokens, its
        iteration starting at ``restart`` if later than its top (an idle loop that picks up
        a request arriving then)."""
        top = self._top_of(0, self.next_index)
        if top is None:
            return None
        return self._fetch_done(0, self.next_index, max(top, restart), new_tokens)

    def begin(self, now: float, work: WaveHostWork, restart: float = 0.0) -> tuple[int, float]:
        """Rank 0 schedules iteration ``k`` at ``now``; returns ``(k, rank 0's launch time)``."""
        k = self.next_index
        ready = self.fetch_done_at(work.new_request_tokens, restart)
        if ready is None or ready > now + 1e-12:
            raise InvariantError(f"rank 0 began wave {k} at {now} before its fetch ({ready})")
        c = self.costs
        self._work[k] = work
        self._top[0][k] = max(self._top[0][k], restart)  # what rank 1's receive waits for
        self._recv[0][k] = now + c.walk_s(work.pass_walk_tokens, work.pass_prompt_tokens)
        self._launch[0][k] = self._recv[0][k] + self._local_work(work)
        self.host_busy_s[0] += self._launch[0][k] - now + self._fetch_work(0, k)
        self.next_index = k + 1
        return k, self._launch[0][k]

    # ---- every rank ---------------------------------------------------------------

    def launch_time(self, stage: int, k: int) -> float | None:
        """When rank ``stage`` has launched wave ``k``; None while it waits on a GPU."""
        known = self._launch[stage].get(k)
        if known is not None:
            return known
        if stage == 0 or k not in self._work:
            raise InvariantError(f"wave {k} was never begun on rank 0 (asked for rank {stage})")
        recv = self._sched(stage, k)
        if recv is None:
            return None
        c, w = self.costs, self._work[k]
        work = c.walk_s(w.batch_walk_tokens, w.batch_prompt_tokens)
        work += c.walk_s(w.pass_walk_tokens, w.pass_prompt_tokens) + self._local_work(w)
        self._launch[stage][k] = recv + work
        self.host_busy_s[stage] += work + self._fetch_work(stage, k)
        return recv + work

    def gpu_done(self, stage: int, k: int, at: float) -> None:
        """Stage ``stage``'s GPU finished wave ``k`` at ``at``; prunes old entries."""
        self._done[stage][k] = at
        if stage == self.num_stages - 1:
            old = k - 2 * self.num_stages - 4
            self._work.pop(old, None)
            for s in range(self.num_stages):
                for table in (self._top, self._arrive, self._recv, self._launch, self._done):
                    table[s].pop(old, None)

    # ---- the recurrences of the module docstring -----------------------------------

    def _local_work(self, w: WaveHostWork) -> float:
        t = self.costs.trtllm
        return self.costs.add_s_per_token * w.first_chunk_tokens + loop_work_s(t, w)

    def _fetch_work(self, stage: int, k: int) -> float:
        """Host seconds rank ``stage`` spends on iteration ``k``'s fetch and finalise."""
        t, n = self.costs.trtllm, self._work[k].new_request_tokens
        work = t.merge_s_per_token * n
        work += t.recv_s_per_token * n if stage > 0 else 0.0
        work += t.send_s_per_token * n if stage < self.num_stages - 1 else 0.0
        retired = self._work.get(k - self.num_stages)
        return work + (self.costs.retire_s_per_token * retired.retire_tokens if retired else 0.0)

    def _launch_of(self, stage: int, k: int) -> float | None:
        if stage == 0:
            launch = self._launch[0].get(k)
            if launch is None:
                raise InvariantError(f"rank 0 has not launched wave {k}")
            return launch
        return self.launch_time(stage, k)

    def _top_of(self, stage: int, k: int) -> float | None:
        """T(stage, k): the top of the rank's iteration ``k``, after finalising wave k-P."""
        known = self._top[stage].get(k)
        if known is not None:
            return known
        start = 0.0
        if k >= 1:
            launch = self._launch_of(stage, k - 1)
            if launch is None:
                return None
            start = launch
        if k >= 2:
            done = self._done[stage].get(k - 2)
            if done is None:
                return None
            start = max(start, done)
        last = self.num_stages - 1
        if stage < last and k >= self.num_stages:  # sample state of wave k-P, relayed
            done, sent = self._done[last].get(k - self.num_stages), self._launch_of(last, k - last)
            if done is None or sent is None:
                return None
            start = max(start, max(done, sent) + (stage + 1) * self.costs.hop_s)
        retired = self._work.get(k - self.num_stages)
        if retired is not None:
            start += self.costs.retire_s_per_token * retired.retire_tokens
        self._top[stage][k] = start
        return start

    def _new_tokens(self, k: int) -> int:
        work = self._work.get(k)
        if work is None:
            raise InvariantError(f"rank > 0 fetching wave {k} before rank 0 began it")
        return work.new_request_tokens

    def _arrived(self, stage: int, k: int) -> float | None:
        """A(stage, k): the rank has received and unpickled iteration ``k``'s payload."""
        if stage == 0:
            return self._top_of(0, k)
        known = self._arrive[stage].get(k)
        if known is not None:
            return known
        top, upstream = self._top_of(stage, k), self._arrived(stage - 1, k)
        if top is None or upstream is None:
            return None
        t, n = self.costs.trtllm, self._new_tokens(k)
        sent = upstream + t.send_s_per_token * n + self.costs.hop_s
        self._arrive[stage][k] = max(top, sent) + t.recv_s_per_token * n
        return self._arrive[stage][k]

    def _fetch_done(self, stage: int, k: int, arrived: float, n: int) -> float | None:
        """F(stage, k) from A(stage, k): forward (blocking on the next rank), then merge."""
        t = self.costs.trtllm
        done = arrived
        if stage < self.num_stages - 1:
            done += t.send_s_per_token * n
            if t.blocking_request_send and n > 0:
                nxt = self._top_of(stage + 1, k)
                if nxt is None:
                    return None
                done = max(done, nxt) + self.costs.hop_s
        return done + t.merge_s_per_token * n

    def _sched(self, stage: int, k: int) -> float | None:
        """R(stage, k): when rank ``stage > 0`` has fetched and received the schedule."""
        known = self._recv[stage].get(k)
        if known is not None:
            return known
        arrived = self._arrived(stage, k)
        if arrived is None:
            return None
        fetched = self._fetch_done(stage, k, arrived, self._new_tokens(k))
        upstream = self._recv[0].get(k) if stage == 1 else self._sched(stage - 1, k)
        if fetched is None or upstream is None:
            return None
        self._recv[stage][k] = max(fetched, upstream + self.costs.hop_s)
        return self._recv[stage][k]
