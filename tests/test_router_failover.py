"""The router's Prefill fast path (request and answer passed on as bytes) keeps its failure
handling: a request a dead pipeline refused before admission is retried once on the other
one, a malformed request is INVALID_ARGUMENT, and a request without an id gets one that the
pipeline answers under. In-process RouterEngine behind the node's PrefillServer, real
`wavepp serve` pipelines."""

from __future__ import annotations

import signal

import grpc
import pytest

from prefill_node.client.prefill_client import PrefillClient
from prefill_node.model.loader_hf import save_hf_checkpoint
from prefill_node.model.weights import random_weights
from prefill_node.server.server import ServerConfig
from prefill_router.discovery import StaticDiscovery
from prefill_router.pipeline_link import PREFILL_METHOD, LinkConfig
from prefill_router.router_engine import RouterConfig, RouterEngine
from prefill_router.scoring import RoutingPolicy
from tests.grpc_harness import ServerThread, wait_until
from tests.router_harness import MODEL, serve, stop

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture
def pipelines(tmp_path):
    save_hf_checkpoint(tmp_path, MODEL, random_weights(MODEL, seed=7))
    procs = [serve(tmp_path) for _ in range(2)]
    try:
        for _, port in procs:
            with PrefillClient(f"127.0.0.1:{port}") as client:
                wait_until(client.is_ready, 60, f"pipeline {port} ready")
        yield [(proc, f"127.0.0.1:{port}") for proc, port in procs]
    finally:
        for proc, _ in procs:
            stop(proc)


def test_a_request_a_dead_pipeline_refused_is_retried_once_elsewhere(pipelines):
    (_, alive), (victim, dead) = pipelines
    # readiness polled (no Watch, whose broken stream would drop it at once), one poll only
    # (at start): the router still counts the killed pipeline as ready, so requests do reach
    # it and are refused there ("failed to connect") before admission
    link = LinkConfig(poll_s=120, watch=False)
    config = RouterConfig(policy=RoutingPolicy.ROUND_ROBIN, link=link)
    engine = RouterEngine(StaticDiscovery([alive, dead]), config)
    engine.start()
    server_config = ServerConfig(host="127.0.0.1", port=0, blocking_submit=False)
    try:
        with ServerThread(engine, server_config) as front, PrefillClient(front.target) as client:
            loads = lambda: [p.ready for p in engine.load().pipelines]
            wait_until(lambda: loads() == [True, True], 30, "both pipelines ready")
            wait_until(client.is_ready, 10, "the router SERVING")
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            results = [client.prefill([(3 * i + k) % 64 for i in range(20)],
                                      request_id=f"r{k}").result for k in range(3)]  # fmt: skip
            assert [r.served_by for r in results] == [alive] * 3
            assert [r.request_id for r in results] == ["r0", "r1", "r2"]
            assert [r.prompt_tokens for r in results] == [20] * 3
            # round-robin offered the dead pipeline at least once; each refusal moved once
            assert dict(engine.metrics.failovers).keys() == {dead}
            assert 1 <= engine.metrics.failovers[dead] <= 3
            assert engine.metrics.answered_requests[alive] == 3
            assert engine.health().ready
    finally:
        engine.shutdown()


def test_the_fast_path_parses_once_and_assigns_missing_request_ids(pipelines):
    (_, first), (_, second) = pipelines
    engine = RouterEngine(StaticDiscovery([first, second]), RouterConfig())
    engine.start()
    server_config = ServerConfig(host="127.0.0.1", port=0, blocking_submit=False)
    try:
        with ServerThread(engine, server_config) as front, PrefillClient(front.target) as client:
            wait_until(client.is_ready, 30, "the router SERVING")
            with grpc.insecure_channel(front.target) as channel:
                raw = channel.unary_unary(PREFILL_METHOD)  # bytes both ways
                with pytest.raises(grpc.RpcError) as err:
                    raw(b"\xff\xff\xff", timeout=10)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "not a valid PrefillRequest" in err.value.details()
            remote = client.prefill([(5 * i + 2) % 64 for i in range(21)])  # no request id
            result = remote.result
            assert len(result.request_id) == 32  # the router's, answered by the pipeline
            assert result.served_by in (first, second)
            assert remote.server_s > 0  # the router's own time, merged into the answer
            assert engine.metrics.answered_requests[result.served_by] == 1
    finally:
        engine.shutdown()
