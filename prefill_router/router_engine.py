"""RouterEngine: the Engine protocol over a cluster of pipelines, so the node's gRPC server
(PrefillServer: the same PrefillService, health, reflection, TLS, metrics) fronts a router.

Per request (``prefill_async``, awaited on the server's event loop; ``submit`` runs it on a
loop of the router's own for callers without one), the decision is ``RouterCore``'s, the
sans-IO core the cluster simulator drives too: hash the prompt with the node's own code and
the cluster's cache identity + the request's ``cache_salt``, look up every pipeline's
leading cached blocks in the global index, score the ready candidates (``Scorer``), record
the prompt's blocks as pending on the chosen pipeline. Which pipelines there are, which are
accepted and ready, and their links are ``Membership``'s (prefill_router/membership.py).
This shell keeps the calls: it forwards the request to the chosen pipeline as a Prefill
call, the bytes the router received as they are (token ids; KV destinations pass through
untouched, so the stages still ship straight to decode). The answer comes back as the
pipeline's bytes; the router reads its cached tokens only.

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
could serve. Any other failure is the request's answer. ``abort`` (a client cancel, a
deadline, or the Abort RPC) cancels the forwarded call, which makes the pipeline abort the
request and free its blocks.

Threading: every link runs on ONE event loop: the loop ``start`` is called on (the serving
loop in ``wavepp router``: serving, forwarding and pipeline monitoring share it, with no
thread per pipeline), else the router's own loop thread. One lock, shared with
``Membership``, guards the core (index, scorer, accounting), the links and the
routed-request table (discovery, ``abort``, ``load`` and scrapes call in from other
threads). Forwarded calls are grpc.aio calls on the requesting loop (the server's), so a
request never changes threads on its way through the router.
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
from prefill_node.client.prefill_client import build_request
from prefill_node.core.cost_model import ChunkCostModel
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
from prefill_router.discovery import PipelineDiscovery
from prefill_router.flow_control import FlowConfig, FlowControl, Verdict, Waiter
from prefill_router.membership import Membership
from prefill_router.pipeline_link import LinkConfig, PipelineLink, start_loop_thread
from prefill_router.router_core import Placement, RouterCore
from prefill_router.router_metrics import RouterMetrics
from prefill_router.scoring import (
    DEFAULT_AFFINITY_SLACK,
    RouteReason,
    RoutingDecision,
    RoutingPolicy,
)
from prefill_router.transfer import TransferModel
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
    # the fetch policy's prior transfer model (refitted from the fetches pipelines report)
    transfer: TransferModel = field(default_factory=lambda: TransferModel(5e-3, 20e-6))


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
    """See the module contract. ``start`` begins discovery; ``shutdown`` stops every link;
    ``membership``: the pipelines behind it (their links, for tests and the CLI)."""

    def __init__(self, discovery: PipelineDiscovery, config: RouterConfig) -> None:
        self.config = config
        self.metrics = RouterMetrics(config.policy.value, self.prediction_ratios,
                                     self._transfer_model)  # fmt: skip
        self._lock = threading.Lock()
        self._core = RouterCore(config.cost_model, config.policy,
                                pending_ttl_s=config.pending_ttl_s,
                                affinity_slack=config.affinity_slack,
                                calibration=config.calibration,
                                transfer=config.transfer
                                if config.policy is RoutingPolicy.FETCH else None)  # fmt: skip
        self._flow = FlowControl(config.flow)
        self.membership = Membership(discovery, self._core, self._lock, config.link,
                                     config.model_name, self.metrics,
                                     self._capacity_changed)  # fmt: skip
        self._routed: dict[str, _Routed] = {}
        # answered pull-mode requests -> their pipeline, newest last (``abort``)
        self._leased: OrderedDict[str, str] = OrderedDict()
        self._loop: asyncio.AbstractEventLoop | None = None  # own loop thread, when needed
        self._link_loop: asyncio.AbstractEventLoop | None = None  # where the links run

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Begin discovery. Links run on the calling thread's running loop (call it on the
        serving loop: one loop for everything), else on the router's own loop thread."""
        try:
            self._link_loop = asyncio.get_running_loop()
        except RuntimeError:
            self._link_loop = self._own_loop()
        self.membership.start(self._link_loop)

    def shutdown(self) -> None:
        """Stop discovery and every link (from any thread but the links' loop: ``aclose``)."""
        for link in self.membership.close():
            link.stop()
        self._stop_own_loop()

    async def aclose(self) -> None:
        """``shutdown`` awaited on the links' loop."""
        if asyncio.get_running_loop() is not self._link_loop:
            await asyncio.to_thread(self.shutdown)
            return
        links = await asyncio.to_thread(self.membership.close)
        await asyncio.gather(*(link.aclose() for link in links))
        self._stop_own_loop()

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

    # -- Engine protocol -----------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """The largest of the accepted pipelines' (0 before the first): read per request."""
        return self.membership.vocab_size

    @property
    def max_model_len(self) -> int:
        """The longest prompt any accepted pipeline took; scoring excludes the ones it
        does not fit."""
        return self.membership.max_model_len

    @property
    def cache_identity(self) -> CacheIdentity:
        return self.membership.identity or CacheIdentity("", 0)

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
            members = self.membership.members()
            scores = [s for s in self._core.assess(len(tokens), hashes, members, now)
                      if s.eligible]  # fmt: skip
            if not scores:
                return False
            chosen = min(scores, key=attrgetter("score"))  # the earliest it could be done
            tenant = options.tenant or options.cache_salt or ""
            waiter = Waiter(request_id, options.priority, tenant, chosen.prefill_s,
                            (loop, loop.create_future()))  # fmt: skip
            left = None if options.deadline_s is None else options.deadline_s - now
            offer = self._flow.offer(waiter, chosen.score, left, self.membership.ready_count())
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
            woken = self._flow.release(self.membership.ready_count())
        self._wake(woken)

    def _capacity_changed(self) -> None:
        """A pipeline's readiness changed (Membership): flow control's slots follow."""
        with self._lock:
            woken = self._flow.drain(self.membership.ready_count())
        self._wake(woken)

    def _wake(self, woken: list[Waiter]) -> None:
        """Hand each admitted waiter its slot on its own loop."""
        if woken:
            self.metrics.offered("dequeued", self._flow.num_waiting, len(woken))
        for waiter in woken:
            loop, future = waiter.handle
            loop.call_soon_threadsafe(_resolve, future)

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
            sent = request + self._prefix_source(routed.placement, len(tokens))
            call = link.aio_prefill()(sent, timeout=timeout, metadata=metadata)
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
            if routed.placement.fetch_from is not None:
                self._observe_fetch(routed.placement, response)
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

    def _prefix_source(self, placement: Placement, prompt_tokens: int) -> bytes:
        """The ``prefix_source`` field a placement that fetches adds to the forwarded
        request (protobuf merges a field appended to a message's bytes): the source
        pipeline's address and the prefix the chosen one reuses after the copy, in whole
        blocks short of the prompt's last token. Empty when it does not fetch or the
        source left."""
        if placement.fetch_from is None:
            return b""
        with self._lock:
            source = self.membership.link(placement.fetch_from)
            size = self._core.block_size
        count = min(placement.cached_tokens, prompt_tokens - 1) // size * size
        if source is None or count <= 0:
            return b""
        tail = prefill_pb2.PrefillRequest()
        tail.prefix_source.address = source.endpoint.address
        tail.prefix_source.num_tokens = count
        return tail.SerializeToString()

    def _observe_fetch(self, placement: Placement, response: prefill_pb2.PrefillResponse) -> None:
        """A fetching placement's answer: what the copy cost, a transfer-model sample when
        it copied (a failed or unneeded one says nothing about the links)."""
        copied = response.fetched_tokens > 0
        self.metrics.fetched(placement.pid, copied, response.timings.fetch_seconds)
        if copied:
            with self._lock:
                self._core.observe_fetch(placement.fetch_blocks, response.timings.fetch_seconds)

    def _calibrate(self, routed: _Routed, started: float) -> None:
        """An answer from ``routed.pid``, forwarded at ``started``: a calibration sample."""
        now = time.monotonic()
        with self._lock:
            self._core.observe(routed.placement, now - started, now)

    def _transfer_model(self) -> TransferModel | None:
        with self._lock:
            fit = self._core.transfer
            return fit.model if fit is not None else None

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
            decision = self._core.decide(len(token_ids), hashes, self.membership.members(),
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
            members = self.membership.members()
            decision, placement = self._core.route(len(tokens), hashes, members, now,
                                                   tried)  # fmt: skip
            if placement is not None:
                link = self.membership.link(placement.pid)
                routed = _Routed(placement, (*tried, placement.pid))
                self._routed[request_id] = routed
        self.metrics.decision(decision.reason.value)
        if placement is None:
            raise self._no_pipeline(decision)
        return link, routed

    def _forget(self, request_id: str, routed: _Routed) -> None:
        with self._lock:
            if self._routed.get(request_id) is routed:
                del self._routed[request_id]
            self._core.finish(routed.placement)
        self.membership.close_if_drained(routed.pid)

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
                link = self.membership.link(self._leased.pop(request_id, ""))
                if link is None:
                    return False
                link.abort(request_id)
                return True
            routed.aborted = True
        routed.loop.call_soon_threadsafe(routed.call.cancel)
        return True

    def load(self) -> EngineLoad:
        with self._lock:
            links = self.membership.current()
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
        ready = self.membership.any_ready()
        detail = "" if ready else "no pipeline behind the router is ready"
        return EngineHealth(live=True, ready=ready, detail=detail)
