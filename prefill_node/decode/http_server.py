"""The reference decode worker behind an OpenAI-compatible HTTP API, the contract of vLLM's.

``POST /v1/completions`` and ``/v1/chat/completions`` (streaming SSE or not), ``GET
/v1/models``, ``GET /health``, Prometheus ``GET /metrics`` (``decode.metrics``). A body's
``kv_transfer_params`` carrying our pull manifests (``kv_transfer.vllm_decode.params``, as
the vLLM connector takes them) gets the prompt's KV READ from the prefill stages; without
them the prompt is computed here. The answer carries ``kv_transfer_params: {"wavepp_loaded":
...}`` as the connector's does (non-streaming: in the body; streaming: in the last chunk,
which vLLM's server does not do). Errors are OpenAI's JSON (``prefill_node.openai_api.errors``).
A client that goes away stops its request: the engine frees its blocks. Imports FastAPI:
import this module only to serve.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from kv_transfer.vllm_decode.params import LOADED_KEY
from prefill_node.decode.decode_engine import DecodeEngine, DecodeEvent, DecodeJob, Finished
from prefill_node.decode.openai_protocol import GenerateRequest, PromptLimits, parse_request
from prefill_node.errors import InvalidRequestError, UnavailableError
from prefill_node.openai_api.errors import ApiError, BadRequest, Unavailable, status_error_body


@dataclass(frozen=True)
class ServedModel:
    """What the server answers for: its name, tokenizer and prompt limits."""

    name: str
    tokenizer: Any
    limits: PromptLimits
    root: str = ""


class _Detokenizer:
    """Text of the generated tokens, as deltas that never take back what was sent (a token
    ending in half a character waits for the rest)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer, self.token_ids, self.shown = tokenizer, [], ""

    def add(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        return self._delta(final=False)

    def _delta(self, final: bool) -> str:
        text = self._tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if not text.startswith(self.shown) or (not final and text.endswith("\ufffd")):
            return ""
        delta, self.shown = text[len(self.shown) :], text
        return delta

    def rest(self) -> str:
        return self._delta(final=True)


class _Request:
    """One request's event queue, fed from the engine thread."""

    def __init__(
        self, engine: DecodeEngine, request_id: str, req: GenerateRequest, eos_ids: Any
    ) -> None:
        self.engine, self.request_id, self.req = engine, request_id, req
        self.events: asyncio.Queue[DecodeEvent] = asyncio.Queue()
        self.finished: Finished | None = None
        self.created = int(time.time())
        loop = asyncio.get_running_loop()

        def sink(event: DecodeEvent) -> None:
            loop.call_soon_threadsafe(self.events.put_nowait, event)

        stop_ids = set(req.stop_token_ids)
        if not req.ignore_eos:
            stop_ids.update(eos_ids)
        self.job = DecodeJob(
            request_id, req.prompt_ids, req.max_tokens, frozenset(stop_ids), sink,
            req.manifests, req.refused, req.traceparent,
        )  # fmt: skip

    async def next_event(self) -> DecodeEvent:
        event = await self.events.get()
        if isinstance(event, Finished):
            self.finished = event
        return event

    def abandon(self) -> None:
        """The client is gone: stop generating and free the blocks (no-op once finished)."""
        if self.finished is None:
            self.engine.cancel(self.request_id)


def build_app(engine: DecodeEngine, model: ServedModel, registry: Any) -> FastAPI:
    """The FastAPI application serving ``engine``."""
    app = FastAPI(title="wavepp decode", docs_url=None, redoc_url=None)

    def error(exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=int(exc.status))

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: HTTPException) -> JSONResponse:
        body = status_error_body(exc.status_code, str(exc.detail))
        return JSONResponse(body, status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, exc: Exception) -> JSONResponse:
        return error(ApiError(f"{type(exc).__name__}: {exc}"))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.alive else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": model.name, "object": "model", "created": int(time.time()),
            "owned_by": "wavepp", "root": model.root or model.name, "parent": None,
            "max_model_len": model.limits.max_model_len,
        }  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await _generate(raw, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        return await _generate(raw, chat=True)

    async def _generate(raw: Request, chat: bool) -> Response:
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            try:
                body = json.loads(await raw.body())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise BadRequest(f"the request body is not valid JSON: {exc}") from exc
            req = parse_request(
                body, chat=chat, served_model=model.name, limits=model.limits,
                tokenizer=model.tokenizer, request_id=request_id,
            )  # fmt: skip
            state = _Request(engine, request_id, req, model.tokenizer.eos_token_ids)
            try:
                engine.check(state.job)
                if not req.stream:  # a stream submits when it starts: see _sse
                    engine.submit(state.job)
            except InvalidRequestError as exc:
                raise BadRequest(str(exc), "max_tokens") from exc
            except UnavailableError as exc:
                raise Unavailable(str(exc)) from exc
        except ApiError as exc:
            return error(exc)
        shape = _Shape(model.name, request_id, state, chat)
        if req.stream:
            events = _sse(state, shape, model.tokenizer)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            answer = await _until_disconnect(raw, _collect(state, shape))
        finally:
            state.abandon()
        if answer is None:  # the client left; nobody reads this
            return Response(status_code=499)
        return answer if isinstance(answer, Response) else JSONResponse(answer)

    async def _collect(state: _Request, shape: _Shape) -> Any:
        token_ids = []
        while not isinstance(event := await state.next_event(), Finished):
            token_ids.append(event.token_id)
        if event.reason in ("error", "abort"):
            return error(ApiError(event.error or "the request was aborted"))
        text = model.tokenizer.decode(token_ids, skip_special_tokens=True)
        return shape.full(text, token_ids, event)

    return app


async def _until_disconnect(raw: Any, work: Any) -> Any:
    """Run ``work``; None when the client disconnects first (``work`` is cancelled)."""

    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    return None


async def _sse(state: _Request, shape: _Shape, tokenizer: Any) -> AsyncIterator[str]:
    """The stream: a chunk per text delta, the finishing chunk, usage, ``[DONE]``. The request
    is submitted here, so a client gone before the stream starts leaves nothing running; one
    gone mid-stream cancels this generator, whose ``finally`` frees the request."""
    detok = _Detokenizer(tokenizer)
    state.engine.submit(state.job)
    try:
        if shape.chat:
            yield _data(shape.chunk({"role": "assistant", "content": ""}, None, None))
        while not isinstance(event := await state.next_event(), Finished):
            delta = detok.add(event.token_id)
            if delta or state.req.return_token_ids:
                yield _data(shape.chunk(delta, None, [event.token_id]))
        if event.reason in ("error", "abort"):
            message = event.error or "the request was aborted"
            body = ApiError(message).body()
            yield _data(body)
        else:
            last = shape.chunk(detok.rest(), event.reason, [])
            if event.load is not None:
                last["kv_transfer_params"] = {LOADED_KEY: event.load.to_dict()}
            yield _data(last)
            if state.req.include_usage:
                yield _data(shape.usage_chunk(len(detok.token_ids)))
        yield "data: [DONE]\n\n"
    finally:
        state.abandon()


def _data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class _Shape:
    """Response bodies in vLLM's shapes for one request."""

    def __init__(self, model_name: str, request_id: str, state: _Request, chat: bool) -> None:
        self.model_name, self.request_id, self.state, self.chat = (
            model_name, request_id, state, chat,
        )  # fmt: skip
        self.req = state.req

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.state.created,
                "model": self.model_name}  # fmt: skip

    def usage(self, completion_tokens: int) -> dict[str, int]:
        prompt = len(self.req.prompt_ids)
        return {"prompt_tokens": prompt, "total_tokens": prompt + completion_tokens,
                "completion_tokens": completion_tokens}  # fmt: skip

    def chunk(self, delta: Any, finish: str | None, token_ids: list[int] | None) -> dict:
        if self.chat:
            message = delta if isinstance(delta, dict) else {"content": delta}
            choice: dict[str, Any] = {"index": 0, "delta": message, "logprobs": None,
                                      "finish_reason": finish}  # fmt: skip
            body = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish,
                      "stop_reason": None}  # fmt: skip
            body = self._head("text_completion")
        if self.req.return_token_ids and token_ids is not None:
            choice["token_ids"] = token_ids
        body["choices"] = [choice]
        return body

    def usage_chunk(self, completion_tokens: int) -> dict[str, Any]:
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = self.usage(completion_tokens)
        return body

    def full(self, text: str, token_ids: list[int], end: Finished) -> dict[str, Any]:
        ids = list(token_ids) if self.req.return_token_ids else None
        if self.chat:
            body = self._head("chat.completion")
            choice: dict[str, Any] = {
                "index": 0, "message": {"role": "assistant", "content": text},
                "logprobs": None, "finish_reason": end.reason, "stop_reason": None,
                "token_ids": ids,
            }  # fmt: skip
            body["prompt_token_ids"] = list(self.req.prompt_ids) if ids is not None else None
        else:
            body = self._head("text_completion")
            choice = {
                "index": 0, "text": text, "logprobs": None, "finish_reason": end.reason,
                "stop_reason": None, "token_ids": ids,
                "prompt_token_ids": list(self.req.prompt_ids) if ids is not None else None,
            }  # fmt: skip
        body["choices"] = [choice]
        body["usage"] = self.usage(len(token_ids))
        loaded = None if end.load is None else {LOADED_KEY: end.load.to_dict()}
        body["kv_transfer_params"] = loaded
        return body
