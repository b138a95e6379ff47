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

FETCH routes with the router's FETCH policy: a request may go to a pipeline that copies
its prefix from another pipeline holding it. The copy is modelled as the runtime would do
it: every stage reads its own layers' blocks from the source's matching stage over its own
link (``ClusterSpec.fetch_link``, one per stage), so a fetch of ``n`` blocks takes the link's
latency plus ``n`` blocks of the busiest stage's KV over one link; fetches that share a
source's or a target's links queue behind each other (the router predicts that queue from
the fetches it placed, and refits the transfer model from each fetch's time on the links,
``RouterCore.observe_fetch``). The request
joins its pipeline's admission queue when the copy is done; the copied blocks enter the
target's cache as if computed (a prefill of the prefix costing no compute: cached, KV
events, LRU as usual), and its admission leases them like any cached prefix. If the source
no longer holds the blocks when the copy would end (evicted), the request computes them.
Not modelled: the lease that would pin the source's blocks during the copy (a copy here
never fails half-way instead).

Closed loop: ``clients`` clients, each sending its next request when the last completes.
Figures exclude the first ``warmup`` completions (the caches start empty) and run to the
last completion, the closed loop's drain included (concurrency falling as fewer requests
than clients remain): a policy that leaves long queues behind pays for them there, and
one straggler can set a run's throughput. ``steady_input_tok_s`` is the throughput while
every client is still sending (up to completion ``requests - clients + 1``), which in turn
favours a policy that keeps some clients waiting in long queues (their requests end after
the window); the two bracket the truth, neither is a latency-bound goodput.
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
from prefill_node.sim.specs import LinkSpec
from prefill_node.sim.tenants import TenantRequest, TenantWorkload
from prefill_router.calibration import CalibrationConfig
from prefill_router.router_core import PipelineMember, Placement, RouterCore
from prefill_router.scoring import RoutingPolicy
from prefill_router.transfer import TransferModel

# A pipeline's stage to the same stage of another pipeline: one 400 Gb/s RDMA NIC per GPU
# (50 GB/s line rate, 40 GB/s assumed achieved by a NIXL READ) and 1 ms per fetch (est.: the
# lease RPC on the source and the transfer's setup). Estimates, not measurements.
RDMA_400G = LinkSpec(bytes_per_s=40e9, latency_s=1e-3)


class ClusterPolicy(enum.Enum):
    """The router's policies, plus the pooled-cache oracle."""

    PREFIX = "prefix"
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    PREFIX_ONLY = "prefix_only"
    FETCH = "fetch"
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
    fetch_link: LinkSpec = RDMA_400G

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
    fetched_share: float = 0.0  # prompt tokens copied from another pipeline (FETCH)
    fetch_gb_per_request: float = 0.0  # KV bytes copied, all stages, per measured request
    fetch_mean_s: float = 0.0  # per fetch: routing decision to the blocks being usable
    recompute_mean_s: float = 0.0  # per fetch: the bottleneck-stage time it replaced
    seed: int = 0  # the workload's
    steady_input_tok_s: float = 0.0  # while every client is still sending (module docstring)


