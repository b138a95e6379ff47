"""Discrete-event simulator of one pipeline: admission rounds, waves through P stages, clients.

It drives the real sans-IO core: the leader (``core.leader.LeaderCore``: the admission
coordinator, the wave scheduler and planner, as the runtime's leader does) and each
stage's block pool, leases and escrows (``CorePort``); only time is simulated, from the
roofline (stage times, activation transfers) and the rounds plane's cost.

Timeline rules (both policies, see ``policies.py`` for what differs):
- Each stage runs waves one at a time, in wave order. Starting a wave on a stage
  materialises its chunks there (escrow -> blocks); when a request's chunk leaves a stage,
  the full blocks it finished become reusable there, and after its last chunk that stage
  completes the request (pins drop).
- A wave leaves stage s, reaches stage s+1 after the activation transfer, and leaves the
  ring when the last stage finishes it; the request completes there and its client sends
  the next request at once (closed loop).
- A round's effects are applied to the core when the round ends (it takes the rounds
  plane's latency: the phases, plus per-token host work for the requests it sees for the
  first time); requests that must wait are retried when something has changed (an
  arrival or a completion), so an idle pipeline never spins.
- WAVE pays, on its rounds timeline, the host work of moving each new request to every
  stage and creating it there (``TrtllmLoopCosts.admission_s_per_token``), and on each
  stage's loop the executor work WavePP keeps (``stage_hosts.py``: per-wave iteration and
  prompt conversion, retire walks), with the same constants as the trtllm's loops.
- TRTLLM instead runs the round inside rank 0's executor-loop iteration, with no time of
  its own, and charges the loop work TensorRT-LLM does per wave on every rank
  (``executor_loops.py``); a stage's GPU starts a wave only once its own rank's loop has
  launched it (the wait is reported as ``loop_stall_s``). SYNC_ADMISSION (the ablation of
  our runtime) runs each round on stage 0's loop instead, phase by phase, each phase
  answered by the other stages between their waves (``leader_rounds.py``); stage 0
  computes nothing meanwhile.

Deterministic: no wall clock, no hashing of Python objects, ties broken by event order.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, replace

from prefill_node.core.admission_messages import Admitted, Rejected, Wait
from prefill_node.core.leader import LeaderCore
from prefill_node.core.planner import WavePlanner
from prefill_node.core.policy import Policy, PolicyKind
from prefill_node.core.round_driver import run_round
from prefill_node.core.wave import Wave
from prefill_node.core.wave_scheduler import WaveScheduler
from prefill_node.errors import InvariantError
from prefill_node.sim.core_port import CorePort
from prefill_node.sim.executor_loops import ExecutorLoops, LoopCosts, wave_host_work
from prefill_node.sim.leader_rounds import LeaderRounds
from prefill_node.sim.policies import ExecutorKind
from prefill_node.sim.presets import Preset
from prefill_node.sim.results import RequestRecord, SimResult, summarise
from prefill_node.sim.roofline import PipelineRoofline
from prefill_node.sim.stage_hosts import StageHosts
from prefill_node.sim.trtllm_issue import TrtllmIssue
from prefill_node.sim.workloads import SimRequest, Workload, WorkloadSpec

_ARRIVE, _ROUND_DONE, _STAGE_DONE, _WAVE_AT_STAGE, _HOST_LAUNCH, _LEADER_FREE = range(6)
_PHASE_SEND, _PHASE_AT_STAGE, _PHASE_REPLY = range(6, 9)  # SYNC_ADMISSION only


@dataclass(frozen=True)
class _Admitted:
    """When an admitted request arrived and was admitted (its progress is the scheduler's)."""

    request: SimRequest
    arrival: float
    admitted_at: float
    cached_len: int


class Simulator(TrtllmIssue):
    """One run: ``spec.num_requests`` requests of one workload under one policy."""

    def __init__(
        self, preset: Preset, spec: WorkloadSpec, policy: Policy, *, check_integrity: bool = False
    ) -> None:
        p = preset = preset.host_scaled()
        # The preset decides the cache granularity; the workload only its prompts.
        spec = replace(spec, block_size=p.block_size, token_scale=p.token_scale)
        self.preset, self.spec, self.policy = preset, spec, policy
        self.roof = PipelineRoofline(p.model, p.gpu, p.link, p.num_stages, p.block_size)
        capacities = [s.capacity_blocks for s in self.roof.stages]
        self.core = CorePort(
            p.block_size,
            p.token_scale,
            capacities,
            [s.num_layers for s in self.roof.stages],
            model_id=p.model.name,
            stage_headroom_blocks=[
                policy.headroom_blocks(n, p.block_size, p.max_wave_tokens) for n in capacities
            ],
            max_round_requests=policy.max_round_requests,
            share_inflight_prefix=policy.share_inflight_prefix,
        )
        self.workload = Workload(spec, cache_tokens=min(capacities) * p.block_size)
        cfg = policy.planner_config(
            max_wave_tokens=p.max_wave_tokens,
            min_wave_tokens=p.min_wave_tokens,
            block_size=p.block_size,
            max_wave_requests=p.max_batch,
            fill_factor=p.fill_factor,
        )
        # the leader: the same core object the runtime's Leader drives
        self.leader: LeaderCore[None] = LeaderCore(
            self.core.coordinator,
            WaveScheduler(policy, WavePlanner(cfg, self.roof.chunk_cost_model())),
            token_scale=p.token_scale,
        )
        self._check = check_integrity
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self.now = 0.0
        self._issued = 0
        self._pending: deque[tuple[SimRequest, float]] = deque()  # not yet submitted
        self._submitted: dict[str, tuple[SimRequest, float]] = {}  # in the coordinator
        self._charged: set[str] = set()  # requests whose host work a round already paid
        self._admitted: dict[str, _Admitted] = {}  # admitted, not finished
        self._records: list[RequestRecord] = []
        self._rejected = 0
        self._round_busy = False  # WAVE: a round is in progress on the rounds timeline
        self._round_wanted = False  # something changed since the last round
        # TRTLLM: every rank's executor loop (executor_loops.py); wave_id -> loop index
        self.loops: ExecutorLoops | None = None
        self.leader_rounds: LeaderRounds | None = None
        # WAVE on the TensorRT-LLM executor: the loop work it keeps, same constants
        self.hosts: StageHosts | None = None
        rounds = p.rounds
        costs = LoopCosts(
            rounds.walk_s_per_token,
            rounds.host_s_per_token,
            p.link.latency_s,
            p.trtllm,
            p.scheduler_walk_scale,
        )
        if policy.kind is PolicyKind.SYNC_ADMISSION:
            self.leader_rounds = LeaderRounds(p.num_stages, rounds.phases, rounds.phase_latency_s)
        elif policy.kind is PolicyKind.TRTLLM:
            self.loops = ExecutorLoops(p.num_stages, costs)
        elif p.executor is ExecutorKind.TRTLLM:
            self.hosts = StageHosts(p.num_stages, costs)
        # TRTLLM (executor loops): prompts not yet broadcast by rank 0's fetch, FCFS, and
        # waves whose launch on a rank waits for another rank's GPU (stage -> (wave, since))
        self._unfetched: deque[tuple[float, int]] = deque()
        self._fetched_until = 0.0  # the last fetch's cut-off: later arrivals wait for the next
        self._leader_idle = False  # rank 0's loop found nothing to run: it fetches continuously
        self._fetch_cut: float | None = None  # arrivals the fetch in progress broadcasts
        self._parked: dict[int, tuple[Wave, float]] = {}
        self._loop_index: dict[int, int] = {}
        self._leader_wakeup: float | None = None
        self._loop_round_done = False  # SYNC_ADMISSION: a round ran since the last wave
        self._round_started = 0.0
        self._stage_busy = [False] * p.num_stages
        self._stage_queue: list[deque[Wave]] = [deque() for _ in range(p.num_stages)]
        self._busy_s = [0.0] * p.num_stages
        self._num_waves = self._wave_tokens = self._num_rounds = self._round_requests = 0
        self._loop_stall_s = 0.0
        self._stage0_debt_s = 0.0  # leader host work owed to stage 0's core (see Preset)

    @property
    def records(self) -> tuple[RequestRecord, ...]:
        """The finished requests so far, in completion order (all of them after ``run``)."""
        return tuple(self._records)

    # ---- driver -------------------------------------------------------------------

    def run(self) -> SimResult:
        """Seed the caches, run the closed loop to completion and summarise."""
        for i, prompt in enumerate(self.workload.seed_prompts()):
            self.core.seed(f"seed-{i}", prompt)
        for _ in range(min(self.spec.concurrency, self.spec.num_requests)):
            self._send_next()
        while self._events:
            self.now, _, kind, payload = heapq.heappop(self._events)
            if kind == _ARRIVE:
                self._on_arrive(payload)  # type: ignore[arg-type]
            elif kind == _ROUND_DONE:
                self._on_round_done(payload)  # type: ignore[arg-type]
            elif kind == _STAGE_DONE:
                self._on_stage_done(*payload)  # type: ignore[misc]
            elif kind == _WAVE_AT_STAGE:
                self._on_wave_at_stage(*payload)  # type: ignore[misc]
            elif kind == _HOST_LAUNCH:
                self._on_host_launch(*payload)  # type: ignore[misc]
            elif kind >= _PHASE_SEND:
                self._on_phase_event(kind, payload)  # type: ignore[arg-type]
            else:
                self._leader_wakeup = None
                self._try_issue()
            if self._check:
                self.core.check_integrity()
        if len(self._records) + self._rejected != self.spec.num_requests:
            raise InvariantError(
                f"simulation stalled: {len(self._records)} done, {self._rejected} rejected, "
                f"{len(self._pending)} pending, {self.leader.scheduler.num_running} running of "
                f"{self.spec.num_requests}"
            )
        self.core.check_integrity()
        return summarise(
            preset=self.preset.name,
            workload=self.spec,
            policy=self.policy.name,
            records=self._records,
            rejected=self._rejected,
            stage_busy_s=self._busy_s,
            num_waves=self._num_waves,
            wave_tokens=self._wave_tokens,
            num_rounds=self._num_rounds,
            round_requests=self._round_requests,
            loop_stall_s=self._loop_stall_s,
        )

    def _push(self, at: float, kind: int, payload: object) -> None:
        heapq.heappush(self._events, (at, self._seq, kind, payload))
        self._seq += 1

    def _send_next(self) -> None:
        if self._issued < self.spec.num_requests:
            self._push(self.now, _ARRIVE, self.workload.request(self._issued))
            self._issued += 1

    # ---- admission ----------------------------------------------------------------

    def _on_arrive(self, request: SimRequest) -> None:
        self._pending.append((request, self.now))
        if self.loops is not None:
            self._unfetched.append((self.now, request.num_tokens))
        self._round_wanted = True
        self._maybe_start_round()
        self._try_issue()

    def _admission_waiting(self) -> bool:
        return bool(self._pending or self._submitted)

    def _submit_pending(self) -> None:
        """Hand arrivals to the coordinator while the batch limit allows (FCFS); under the
        executor-loops trtllm only those rank 0's last fetch has broadcast."""
        while self._pending and (
            self.leader.scheduler.num_running + len(self._submitted) < self.preset.max_batch
        ):
            if self.loops is not None and self._pending[0][1] > self._fetched_until:
                break
            request, arrival = self._pending.popleft()
            rejected = self.leader.enqueue(self.core.spec(request.request_id, request.tokens))
            if rejected is not None:
                self._rejected += 1
                self._send_next()
            else:
                self._submitted[request.request_id] = (request, arrival)

    def _start_round(self) -> bool:
        """Start a round over the head of the coordinator's queue; False if it is empty."""
        self._submit_pending()
        ids = self.core.next_round_ids()
        if not ids:
            return False
        self._round_busy, self._round_wanted = True, False
        # Host work per token is paid once per request, by the first round that looks at it
        # (token transport, hashing, probe, lease, escrow: what bench/calibrate_admission.py
        # measures); a request retried after a Wait costs little more than the phases.
        fresh = [r for r in ids if r not in self._charged]
        self._charged.update(fresh)
        tokens = sum(self._submitted[r][0].num_tokens for r in fresh)
        seeded = sum(self._submitted[r][0].seeded_len for r in fresh)
        # moving the new requests to every stage and creating them there (wave: off the loop)
        host = self.preset.rounds.host_s(tokens, seeded)
        host += self.preset.trtllm.admission_s_per_token * tokens
        self._num_rounds += 1
        self._round_requests += len(ids)
        if self.leader_rounds is not None:  # on stage 0's loop: host work, then the phases
            self.leader_rounds.begin()
            self._round_started = self.now
            self._push(self.now + host, _PHASE_SEND, None)
            return True
        if self.preset.leader_shares_stage0_core:  # its Python time-slices stage 0's core
            self._stage0_debt_s += host
        phases = self.preset.rounds.phases * self.preset.rounds.phase_latency_s
        self._push(self.now + phases + host, _ROUND_DONE, None)
        return True

    def _on_phase_event(self, kind: int, stage: int | None) -> None:
        """SYNC_ADMISSION: send a phase to every other stage, deliver it, collect replies."""
        lr = self.leader_rounds
        if lr is None:
            raise InvariantError("phase event without sync-admission")
        if kind == _PHASE_SEND:
            for s in range(1, self.preset.num_stages):
                self._push(self.now + lr.one_way_s, _PHASE_AT_STAGE, s)
            if self.preset.num_stages > 1:
                return
        elif kind == _PHASE_AT_STAGE:
            if lr.arrive(stage, self._stage_busy[stage]):  # answered at once
                self._push(self.now + lr.one_way_s, _PHASE_REPLY, stage)
            return
        elif not lr.reply(stage):
            return
        if lr.next_phase():
            self._push(self.now, _PHASE_SEND, None)
            return
        self._loop_stall_s += self.now - self._round_started  # stage 0 computed nothing
        self._loop_round_done = True
        self._on_round_done(None)

    def _maybe_start_round(self) -> None:
        """WAVE policy only: rounds on their own timeline, back to back while useful."""
        if self.policy.admission_on_loop or self._round_busy:
            return
        if self._round_wanted and self._admission_waiting():
            self._start_round()

    def _on_round_done(self, _: object) -> None:
        self._round_busy = False
        self._apply_outcomes(self._run_round())
        self._maybe_start_round()
        self._try_issue()

    def _run_round(self) -> tuple[object, ...]:
        """The round's effects on the core: the leader's round over every stage."""
        return run_round(self.leader, self.core.stages)

    def _apply_outcomes(self, outcomes: tuple[object, ...]) -> None:
        """Admitted requests start running (the leader scheduled them), rejected ones are
        counted, waiting ones stay queued."""
        admitted = 0
        for outcome in outcomes:
            rid = outcome.request_id
            if isinstance(outcome, Admitted):
                request, arrival = self._submitted.pop(rid)
                self._charged.discard(rid)
                self._admitted[rid] = _Admitted(request, arrival, self.now, outcome.cached_len)
                admitted += 1
            elif isinstance(outcome, Rejected):
                del self._submitted[rid]
                self._charged.discard(rid)
                self._rejected += 1
                self._send_next()
            elif not isinstance(outcome, Wait):  # Wait: stays queued, FCFS
                raise InvariantError(f"unexpected admission outcome {outcome!r}")
        if admitted and self._admission_waiting():
            self._round_wanted = True  # progress was made: the rest may fit now

    # ---- execution ----------------------------------------------------------------

    def _try_issue(self) -> None:
        """Plan and start the next wave on stage 0 if the leader and the ring allow it."""
        if self.loops is not None:
            self._try_issue_trtllm(self.loops)
            return
        if self.leader_rounds is not None:
            self._try_issue_leader_rounds()
            return
        if self._stage_busy[0] or self._stage_queue[0]:
            return
        wave = self.leader.next_wave()
        if wave is not None:
            self._count(wave)
            if self.hosts is not None:
                runs = ((c, self.leader.scheduler.request(c.request_id)) for c in wave.chunks)
                chunks = [(c.start, c.end, r.cached_len, r.end) for c, r in runs]
                self.hosts.plan(wave.wave_id, self.now, wave_host_work([], chunks, 0))
            self._start_on_stage(0, wave)

    def _try_issue_leader_rounds(self) -> None:
        """The sync-admission ablation (``Leader.next_wave``): when stage 0's loop is free, one
        round if there is round work, then one wave if the ring allows; with no wave to run,
        a further round as soon as there is round work again."""
        if self._stage_busy[0] or self._round_busy:
            return
        after_round, self._loop_round_done = self._loop_round_done, False
        round_work = self._round_wanted and self._admission_waiting()
        if not after_round and round_work and self._start_round():
            return
        wave = self.leader.next_wave()
        if wave is None:
            if after_round and self._round_wanted and self._admission_waiting():
                self._start_round()
            return
        self._count(wave)
        self._start_on_stage(0, wave)

    def _wake_leader(self, at: float) -> None:
        if self._leader_wakeup is None or self._leader_wakeup > at:
            self._leader_wakeup = at
            self._push(at, _LEADER_FREE, None)

    def _count(self, wave: Wave) -> None:
        self._num_waves += 1
        self._wave_tokens += wave.num_tokens

    def _start_on_stage(self, stage: int, wave: Wave) -> None:
        if self.loops is not None:  # trtllm: the GPU waits for its rank's loop to launch
            launch = self.loops.launch_time(stage, self._loop_index[wave.wave_id])
            if launch is None:  # its fetch waits for the next rank's loop (blocking send)
                self._stage_busy[stage] = True
                self._parked[stage] = (wave, self.now)
                return
            if launch > self.now:
                self._stage_busy[stage] = True  # held for this wave; later ones queue
                self._loop_stall_s += launch - self.now
                self._push(launch, _HOST_LAUNCH, (stage, wave))
                return
        if self.hosts is not None:  # wave: the GPU waits for its stage's host too
            ready = self.hosts.ready_at(stage, wave.wave_id)
            if ready > self.now:
                self._stage_busy[stage] = True
                self._loop_stall_s += ready - self.now
                self._push(ready, _HOST_LAUNCH, (stage, wave))
                return
            self.hosts.launched(stage, wave.wave_id)
        for chunk in wave.chunks:
            self.core.materialise(stage, chunk)
        duration = self.roof.stage_time(stage, wave.chunks)
        if stage == 0:  # the leader's host work since stage 0's last wave (wave policy)
            duration, self._stage0_debt_s = duration + self._stage0_debt_s, 0.0
        self._stage_busy[stage] = True
        self._busy_s[stage] += duration
        self._push(self.now + duration, _STAGE_DONE, (stage, wave))

    def _on_host_launch(self, stage: int, wave: Wave) -> None:
        self._stage_busy[stage] = False
        self._start_on_stage(stage, wave)

    def _on_wave_at_stage(self, stage: int, wave: Wave) -> None:
        if self._stage_busy[stage]:
            self._stage_queue[stage].append(wave)
        else:
            self._start_on_stage(stage, wave)

    def _on_stage_done(self, stage: int, wave: Wave) -> None:
        self._stage_busy[stage] = False
        last_stage = stage == self.preset.num_stages - 1
        if self.loops is not None:
            self.loops.gpu_done(stage, self._loop_index[wave.wave_id], self.now)
            self._retry_parked()
        retired = 0
        for chunk in wave.chunks:
            if self.leader.is_last(chunk):
                self.core.complete(stage, chunk.request_id)
                self._round_wanted = True  # capacity came back on this stage
                retired += chunk.end
            else:
                self.core.cache_computed(stage, chunk)
        if self.hosts is not None and retired:
            self.hosts.retire(stage, self.now, retired)
        if last_stage:  # the leader: finished requests, blocks waiting requests may use
            done = self.leader.wave_done(wave.wave_id)
            self._round_wanted |= done.released
            for rid in done.finished:
                self._complete(rid)
            self._loop_index.pop(wave.wave_id, None)
        else:
            arrive = self.now + self.roof.transfer_time(wave.num_tokens)
            self._push(arrive, _WAVE_AT_STAGE, (stage + 1, wave))
        lr = self.leader_rounds
        if lr is not None and lr.stage_free(stage):  # a parked phase takes the lock first
            self._push(self.now + lr.one_way_s, _PHASE_REPLY, stage)
        if self._stage_queue[stage]:
            self._start_on_stage(stage, self._stage_queue[stage].popleft())
        self._maybe_start_round()
        self._try_issue()

    def _complete(self, request_id: str) -> None:
        run = self._admitted.pop(request_id)
        self._records.append(
            RequestRecord(
                arrival=run.arrival,
                admitted=run.admitted_at,
                finished=self.now,
                prompt_tokens=run.request.num_tokens,
                cached_tokens=run.cached_len,
            )
        )
        self._send_next()
