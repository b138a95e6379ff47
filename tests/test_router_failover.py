"""The router fails a request over instead of failing it: a pipeline that dies under a request
(its process killed, or one of its stages) costs the caller nothing but time, the request
answers OK from the other pipeline, and the reason is counted. A dead pipeline leaves routing
as soon as its connection breaks, even where readiness is only polled, and its new instance
at the same address comes back. The Prefill fast path (request and answer passed on as bytes)
keeps its error handling: a malformed request is INVALID_ARGUMENT, and a request without an
id gets one that the pipeline answers under. In-process RouterEngine behind the node's
PrefillServer, real `wavepp serve` pipelines; a pipeline is killed only once the pipeline
itself reports the request part-way through (no sleeps)."""

from __future__ import annotations

import contextlib
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from prefill_node.client.prefill_client import PrefillClient
from prefill_node.model.loader_hf import save_hf_checkpoint
from prefill_node.model.weights import random_weights
from prefill_node.process_tree import ProcessTree
from prefill_node.server.server import ServerConfig
from prefill_router.discovery import PipelineEndpoint, StaticDiscovery
from prefill_router.pipeline_link import PREFILL_METHOD, LinkConfig, PipelineLink
from prefill_router.router_engine import RouterConfig, RouterEngine
from tests.grpc_harness import ServerThread, wait_until
from tests.router_harness import MODEL, serve, stop

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PROMPT = [(7 * i + 3) % 64 for i in range(240)]  # 15 chunks of 16 tokens
WAVE_DELAY_S = 0.1  # per wave and stage: the prompt is in flight for seconds


@pytest.fixture
def model_dir(tmp_path):
    save_hf_checkpoint(tmp_path, MODEL, random_weights(MODEL, seed=7))
    return tmp_path


@pytest.fixture
def pipelines(model_dir):
    procs = [serve(model_dir, wave_delay_s=WAVE_DELAY_S) for _ in range(2)]
    try:
        for _, port in procs:
            with PrefillClient(f"127.0.0.1:{port}") as client:
                wait_until(client.is_ready, 60, f"pipeline {port} ready")
        yield [(proc, f"127.0.0.1:{port}") for proc, port in procs]
    finally:
        for proc, _ in procs:
            stop(proc)


def front(engine: RouterEngine) -> ServerThread:
    return ServerThread(engine, ServerConfig(host="127.0.0.1", port=0, blocking_submit=False))


@contextlib.contextmanager
def one_request_mid_flight(discovery):
    """A router over ``discovery`` behind its gRPC front, both pipelines ready, with request
    r0 (PROMPT) sent through it: yields (engine, client, the pending call's future)."""
    engine = RouterEngine(discovery, RouterConfig())
    engine.start()
    try:
        with (
            front(engine) as srv,
            PrefillClient(srv.target) as client,
            ThreadPoolExecutor(1) as pool,
        ):
            wait_until(lambda: all(p.ready for p in engine.load().pipelines), 30, "both ready")
            wait_until(client.is_ready, 10, "the router SERVING")
            yield engine, client, pool.submit(client.prefill, PROMPT, request_id="r0", timeout_s=60)
    finally:
        engine.shutdown()


def wait_routed_mid_flight(engine: RouterEngine, timeout_s: float = 30.0) -> str:
    """The pipeline the router sent its one request to, once that pipeline reports it
    admitted and part-way through (holding blocks on every stage)."""
    found: list[str] = []

    def mid_flight() -> bool:
        busy = [p.address for p in engine.load().pipelines if p.inflight_requests]
        if not busy:
            return False
        with PrefillClient(busy[0]) as client:
            load = client.load(timeout_s=5)
        started = 0 < load.inflight_tokens < len(PROMPT)
        if started and all(s.used_blocks > 0 for s in load.stages):
            found.append(busy[0])
        return bool(found)

    wait_until(mid_flight, timeout_s, "the request part-way through a pipeline")
    return found[0]


def stage_pid(proc) -> int:
    """The process of stage 1 of a `wavepp serve` (the leader's child running stage_main)."""
    for pid in ProcessTree(proc.pid).pids():
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"prefill_node.runtime.stage_main" in cmdline:
            return pid
    raise AssertionError("no stage process under the pipeline")


