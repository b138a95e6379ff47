"""The PrefillService servicer: converts proto <-> engine types and maps errors to statuses.

Thin by design: validation lives in ``convert.parse_request``, scheduling in the engine. Error
policy (every message says what to fix):

- InvalidRequestError -> INVALID_ARGUMENT; NeverFitsError -> RESOURCE_EXHAUSTED;
  OverloadedError (a router shedding load) -> RESOURCE_EXHAUSTED with trailing metadata
  ``retry-after-ms``;
  UnavailableError or a not-ready pipeline -> UNAVAILABLE, with trailing metadata
  ``wavepp-failover``: why a router may retry it on another pipeline, or ``no``;
- the earlier of the request's ``timeout`` and the call's deadline passing -> the request is
  aborted in the engine (its blocks freed on every stage) -> DEADLINE_EXCEEDED;
- the client cancelling the call -> engine abort -> CANCELLED; an ``Abort`` RPC -> CANCELLED;
- anything else -> INTERNAL, logged with the request id;
- Score on an engine that does not route (a pipeline) -> UNIMPLEMENTED.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Protocol, TypeVar, runtime_checkable

import grpc
from google.protobuf.message import DecodeError

from prefill_node import __version__, tracing
from prefill_node.engine.types import Engine, PrefillOptions, PrefillResult, ScoreReport
from prefill_node.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    RequestAbortedError,
)
from prefill_node.model.tokenizer import PromptTokenizer
from prefill_node.server.kv_event_hub import KVEventHub
from prefill_node.server.loop_bridge import LoopBridge
from prefill_node.server.metrics import ServerMetrics
from prefill_node.server.prefix_fetch import FetchOutcome, PrefixFetcher, PrefixFetching
from prefill_node.wire.convert import (
    ModelLimits,
    ParsedRequest,
    Relayed,
    load_to_proto,
    parse_request,
    response_to_proto,
    token_ids_of,
)
from prefill_node.wire.kv_convert import batch_to_proto, manifest_to_proto
from prefill_node.wire.status import FAILOVER_KEY, status_of
from wavepp_proto.prefill.v1 import kv_events_pb2, prefill_pb2, prefill_pb2_grpc

log = logging.getLogger(__name__)

# UNAVAILABLE before anything was admitted starts with this: a router may retry elsewhere.
NOT_READY = "the pipeline is not ready"


T = TypeVar("T")


@runtime_checkable
class ResponseForwarder(Protocol):
    """An engine that passes a request on to a pipeline and its answer back (a router),
    awaited on the server's loop: no PrefillResult round trip, no re-encoding. ``forward``
    gets the request as received and as parsed (token ids: text is already tokenised here)
    and ``raw``, the request's bytes as received (None: encode ``request`` instead); the
    request goes on with ``parsed.options.request_id`` and ``parsed.token_ids``. Cancelling
    it cancels the request. Errors are the engine's typed errors. Such an engine is a
    router: the server answers its Prefill calls as bytes (``PrefillBytes``), GetServerInfo
    says ``router`` and SubscribeKvEvents points at its pipelines."""

    async def forward(
        self, request: prefill_pb2.PrefillRequest, parsed: ParsedRequest, raw: bytes | None
    ) -> Relayed: ...


@runtime_checkable
class PrefillScorer(Protocol):
    """An engine that can say where a prompt would be prefilled without prefilling it (a
    router): ``score`` reserves and records nothing; bad input raises the typed errors."""

    def score(self, token_ids: tuple[int, ...], cache_salt: str | None) -> ScoreReport: ...


class RequestFailure(Exception):
    """A request's final status; raised inside the servicer, sent as a status or stream entry."""

    def __init__(
        self,
        request_id: str,
        code: grpc.StatusCode,
        message: str,
        trailers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        super().__init__(request_id, code, message)
        self.request_id = request_id
        self.code = code
        self.message = message
        self.trailers = trailers  # trailing metadata sent with the status


def _failure(request_id: str, exc: BaseException) -> RequestFailure:
    """``exc`` as the request's final status (``wire.status``: the one table both ways)."""
    status = status_of(exc)
    if status is not None:
        return RequestFailure(request_id, status[0], str(exc), status[1])
    log.error("request %s failed with an internal error", request_id, exc_info=exc)
    return RequestFailure(
        request_id,
        grpc.StatusCode.INTERNAL,
        f"internal error in request {request_id} ({type(exc).__name__}); see the server log",
    )


class _Registration:
    """Stands in for a server to collect the generated registration's method handlers."""

    handlers: dict[str, grpc.RpcMethodHandler]

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass  # the same handlers come to add_registered_method_handlers

    def add_registered_method_handlers(self, service: str, handlers) -> None:
        self.handlers = dict(handlers)


def method_handlers(servicer: PrefillServicer) -> dict[str, grpc.RpcMethodHandler]:
    """The PrefillService's method handlers, as generated, except that a forwarder's
    Prefill is served as bytes both ways (``PrefillBytes``)."""
    registration = _Registration()
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, registration)
    handlers = registration.handlers
    if servicer.forwards:
        handlers["Prefill"] = grpc.unary_unary_rpc_method_handler(servicer.PrefillBytes)
    return handlers


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    """Serves one engine. ``ready`` is kept current by the server's health monitor.
    ``instance_id`` is new for every servicer (a server start): GetServerInfo and every KV
    event batch carry it, so a router sees a restart at the same address."""

    def __init__(
        self,
        engine: Engine,
        *,
        tokenizer: PromptTokenizer | None = None,
        metrics: ServerMetrics | None = None,
        kv_events: KVEventHub | None = None,
        max_stream_inflight: int = 256,
        submit_threads: int = 8,
        blocking_submit: bool = True,
        model_name: str = "",
    ) -> None:
        self._engine = engine
        self._forward = engine.forward if isinstance(engine, ResponseForwarder) else None
        self._model_name = model_name
        self.instance_id = uuid.uuid4().hex
        self._num_stages: int | None = None  # GetServerInfo: fixed for the server's life
        self._submit_pool = None
        if blocking_submit:
            self._submit_pool = ThreadPoolExecutor(
                submit_threads, thread_name_prefix="wavepp-submit"
            )
        self._tokenizer = tokenizer
        self._metrics = metrics or ServerMetrics()
        self._kv_events = kv_events
        self._max_stream_inflight = max_stream_inflight
        self._bridge: LoopBridge | None = None  # engine futures -> the serving loop
        self._fetcher = None  # a request's prefix_source (pipelines with KV agents only)
        if self._forward is None and isinstance(engine, PrefixFetching):
            self._fetcher = PrefixFetcher(engine, self._metrics, self._submit_pool)
        self._last_limits = ModelLimits(0, 0)
        self.ready = True
        self.not_ready_detail = ""

    @property
    def forwards(self) -> bool:
        """True when the engine is a ResponseForwarder (a router)."""
        return self._forward is not None

    @property
    def _limits(self) -> ModelLimits:
        """Read per request: a router learns its pipelines' limits after it starts (made
        anew only when they change)."""
        vocab_size, max_model_len = self._engine.vocab_size, self._engine.max_model_len
        limits = self._last_limits
        if limits.vocab_size != vocab_size or limits.max_model_len != max_model_len:
            limits = self._last_limits = ModelLimits(vocab_size, max_model_len)
        return limits

    async def Prefill(self, request, context):
        try:
            return await self._prefill(request, context.time_remaining(), None, context)
        except RequestFailure as f:
            await context.abort(f.code, f.message, f.trailers)

    async def PrefillBytes(self, data: bytes, context) -> bytes:
        """Prefill of a forwarder (a router), served without (de)serialisers
        (``method_handlers``): the request is parsed once here and goes on as the bytes
        received; the pipeline's answer comes back as its bytes with this server's fields
        appended (a serialised message merges field by field into the one before it)."""
        try:
            request = prefill_pb2.PrefillRequest.FromString(data)
        except DecodeError as exc:
            self._metrics.observe_failure("invalid_argument")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the request is not a valid PrefillRequest: {exc}")  # fmt: skip
        try:
            return await self._prefill(request, context.time_remaining(), data, context)
        except RequestFailure as f:
            await context.abort(f.code, f.message, f.trailers)

    async def PrefillStream(
        self, request_iterator, context
    ) -> AsyncIterator[prefill_pb2.PrefillStreamResponse]:
        """Requests run concurrently (at most ``max_stream_inflight`` at once: reading pauses
        beyond that); responses are yielded in completion order. Cancelling the call aborts
        every unfinished request of the stream."""
        done: asyncio.Queue = asyncio.Queue()
        end = object()
        slots = asyncio.Semaphore(self._max_stream_inflight)
        tasks: set[asyncio.Task] = set()

        async def one(req: prefill_pb2.PrefillRequest) -> None:
            try:
                resp = await self._prefill(req, context.time_remaining(), None, context)
                item = prefill_pb2.PrefillStreamResponse(request_id=resp.request_id, response=resp)
            except RequestFailure as f:
                error = prefill_pb2.PrefillError(code=f.code.value[0], message=f.message)
                item = prefill_pb2.PrefillStreamResponse(request_id=f.request_id, error=error)
            finally:
                slots.release()
            done.put_nowait(item)

        async def reader() -> None:
            try:
                async for req in request_iterator:
                    await slots.acquire()
                    task = asyncio.create_task(one(req))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
            finally:
                done.put_nowait(end)

        reading = asyncio.create_task(reader())
        try:
            reader_done = False
            while not reader_done or tasks or not done.empty():
                item = await done.get()
                if item is end:
                    reader_done = True
                    reading.result()
                    continue
                yield item
        finally:
            for task in (reading, *tasks):
                task.cancel()

    async def Abort(self, request, context):
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        return prefill_pb2.AbortResponse(aborted=self._engine.abort(request.request_id))

    async def GetLoad(self, request, context):
        try:
            load = await asyncio.to_thread(self._engine.load)
        except Exception as exc:
            f = _failure("GetLoad", exc)
            await context.abort(f.code, f.message, f.trailers)
        return load_to_proto(load)

    async def GetServerInfo(self, request, context):
        if self._num_stages is None:  # once: a busy pipeline's load() waits on every stage
            try:
                load = await asyncio.to_thread(self._engine.load)
            except Exception as exc:
                f = _failure("GetServerInfo", exc)
                await context.abort(f.code, f.message, f.trailers)
            self._num_stages = len(load.stages)
        identity = self._engine.cache_identity
        return prefill_pb2.ServerInfo(
            model_name=self._model_name,
            vocab_size=self._limits.vocab_size,
            max_model_len=self._limits.max_model_len,
            num_stages=self._num_stages,
            text_prompts=self._tokenizer is not None,
            chat_template=self._tokenizer is not None and self._tokenizer.has_chat_template,
            server_version=__version__,
            instance_id=self.instance_id,
            block_size=identity.block_size,
            cache_model_id=identity.model_id,
            pipeline_id=self._kv_events.pipeline_id if self._kv_events is not None else "",
            kv_events=self._kv_events is not None,
            router=self._forward is not None,  # a forwarder sits in front of pipelines
            snapshot_interval_blocks=identity.snapshot_interval_blocks or 0,
        )

    async def Score(self, request, context):
        """A router's dry run of Prefill (``PrefillScorer``): validated like Prefill, then
        scored on the loop (no engine call, nothing reserved)."""
        if not isinstance(self._engine, PrefillScorer):
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED, "Score is a router's call; this is a pipeline"
            )
        request_id = request.request_id or "score"
        span = None
        if tracing.enabled():
            span = tracing.start_span("wavepp.router.score", context.invocation_metadata(),
                                      kind="server")  # fmt: skip
        try:
            parsed = parse_request(request, request_id=request_id, limits=self._limits,
                                   tokenizer=self._tokenizer)  # fmt: skip
            report = self._engine.score(parsed.token_ids, parsed.options.cache_salt)
        except Exception as exc:
            tracing.end(span, error=exc)
            f = _failure(request_id, exc)
            await context.abort(f.code, f.message, f.trailers)
        if span is not None:
            span.set_attributes({tracing.PIPELINE: report.pipeline_id,
                                 tracing.CACHED_TOKENS: report.cached_tokens,
                                 "wavepp.route_reason": report.reason})  # fmt: skip
            tracing.end(span)
        return prefill_pb2.ScoreResponse(
            pipeline_id=report.pipeline_id,
            reason=report.reason,
            prompt_tokens=report.prompt_tokens,
            cached_tokens=report.cached_tokens,
            queued_seconds=report.queued_s,
            prefill_seconds=report.prefill_s,
            ready_pipelines=report.ready_pipelines,
        )

    async def LeasePrefix(self, request, context):
        """The source side of a prefix fetch (``PrefixFetching.lend_prefix``): one control
        round on the pipeline, nothing queued; runs off the loop."""
        if self._fetcher is None:
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED,
                "LeasePrefix is a pipeline's call (a router or a remote engine lends nothing)",
            )
        if self._engine.kv_allow is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this pipeline runs without KV agents (--no-kv-shipping): it lends nothing",
            )
        tokens = token_ids_of(request.token_ids)
        ttl = request.lease_ttl_ms / 1e3 if request.lease_ttl_ms else None
        try:
            lend = partial(self._engine.lend_prefix, tokens, request.cache_salt or None, ttl)
            manifests = await asyncio.get_running_loop().run_in_executor(self._submit_pool, lend)
        except Exception as exc:
            f = _failure("lease-prefix", exc)
            await context.abort(f.code, f.message, f.trailers)
        response = prefill_pb2.LeasePrefixResponse(
            cache_model_id=self._engine.cache_identity.model_id
        )
        for m in manifests:
            response.stage_manifests.append(manifest_to_proto(m))
        return response

    async def SubscribeKvEvents(
        self, request, context
    ) -> AsyncIterator[kv_events_pb2.KvEventBatch]:
        if self._kv_events is None:
            why = "this server publishes no KV events"
            if self._forward is not None:  # a router: its pipelines do; GetLoad lists them
                why = "a router publishes no KV events; subscribe to its pipelines (see GetLoad)"
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, why)
        sub = self._kv_events.subscribe()
        try:
            while (batch := await sub.next_batch()) is not None:
                sequence, events = batch
                yield batch_to_proto(
                    sequence, events, self._kv_events.pipeline_id, time.time(), self.instance_id
                )
        finally:
            sub.close()
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "this subscriber fell too far behind the KV events and was dropped; resubscribe",
        )

    async def _run_engine(
        self, token_ids: tuple[int, ...], options: PrefillOptions
    ) -> PrefillResult:
        """With ``blocking_submit`` (the default) ``submit`` runs on the submit pool: an engine
        may compute inside it, which must never stall the event loop. An engine whose submit
        only enqueues (both wavepp engines) is called inline, saving a thread hop.
        Completions reach the loop through the LoopBridge (one wakeup per burst).
        """
        loop = asyncio.get_running_loop()
        if self._bridge is None or self._bridge.loop is not loop:
            self._bridge = LoopBridge(loop)
        if self._submit_pool is None:
            future = self._engine.submit(token_ids, options)
        else:
            future = await loop.run_in_executor(
                self._submit_pool, self._engine.submit, token_ids, options
            )
        return await self._bridge.watch(future)

    async def close_sources(self) -> None:
        """Close the channels to the pipelines prefixes were fetched from."""
        if self._fetcher is not None:
            await self._fetcher.close()

    def close(self) -> None:
        """Stop the submit pool; submits not yet started are dropped."""
        if self._submit_pool is not None:
            self._submit_pool.shutdown(wait=False, cancel_futures=True)

    async def _prefill(
        self,
        req: prefill_pb2.PrefillRequest,
        call_remaining_s: float | None,
        raw: bytes | None = None,
        context: grpc.aio.ServicerContext | None = None,
    ) -> prefill_pb2.PrefillResponse | bytes:
        """Run one request to its response, or raise RequestFailure (metrics recorded). A
        forwarder's answer is bytes when ``raw`` (the request's bytes) is given. With tracing
        on, the request runs under a server span continuing the caller's ``traceparent``."""
        request_id = req.request_id or uuid.uuid4().hex
        if not tracing.enabled():
            return await self._prefill_untraced(req, call_remaining_s, raw, request_id, "")
        metadata = context.invocation_metadata() if context is not None else None
        name = "wavepp.router.request" if self._forward is not None else "wavepp.leader.request"
        span = tracing.start_span(name, metadata or None, {tracing.REQUEST_ID: request_id},
                                  kind="server")  # fmt: skip
        error: BaseException | None = None
        try:
            return await self._prefill_untraced(
                req, call_remaining_s, raw, request_id, tracing.traceparent(span)
            )
        except RequestFailure as f:
            error = f
            span.set_attribute("rpc.grpc.status_code", f.code.value[0])
            raise
        except BaseException as exc:
            error = exc
            raise
        finally:
            tracing.end(span, error=error)

    async def _prefill_untraced(
        self,
        req: prefill_pb2.PrefillRequest,
        call_remaining_s: float | None,
        raw: bytes | None,
        request_id: str,
        traceparent: str,
    ) -> prefill_pb2.PrefillResponse | bytes:
        started = time.perf_counter()
        try:
            if not self.ready:
                raise RequestFailure(
                    request_id,
                    grpc.StatusCode.UNAVAILABLE,
                    f"{NOT_READY} ({self.not_ready_detail}); retry later",
                    ((FAILOVER_KEY, "not_ready"),),
                )
            try:
                parsed = parse_request(
                    req,
                    request_id=request_id,
                    limits=self._limits,
                    tokenizer=self._tokenizer,
                    call_remaining_s=call_remaining_s,
                )
            except Exception as exc:
                raise _failure(request_id, exc) from exc
            if traceparent:
                options = dataclasses.replace(parsed.options, traceparent=traceparent)
                parsed = dataclasses.replace(parsed, options=options)
            if self._forward is not None:  # a router: the pipeline's response, passed on
                relayed = await self._await_engine(parsed, self._forward(req, parsed, raw))
            else:
                fetched = FetchOutcome(0, 0.0)
                if parsed.prefix_source is not None and self._fetcher is not None:
                    try:
                        fetched = await self._fetcher.fetch(parsed)
                    except InvalidRequestError as exc:
                        raise _failure(request_id, exc) from exc
                result = await self._await_engine(
                    parsed, self._run_engine(parsed.token_ids, parsed.options)
                )
        except RequestFailure as f:
            self._metrics.observe_failure(f.code.name.lower())
            raise
        except asyncio.CancelledError:
            self._metrics.observe_failure("cancelled")
            raise
        server_s = time.perf_counter() - started
        echo = parsed.token_ids if parsed.from_text else ()
        if self._forward is None:
            if fetched.seconds:
                timings = dataclasses.replace(result.timings, fetch_s=fetched.seconds)
                result = dataclasses.replace(result, fetched_tokens=fetched.tokens, timings=timings)
            self._metrics.observe_success(result, server_s)
            return response_to_proto(result, prompt_token_ids=echo, server_s=server_s)
        self._metrics.observe_response(relayed.response, server_s)
        tail = prefill_pb2.PrefillResponse(served_by=relayed.served_by, prompt_token_ids=echo)
        tail.timings.server_seconds = server_s
        data = relayed.data + tail.SerializeToString()  # merges into the pipeline's fields
        return data if raw is not None else prefill_pb2.PrefillResponse.FromString(data)

    async def _await_engine(self, parsed: ParsedRequest, run: Awaitable[T]) -> T:
        """``run``'s outcome; aborts the request in the engine (its blocks freed on every
        stage) when the call is cancelled or the deadline passes, and maps errors."""
        request_id = parsed.options.request_id or ""
        deadline = parsed.options.deadline_s
        try:
            if parsed.timeout_s is None:  # no timer task on the common path
                return await run
            return await asyncio.wait_for(run, parsed.timeout_s)
        except asyncio.CancelledError:
            self._engine.abort(request_id)
            raise
        except Exception as exc:
            missed = deadline is not None and time.monotonic() >= deadline
            expired = isinstance(exc, TimeoutError | RequestAbortedError) and missed
            if expired or isinstance(exc, DeadlineExceededError):
                self._engine.abort(request_id)
                raise RequestFailure(
                    request_id,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"request {request_id} missed its deadline of {parsed.timeout_s or 0.0:.3f}s "
                    "and was aborted; raise the timeout or send a shorter prompt",
                ) from None
            raise _failure(request_id, exc) from exc
