"""RouterEngine: the Engine protocol over a cluster of pipelines, so the node's gRPC server
(PrefillServer: the same PrefillService, health, reflection, TLS, metrics) fronts a router.

Per request (``prefill_async``, awaited on the server's event loop; ``submit`` runs it on a
loop of the router's own for callers without one), the decision is ``RouterCore``'s, the
sans-IO core the cluster simulator drives too: hash the prompt with the node's own code
and the cluster's cache identity + the request's ``cache_salt``, look up
every pipeline's leading cached blocks in the global index, score the ready candidates
(``Scorer``), record the prompt's blocks as pending on the chosen pipeline; this shell
keeps the links (membership comes from them) and the calls, and forwards the
request there as a Prefill call: the bytes the router received, as they are (token ids; KV
destinations pass through untouched, so the stages still ship straight to decode). The
answer comes back as the pipeline's bytes; the router reads its cached tokens only.

Flow control (``_admit``, FlowControl): at most so many requests per ready pipeline are
forwarded at once; the rest wait in a bounded queue by priority and tenant turns, and a
request is rejected at once (OverloadedError: RESOURCE_EXHAUSTED + retry-after-ms) when the
queue is full or the Scorer's prediction exceeds its deadline. The Scorer's predictions, for
routing and admission alike, are the cost model's seconds scaled by each pipeline's measured /
predicted ratio of time to answer (``PredictionCalibration``, learned from every answer).

Failover: a prefill has no side effect a retry could duplicate (the cache is a cache) as long
as nothing of it reached the caller or its decode side. So a call that failed that way is
retried on the next best pipeline, at most once per pipeline, while the request's deadline
lasts (``failover_reason``: the connection was lost or never made; the pipeline was not
ready, a stage died, or a pull-mode KV hand-off failed, as the pipeline's ``wavepp-failover``
trailer says); the reason goes to ``wavepp_router_failovers_total``. A lost connection also
takes the pipeline out of routing at once. The caller gets UNAVAILABLE only when no pipeline
could serve. Any other failure is the request's answer. ``abort`` (a client cancel, a deadline, or
the Abort RPC) cancels the forwarded call, which makes the pipeline abort the request and
free its blocks. Pipelines come and go through the discovery; a link that is not ready, or
whose KV-event stream broke, has no entries in the index until its next snapshot.

Threading: every link runs on ONE event loop: the loop ``start`` is called on (the serving
loop in ``wavepp router``: serving, forwarding and pipeline monitoring share it, with no
thread per pipeline), else the router's own loop thread. One lock guards the core (index,
scorer, accounting) and the routed-request table (discovery, ``abort``, ``load`` and
scrapes call in from other threads). Forwarded calls are grpc.aio calls on the requesting
loop (the server's), so a request never changes threads on its way through the router.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from operator import attrgetter

import grpc

from prefill_node import tracing
from prefill_node.client.prefill_client import RemoteServerInfo, build_request
from prefill_node.core.cost_model import ChunkCostModel
from prefill_node.core.hashing import model_cache_name
from prefill_node.core.kv_events import KVEvent
from prefill_node.engine.types import (
    CacheIdentity,
    EngineHealth,
    EngineLoad,
    PrefillOptions,
    PrefillResult,
    ScoreReport,
)
from prefill_node.errors import (
    DeadlineExceededError,
    NeverFitsError,
    OverloadedError,
    RequestAbortedError,
    UnavailableError,
)
from prefill_node.wire.convert import ParsedRequest, Relayed, result_from_proto
from prefill_node.wire.status import CONNECTION_LOST, error_from_rpc, failover_reason
from prefill_router.calibration import CalibrationConfig
from prefill_router.discovery import PipelineDiscovery, PipelineEndpoint
from prefill_router.flow_control import FlowConfig, FlowControl, Verdict, Waiter
from prefill_router.index import UnknownPipelineError
from prefill_router.pipeline_link import LinkConfig, PipelineLink, start_loop_thread
from prefill_router.router_core import UNBOUNDED_BLOCKS, PipelineMember, Placement, RouterCore
from prefill_router.router_metrics import RouterMetrics
from prefill_router.scoring import (
    DEFAULT_AFFINITY_SLACK,
    RouteReason,
    RoutingDecision,
    RoutingPolicy,
)
from wavepp_proto.prefill.v1 import prefill_pb2

log = logging.getLogger(__name__)

# A generic compute-bound default (about a 1B dense model); ``wavepp router --model`` derives
# one from the model's shape. Only the ratio of the two terms changes routing decisions.
DEFAULT_COST = ChunkCostModel(per_token_s=2e-6, per_token_context_s=2e-10)
_LEASED_KEPT = 4096  # answered pull-mode requests whose leases an Abort can still revoke


@dataclass(frozen=True)
class RouterConfig:
    """``model_name``: refuse pipelines serving another model (its name as in the cache
    identity, ``model_cache_id``). Either way the first pipeline accepted defines the
    cluster's identity (model id with dtype, block size); later ones must match it."""

    policy: RoutingPolicy = RoutingPolicy.PREFIX
    cost_model: ChunkCostModel = DEFAULT_COST
    pending_ttl_s: float = 2.0
    affinity_slack: float = DEFAULT_AFFINITY_SLACK  # prefer the cache hit within this share
    link: LinkConfig = field(default_factory=LinkConfig)
    model_name: str | None = None
    flow: FlowConfig = field(default_factory=FlowConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)


