"""Discrete-event simulator of one pipeline: admission rounds, waves through P stages, clients.

It drives the real sans-IO core (per-stage block pools, leases, escrows, the admission
coordinator, the wave planner) through ``CorePort``; only time is simulated, from the
roofline (stage times, activation transfers) and the rounds plane's cost.

Timeline rules (both policies, see ``policies.py`` for what differs):
- Each stage runs waves one at a time, in wave order. Starting a wave on a stage
  materialises its chunks there (escrow -> blocks); when a request's last chunk leaves a
  stage, that stage completes the request (new blocks become reusable, pins drop).
- A wave leaves stage s, reaches stage s+1 after the activation transfer, and leaves the
  ring when the last stage finishes it; the request completes there and its client sends
  the next request at once (closed loop).
- A round's effects are applied to the core when the round ends (it takes the rounds
  plane's latency: the phases, plus per-token host work for the requests it sees for the
  first time); requests that must wait are retried when something has changed (an
  arrival or a completion), so an idle pipeline never spins.

Deterministic: no wall clock, no hashing of Python objects, ties broken by event order.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, replace

from prefill_node.core.admission_messages import Admitted, Rejected, Wait
from prefill_node.core.planner import PlannerConfig, WavePlanner
from prefill_node.core.wave import UnscheduledWork, Wave
from prefill_node.errors import InvariantError
from prefill_node.sim.core_port import CorePort
from prefill_node.sim.policies import Policy
from prefill_node.sim.presets import Preset
from prefill_node.sim.results import RequestRecord, SimResult, summarise
from prefill_node.sim.roofline import PipelineRoofline
from prefill_node.sim.workloads import SimRequest, Workload, WorkloadSpec

_ARRIVE, _ROUND_DONE, _STAGE_DONE, _WAVE_AT_STAGE = range(4)


@dataclass
class _Running:
    """An admitted request: what the planner still has to schedule and what is in flight."""

    request: SimRequest
    arrival: float
    admitted_at: float
    cached_len: int
    next_start: int
    in_flight: int = 0

    @property
    def end(self) -> int:
        return self.request.num_tokens


class Simulator:
    """One run: ``spec.num_requests`` requests of one workload under one policy."""

    def __init__(
        self, preset: Preset, spec: WorkloadSpec, policy: Policy, *, check_integrity: bool = False
    ) -> None:
        p = preset
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
            lease_headroom_tokens=2 * p.num_stages * p.max_wave_tokens,
            max_round_requests=policy.max_round_requests,
        )
        self.workload = Workload(spec, cache_tokens=min(capacities) * p.block_size)
        cfg = PlannerConfig(
            num_stages=p.num_stages,
            max_wave_tokens=p.max_wave_tokens,
            min_wave_tokens=p.min_wave_tokens,
            block_size=p.block_size,
            fill_factor=p.fill_factor,
            max_wave_requests=p.max_batch,
            mode=policy.planner_mode,
            fragment_rule=policy.fragment_rule,
        )
        self.planner = WavePlanner(cfg, self.roof.chunk_cost_model())
        self._check = check_integrity
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self.now = 0.0
        self._issued = 0
        self._pending: deque[tuple[SimRequest, float]] = deque()  # not yet submitted
        self._submitted: dict[str, tuple[SimRequest, float]] = {}  # in the coordinator
        self._charged: set[str] = set()  # requests whose host work a round already paid
        self._running: dict[str, _Running] = {}  # admitted, not finished, FCFS order
        self._records: list[RequestRecord] = []
        self._rejected = 0
        self._round_busy = False  # a round is in progress (its own timeline or the loop's)
        self._round_wanted = False  # something changed since the last round
        self._loop_round_done = False  # lockstep: the round before the next wave has run
        self._in_flight = 0
        self._stage_busy = [False] * p.num_stages
        self._stage_queue: list[deque[Wave]] = [deque() for _ in range(p.num_stages)]
        self._busy_s = [0.0] * p.num_stages
        self._num_waves = self._wave_tokens = self._num_rounds = self._round_requests = 0
        self._loop_stall_s = 0.0

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
            else:
                self._on_wave_at_stage(*payload)  # type: ignore[misc]
            if self._check:
                self.core.check_integrity()
        if len(self._records) + self._rejected != self.spec.num_requests:
            raise InvariantError(
                f"simulation stalled: {len(self._records)} done, {self._rejected} rejected, "
                f"{len(self._pending)} pending, {len(self._running)} running of "
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
        self._round_wanted = True
        self._maybe_start_round()
        self._try_issue()

    def _admission_waiting(self) -> bool:
        return bool(self._pending or self._submitted)

    def _submit_pending(self) -> None:
        """Hand arrivals to the coordinator while the batch limit allows (FCFS)."""
        while self._pending and (len(self._running) + len(self._submitted) < self.preset.max_batch):
            request, arrival = self._pending.popleft()
            rejected = self.core.submit(self.core.spec(request.request_id, request.tokens))
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
        latency = self.preset.rounds.round_s(sum(self._submitted[r][0].num_tokens for r in fresh))
        if self.policy.admission_on_loop:
            self._loop_stall_s += latency
        self._num_rounds += 1
        self._round_requests += len(ids)
        self._push(self.now + latency, _ROUND_DONE, None)
        return True

    def _maybe_start_round(self) -> None:
        """WAVE policy only: rounds on their own timeline, back to back while useful."""
        if self.policy.admission_on_loop or self._round_busy:
            return
        if self._round_wanted and self._admission_waiting():
            self._start_round()

    def _on_round_done(self, _: object) -> None:
        self._round_busy = False
        admitted = 0
        for outcome in self.core.run_round():
            rid = outcome.request_id
            if isinstance(outcome, Admitted):
                request, arrival = self._submitted.pop(rid)
                self._charged.discard(rid)
                run = _Running(request, arrival, self.now, outcome.cached_len, outcome.cached_len)
                self._running[rid] = run
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
        if self.policy.admission_on_loop:
            self._loop_round_done = True
        self._maybe_start_round()
        self._try_issue()

    # ---- execution ----------------------------------------------------------------

    def _schedulable(self) -> list[UnscheduledWork]:
        pipelined = self.policy.pipelined_chunks
        return [
            UnscheduledWork(rid, r.next_start, r.end)
            for rid, r in self._running.items()
            if r.next_start < r.end and (pipelined or r.in_flight == 0)
        ]

    def _try_issue(self) -> None:
        """Plan and start the next wave on stage 0 if the leader and the ring allow it."""
        on_loop = self.policy.admission_on_loop
        if self._stage_busy[0] or self._stage_queue[0] or (on_loop and self._round_busy):
            return
        if self._in_flight >= self.policy.ring_size:
            return
        # Lockstep: one loop iteration = fetch/admit (one round, synchronous: stage 0 idles
        # meanwhile), then schedule and launch one micro-batch, as in TRT-LLM's PP loop.
        if (
            on_loop
            and not self._loop_round_done
            and self._round_wanted
            and self._admission_waiting()
            and self._start_round()
        ):
            return
        work = self._schedulable()
        wave = self.planner.plan(work) if work else None
        if wave is None:
            return
        self._loop_round_done = False
        for chunk in wave.chunks:
            run = self._running[chunk.request_id]
            if chunk.start != run.next_start or chunk.end > run.end:
                raise InvariantError(f"planner scheduled {chunk} out of order")
            run.next_start = chunk.end
            run.in_flight += 1
        self._in_flight += 1
        self._num_waves += 1
        self._wave_tokens += wave.num_tokens
        self._start_on_stage(0, wave)

    def _start_on_stage(self, stage: int, wave: Wave) -> None:
        for chunk in wave.chunks:
            self.core.materialise(stage, chunk)
        duration = self.roof.stage_time(stage, wave.chunks)
        self._stage_busy[stage] = True
        self._busy_s[stage] += duration
        self._push(self.now + duration, _STAGE_DONE, (stage, wave))

    def _on_wave_at_stage(self, stage: int, wave: Wave) -> None:
        if self._stage_busy[stage]:
            self._stage_queue[stage].append(wave)
        else:
            self._start_on_stage(stage, wave)

    def _on_stage_done(self, stage: int, wave: Wave) -> None:
        self._stage_busy[stage] = False
        last_stage = stage == self.preset.num_stages - 1
        for chunk in wave.chunks:
            run = self._running[chunk.request_id]
            if chunk.end == run.end:
                self.core.finish(stage, chunk.request_id)
                self._round_wanted = True  # capacity came back on this stage
            if last_stage:
                run.in_flight -= 1
                if chunk.end == run.end:
                    self._complete(run)
        if last_stage:
            self._in_flight -= 1
            self._loop_round_done = False  # lockstep: a new loop iteration fetches again
        else:
            arrive = self.now + self.roof.transfer_time(wave.num_tokens)
            self._push(arrive, _WAVE_AT_STAGE, (stage + 1, wave))
        if self._stage_queue[stage]:
            self._start_on_stage(stage, self._stage_queue[stage].popleft())
        self._maybe_start_round()
        self._try_issue()

    def _complete(self, run: _Running) -> None:
        del self._running[run.request.request_id]
        self._records.append(
            RequestRecord(
                arrival=run.arrival,
                admitted=run.admitted_at,
                finished=self.now,
                prompt_tokens=run.end,
                cached_tokens=run.cached_len,
            )
        )
        self._send_next()
