"""The one two-way table between the node's typed errors and gRPC status codes.

Servers encode with ``status_of`` (a pipeline's servicer and a router's, which is the same
servicer); clients decode with ``error_of`` (``RemoteEngine``, and the router reading a
pipeline's answer), so a typed error survives every hop: a pipeline's ``OverloadedError``
reaches the router's caller as ``OverloadedError`` with its retry-after, not as
``NeverFitsError``; a ``DeadlineExceededError`` as itself, not as a cancellation.

| error | status | trailing metadata |
|---|---|---|
| ``InvalidRequestError`` | INVALID_ARGUMENT | |
| ``OverloadedError`` | RESOURCE_EXHAUSTED | ``retry-after-ms``: when a retry fares better |
| ``NeverFitsError`` | RESOURCE_EXHAUSTED | (none: retrying the same request never helps) |
| ``UnavailableError`` | UNAVAILABLE | ``wavepp-failover``: why it may run elsewhere, or ``no`` |
| ``DeadlineExceededError`` | DEADLINE_EXCEEDED | |
| ``RequestAbortedError`` | CANCELLED | |
| anything else | INTERNAL (the server logs it) | |

An UNAVAILABLE without ``wavepp-failover`` never came from a servicer: the transport lost
or never had a connection (decoded as ``UnavailableError`` whose ``failover`` says so).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import grpc

from prefill_node.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    NeverFitsError,
    OverloadedError,
    RequestAbortedError,
    UnavailableError,
    WaveppError,
)

# Trailing metadata of an UNAVAILABLE a servicer sends: why a router may send the request to
# another pipeline (``UnavailableError.failover``), or FAILOVER_NO.
FAILOVER_KEY = "wavepp-failover"
FAILOVER_NO = "no"
CONNECTION_LOST = "connection_lost"  # an UNAVAILABLE without the key: from the transport
# Trailing metadata of a RESOURCE_EXHAUSTED for overload: milliseconds to wait before a retry.
RETRY_AFTER_KEY = "retry-after-ms"

Trailers = tuple[tuple[str, str], ...]

# Most specific first: the first class ``exc`` is an instance of gives its code.
_CODES: tuple[tuple[type[WaveppError], grpc.StatusCode], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (OverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NeverFitsError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (UnavailableError, grpc.StatusCode.UNAVAILABLE),
    (DeadlineExceededError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (RequestAbortedError, grpc.StatusCode.CANCELLED),
)


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, Trailers] | None:
    """The status code and trailing metadata ``exc`` is sent as; None when it has none (an
    internal error: the caller sends INTERNAL and logs it)."""
    for kind, code in _CODES:
        if isinstance(exc, kind):
            if isinstance(exc, OverloadedError):
                retry_ms = max(1, math.ceil(exc.retry_after_s * 1000))
                return code, ((RETRY_AFTER_KEY, str(retry_ms)),)
            if isinstance(exc, UnavailableError):
                return code, ((FAILOVER_KEY, exc.failover or FAILOVER_NO),)
            return code, ()
    return None


def error_of(
    code: grpc.StatusCode, details: str | None, trailers: Iterable[tuple[str, str]] | None
) -> WaveppError:
    """The typed error a failed call's status stands for; the message is the server's
    ``details`` with the code's name appended."""
    message = f"{details} [{code.name}]"
    meta = dict(trailers or ())
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        retry_ms = meta.get(RETRY_AFTER_KEY)
        if retry_ms is not None and retry_ms.isdigit():
            return OverloadedError(message, int(retry_ms) / 1000)
        return NeverFitsError(message)
    if code == grpc.StatusCode.UNAVAILABLE:
        error = UnavailableError(message)
        error.failover = failover_reason(code, meta.items())
        return error
    kind = next((k for k, c in _CODES if c == code), WaveppError)
    return kind(message)


def error_from_rpc(exc: grpc.RpcError) -> WaveppError:
    """``error_of`` a failed call (sync or asyncio: both carry code, details, trailers)."""
    return error_of(exc.code(), exc.details(), exc.trailing_metadata())  # type: ignore[attr-defined]


def failover_reason(
    code: grpc.StatusCode, trailers: Iterable[tuple[str, str]] | None
) -> str | None:
    """Why a failed call may run on another pipeline, or None: only an UNAVAILABLE may, as
    its ``wavepp-failover`` trailer says; one without the trailer came from the transport
    (``CONNECTION_LOST``)."""
    if code != grpc.StatusCode.UNAVAILABLE:
        return None
    value = dict(trailers or ()).get(FAILOVER_KEY, CONNECTION_LOST)
    return None if value == FAILOVER_NO else value
