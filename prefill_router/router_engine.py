"""RouterEngine: the Engine protocol over a cluster of pipelines, so the node's gRPC server
(PrefillServer: the same PrefillService, health, reflection, TLS, metrics) fronts a router.

Per request (``prefill_async``, awaited on the server's event loop; ``submit`` runs it on a
loop of the router's own for callers without one): hash the prompt with the node's own code
and the cluster's cache identity + the request's ``cache_salt``, look up
every pipeline's leading cached blocks in the global index, score the ready candidates
(``Scorer``), record the prompt's blocks as pending on the chosen pipeline, and forward the
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
thread per pipeline), else the router's own loop thread. One lock guards the index, the
scorer and the routed-request table (discovery, ``abort``, ``load`` and scrapes call in from
other threads). Forwarded calls are grpc.aio calls on the requesting loop (the server's), so
a request never changes threads on its way through the router.
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
from prefill_node.client.remote_engine import error_from_rpc
from prefill_node.core.cost_model import ChunkCostModel
from prefill_node.core.hashing import ExtraKeys, hash_block_tokens, model_cache_name
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
from prefill_node.server.convert import ParsedRequest, result_from_proto
from prefill_node.server.servicer import FAILOVER_KEY, FAILOVER_NO, Relayed
from prefill_router.calibration import CalibrationConfig, PredictionCalibration
from prefill_router.discovery import PipelineDiscovery, PipelineEndpoint
from prefill_router.flow_control import FlowConfig, FlowControl, Verdict, Waiter
from prefill_router.index import GlobalPrefixIndex, UnknownPipelineError
from prefill_router.pipeline_link import LinkConfig, PipelineLink, start_loop_thread
from prefill_router.router_metrics import RouterMetrics
from prefill_router.scoring import (
    DEFAULT_AFFINITY_SLACK,
    CandidateScore,
    PipelineView,
    RouteReason,
    RoutingDecision,
    RoutingPolicy,
    Scorer,
)
from wavepp_proto.prefill.v1 import prefill_pb2

log = logging.getLogger(__name__)

# A generic compute-bound default (about a 1B dense model); ``wavepp router --model`` derives
# one from the model's shape. Only the ratio of the two terms changes routing decisions.
DEFAULT_COST = ChunkCostModel(per_token_s=2e-6, per_token_context_s=2e-10)
_NO_OWN = (0.0, 0, 0)  # a pipeline without requests routed here: (cost_s, tokens, requests)
_UNBOUNDED = 1 << 40  # a pipeline's capacity before its first load
_MAX_SALTS = 4096  # ExtraKeys kept per cache_salt (tenants); beyond it the table starts over
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
    """One forwarded request (guarded by the engine lock)."""

    pid: str
    cost_s: float  # its prefill's cost-model seconds (what it adds to the pipeline's queue)
    computed_tokens: int
    predicted_cached: int
    predicted_cost_s: float  # queued + prefill cost-model seconds there, at routing
    call: grpc.aio.UnaryUnaryCall | None = None
    loop: asyncio.AbstractEventLoop | None = None
    tried: tuple[str, ...] = ()
    aborted: bool = False
    reason: str = ""  # the routing decision's reason (traced)


CONNECTION_LOST = "connection_lost"
LINK_CLOSED = "link_closed"  # the router closed the link under a call (it was shutting down)


def _resolve(future: asyncio.Future) -> None:
    if not future.done():  # a cancelled waiter gives its slot back itself
        future.set_result(None)


def failover_reason(exc: grpc.aio.AioRpcError) -> str | None:
    """Why the failed forwarded call may be run on another pipeline, or None. A pipeline's
    servicer marks each UNAVAILABLE it sends (``FAILOVER_KEY``); one without the mark came
    from the transport: no connection, or it broke (the pipeline died mid-request)."""
    if exc.code() != grpc.StatusCode.UNAVAILABLE:
        return None
    for key, value in exc.trailing_metadata() or ():
        if key == FAILOVER_KEY:
            return None if value == FAILOVER_NO else str(value)
    return CONNECTION_LOST


class RouterEngine:
    """See the module contract. ``start`` begins discovery; ``shutdown`` stops every link."""

    def __init__(self, discovery: PipelineDiscovery, config: RouterConfig) -> None:
        self.config = config
        self.metrics = RouterMetrics(config.policy.value, self.prediction_ratios)
        self._discovery = discovery
        self._lock = threading.Lock()
        self._index = GlobalPrefixIndex(config.pending_ttl_s)
        self._flow = FlowControl(config.flow)
        self._calibration = PredictionCalibration(config.calibration)
        self._scorer: Scorer | None = None  # once the cluster's identity is known
        self._identity: CacheIdentity | None = None
        self._links: dict[str, PipelineLink] = {}
        # left the discovery with calls still forwarded there: closed when the last one ends
        self._leaving: dict[str, PipelineLink] = {}
        self._routed: dict[str, _Routed] = {}
        # answered pull-mode requests -> their pipeline, newest last (``abort``)
        self._leased: OrderedDict[str, str] = OrderedDict()
        # per pipeline: (cost_s, computed_tokens, requests) summed over its _Routed entries
        self._own: dict[str, tuple[float, int, int]] = {}
        # per pipeline: (load, info, capacity_blocks, max_model_len, snapshot interval), the
        # view's parts that change only with a new load or identity (see ``_view``)
        self._derived: dict[str, tuple] = {}
        self._per_token_s = config.cost_model.per_token_s
        self._extra: dict[str | None, ExtraKeys] = {}  # per cache_salt, bounded (_MAX_SALTS)
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
                self._derived.pop(link.pid, None)
                self._calibration.forget(link.pid)
                self._drop_index(link.pid)
                if link.pid not in self._own:
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
                    cfg = self.config
                    self._scorer = Scorer(cfg.cost_model, identity.block_size, cfg.policy,
                                          cfg.affinity_slack)  # fmt: skip
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
                if link.pid not in self._index:
                    self._index.add_pipeline(link.pid)  # entries come with its snapshot
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
                result = self._index.apply(link.pid, sequence, events)
            except UnknownPipelineError:  # dropped while the batch was on its way
                return False
        if sequence == 1:
            self.metrics.resync(link.pid)
        return not result.needs_resubscribe

    def link_stream_lost(self, link: PipelineLink, reason: str) -> None:
        with self._lock:
            if self._links.get(link.pid) is not link or link.pid not in self._index:
                return
            self._drop_index(link.pid)
            if link.ready:
                self._index.add_pipeline(link.pid)  # awaiting the next snapshot
        log.info("pipeline %s: KV events %s; re-indexing from a new subscription", link.pid,
                 reason)  # fmt: skip

    def _drop_index(self, pid: str) -> None:
        """Caller holds the lock."""
        if pid in self._index:
            self._index.drop_pipeline(pid)

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
        identity = self._identity  # set once, never reset: no lock needed to read it
        if identity is None:
            raise UnavailableError("no pipeline has connected to the router yet; retry later")
        hashes = hash_block_tokens(tokens, identity.block_size,
                                   self._extra_keys(identity, options.cache_salt))  # fmt: skip
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
            scores = [s for s in self._assess(len(tokens), hashes, now) if s.eligible]
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
            self.metrics.answered(routed.pid, routed.predicted_cached, response.cached_tokens)
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
            reason = failover_reason(exc)
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
            tracing.CACHED_TOKENS: routed.predicted_cached,
            tracing.PROMPT_TOKENS: prompt_tokens,
            "wavepp.route_reason": routed.reason,
            "wavepp.attempt": len(routed.tried),
        }
        tracing.record("wavepp.router.route", parent, t_route, time.time_ns(), attributes)
        return tracing.start_span("wavepp.router.forward", parent, attributes, kind="client")

    def _calibrate(self, routed: _Routed, started: float) -> None:
        """An answer from ``routed.pid``, forwarded at ``started``: a calibration sample."""
        now = time.monotonic()
        with self._lock:
            self._calibration.observe(routed.pid, routed.predicted_cost_s, now - started, now)

    def prediction_ratios(self) -> dict[str, float]:
        """Each pipeline's measured / predicted time ratio now (``PredictionCalibration``;
        pipelines without an answer yet are absent: 1)."""
        with self._lock:
            return self._calibration.ratios(time.monotonic())

    def score(self, token_ids: Sequence[int], cache_salt: str | None) -> ScoreReport:
        """Where ``prefill`` would send this prompt now (the Score RPC): the same hashing,
        index lookup and scoring, with nothing recorded (no pending entries, no accounting;
        only round-robin's rotation moves). No pipeline connected yet -> UnavailableError."""
        identity = self._identity
        if identity is None:
            raise UnavailableError("no pipeline has connected to the router yet; retry later")
        hashes = hash_block_tokens(token_ids, identity.block_size,
                                   self._extra_keys(identity, cache_salt))  # fmt: skip
        with self._lock:
            decision = self._decide(len(token_ids), hashes, time.monotonic(), ())
        chosen = next((c for c in decision.candidates if c.pid == decision.pipeline), None)
        return ScoreReport(
            decision.pipeline or "", decision.reason.value, len(token_ids),
            decision.cached_tokens, chosen.queued_s if chosen else 0.0,
            chosen.prefill_s if chosen else 0.0,
            sum(c.eligible for c in decision.candidates),
        )  # fmt: skip

    def _extra_keys(self, identity: CacheIdentity, salt: str | None) -> ExtraKeys:
        """The cluster's ExtraKeys for ``salt``, made once per salt (their digest is the
        costly part); the table is emptied when it outgrows ``_MAX_SALTS``."""
        extra = self._extra.get(salt)
        if extra is None:
            if len(self._extra) >= _MAX_SALTS:
                self._extra.clear()
            extra = self._extra[salt] = ExtraKeys(identity.model_id, salt)
        return extra

    def _route(
        self, tokens: Sequence[int], hashes: Sequence[int], request_id: str, tried: tuple[str, ...]
    ) -> tuple[PipelineLink, _Routed]:
        """Choose a pipeline (not one of ``tried``), record the prompt as pending there and
        the request as routed; raises the typed error when none can take it."""
        now = time.monotonic()
        with self._lock:
            decision = self._decide(len(tokens), hashes, now, tried)
            if decision.pipeline is not None:
                link = self._links[decision.pipeline]
                chosen = next(c for c in decision.candidates if c.pid == decision.pipeline)
                self._index.record_pending(decision.pipeline, hashes, now)
                routed = _Routed(decision.pipeline, chosen.prefill_cost_s,
                                 len(tokens) - decision.cached_tokens, decision.cached_tokens,
                                 chosen.queued_cost_s + chosen.prefill_cost_s,
                                 tried=(*tried, decision.pipeline),
                                 reason=decision.reason.value)  # fmt: skip
                self._routed[request_id] = routed
                self._account(routed, 1)
        self.metrics.decision(decision.reason.value)
        if decision.pipeline is None:
            raise self._no_pipeline(decision)
        return link, routed

    def _forget(self, request_id: str, routed: _Routed) -> None:
        drained = None
        with self._lock:
            if self._routed.get(request_id) is routed:
                del self._routed[request_id]
                self._account(routed, -1)
                if routed.pid in self._leaving and routed.pid not in self._own:
                    drained = self._leaving.pop(routed.pid)
        if drained is not None:  # its last call ended: close it on its loop, not blocking ours
            log.info("pipeline %s: the calls on it ended; closing its link", drained.pid)
            loop = self._link_loop
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(drained.stop)

    def _account(self, routed: _Routed, sign: int) -> None:
        """Add (1) or take back (-1) ``routed`` in its pipeline's sums. Caller holds the lock."""
        cost, tokens, count = self._own.get(routed.pid, _NO_OWN)
        count += sign
        if count:
            cost = max(0.0, cost + sign * routed.cost_s)  # float sums drift: never below 0
            self._own[routed.pid] = (cost, tokens + sign * routed.computed_tokens, count)
        else:
            self._own.pop(routed.pid, None)

    def _decide(self, prompt_tokens: int, hashes, now: float, tried) -> RoutingDecision:
        """Caller holds the lock."""
        return self._scorer_for().choose(prompt_tokens, *self._inputs(hashes, now, tried))

    def _assess(self, prompt_tokens: int, hashes, now: float) -> tuple[CandidateScore, ...]:
        """Every pipeline's score for the prompt, choosing nothing. Caller holds the lock."""
        return self._scorer_for().assess(prompt_tokens, *self._inputs(hashes, now, ()))

    def _scorer_for(self) -> Scorer:
        if self._scorer is None:
            raise UnavailableError("no pipeline has connected to the router yet; retry later")
        return self._scorer

    def _inputs(self, hashes, now: float, tried) -> tuple[dict, list[PipelineView]]:
        """The index's matches and the candidates' views (not ``tried``). Caller holds
        the lock."""
        matches = self._index.match(hashes, now)
        views = [
            self._view(link, now)
            for link in self._links.values()
            if link.refused is None and link.info is not None and link.pid not in tried
        ]
        return matches, views

    def _view(self, link: PipelineLink, now: float) -> PipelineView:
        """Caller holds the lock. What changes per request (own accounting, the index) is
        read each time; what comes with a load or an identity is derived once per object."""
        pid, load, info = link.pid, link.load, link.info
        own_cost, own_tokens, own_requests = self._own.get(pid, _NO_OWN)
        cached = self._derived.get(pid)
        if cached is None or cached[0] is not load or cached[1] is not info:
            stages = load.stages if load is not None else ()
            capacity = min((s.total_blocks for s in stages), default=_UNBOUNDED)
            max_len = info.max_model_len if info is not None else 0
            snap = info.snapshot_interval_blocks or None if info else None
            cached = self._derived[pid] = (load, info, capacity, max_len, snap)
        others = max(0, load.inflight_tokens - own_tokens) if load is not None else 0
        index = self._index
        indexed = pid in index
        return PipelineView(pid, link.ready and indexed, own_cost + others * self._per_token_s,
                            cached[3], cached[2], own_requests, cached[4],
                            index.num_blocks(pid) if indexed else 0,
                            self._calibration.ratio(pid, now))  # fmt: skip

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
            inflight = {pid: own[2] for pid, own in self._own.items()}
            indexed = {pid: self._index.num_blocks(pid) for pid in self._index.pipelines}
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
            return self._index.num_blocks(pid) if pid in self._index else 0
