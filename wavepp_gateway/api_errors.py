"""Typed gateway errors and their OpenAI error JSON (``{"error": {message, type, param, code}}``).

The shapes and status codes are vLLM's OpenAI server's, so a client sees the same error
whether it talks to the gateway or to ``vllm serve``: bad input -> 400 ``BadRequestError``,
an unknown model -> 404 ``NotFoundError`` (param ``model``), nothing able to serve ->
503 ``ServiceUnavailableError``, a decode failure after retrying -> 502 ``BadGatewayError``.
"""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An error answered to the client; ``status`` is the HTTP status."""

    status = 500
    type = "InternalServerError"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.status, self.param)


class BadRequest(ApiError):
    """The request is malformed or asks for something invalid (nothing was allocated)."""

    status = 400
    type = "BadRequestError"


class ModelNotFound(ApiError):
    """The request names a model this gateway does not serve."""

    status = 404
    type = "NotFoundError"


class Unavailable(ApiError):
    """Nothing can serve the request now (no ready decode instance, or the prefill tier is
    down under ``--prefill remote``); the client may retry."""

    status = 503
    type = "ServiceUnavailableError"


class DecodeFailed(ApiError):
    """Decode instances failed the request before its first token, the retry included."""

    status = 502
    type = "BadGatewayError"


def error_body(message: str, type_: str, status: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}
