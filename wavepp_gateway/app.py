"""The gateway's ASGI app: OpenAI routes, ``/v1/models``, ``/health`` and ``/metrics``."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from prefill_node.openai_api.errors import Unavailable
from wavepp_gateway.decode_fleet import DecodeFleet
from wavepp_gateway.metrics import GatewayMetrics
from wavepp_gateway.openai_request import Route
from wavepp_gateway.request_path import RequestPath

Factory = Callable[[], Awaitable[tuple[RequestPath, DecodeFleet, Callable[[], Awaitable[None]]]]]


def build_app(factory: Factory, metrics: GatewayMetrics) -> FastAPI:
    """The app; ``factory`` runs on the serving loop at startup (clients and the fleet's
    tasks belong to that loop) and returns the request path, the fleet and a closer."""
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state["path"], state["fleet"], close = await factory()
        try:
            yield
        finally:
            await close()

    app = FastAPI(title="wavepp gateway", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)  # fmt: skip
    created = int(time.time())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await state["path"].handle(Route.COMPLETIONS, request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await state["path"].handle(Route.CHAT, request)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        config = state["path"].config
        card = {"id": config.served_model, "object": "model", "created": created,
                "owned_by": "wavepp", "root": config.served_model, "parent": None,
                "max_model_len": config.max_model_len}  # fmt: skip
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/health")
    async def health() -> Response:
        """200 while at least one decode instance is ready (vLLM's /health answers 200)."""
        if state["fleet"].num_ready():
            return Response(status_code=200)
        error = Unavailable("no decode instance is ready")
        return JSONResponse(error.body(), status_code=error.status)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4")

    return app
