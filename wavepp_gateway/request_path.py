"""One request through the gateway: validate and tokenise, pick a decode instance, decide
remote or local prefill, prefill on the tier (pull mode), send decode the request with
``kv_transfer_params``, relay its answer unchanged (streamed or not).

Failure semantics (docs/gateway.md):
- a bad request -> 400 (unknown model 404) before the tier or decode sees it;
- the tier unavailable -> local prefill under ``auto``, 503 under ``remote``;
- a decode instance that fails before the first token (no connection, a 5xx, a stream that
  breaks before its first byte) -> retried once on another instance: with the same
  ``kv_transfer_params`` when the first never got the request, as local prefill otherwise
  (the first may have consumed the leases); a 4xx from decode is relayed as it is;
- the client gone before the answer starts -> the prefill call and the decode request are
  cancelled (the pipeline aborts and frees its blocks); gone mid-stream -> the decode
  stream is closed, so the instance aborts the request;
- a remote prefill whose KV decode did not use (no decode answered, the retry computed the
  prompt, decode refused the request or the KV, the client gone meanwhile) -> its leases
  are given back at once (an Abort of the answered request through the router), not left
  to their TTL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kv_transfer.vllm_decode.params import LOADED_KEY, TRACE_KEY
from prefill_node import tracing
from prefill_node.model.tokenizer import PromptTokenizer
from prefill_node.openai_api.errors import ApiError, BadRequest, DecodeFailed, Unavailable
from wavepp_gateway.client_disconnect import ClientGone, until_disconnected
from wavepp_gateway.config import GatewayConfig, PrefillMode
from wavepp_gateway.decision import (
    Decision,
    DecodeView,
    FirstTokenModel,
    Reason,
    decide,
    pick_decode,
)
from wavepp_gateway.decode_fleet import DecodeFleet, DecodeInstance
from wavepp_gateway.metrics import GatewayMetrics
from wavepp_gateway.openai_request import (
    GatewayRequest,
    Route,
    parse_body,
    parse_request,
)
from wavepp_gateway.tier import PrefillTier, TierError, TierPrefill

log = logging.getLogger(__name__)
_LOADED = LOADED_KEY.encode()
_JSON = {"content-type": "application/json"}


class _DecodeAttemptFailed(Exception):
    def __init__(self, instance: str, kind: str, delivered: bool) -> None:
        super().__init__(f"decode instance {instance}: {kind}")
        self.instance, self.kind, self.delivered = instance, kind, delivered


@dataclass
class _Answer:
    """Decode's answer, not yet relayed: its status, headers to pass on, and either the
    whole body or an open stream with its first chunk read."""

    instance: str
    status: int
    with_kv: bool  # kv_transfer_params were sent with the request
    body: bytes = b""
    stream: Any = None  # aiohttp.ClientResponse, open
    chunks: Any = None  # its raw byte iterator, the first chunk read already
    first: bytes = b""


class RequestPath:
    """See the module contract; one per gateway, used on the serving loop."""

    def __init__(
        self,
        config: GatewayConfig,
        tokenizer: PromptTokenizer,
        fleet: DecodeFleet,
        tier: PrefillTier | None,
        metrics: GatewayMetrics,
    ) -> None:
        self.config = config
        self._tokenizer = tokenizer
        self._fleet = fleet
        self._tier = tier
        self._metrics = metrics
        self._first_token = FirstTokenModel(config.rule)  # auto's predictions, learned
        self._releasing: set[asyncio.Task] = set()  # lease releases under way

    async def handle(self, route: Route, request: Request) -> Response:
        if not tracing.enabled():
            return await self._handle(route, request, None)
        span = tracing.start_span("wavepp.gateway.request", request.headers,
                                  {"http.route": route.value}, kind="server")  # fmt: skip
        try:
            response = await self._handle(route, request, span)
        except BaseException as exc:
            tracing.end(span, error=exc)
            raise
        span.set_attribute("http.response.status_code", response.status_code)
        if not isinstance(response, StreamingResponse):  # a stream's relay ends it
            tracing.end(span, error="error" if response.status_code >= 400 else None)
        return response

    async def _handle(self, route: Route, request: Request, span: Any) -> Response:
        started = time.monotonic()
        label = route.label
        try:
            raw = await request.body()
            tokenize = None
            if span is not None:
                tokenize = tracing.start_span("wavepp.gateway.tokenize", tracing.headers(span))
            req = parse_request(route, parse_body(raw), served_model=self.config.served_model,
                                max_model_len=self.config.max_model_len,
                                default_max_tokens=self.config.default_max_tokens,
                                tokenizer=self._tokenizer)  # fmt: skip
            if span is not None:
                tokenize.set_attribute(tracing.PROMPT_TOKENS, len(req.prompt_ids))
                tracing.end(tokenize)
                req = dataclasses.replace(req, traceparent=tracing.traceparent(span))
            answer, headers, decision = await until_disconnected(request, self._serve(req))
        except ApiError as exc:
            self._metrics.requests.labels(label, _outcome(exc)).inc()
            return JSONResponse(exc.body(), status_code=exc.status)
        except ClientGone:
            self._metrics.requests.labels(label, "cancelled").inc()
            return Response(status_code=499)
        prefill = decision.label
        if span is not None:
            span.set_attribute("wavepp.prefill", prefill)
            span.set_attribute("wavepp.prefill_reason", decision.reason.value)
        if answer.stream is None:
            self._finish(label, prefill, answer, started)
            return Response(answer.body, answer.status, headers, media_type="application/json")
        self._metrics.ttft.labels(label, prefill).observe(time.monotonic() - started)
        return StreamingResponse(self._relay(answer, label, prefill, started, span),
                                 answer.status, headers,
                                 media_type="text/event-stream")  # fmt: skip

    def _finish(self, label: str, prefill: str, answer: _Answer, started: float) -> None:
        outcome = "ok" if answer.status < 400 else f"decode_{answer.status}"
        self._metrics.requests.labels(label, outcome).inc()
        self._metrics.e2e.labels(label, prefill).observe(time.monotonic() - started)

    async def _relay(
        self, answer: _Answer, label: str, prefill: str, started: float, span: Any = None
    ) -> AsyncIterator[bytes]:
        outcome = "cancelled"  # the client went away unless the stream ends
        try:
            yield answer.first
            async for chunk in answer.chunks:
                if _LOADED in chunk:  # the last event, where decode puts kv_transfer_params
                    self._count_kv_load_events(chunk)
                yield chunk
            outcome = "ok"
        except Exception as exc:  # decode broke mid-stream: the client's stream just ends
            outcome = "decode_error"
            self._metrics.decode_errors.labels(answer.instance, "mid_stream").inc()
            log.warning("decode instance %s broke a stream: %s", answer.instance, exc)
        finally:
            if outcome == "ok":
                answer.stream.release()  # read to its end: the connection goes back to the pool
            else:
                answer.stream.close()  # closing it makes decode abort the unfinished request
            self._metrics.requests.labels(label, outcome).inc()
            self._metrics.e2e.labels(label, prefill).observe(time.monotonic() - started)
            tracing.end(span, error=None if outcome == "ok" else outcome)

    async def _serve(self, req: GatewayRequest) -> tuple[_Answer, dict[str, str], Decision]:
        ready = self._fleet.views(req.prompt_ids, req.cache_salt)
        views = [v for v in ready if v.fits(req.min_context)]
        if ready and not views:
            longest = max(v.max_model_len or 0 for v in ready)
            param = "prompt" if req.route is Route.COMPLETIONS else "messages"
            raise BadRequest(f"the request needs {req.min_context} tokens (prompt + "
                             f"completion); the decode instances take at most {longest}",
                             param)  # fmt: skip
        decode = pick_decode(views, self.config.rule)
        if decode is None:
            raise Unavailable("no decode instance is ready; retry later")
        decision, prefill = await self._prefill(req, decode)
        decided = time.monotonic()
        headers = {"x-wavepp-prefill": decision.label,
                   "x-wavepp-prefill-reason": decision.reason.value}  # fmt: skip
        if prefill is not None:
            headers["x-wavepp-prefill-pipeline"] = prefill.pipeline
            headers["x-wavepp-cached-tokens"] = str(prefill.cached_tokens)
        else:
            headers["x-wavepp-cached-tokens"] = str(decision.decode.cached_tokens)
        params = prefill.kv_transfer_params if prefill is not None else None
        try:
            answer = await self._decode(req, decode, params, views)
        except BaseException:  # no decode answered, or the client went away meanwhile
            if prefill is not None:
                self._release(prefill)
            raise
        if answer.stream is not None and answer.status < 400:
            self._learn(decision, prefill, answer, time.monotonic() - decided)
        loaded = self._count_kv_load(answer.body) if answer.stream is None else None
        if prefill is not None and (not answer.with_kv or answer.status >= 400 or loaded is False):
            self._release(prefill)  # the retry computed the prompt, or decode refused the KV
        headers["x-wavepp-decode"] = answer.instance
        if params is not None and not answer.with_kv:  # the retry computed the prompt
            headers["x-wavepp-prefill"] = "local"
            headers["x-wavepp-prefill-reason"] = "decode_retry"
            del headers["x-wavepp-prefill-pipeline"]
            cached = next((v.cached_tokens for v in views if v.instance == answer.instance), 0)
            headers["x-wavepp-cached-tokens"] = str(cached)
        return answer, headers, decision

    def _learn(
        self, decision: Decision, prefill: TierPrefill | None, answer: _Answer, seconds: float
    ) -> None:
        """A stream's first byte, ``seconds`` after the decision, is a sample for auto's
        first-token predictions: of the decode instance's prefill rate when it computed the
        prompt as decided, of the tier's hand-off when it loaded the tier's KV."""
        d, m = decision.decode, self._metrics
        if answer.instance != d.instance:
            return  # retried elsewhere: neither prediction was what happened
        if prefill is None:
            tokens = d.prefilling_tokens + d.uncached(decision.prompt_tokens)
            self._first_token.observe_local(d.instance, tokens, seconds)
            m.decode_prefill_rate.labels(d.instance).set(self._first_token.rate(d.instance))
        elif answer.with_kv and decision.tier is not None:
            self._first_token.observe_remote(decision.tier, seconds)
            m.tier_handoff.set(self._first_token.handoff_s)

    async def _prefill(
        self, req: GatewayRequest, decode: DecodeView
    ) -> tuple[Decision, TierPrefill | None]:
        mode, tier = self.config.mode, self._tier
        report = None
        if mode is PrefillMode.AUTO and tier is not None:
            if not req.traceparent:
                report = await tier.score(req.prompt_ids, req.cache_salt)
            else:
                span = tracing.start_span("wavepp.gateway.tier_score", req.traceparent,
                                          kind="client")  # fmt: skip
                report = await tier.score(req.prompt_ids, req.cache_salt, tracing.headers(span))
                if report is not None:
                    span.set_attribute(tracing.PIPELINE, report.pipeline_id)
                    span.set_attribute(tracing.CACHED_TOKENS, report.cached_tokens)
                tracing.end(span, error=None if report is not None else "no answer")
        decision = decide(mode, self.config.rule, len(req.prompt_ids), decode, report,
                          self._first_token)  # fmt: skip
        prefill = None
        if decision.remote:
            prefill, decision = await self._remote(req, decision)
        m = self._metrics
        m.decisions.labels(decision.label, decision.reason.value).inc()
        m.prompt_tokens.labels(decision.label).inc(len(req.prompt_ids))
        m.decision_cached.labels("decode").inc(decision.decode.cached_tokens)
        if report is not None:
            m.decision_cached.labels("tier").inc(report.cached_tokens)
            m.tier_queue.observe(report.queued_s)
        log.debug("%s", decision.describe())
        return decision, prefill

    def _release(self, prefill: TierPrefill) -> None:
        """The tier's leases for ``prefill`` will not be pulled: give them back now, in the
        background (the answer does not wait for it)."""

        async def release() -> None:
            released = await self._tier.release(prefill.request_id)
            self._metrics.tier_releases.labels("released" if released else "none_held").inc()

        task = asyncio.get_running_loop().create_task(release())
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def _remote(
        self, req: GatewayRequest, decision: Decision
    ) -> tuple[TierPrefill | None, Decision]:
        """Prefill on the tier; under ``auto`` a tier failure falls back to local."""
        if self._tier is None:
            raise Unavailable("--prefill remote, but no prefill tier (--router) is configured")
        request_id = f"gw-{uuid.uuid4().hex}"
        span = None
        if req.traceparent:
            span = tracing.start_span("wavepp.gateway.tier_prefill", req.traceparent,
                                      {tracing.REQUEST_ID: request_id}, kind="client")  # fmt: skip
        try:
            prefilled = await self._tier.prefill(req.prompt_ids, request_id, req.cache_salt,
                                                 tracing.headers(span))  # fmt: skip
            if span is not None:
                span.set_attribute(tracing.PIPELINE, prefilled.pipeline)
                span.set_attribute(tracing.CACHED_TOKENS, prefilled.cached_tokens)
                tracing.end(span)
            return prefilled, decision
        except BaseException as exc:
            tracing.end(span, error=exc)
            if not isinstance(exc, TierError):
                raise
            self._metrics.tier_errors.labels(exc.status).inc()
            if self.config.mode is PrefillMode.AUTO:
                log.info("prefill tier failed (%s); prefilling on decode instead", exc)
                local = Decision(False, Reason.TIER_UNAVAILABLE, decision.prompt_tokens,
                                 decision.decode, decision.tier)  # fmt: skip
                return None, local
            if exc.status == "INVALID_ARGUMENT":
                raise BadRequest(str(exc)) from None
            raise Unavailable(f"{exc}; retry later") from None

    async def _decode(
        self, req: GatewayRequest, decode: DecodeView, params: dict | None, views
    ) -> _Answer:
        try:
            return await self._attempt(req, decode, params)
        except _DecodeAttemptFailed as first:
            self._metrics.decode_errors.labels(first.instance, first.kind).inc()
            retry = pick_decode(views, self.config.rule, exclude=(first.instance,))
            if retry is None:
                raise DecodeFailed(f"{first}; no other decode instance to retry on") from None
            self._metrics.decode_retries.inc()
            log.info("%s; retrying on %s", first, retry.instance)
            try:
                return await self._attempt(req, retry, None if first.delivered else params)
            except _DecodeAttemptFailed as second:
                self._metrics.decode_errors.labels(second.instance, second.kind).inc()
                raise DecodeFailed(f"{first}; retried: {second}") from None

    async def _attempt(self, req: GatewayRequest, view: DecodeView, params: dict | None) -> _Answer:
        """One request to ``view``'s instance; while it computes the prompt (no ``params``),
        the instance counts those tokens as pending prefill work (``decide`` reads it)."""
        iid = view.instance
        inst = self._fleet.instance(iid)
        if inst is None:
            raise _DecodeAttemptFailed(iid, "gone", delivered=False)
        if params is not None:  # decode loads the prompt's KV: nothing to compute there
            return await self._send(req, inst, params)
        local = view.uncached(len(req.prompt_ids))
        gauge = self._metrics.decode_prefilling.labels(iid)
        inst.prefilling_tokens += local
        gauge.set(inst.prefilling_tokens)
        try:
            return await self._send(req, inst, params)
        finally:
            inst.prefilling_tokens -= local
            gauge.set(inst.prefilling_tokens)

    async def _send(
        self, req: GatewayRequest, inst: DecodeInstance, params: dict | None
    ) -> _Answer:
        iid = inst.id
        body = dict(req.body)
        if req.route is Route.COMPLETIONS:
            body["prompt"] = list(req.prompt_ids)  # tokenised once, here
        headers = _JSON
        span = None
        if req.traceparent:  # decode continues the trace from the header, its KV load too
            span = tracing.start_span("wavepp.gateway.decode", req.traceparent,
                                      {"wavepp.decode_instance": iid,
                                       "wavepp.kv_from_tier": params is not None},
                                      kind="client")  # fmt: skip
            context = tracing.headers(span)
            headers = {**_JSON, **dict(context)}
            if params is not None:
                params = {**params, TRACE_KEY: tracing.traceparent(span)}
        if params is not None:
            body["kv_transfer_params"] = params
        try:
            answer = await self._post(req, inst, body, headers)
        except BaseException as exc:
            tracing.end(span, error=exc)
            raise
        tracing.end(span, error="error" if answer.status >= 400 else None)
        return answer

    async def _post(
        self, req: GatewayRequest, inst: DecodeInstance, body: dict, headers: dict[str, str]
    ) -> _Answer:
        """Send ``body`` to ``inst``: its whole answer, or its open stream with the first
        chunk read; a failure before that raises _DecodeAttemptFailed."""
        import aiohttp

        iid = inst.id
        params = body.get("kv_transfer_params")
        connect_s = self.config.decode_connect_timeout_s
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_s)
        try:
            reply = await self._fleet.http.post(inst.url + req.route.value,
                                                data=json.dumps(body).encode(), timeout=timeout,
                                                headers=headers)  # fmt: skip
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            self._fleet.mark_down(iid)
            raise _DecodeAttemptFailed(iid, "connect", delivered=False) from exc
        except aiohttp.ClientError as exc:
            raise _DecodeAttemptFailed(iid, "transport", delivered=True) from exc
        try:
            if reply.status >= 500:
                raise _DecodeAttemptFailed(iid, f"http_{reply.status}", delivered=True)
            if not req.stream or reply.status != 200:
                return _Answer(iid, reply.status, params is not None, await reply.read())
            chunks = reply.content.iter_any()
            first = b""
            async for chunk in chunks:
                if chunk:
                    first = chunk
                    break
            if not first:
                raise _DecodeAttemptFailed(iid, "empty_stream", delivered=True)
            answer = _Answer(iid, 200, params is not None, stream=reply, chunks=chunks,
                             first=first)  # fmt: skip
            reply = None  # the relay's now: it closes it
            return answer
        except aiohttp.ClientError as exc:
            raise _DecodeAttemptFailed(iid, "transport", delivered=True) from exc
        finally:
            if reply is not None:
                reply.release()  # back to the pool when read to its end, else closed

    def _count_kv_load(self, body: bytes) -> bool | None:
        """``wavepp_loaded`` of an answer: did the KV load succeed on decode (None: the
        answer does not say)."""
        if _LOADED not in body:  # no kv_transfer_params came back: nothing to parse
            return None
        try:
            loaded = (json.loads(body).get("kv_transfer_params") or {}).get(LOADED_KEY)
        except (ValueError, AttributeError):
            return None
        if not isinstance(loaded, dict):
            return None
        ok = bool(loaded.get("ok"))
        self._metrics.kv_loads.labels("ok" if ok else "failed").inc()
        return ok

    def _count_kv_load_events(self, chunk: bytes) -> None:
        """The same from a stream's SSE events (``data: {...}`` lines) in ``chunk``; an
        event split across chunks is not counted."""
        for line in chunk.split(b"\n"):
            if line.startswith(b"data: {") and _LOADED in line:
                self._count_kv_load(line[6:])


def _outcome(exc: ApiError) -> str:
    return {400: "bad_request", 404: "not_found", 503: "unavailable"}.get(
        exc.status, "decode_failed"
    )
