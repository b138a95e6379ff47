"""Typed errors answered in OpenAI's error JSON (``{"error": {message, type, param, code}}``).

Shapes and status codes are vLLM's OpenAI server's, so a client sees the same error from the
gateway, from ``wavepp decode --serve`` and from ``vllm serve``: bad input -> 400
``BadRequestError``, an unknown model -> 404 ``NotFoundError`` (param ``model``), nothing
able to serve -> 503 ``ServiceUnavailableError``, a decode failure behind the gateway -> 502
``BadGatewayError``, a failure of the server itself -> 500 ``InternalServerError``.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any


class ApiError(Exception):
    """An error answered to the client; ``status`` is the HTTP status, ``type`` its name."""

    status = HTTPStatus.INTERNAL_SERVER_ERROR
    type = "InternalServerError"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.status, self.param)


class BadRequest(ApiError):
    """The request is malformed or asks for something not served (nothing was allocated)."""

    status = HTTPStatus.BAD_REQUEST
    type = "BadRequestError"


class ModelNotFound(ApiError):
    """The request names a model this server does not serve."""

    status = HTTPStatus.NOT_FOUND
    type = "NotFoundError"


class Unavailable(ApiError):
    """Nothing can serve the request now; the client may retry."""

    status = HTTPStatus.SERVICE_UNAVAILABLE
    type = "ServiceUnavailableError"


class DecodeFailed(ApiError):
    """Decode instances failed the request before its first token, the retry included."""

    status = HTTPStatus.BAD_GATEWAY
    type = "BadGatewayError"


def unknown_model(model: Any, served_model: str) -> ModelNotFound:
    """vLLM's words for a ``model`` it does not serve."""
    return ModelNotFound(
        f"The model `{model}` does not exist. Valid aliases: {served_model}.", "model"
    )


def error_body(message: str, type_: str, status: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object; ``code`` is the HTTP status, as vLLM's server sets it."""
    return {"error": {"message": message, "type": type_, "param": param, "code": int(status)}}


def status_error_body(status: int, message: str) -> dict[str, Any]:
    """The error object of an HTTP status raised by the web framework itself (404 route,
    405 method, ...): its type is the status phrase, as vLLM names them."""
    phrase = HTTPStatus(status).phrase.replace(" ", "")
    return error_body(message, f"{phrase}Error", status)