class _Pipeline:
    """One pipeline's FCFS server and the requests routed to it."""

    def __init__(self, pid: str, core: CorePort) -> None:
        self.pid, self.core = pid, core
        self.queue: deque[tuple[str, int]] = deque()  # admitted: (request id, cached ids)
        self.busy = False
        self.placements: dict[str, Placement] = {}  # routed, unfinished
        self.sequence = 0
        self.served = 0
        self.links_free_at = 0.0  # its stages' fetch links (FETCH)


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
        # one block's KV on the stage with the most layers: what its link carries per block
        block_tokens = spec.block_tokens
        kv_token = p.model.kv_bytes_per_token_layer()
        self.stage_block_bytes = max(st.num_layers for st in roof.stages) * kv_token * block_tokens
        self.block_bytes = p.model.num_layers * kv_token * block_tokens  # all stages
        link = spec.fetch_link
        self.fetch_model = TransferModel.for_link(
            self.stage_block_bytes, link.bytes_per_s, link.latency_s
        )
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
        fetch = self.fetch_model if policy is ClusterPolicy.FETCH else None
        self.router = RouterCore(self.cost, policy.routing,
                                 calibration=CalibrationConfig(alpha=0.0),
                                 transfer=fetch)  # fmt: skip
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
        # (arrival, completion, prompt ids, cached ids, pipeline, its fetch or None)
        self._done: list[tuple[float, float, int, int, str, tuple[int, float, float] | None]] = []
        # FETCH: pseudo-request id of a copy -> the request that waits for it
        self._copies: dict[str, RequestSpec] = {}
        self._fetches: dict[str, tuple[int, float, float]] = {}  # rid -> ids, seconds, saved

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
            elif kind == 3:
                self._fetched(*payload)  # type: ignore[misc]
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
        if placement.fetch_from is not None:
            self._fetch(pipe, spec, placement)
            return
        self._join(pipe, spec)

    def _join(self, pipe: _Pipeline, spec: RequestSpec) -> None:
        """The request joins ``pipe``'s admission queue."""
        rejected = pipe.core.enqueue(spec)
        if rejected is not None:
            waiting = self._copies.pop(spec.request_id, None)
            if waiting is not None:  # never: a copy is a prefix of a prompt that fits
                self._join(pipe, waiting)
                return
            self._reject(spec.request_id)
            return
        self._admit(pipe)

    def _fetch(self, pipe: _Pipeline, spec: RequestSpec, placement: Placement) -> None:
        """Start copying the placement's prefix blocks to ``pipe`` (after the copies already
        using the source's or the target's links)."""
        source = next(p for p in self.pipelines if p.pid == placement.fetch_from)
        start = max(self.now, source.links_free_at, pipe.links_free_at)
        done = start + self.fetch_model.fetch_s(placement.fetch_blocks)
        source.links_free_at = pipe.links_free_at = done
        self._push(done, 3, (pipe, source, spec, placement, self.now, start))

    def _fetched(
        self, pipe: _Pipeline, source: _Pipeline, spec: RequestSpec, placement: Placement,
        began: float, start: float,
    ) -> None:  # fmt: skip
        """The copy ended: its blocks enter ``pipe``'s cache (when the source still held
        them), then the request joins the queue."""
        bs = self.spec.block_ids
        end = -(-placement.cached_tokens // bs)  # blocks through the copied prefix
        prefix = spec.token_ids[: end * bs]
        hashes = self.router.hashes(prefix, spec.extra.cache_salt)
        held = self.router.index.match(hashes, self.now, pending=False).get(source.pid, 0)
        self.router.observe_fetch(placement.fetch_blocks, self.now - start)
        if held < end:  # evicted at the source: the request computes it
            self._join(pipe, spec)
            return
        copy = RequestSpec(f"{spec.request_id}/copy", prefix, spec.extra)
        self._copies[copy.request_id] = spec
        before = placement.cached_tokens - placement.fetch_blocks * bs
        saved = self.cost.chunk_cost(before, placement.fetch_blocks * bs)
        self._fetches[spec.request_id] = (placement.fetch_blocks * bs, self.now - began, saved)
        self._join(pipe, copy)

    def _admit(self, pipe: _Pipeline) -> None:
        """Run admission rounds on ``pipe``'s core while they admit someone (FCFS)."""
        while pipe.core.num_queued:
            outcomes = pipe.core.run_round()
            progress = False
            for o in outcomes:
                waiting = self._copies.pop(o.request_id, None)
                if waiting is not None:  # a copy: its blocks arrive, computed by nobody
                    if isinstance(o, Admitted):
                        self._settle(pipe, o.request_id, o.cached_len, o.num_tokens)
                    self._join(pipe, waiting)
                    progress = True
                elif isinstance(o, Admitted):
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

    def _settle(self, pipe: _Pipeline, rid: str, cached: int, num_tokens: int) -> None:
        """``rid``'s ids past ``cached`` are in ``pipe``'s cache now (computed, or copied
        there): it completes, leaving its blocks cached, unpinned and published."""
        if num_tokens > cached:
            pipe.core.materialise(0, ScheduledChunk(rid, cached, num_tokens - cached))
        pipe.core.finish(0, rid)
        self._publish(pipe)

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
        self._settle(owner, rid, cached, n)
        self.router.finish(owner.placements.pop(rid))
        owner.served += 1
        self._done.append((arrival, self.now, n, cached, owner.pid, self._fetches.pop(rid, None)))
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
        steady = done[: max(1, len(done) - s.clients + 1)]  # completions up to R - C + 1
        steady_span = (steady[-1][1] - start) if steady else 0.0
        fetches = [d[5] for d in done if d[5] is not None]
        fetched = sum(f[0] for f in fetches)
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
            fetched_share=fetched * s.token_scale / prompt if prompt else 0.0,
            fetch_gb_per_request=fetched / s.block_ids * self.block_bytes / 1e9 / len(done)
            if done
            else 0.0,
            fetch_mean_s=sum(f[1] for f in fetches) / len(fetches) if fetches else 0.0,
            recompute_mean_s=sum(f[2] for f in fetches) / len(fetches) if fetches else 0.0,
            seed=s.workload.seed,
            steady_input_tok_s=sum(d[2] for d in steady) * s.token_scale / steady_span
            if steady_span
            else 0.0,
        )