@dataclass(slots=True)
class _Routed:
    """One forwarded request: its placement (``RouterCore``) and its call (guarded by the
    engine lock). ``tried``: the pipelines it was forwarded to so far, this one last."""

    placement: Placement
    tried: tuple[str, ...]
    call: grpc.aio.UnaryUnaryCall | None = None
    loop: asyncio.AbstractEventLoop | None = None
    aborted: bool = False

    @property
    def pid(self) -> str:
        return self.placement.pid


LINK_CLOSED = "link_closed"  # the router closed the link under a call (it was shutting down)


def _resolve(future: asyncio.Future) -> None:
    if not future.done():  # a cancelled waiter gives its slot back itself
        future.set_result(None)


class RouterEngine:
    """See the module contract. ``start`` begins discovery; ``shutdown`` stops every link."""

    def __init__(self, discovery: PipelineDiscovery, config: RouterConfig) -> None:
        self.config = config
        self.metrics = RouterMetrics(config.policy.value, self.prediction_ratios)
        self._discovery = discovery
        self._lock = threading.Lock()
        self._core = RouterCore(config.cost_model, config.policy,
                                pending_ttl_s=config.pending_ttl_s,
                                affinity_slack=config.affinity_slack,
                                calibration=config.calibration)  # fmt: skip
        self._flow = FlowControl(config.flow)
        self._identity: CacheIdentity | None = None
        self._links: dict[str, PipelineLink] = {}
        # left the discovery with calls still forwarded there: closed when the last one ends
        self._leaving: dict[str, PipelineLink] = {}
        self._routed: dict[str, _Routed] = {}
        # answered pull-mode requests -> their pipeline, newest last (``abort``)
        self._leased: OrderedDict[str, str] = OrderedDict()
        # per pipeline: (load, info, ready, its PipelineMember), made again only when the
        # link's load, identity or readiness changed (see ``_member``)
        self._members: dict[str, tuple] = {}
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None  # own loop thread, when needed
        self._link_loop: asyncio.AbstractEventLoop | None = None  # where the links run
        self._vocab_size = self._max_model_len = 0  # over the pipelines accepted so far

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Begin discovery. Links run on the calling thread's running loop (call it on the
        serving loop: one loop for everything), else on the router's own loop thread."""
        try:
            self._link_loop = asyncio.get_running_loop()
        except RuntimeError:
            self._link_loop = self._own_loop()
        self._discovery.start(self._on_endpoints)

    def shutdown(self) -> None:
        """Stop discovery and every link (from any thread but the links' loop: ``aclose``)."""
        self._discovery.stop()
        for link in self._close():
            link.stop()
        self._stop_own_loop()

    async def aclose(self) -> None:
        """``shutdown`` awaited on the links' loop."""
        if asyncio.get_running_loop() is not self._link_loop:
            await asyncio.to_thread(self.shutdown)
            return
        await asyncio.to_thread(self._discovery.stop)
        await asyncio.gather(*(link.aclose() for link in self._close()))
        self._stop_own_loop()

    def _close(self) -> list[PipelineLink]:
        with self._lock:
            links = [*self._links.values(), *self._leaving.values()]
            self._closed, self._links, self._leaving = True, {}, {}
        return links

    def _stop_own_loop(self) -> None:
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(loop.stop)

    def _own_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._loop = start_loop_thread("router-loop")
            return self._loop

    def _on_endpoints(self, endpoints: frozenset[PipelineEndpoint]) -> None:
        """Discovery's full set: start links for new endpoints, stop links for gone ones."""
        wanted = {e.id: e for e in endpoints}
        with self._lock:
            if self._closed:
                return
            gone = [link for pid, link in self._links.items() if pid not in wanted]
            stopping, draining = [], set()
            for link in gone:
                del self._links[link.pid]
                self._members.pop(link.pid, None)
                self._core.forget(link.pid)
                if not self._core.placed_requests(link.pid):
                    stopping.append(link)
                    continue
                # calls in flight there: the pod drains them; an older leaving link goes now
                older = self._leaving.pop(link.pid, None)
                if older is not None:
                    stopping.append(older)
                self._leaving[link.pid] = link
                draining.add(link.pid)
            new = [PipelineLink(e, self, self.config.link) for pid, e in wanted.items()
                   if pid not in self._links]  # fmt: skip
            for link in new:
                self._links[link.pid] = link
        for link in gone:
            log.info("pipeline %s left the discovery%s", link.pid,
                     "; its link closes when the calls on it end" if link.pid in draining
                     else "")  # fmt: skip
        for link in stopping:
            link.stop()
        for link in new:
            log.info("pipeline %s (%s) found", link.pid, link.endpoint.address)
            link.start(self._link_loop)

    # -- LinkListener --------------------------------------------------------------------------
    def link_identified(self, link: PipelineLink, info: RemoteServerInfo) -> str | None:
        identity = CacheIdentity(
            info.cache_model_id, info.block_size, info.snapshot_interval_blocks or None
        )
        with self._lock:
            if info.router or not info.block_size or not info.kv_events:
                why = "not a pipeline publishing KV events (a router, or a server without them)"
            elif self.config.model_name not in (None, model_cache_name(identity.model_id)):
                why = f"serves {identity.model_id!r}, this router routes {self.config.model_name!r}"
            elif self._identity is not None and identity != self._identity:
                why = (f"serves {identity.model_id!r} with {identity.block_size}-token blocks; "
                       f"the cluster serves {self._identity.model_id!r} with "
                       f"{self._identity.block_size}-token blocks")  # fmt: skip
            else:
                why = None
                self._vocab_size = max(self._vocab_size, info.vocab_size)
                self._max_model_len = max(self._max_model_len, info.max_model_len)
                if self._identity is None:
                    self._identity = identity
                    self._core.start_scoring(identity.model_id, identity.block_size)
                    log.info("cluster cache identity: %s, %d-token blocks", *(
                        identity.model_id, identity.block_size))  # fmt: skip
        if why is not None:
            self.metrics.pipeline_refused(link.pid)
        return why

    def link_ready(self, link: PipelineLink, ready: bool, reason: str) -> None:
        with self._lock:
            if self._links.get(link.pid) is not link:
                return
            if ready:
                if link.pid not in self._core.index:
                    self._core.index.add_pipeline(link.pid)  # entries come with its snapshot
            else:
                self._drop_index(link.pid)
            woken = self._flow.drain(self._ready_count())  # more room, or none ready
        self._wake(woken)
        if not ready:
            self.metrics.pipeline_lost(link.pid)

    def link_batch(self, link: PipelineLink, sequence: int, events: tuple[KVEvent, ...]) -> bool:
        with self._lock:
            if self._links.get(link.pid) is not link:
                return False
            try:
                result = self._core.index.apply(link.pid, sequence, events)
            except UnknownPipelineError:  # dropped while the batch was on its way
                return False
        if sequence == 1:
            self.metrics.resync(link.pid)
        return not result.needs_resubscribe

    def link_stream_lost(self, link: PipelineLink, reason: str) -> None:
        with self._lock:
            index = self._core.index
            if self._links.get(link.pid) is not link or link.pid not in index:
                return
            self._drop_index(link.pid)
            if link.ready:
                index.add_pipeline(link.pid)  # awaiting the next snapshot
        log.info("pipeline %s: KV events %s; re-indexing from a new subscription", link.pid,
                 reason)  # fmt: skip

    def _drop_index(self, pid: str) -> None:
        """Caller holds the lock."""
        if pid in self._core.index:
            self._core.index.drop_pipeline(pid)

    # -- Engine protocol -----------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """The largest of the accepted pipelines' (0 before the first): read per request."""
        return self._vocab_size

    @property
    def max_model_len(self) -> int:
        """The longest prompt any accepted pipeline took; scoring excludes the ones it
        does not fit."""
        return self._max_model_len

    @property
    def cache_identity(self) -> CacheIdentity:
        return self._identity or CacheIdentity("", 0)

    def submit(self, token_ids: Sequence[int], options: PrefillOptions) -> Future[PrefillResult]:
        """``prefill_async`` on the router's own event-loop thread (for callers without a
        loop); unlike a pipeline's, every failure, validation included, comes through the
        future."""
        return asyncio.run_coroutine_threadsafe(
            self.prefill_async(token_ids, options), self._own_loop()
        )

    async def prefill_async(
        self, token_ids: Sequence[int], options: PrefillOptions
    ) -> PrefillResult:
        """Route and forward one request on the running loop; cancelling the coroutine
        cancels the forwarded call, so the pipeline aborts it."""
        tokens = list(token_ids)
        request = build_request(tokens, request_id=options.request_id or "",
                                cache_salt=options.cache_salt or "",
                                top_logprobs=options.top_logprobs,
                                kv_destination=options.kv_destination,
                                priority=options.priority,
                                tenant_id=options.tenant or "")  # fmt: skip
        relayed = await self._forward(request.SerializeToString(), tokens, options)
        relayed.response.served_by = relayed.served_by
        return result_from_proto(relayed.response)

    async def forward(
        self, request: prefill_pb2.PrefillRequest, parsed: ParsedRequest, raw: bytes | None
    ) -> Relayed:
        """The server's path (``ResponseForwarder``): the request's bytes as received go on
        to the chosen pipeline, and the pipeline's answer comes back as its bytes. A text
        prompt is re-encoded with the ids tokenised here; a request id the server made up
        is appended (the later field wins)."""
        request_id = parsed.options.request_id or ""
        if raw is None or parsed.from_text:
            request.request_id = request_id
            if parsed.from_text:
                request.token_ids.ids[:] = parsed.token_ids  # the oneof drops the text
            raw = request.SerializeToString()
        elif request.request_id != request_id:
            raw += prefill_pb2.PrefillRequest(request_id=request_id).SerializeToString()
        return await self._forward(raw, parsed.token_ids, parsed.options)

    async def _forward(
        self, request: bytes, tokens: Sequence[int], options: PrefillOptions
    ) -> Relayed:
        """Admit the encoded ``request`` (``tokens``: its prompt) through flow control, then
        route and forward it."""
        with self._lock:
            hashes = self._core.hashes(tokens, options.cache_salt)
        slot = await self._admit(tokens, hashes, options)
        try:
            return await self._forward_admitted(request, tokens, hashes, options)
        finally:
            if slot:
                self._release_slot()

    async def _admit(
        self, tokens: Sequence[int], hashes: Sequence[int], options: PrefillOptions
    ) -> bool:
        """Wait for a slot (FlowControl), or raise OverloadedError at once: the queue is
        full, or the Scorer's prediction on the best pipeline now, plus the cost of what
        waits ahead, exceeds the request's deadline. False: no pipeline can take it
        (``_route`` raises why), so no slot is held."""
        now = time.monotonic()
        request_id = options.request_id or ""
        loop = asyncio.get_running_loop()
        with self._lock:
            scores = [s for s in self._core.assess(len(tokens), hashes, self._members_now(), now)
                      if s.eligible]  # fmt: skip
            if not scores:
                return False
            chosen = min(scores, key=attrgetter("score"))  # the earliest it could be done
            tenant = options.tenant or options.cache_salt or ""
            waiter = Waiter(request_id, options.priority, tenant, chosen.prefill_s,
                            (loop, loop.create_future()))  # fmt: skip
            left = None if options.deadline_s is None else options.deadline_s - now
            offer = self._flow.offer(waiter, chosen.score, left, self._ready_count())
            waiting = self._flow.num_waiting
        self.metrics.offered(offer.verdict.value, waiting)
        if offer.verdict is Verdict.ADMIT:
            return True
        if offer.verdict is Verdict.QUEUE_FULL:
            raise OverloadedError(
                f"the router's queue is full ({self._flow.config.max_queue} requests wait); "
                f"retry in {offer.retry_after_s:.3f}s", offer.retry_after_s)  # fmt: skip
        if offer.verdict is Verdict.DEADLINE:
            raise OverloadedError(
                f"request {request_id!r} is predicted to take {offer.predicted_s:.3f}s, past "
                f"its deadline in {left:.3f}s; retry in {offer.retry_after_s:.3f}s or with a "
                "longer deadline", offer.retry_after_s)  # fmt: skip
        if offer.verdict is Verdict.WAIT_LIMIT:
            raise OverloadedError(
                f"request {request_id!r} is predicted to wait "
                f"{offer.predicted_s - waiter.cost_s:.3f}s for a pipeline, past the router's "
                f"--max-wait of {self._flow.config.max_wait_s:g}s; retry in "
                f"{offer.retry_after_s:.3f}s", offer.retry_after_s)  # fmt: skip
        try:
            await waiter.handle[1]
        except asyncio.CancelledError:
            with self._lock:
                withdrawn = self._flow.withdraw(waiter)
                waiting = self._flow.num_waiting
            if withdrawn:
                self.metrics.offered("withdrawn", waiting)
            else:  # admitted meanwhile: pass its slot on
                self._release_slot()
            raise
        self.metrics.queue_wait(time.monotonic() - now)
        if tracing.enabled():
            tracing.record("wavepp.router.queue", options.traceparent, tracing.wall_ns(now),
                           time.time_ns(), {tracing.REQUEST_ID: request_id,
                                            "wavepp.tenant": tenant,
                                            "wavepp.priority": options.priority})  # fmt: skip
        return True

    def _release_slot(self) -> None:
        with self._lock:
            woken = self._flow.release(self._ready_count())
        self._wake(woken)

    def _wake(self, woken: list[Waiter]) -> None:
        """Hand each admitted waiter its slot on its own loop."""
        if woken:
            self.metrics.offered("dequeued", self._flow.num_waiting, len(woken))
        for waiter in woken:
            loop, future = waiter.handle
            loop.call_soon_threadsafe(_resolve, future)

    def _ready_count(self) -> int:
        """Caller holds the lock."""
        return sum(link.ready and link.refused is None for link in self._links.values())

    async def _forward_admitted(
        self,
        request: bytes,
        tokens: Sequence[int],
        hashes: Sequence[int],
        options: PrefillOptions,
    ) -> Relayed:
        """Route and forward; fail over to the next best pipeline while a failure allows
        it (module contract)."""
        request_id = options.request_id or ""
        tried: tuple[str, ...] = ()
        failed: list[str] = []  # "pipeline: reason" of each failover, for the final error
        while True:
            t_route = time.time_ns() if tracing.enabled() else 0
            try:
                link, routed = self._route(tokens, hashes, request_id, tried)
            except UnavailableError:
                if not failed:
                    raise
                raise UnavailableError(
                    f"no pipeline could serve request {request_id!r} (failed on "
                    f"{'; '.join(failed)}; no other is ready); retry later"
                ) from None
            timeout = None
            if options.deadline_s is not None:
                timeout = max(0.0, options.deadline_s - time.monotonic())
            span = metadata = None
            if tracing.enabled():
                span = self._trace_route(options.traceparent, request_id, routed, len(tokens),
                                         t_route)  # fmt: skip
                metadata = tracing.headers(span)
            call = link.aio_prefill()(request, timeout=timeout, metadata=metadata)
            routed.call, routed.loop = call, asyncio.get_running_loop()
            started = time.monotonic()
            try:
                data, reason, detail = await self._answer(call, routed, request_id, link)
            except BaseException as exc:
                tracing.end(span, error=exc)
                raise
            if span is not None:
                if reason is not None:
                    span.add_event("wavepp.failover", {"wavepp.failover_reason": reason})
                tracing.end(span, error=reason)
            if reason is not None:
                self.metrics.failover(routed.pid, reason)
                log.info("pipeline %s failed %s before answering (%s: %s); failing over",
                         routed.pid, request_id, reason, detail)  # fmt: skip
                failed.append(f"{routed.pid}: {reason}")
                tried = routed.tried
                if options.deadline_s is not None and time.monotonic() >= options.deadline_s:
                    raise DeadlineExceededError(
                        f"request {request_id!r} missed its deadline while failing over "
                        f"({'; '.join(failed)})"
                    ) from None
                continue
            self._calibrate(routed, started)
            response = prefill_pb2.PrefillResponse.FromString(data)
            self.metrics.answered(routed.pid, routed.placement.cached_tokens,
                                  response.cached_tokens)  # fmt: skip
            if request_id and any(m.lease_id for m in response.stage_manifests):
                with self._lock:  # pull leases: an Abort may still revoke them there
                    self._leased[request_id] = routed.pid
                    while len(self._leased) > _LEASED_KEPT:
                        self._leased.popitem(last=False)
            return Relayed(data, response, routed.pid)

    async def _answer(
        self, call: grpc.aio.UnaryUnaryCall, routed: _Routed, request_id: str, link: PipelineLink
    ) -> tuple[bytes | None, str | None, str]:
        """The forwarded ``call``'s answer: (its bytes, None, "") or, when the request may
        fail over, (None, why, detail); other failures raise the typed error."""
        data, reason, detail = None, None, ""
        try:
            data = await call
        except asyncio.CancelledError:
            call.cancel()
            if routed.aborted:  # Abort(request_id), not the caller going away
                raise RequestAbortedError(f"request {request_id} was aborted") from None
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise  # the caller went away
            # nobody cancelled this request: the link's channel closed under the call
            reason, detail = LINK_CLOSED, "the router closed its link"
        except grpc.aio.AioRpcError as exc:
            reason = failover_reason(exc.code(), exc.trailing_metadata())
            if reason is None:
                raise error_from_rpc(exc) from None
            if reason == CONNECTION_LOST:
                link.connection_lost(exc.details() or exc.code().name)
            detail = exc.details()
        finally:
            self._forget(request_id, routed)
        if routed.aborted:  # an Abort that landed as the call ended still wins (its caller
            # was told True): no failover, and an answer's pull leases are revoked there
            if data is not None:
                link.abort(request_id)
            raise RequestAbortedError(f"request {request_id} was aborted")
        return data, reason, detail

    @staticmethod
    def _trace_route(
        parent: str, request_id: str, routed: _Routed, prompt_tokens: int, t_route: int
    ):
        """Trace one routing decision and start the span of the call forwarded on it (its
        context goes to the pipeline as metadata); the caller ends the latter."""
        attributes = {
            tracing.REQUEST_ID: request_id,
            tracing.PIPELINE: routed.pid,
            tracing.CACHED_TOKENS: routed.placement.cached_tokens,
            tracing.PROMPT_TOKENS: prompt_tokens,
            "wavepp.route_reason": routed.placement.reason,
            "wavepp.attempt": len(routed.tried),
        }
        tracing.record("wavepp.router.route", parent, t_route, time.time_ns(), attributes)
        return tracing.start_span("wavepp.router.forward", parent, attributes, kind="client")

    def _calibrate(self, routed: _Routed, started: float) -> None:
        """An answer from ``routed.pid``, forwarded at ``started``: a calibration sample."""
        now = time.monotonic()
        with self._lock:
            self._core.observe(routed.placement, now - started, now)

    def prediction_ratios(self) -> dict[str, float]:
        """Each pipeline's measured / predicted time ratio now (``PredictionCalibration``;
        pipelines without an answer yet are absent: 1)."""
        with self._lock:
            return self._core.calibration.ratios(time.monotonic())

    def score(self, token_ids: Sequence[int], cache_salt: str | None) -> ScoreReport:
        """Where ``prefill`` would send this prompt now (the Score RPC): the same hashing,
        index lookup and scoring, with nothing recorded (no pending entries, no accounting;
        only round-robin's rotation moves). No pipeline connected yet -> UnavailableError."""
        with self._lock:
            hashes = self._core.hashes(token_ids, cache_salt)
            decision = self._core.decide(len(token_ids), hashes, self._members_now(),
                                         time.monotonic())  # fmt: skip
        chosen = next((c for c in decision.candidates if c.pid == decision.pipeline), None)
        return ScoreReport(
            decision.pipeline or "", decision.reason.value, len(token_ids),
            decision.cached_tokens, chosen.queued_s if chosen else 0.0,
            chosen.prefill_s if chosen else 0.0,
            sum(c.eligible for c in decision.candidates),
        )  # fmt: skip

    def _route(
        self, tokens: Sequence[int], hashes: Sequence[int], request_id: str, tried: tuple[str, ...]
    ) -> tuple[PipelineLink, _Routed]:
        """Choose a pipeline (not one of ``tried``) and place the request there
        (``RouterCore.route``: pending blocks, accounting), recording it as routed; raises
        the typed error when none can take it."""
        now = time.monotonic()
        with self._lock:
            decision, placement = self._core.route(len(tokens), hashes, self._members_now(), now,
                                                   tried)  # fmt: skip
            if placement is not None:
                link = self._links[placement.pid]
                routed = _Routed(placement, (*tried, placement.pid))
                self._routed[request_id] = routed
        self.metrics.decision(decision.reason.value)
        if placement is None:
            raise self._no_pipeline(decision)
        return link, routed

    def _forget(self, request_id: str, routed: _Routed) -> None:
        drained = None
        with self._lock:
            if self._routed.get(request_id) is routed:
                del self._routed[request_id]
            self._core.finish(routed.placement)
            pid = routed.pid
            if pid in self._leaving and not self._core.placed_requests(pid):
                drained = self._leaving.pop(pid)
        if drained is not None:  # its last call ended: close it on its loop, not blocking ours
            log.info("pipeline %s: the calls on it ended; closing its link", drained.pid)
            loop = self._link_loop
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(drained.stop)

    def _members_now(self) -> list[PipelineMember]:
        """The links routing may choose from, as members. Caller holds the lock."""
        return [self._member(link) for link in self._links.values()
                if link.refused is None and link.info is not None]  # fmt: skip

    def _member(self, link: PipelineLink) -> PipelineMember:
        """``link`` as a member, made again only when its load, identity or readiness
        changed. Caller holds the lock."""
        load, info, ready = link.load, link.info, link.ready
        cached = self._members.get(link.pid)
        if cached is None or cached[0] is not load or cached[1] is not info or cached[2] != ready:
            stages = load.stages if load is not None else ()
            member = PipelineMember(
                link.pid, ready, info.max_model_len if info is not None else 0,
                min((st.total_blocks for st in stages), default=UNBOUNDED_BLOCKS),
                (info.snapshot_interval_blocks or None) if info is not None else None,
                load.inflight_tokens if load is not None else 0,
            )  # fmt: skip
            cached = self._members[link.pid] = (load, info, ready, member)
        return cached[3]

    def _no_pipeline(self, decision: RoutingDecision) -> Exception:
        if decision.reason is RouteReason.NEVER_FITS:
            return NeverFitsError(
                f"the prompt ({decision.prompt_tokens} tokens) fits no pipeline behind this "
                "router (too long, or more KV blocks than a stage holds); send a shorter one"
            )
        return UnavailableError("no pipeline is ready to take this prompt; retry later")

    def abort(self, request_id: str) -> bool:
        """Cancel the forwarded call (from any thread); the caller gets RequestAbortedError.
        A pull-mode request already answered: the Abort goes on to the pipeline that served
        it, whose stages revoke the leases decode did not use (in the background)."""
        with self._lock:
            routed = self._routed.get(request_id)
            if routed is None or routed.call is None or routed.loop is None:
                link = self._links.get(self._leased.pop(request_id, ""))
                if link is None:
                    return False
                link.abort(request_id)
                return True
            routed.aborted = True
        routed.loop.call_soon_threadsafe(routed.call.cancel)
        return True

    def load(self) -> EngineLoad:
        with self._lock:
            links = list(self._links.values())
            inflight = self._core.placed_by_pipeline()
            index = self._core.index
            indexed = {pid: index.num_blocks(pid) for pid in index.pipelines}
        pipelines = tuple(
            link.described(inflight.get(link.pid, 0), indexed.get(link.pid, 0)) for link in links
        )
        return EngineLoad(
            queue_depth=sum(p.queue_depth for p in pipelines),
            inflight_requests=sum(p.inflight_requests for p in pipelines),
            inflight_tokens=sum(p.inflight_tokens for p in pipelines),
            stages=(),
            pipelines=pipelines,
        )

    def health(self) -> EngineHealth:
        ready = any(link.ready for link in self._accepted())
        detail = "" if ready else "no pipeline behind the router is ready"
        return EngineHealth(live=True, ready=ready, detail=detail)

    def _accepted(self) -> list[PipelineLink]:
        with self._lock:
            return [link for link in self._links.values() if link.refused is None]

    def links(self) -> dict[str, PipelineLink]:
        """The current links by pipeline id (a copy; for tests and the CLI)."""
        with self._lock:
            return dict(self._links)

    def leaving(self) -> dict[str, PipelineLink]:
        """Links that left the discovery and still carry forwarded calls (a copy)."""
        with self._lock:
            return dict(self._leaving)

    def index_snapshot(self, pid: str) -> int:
        """Confirmed blocks the index holds for ``pid`` (0 when it has none)."""
        with self._lock:
            index = self._core.index
            return index.num_blocks(pid) if pid in index else 0