@pytest.mark.parametrize("fault", ["pipeline", "stage"])
def test_a_pipeline_that_dies_mid_request_fails_over_and_the_request_answers_ok(pipelines, fault):
    by_address = {address: proc for proc, address in pipelines}
    with one_request_mid_flight(StaticDiscovery(list(by_address))) as (engine, client, pending):
        victim = wait_routed_mid_flight(engine)
        proc = by_address[victim]
        os.kill(proc.pid if fault == "pipeline" else stage_pid(proc), signal.SIGKILL)
        result = pending.result(timeout=60).result
        (survivor,) = set(by_address) - {victim}
        assert result.served_by == survivor
        assert (result.request_id, result.prompt_tokens) == ("r0", len(PROMPT))
        reason = "connection_lost" if fault == "pipeline" else "pipeline_unavailable"
        assert dict(engine.metrics.failovers) == {(victim, reason): 1}
        assert dict(engine.metrics.answered_requests) == {survivor: 1}
        # the dead pipeline is out of routing (its connection or its readiness said so)
        wait_until(lambda: not engine.membership.links()[victim].ready, 10, "the victim dropped")
        again = client.prefill(PROMPT[:40], request_id="r1", timeout_s=60).result
        assert again.served_by == survivor
        # with the other pipeline gone too, nothing can serve: UNAVAILABLE
        stop(by_address[survivor])
        wait_until(lambda: not engine.health().ready, 10, "no pipeline ready")
        with pytest.raises(grpc.RpcError) as err:
            client.prefill(PROMPT[:40], request_id="r2", timeout_s=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_dead_pipeline_leaves_polled_routing_at_once_and_its_new_instance_returns(
    model_dir, pipelines
):
    (_, alive), (victim, dead) = pipelines
    # readiness polled once a minute: only the channel's connectivity can drop it in time
    link = LinkConfig(poll_s=60, watch=False, retry_s=0.5)
    engine = RouterEngine(StaticDiscovery([alive, dead]), RouterConfig(link=link))
    engine.start()
    try:
        wait_until(lambda: all(p.ready for p in engine.load().pipelines), 30, "both ready")
        before = engine.membership.links()[dead].info.instance_id
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        # the link's flag drops first, then its owner counts the loss: wait for the count
        wait_until(lambda: engine.metrics.lost[dead] >= 1, 10, "the dead pipeline dropped")
        assert not engine.membership.links()[dead].ready and engine.membership.links()[alive].ready
        assert engine.metrics.lost[dead] == 1
        restarted, _ = serve(model_dir, port=int(dead.rsplit(":", 1)[1]))
        try:
            wait_until(lambda: engine.membership.links()[dead].ready, 60, "the new instance back")
            assert engine.membership.links()[dead].info.instance_id != before
        finally:
            stop(restarted)
    finally:
        engine.shutdown()


def test_the_fast_path_parses_once_and_assigns_missing_request_ids(pipelines):
    (_, first), (_, second) = pipelines
    engine = RouterEngine(StaticDiscovery([first, second]), RouterConfig())
    engine.start()
    try:
        with front(engine) as srv, PrefillClient(srv.target) as client:
            wait_until(client.is_ready, 30, "the router SERVING")
            with grpc.insecure_channel(srv.target) as channel:
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


class AbortOnAnswer:
    """A forwarded call that, once the pipeline's answer is in, has the router abort the
    request before the router reads that answer: the race a soak client hits when its Abort
    reaches the router just as the pipeline answers (the router said True: it had it)."""

    def __init__(self, call, engine: RouterEngine, request_id: str) -> None:
        self._call, self._engine, self._request_id = call, engine, request_id
        self.landed: bool | None = None

    def cancel(self) -> bool:
        return self._call.cancel()

    def __await__(self):
        data = yield from self._call.__await__()
        self.landed = self._engine.abort(self._request_id)
        return data


def test_an_abort_that_lands_as_the_answer_arrives_still_cancels_the_request(
    pipelines, monkeypatch
):
    """Abort said True, so the request ends CANCELLED, never OK; the pipeline answered, so
    nothing is left on it (its blocks free)."""
    addresses = [address for _, address in pipelines]
    engine = RouterEngine(StaticDiscovery(addresses), RouterConfig())
    calls: list[AbortOnAnswer] = []
    raw = PipelineLink.aio_prefill

    def aio_prefill(link):
        def forward(request, **kwargs):
            calls.append(AbortOnAnswer(raw(link)(request, **kwargs), engine, "r-abort"))
            return calls[-1]

        return forward

    monkeypatch.setattr(PipelineLink, "aio_prefill", aio_prefill)
    engine.start()
    try:
        with front(engine) as srv, PrefillClient(srv.target) as client:
            wait_until(client.is_ready, 30, "the router SERVING")
            with pytest.raises(grpc.RpcError) as err:
                client.prefill(PROMPT[:40], request_id="r-abort", timeout_s=60)
            assert err.value.code() == grpc.StatusCode.CANCELLED
            assert [c.landed for c in calls] == [True]  # one call, and the Abort landed
            assert not engine.metrics.answered_requests and not engine.metrics.failovers
            for address in addresses:
                with PrefillClient(address) as pipeline:
                    load = pipeline.load(timeout_s=10)
                assert load.inflight_requests == 0
                assert all(s.used_blocks == 0 for s in load.stages)
    finally:
        engine.shutdown()


class ChangingDiscovery:
    """A ``PipelineDiscovery`` whose set the test changes (``set``), as an EndpointSlice watch
    does when a pod starts terminating."""

    def __init__(self, addresses: list[str]) -> None:
        self._endpoints = frozenset(PipelineEndpoint(a, a) for a in addresses)
        self._on_change = None

    def start(self, on_change) -> None:
        self._on_change = on_change
        on_change(self._endpoints)

    def set(self, addresses: list[str]) -> None:
        self._endpoints = frozenset(PipelineEndpoint(a, a) for a in addresses)
        self._on_change(self._endpoints)

    def current(self) -> frozenset[PipelineEndpoint]:
        return self._endpoints

    def stop(self) -> None:
        """Nothing runs."""


def test_a_pipeline_leaving_discovery_mid_request_finishes_it_then_its_link_closes(pipelines):
    """A pod that starts terminating leaves its EndpointSlice first and drains: the router
    routes nothing new there, lets the call it has there answer, and closes the link only
    then (closing it at once cancelled the call and left the caller without a status until
    its deadline)."""
    addresses = [address for _, address in pipelines]
    discovery = ChangingDiscovery(addresses)
    with one_request_mid_flight(discovery) as (engine, client, pending):
        leaving = wait_routed_mid_flight(engine)
        (staying,) = set(addresses) - {leaving}
        discovery.set([staying])
        assert set(engine.membership.links()) == {staying}  # out of routing at once
        again = client.prefill(PROMPT[:40], request_id="r1", timeout_s=60).result
        assert again.served_by == staying
        result = pending.result(timeout=60).result
        assert (result.request_id, result.served_by) == ("r0", leaving)
        assert not engine.metrics.failovers
        wait_until(lambda: not engine.membership.leaving(), 10, "the drained link closed")
