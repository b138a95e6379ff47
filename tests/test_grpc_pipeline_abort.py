"""Client cancel, deadlines, the Abort RPC and cancelled streams on a real gRPC server over the
real 2-stage PipelineEngine: each aborts the request inside the pipeline while it is part-way
through, and its blocks end up free on EVERY stage (the stages' own counts, integrity true).

The pipeline runs with ``debug_wave_delay_s`` (every stage sleeps 30 ms per wave) and 8-token
waves, so a 160-token prompt stays in flight for ~0.6 s: long enough to act on it mid-flight
without racing its completion.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from prefill_node.client.prefill_client import AsyncPrefillClient, PrefillClient, build_request
from tests.grpc_harness import (
    ServerThread,
    pipeline_server_config,
    start_tiny_pipeline,
    wait_mid_flight,
    wait_until,
)
from wavepp_proto.prefill.v1 import prefill_pb2_grpc

pytestmark = pytest.mark.timeout(120)

LONG = [(7 * i + 3) % 64 for i in range(160)]
DELAY_S = 0.03


@pytest.fixture(scope="module")
def engine():
    eng = start_tiny_pipeline(
        stage_blocks=(256, 256),
        max_wave_tokens=8,
        min_wave_tokens=8,
        debug_wave_delay_s=DELAY_S,
    )
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(engine, pipeline_server_config()) as srv:
        yield srv


def _used(engine) -> list[int]:
    return [s.pool.in_use for s in engine.stage_stats()]


def _assert_freed_everywhere(engine) -> None:
    """The aborted request left the pipeline: no block in use on any stage, integrity true."""
    wait_until(lambda: _used(engine) == [0, 0], 10, "blocks freed on every stage")
    load = engine.load()
    assert (load.queue_depth, load.inflight_requests, load.inflight_tokens) == (0, 0, 0)
    engine.debug_check_integrity()


def _outcome(srv: ServerThread, outcome: str) -> float:
    value = srv.server.metrics.registry.get_sample_value(
        "wavepp_requests_total", {"outcome": outcome}
    )
    return value or 0.0


def _resend_shows_it_stopped(srv: ServerThread, prompt: list[int], salt: str) -> None:
    """The pipeline still serves, and sending the aborted prompt again (same salt) finds less
    than all of it cached: the pipeline stopped computing it part-way (a request that ran to
    completion would leave every full block but the last token's cached)."""
    with PrefillClient(srv.target) as client:
        again = client.prefill(prompt, cache_salt=salt).result
    assert again.cached_tokens + again.computed_tokens == len(prompt)
    assert again.cached_tokens < len(prompt) - 4, again


def test_client_cancel_mid_flight_aborts_it_on_every_stage(engine, server):
    before = _outcome(server, "cancelled")

    async def run():
        async with AsyncPrefillClient(server.target) as client:
            call = client.prefill_call(LONG, request_id="cancel-me", cache_salt="cancel")
            await asyncio.to_thread(wait_mid_flight, engine, len(LONG))
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call

    asyncio.run(run())
    _assert_freed_everywhere(engine)
    assert not engine.abort("cancel-me")  # the server aborted it already
    wait_until(lambda: _outcome(server, "cancelled") == before + 1, 5, "cancel metric")
    _resend_shows_it_stopped(server, LONG, "cancel")


@pytest.mark.parametrize("via", ["request timeout", "call deadline"])
def test_deadline_mid_flight_aborts_it_on_every_stage(engine, server, via):
    limit = {"timeout_s": 0.3} if via == "request timeout" else {"deadline_s": 0.3}
    with PrefillClient(server.target) as client, ThreadPoolExecutor(1) as pool:
        pending = pool.submit(
            client.prefill, LONG, request_id=f"late-{via}", cache_salt=via, **limit
        )
        wait_mid_flight(engine, len(LONG))
        with pytest.raises(grpc.RpcError) as err:
            pending.result(10)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    if via == "request timeout":  # the server's own answer, which says what to do
        assert "missed its deadline of 0.300s and was aborted" in err.value.details()
    _assert_freed_everywhere(engine)
    assert not engine.abort(f"late-{via}")
    _resend_shows_it_stopped(server, LONG, via)


def test_abort_rpc_mid_flight_aborts_it_on_every_stage(engine, server):
    with PrefillClient(server.target) as client, ThreadPoolExecutor(1) as pool:
        pending = pool.submit(client.prefill, LONG, request_id="victim", cache_salt="abort")
        wait_mid_flight(engine, len(LONG))
        assert client.abort("victim") is True
        with pytest.raises(grpc.RpcError) as err:
            pending.result(10)
        assert client.abort("victim") is False  # gone: a second abort finds nothing
    assert err.value.code() == grpc.StatusCode.CANCELLED
    assert "'victim' was aborted" in err.value.details()
    _assert_freed_everywhere(engine)
    _resend_shows_it_stopped(server, LONG, "abort")


def test_cancelling_a_stream_aborts_all_its_requests_on_every_stage(engine, server):
    requests = [
        build_request(LONG[i:] + LONG[:i], request_id=f"s{i}", cache_salt="stream")
        for i in range(3)
    ]
    with grpc.insecure_channel(server.target) as channel:
        call = prefill_pb2_grpc.PrefillServiceStub(channel).PrefillStream(iter(requests))
        wait_until(lambda: engine.load().inflight_requests == 3, 10, "3 requests admitted")
        wait_mid_flight(engine, 3 * len(LONG))
        call.cancel()
        _assert_freed_everywhere(engine)
    for i in range(3):
        _resend_shows_it_stopped(server, LONG[i:] + LONG[:i], "stream")
