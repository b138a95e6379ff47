"""Cluster simulation: N pipelines behind the router's real index and scoring, one policy a run.

What is real: the router's sans-IO core (``RouterCore``: its ``GlobalPrefixIndex``, fed by
each pipeline's KV events, with the pending entries it records for every routed prompt; its
``Scorer``, every ``RoutingPolicy``; its accounting of the requests it placed, the queued
cost the scorer reads), driven as the router's server drives it; each pipeline's cache is
the node's own admission core (``CorePort``: block pool, prefix index, leases, escrow, LRU
eviction, KV events); prompts are hashed by the router core with each tenant's cache salt.

What is modelled: a pipeline is one FCFS server at the speed of its bottleneck stage (the
preset's roofline cost model, ``PipelineRoofline.chunk_cost_model``): a request of
``n`` tokens, ``c`` of them cached, occupies it for ``chunk_cost(c, n - c)`` and completes
``P - 1`` such times later (its last stage). That is the pipeline's compute bound; host
costs and the wave/baseline difference are the single-pipeline simulator's business. A
pipeline's cache holds what its smallest stage holds. Admission runs when the request
reaches the pipeline (the lease pins the cached prefix then; a request that does not fit
waits, FCFS); the blocks a request computed become cached, and are published to the index,
when it completes. KV events reach the index at once.

The ORACLE is one pooled cache of all pipelines' capacity, shared by every pipeline
(least-loaded placement): the cached share no routing can beat with these caches.

Closed loop: ``clients`` clients, each sending its next request when the last completes.
Figures exclude the first ``warmup`` completions (the caches start empty).
"""

from __future__ import annotations

import enum
import heapq
from collections import deque
from dataclasses import dataclass

from prefill_node.core.admission_messages import Admitted, Rejected
from prefill_node.core.cost_model import ChunkCostModel
from prefill_node.core.hashing import ExtraKeys
from prefill_node.core.request import RequestSpec
from prefill_node.core.wave import ScheduledChunk
from prefill_node.errors import InvalidRequestError, InvariantError
from prefill_node.sim.core_port import CorePort
from prefill_node.sim.presets import Preset
from prefill_node.sim.results import percentile
from prefill_node.sim.roofline import PipelineRoofline
from prefill_node.sim.tenants import TenantRequest, TenantWorkload
from prefill_router.calibration import CalibrationConfig
from prefill_router.router_core import PipelineMember, Placement, RouterCore
from prefill_router.scoring import RoutingPolicy


class ClusterPolicy(enum.Enum):
    """The router's policies, plus the pooled-cache oracle."""

    PREFIX = "prefix"
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    PREFIX_ONLY = "prefix_only"
    ORACLE = "oracle"

    @property
    def routing(self) -> RoutingPolicy:
        if self is ClusterPolicy.ORACLE:
            return RoutingPolicy.LEAST_LOADED
        return RoutingPolicy(self.value)


@dataclass(frozen=True)
class ClusterSpec:
    """One cluster run. ``token_scale``: real tokens per id (prompt sizes in the workload are
    ids); the core's blocks are ``block_ids`` ids. ``cache_blocks`` per pipeline: None = the
    preset's smallest stage at this block size."""

    preset: Preset
    num_pipelines: int
    workload: TenantWorkload
    clients: int
    token_scale: int = 256
    block_ids: int = 4
    warmup: int = 0
    cache_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.num_pipelines < 1 or self.clients < 1 or self.token_scale < 1:
            raise InvalidRequestError("num_pipelines, clients and token_scale must be >= 1")
        if not 0 <= self.warmup < self.workload.requests:
            raise InvalidRequestError("warmup must be in [0, requests)")

    @property
    def block_tokens(self) -> int:
        return self.block_ids * self.token_scale


@dataclass(frozen=True)
class ClusterResult:
    """One run, flat (``--json`` rows)."""

    preset: str
    pipelines: int
    policy: str
    zipf: float
    tenants: int
    clients: int
    requests: int
    input_tok_s: float
    computed_tok_s: float
    cached_share: float
    p50_s: float
    p95_s: float
    busiest_share: float  # the busiest pipeline's share of the measured requests
    rejected: int


