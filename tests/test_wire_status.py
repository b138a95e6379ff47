"""The two-way status table: every typed error survives a hop (server encodes, client
decodes) with its type and its fields; what is not typed is INTERNAL."""

from __future__ import annotations

import grpc
import pytest

from prefill_node.errors import (
    DeadlineExceededError,
    InvalidPromptError,
    InvalidRequestError,
    KVHandoffError,
    NeverFitsError,
    OverloadedError,
    RequestAbortedError,
    UnavailableError,
    WaveppError,
)
from prefill_node.wire.status import (
    CONNECTION_LOST,
    FAILOVER_KEY,
    RETRY_AFTER_KEY,
    error_of,
    failover_reason,
    status_of,
)


def hop(exc: BaseException) -> WaveppError:
    status = status_of(exc)
    assert status is not None
    code, trailers = status
    return error_of(code, str(exc), trailers)


@pytest.mark.parametrize(
    ("error", "code", "kind"),
    [
        (InvalidPromptError("token 9 is outside the vocabulary"),
         grpc.StatusCode.INVALID_ARGUMENT, InvalidRequestError),
        (NeverFitsError("too long"), grpc.StatusCode.RESOURCE_EXHAUSTED, NeverFitsError),
        (DeadlineExceededError("late"), grpc.StatusCode.DEADLINE_EXCEEDED,
         DeadlineExceededError),
        (RequestAbortedError("gone"), grpc.StatusCode.CANCELLED, RequestAbortedError),
    ],
)  # fmt: skip
def test_each_family_has_one_code_and_comes_back_as_its_type(error, code, kind) -> None:
    status = status_of(error)
    assert status is not None and status[0] == code
    back = hop(error)
    assert type(back) is kind and str(error) in str(back) and code.name in str(back)


def test_overload_keeps_its_retry_after_and_is_not_never_fits() -> None:
    code, trailers = status_of(OverloadedError("queue full", 0.0123))  # type: ignore[misc]
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(trailers) == {RETRY_AFTER_KEY: "13"}  # rounded up to a whole millisecond
    back = hop(OverloadedError("queue full", 0.0123))
    assert isinstance(back, OverloadedError) and back.retry_after_s == pytest.approx(0.013)
    # without the trailer (or with garbage in it) it is a prompt that can never fit
    assert type(error_of(code, "x", ())) is NeverFitsError
    assert type(error_of(code, "x", ((RETRY_AFTER_KEY, "soon"),))) is NeverFitsError


def test_unavailable_carries_its_failover_reason_both_ways() -> None:
    pipeline_down = UnavailableError("a stage died")
    code, trailers = status_of(pipeline_down)  # type: ignore[misc]
    assert (code, dict(trailers)) == (grpc.StatusCode.UNAVAILABLE,
                                      {FAILOVER_KEY: "pipeline_unavailable"})  # fmt: skip
    back = hop(pipeline_down)
    assert isinstance(back, UnavailableError) and back.failover == "pipeline_unavailable"
    decode_saw_bytes = KVHandoffError("decode read half", decode_saw_bytes=True)
    assert dict(status_of(decode_saw_bytes)[1]) == {FAILOVER_KEY: "no"}  # type: ignore[index]
    assert hop(decode_saw_bytes).failover is None  # type: ignore[attr-defined]
    assert failover_reason(grpc.StatusCode.UNAVAILABLE, ((FAILOVER_KEY, "no"),)) is None
    # an UNAVAILABLE no servicer sent (no trailer): the transport's
    assert failover_reason(grpc.StatusCode.UNAVAILABLE, None) == CONNECTION_LOST
    transport = error_of(grpc.StatusCode.UNAVAILABLE, "eof", ())
    assert isinstance(transport, UnavailableError) and transport.failover == CONNECTION_LOST
    assert failover_reason(grpc.StatusCode.INTERNAL, ((FAILOVER_KEY, "x"),)) is None


def test_what_is_not_typed_is_internal_and_decodes_to_the_base() -> None:
    assert status_of(KeyError("bug")) is None
    assert type(error_of(grpc.StatusCode.INTERNAL, "boom", ())) is WaveppError