class _Pipeline:
    """One pipeline's FCFS server and the requests routed to it."""

    def __init__(self, pid: str, core: CorePort) -> None:
        self.pid, self.core = pid, core
        self.queue: deque[tuple[str, int]] = deque()  # admitted: (request id, cached ids)
        self.busy = False
        self.placements: dict[str, Placement] = {}  # routed, unfinished
        self.sequence = 0
        self.served = 0


class ClusterSim:
    """N pipelines, the router and the clients (see the module docstring)."""

    def __init__(self, spec: ClusterSpec, policy: ClusterPolicy) -> None:
        self.spec, self.policy = spec, policy
        p = spec.preset
        roof = PipelineRoofline(p.model, p.gpu, p.link, p.num_stages, spec.block_tokens)
        real = roof.chunk_cost_model()
        s = spec.token_scale
        # costs per id: a chunk of n ids is n * s tokens attending s times as many positions
        self.cost = ChunkCostModel(real.per_token_s * s, real.per_token_context_s * s * s)
        self.stages = p.num_stages
        cap = spec.cache_blocks or min(st.capacity_blocks for st in roof.stages)
        self.capacity = cap
        self.model_id = p.model.name
        n = spec.num_pipelines
        pooled = None
        if policy is ClusterPolicy.ORACLE:
            pooled = self._core(cap * n, events=False)
        self.pipelines = [
            _Pipeline(f"p{i:02d}", pooled or self._core(cap, events=True)) for i in range(n)
        ]
        # no calibration: the simulated pipelines run exactly at the cost model's speed
        self.router = RouterCore(self.cost, policy.routing,
                                 calibration=CalibrationConfig(alpha=0.0))  # fmt: skip
        self.router.start_scoring(self.model_id, spec.block_ids)
        self._members = [PipelineMember(p.pid, True, 1 << 40, cap) for p in self.pipelines]
        for pipe in self.pipelines:
            self.router.index.add_pipeline(pipe.pid)
            self._publish(pipe, initial=True)
        self.requests = spec.workload.requests_of_run(0)
        self._owner: dict[str, tuple[_Pipeline, int, float, int]] = {}
        self._cached: dict[str, int] = {}
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = self._issued = self._rejected = 0
        self.now = 0.0
        self._done: list[tuple[float, float, int, int, str]] = []

    def _core(self, blocks: int, *, events: bool) -> CorePort:
        return CorePort(
            self.spec.block_ids,
            1,
            [blocks],
            [1],
            model_id=self.model_id,
            stage_headroom_blocks=[0],
            max_round_requests=64,
            enable_kv_events=events,
        )

    def _publish(self, pipe: _Pipeline, initial: bool = False) -> None:
        if self.policy is ClusterPolicy.ORACLE:
            return
        events = pipe.core.drain_events(0)
        if events or initial:
            pipe.sequence += 1
            result = self.router.index.apply(pipe.pid, pipe.sequence, events)
            if result.needs_resubscribe:
                raise InvariantError(f"{pipe.pid}: KV event gap in the simulation")

    def _push(self, at: float, kind: int, payload: object) -> None:
        heapq.heappush(self._events, (at, self._seq, kind, payload))
        self._seq += 1

    # ---- the run --------------------------------------------------------------------

    def run(self) -> ClusterResult:
        for _ in range(min(self.spec.clients, len(self.requests))):
            self._send_next()
        while self._events:
            self.now, _, kind, payload = heapq.heappop(self._events)
            if kind == 0:
                self._route(payload)  # type: ignore[arg-type]
            elif kind == 1:
                self._free(payload)  # type: ignore[arg-type]
            else:
                self._complete(*payload)  # type: ignore[misc]
        for pipe in self.pipelines:
            pipe.core.check_integrity()
        self.router.index.check_integrity()
        return self._summary()

    def _send_next(self) -> None:
        if self._issued < len(self.requests):
            self._push(self.now, 0, self._issued)
            self._issued += 1

    def _spec(self, i: int, req: TenantRequest) -> RequestSpec:
        return RequestSpec(f"r{i}", req.tokens, ExtraKeys(self.model_id, cache_salt=req.salt))

    def _route(self, i: int) -> None:
        req = self.requests[i]
        spec = self._spec(i, req)
        hashes = self.router.hashes(req.tokens, req.salt)
        pending = self.policy is not ClusterPolicy.ORACLE  # the pool has no index to feed
        decision, placement = self.router.route(
            len(req.tokens), hashes, self._members, self.now, record_pending=pending
        )
        if placement is None:
            raise InvariantError(f"request {i} not routed: {decision.reason}")
        pipe = next(p for p in self.pipelines if p.pid == placement.pid)
        pipe.placements[spec.request_id] = placement
        self._owner[spec.request_id] = (pipe, i, self.now, len(req.tokens))
        rejected = pipe.core.enqueue(spec)
        if rejected is not None:
            self._reject(spec.request_id)
            return
        self._admit(pipe)

    def _admit(self, pipe: _Pipeline) -> None:
        """Run admission rounds on ``pipe``'s core while they admit someone (FCFS)."""
        while pipe.core.num_queued:
            outcomes = pipe.core.run_round()
            progress = False
            for o in outcomes:
                if isinstance(o, Admitted):
                    owner = self._owner[o.request_id][0]
                    self._cached[o.request_id] = o.cached_len
                    owner.queue.append((o.request_id, o.cached_len))
                    self._start(owner)
                    progress = True
                elif isinstance(o, Rejected):
                    self._reject(o.request_id)
                    progress = True
            if not progress:
                return

    def _reject(self, rid: str) -> None:
        pipe = self._owner.pop(rid)[0]
        self.router.finish(pipe.placements.pop(rid))
        self._rejected += 1
        self._send_next()

    def _start(self, pipe: _Pipeline) -> None:
        if pipe.busy or not pipe.queue:
            return
        rid, cached = pipe.queue.popleft()
        n = self._owner[rid][3]
        service = self.cost.chunk_cost(cached, n - cached)
        pipe.busy = True
        self._push(self.now + service, 1, pipe)
        self._push(self.now + self.stages * service, 2, (pipe, rid, cached))

    def _free(self, pipe: _Pipeline) -> None:
        pipe.busy = False
        self._start(pipe)

    def _complete(self, pipe: _Pipeline, rid: str, cached: int) -> None:
        owner, i, arrival, n = self._owner.pop(rid)
        core = owner.core
        if n > cached:
            core.materialise(0, ScheduledChunk(rid, cached, n - cached))
        core.finish(0, rid)
        self.router.finish(owner.placements.pop(rid))
        owner.served += 1
        self._publish(owner)
        self._done.append((arrival, self.now, n, cached, owner.pid))
        self._admit(owner)
        self._send_next()

    def _summary(self) -> ClusterResult:
        s = self.spec
        done = sorted(self._done, key=lambda d: d[1])[s.warmup :]
        start = sorted(self._done, key=lambda d: d[1])[s.warmup - 1][1] if s.warmup else 0.0
        span = (done[-1][1] - start) if done else 0.0
        prompt = sum(d[2] for d in done) * s.token_scale
        cached = sum(d[3] for d in done) * s.token_scale
        per_pipe: dict[str, int] = {}
        for d in done:
            per_pipe[d[4]] = per_pipe.get(d[4], 0) + 1
        lat = [d[1] - d[0] for d in done]
        return ClusterResult(
            preset=s.preset.name,
            pipelines=s.num_pipelines,
            policy=self.policy.value,
            zipf=s.workload.zipf,
            tenants=s.workload.tenants,
            clients=s.clients,
            requests=len(done),
            input_tok_s=prompt / span if span else 0.0,
            computed_tok_s=(prompt - cached) / span if span else 0.0,
            cached_share=cached / prompt if prompt else 0.0,
            p50_s=percentile(lat, 50),
            p95_s=percentile(lat, 95),
            busiest_share=max(per_pipe.values()) / len(done) if done else 0.0,
            rejected=self._rejected,
        )
