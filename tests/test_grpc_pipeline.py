"""A real grpc.aio server over the real 2-stage multi-process PipelineEngine (gloo, CPU):
sync and asyncio clients at concurrency 64 get exactly what the in-process engine gives, a
burst of bad requests leaves it SERVING with integrity true on every stage, load and streams.

One pipeline and one server for the whole module (a pipeline start costs seconds). Every test
uses its own cache salts, so tests see neither each other's cache nor each other's timing.
"""

from __future__ import annotations

import asyncio
import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefill_node.client.prefill_client import (
    SERVICE_NAME,
    AsyncPrefillClient,
    PrefillClient,
    build_request,
)
from prefill_node.engine.types import PrefillOptions
from tests.grpc_harness import (
    PIPELINE_HF,
    ServerThread,
    assert_same_result,
    pipeline_server_config,
    start_tiny_pipeline,
)
from wavepp_proto.prefill.v1 import prefill_pb2, prefill_pb2_grpc

pytestmark = pytest.mark.timeout(120)

VOCAB = PIPELINE_HF["vocab_size"]
BLOCKS = 2048
TOP = 5


@pytest.fixture(scope="module")
def engine():
    eng = start_tiny_pipeline(stage_blocks=(BLOCKS, BLOCKS))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(engine, pipeline_server_config()) as srv:
        yield srv


@pytest.fixture(autouse=True)
def drained_and_intact(engine):
    """After every test: nothing in flight, no block pinned, integrity true on every stage."""
    yield
    engine.debug_check_integrity()
    load = engine.load()
    assert (load.queue_depth, load.inflight_requests) == (0, 0)
    assert [s.used_blocks for s in load.stages] == [0, 0]


def _bursts(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """64 cold prompts with distinct first blocks, then 64 extending them (prefix reuse)."""
    rng = random.Random(seed)
    firsts = rng.sample(range(VOCAB), 64)
    cold = [[f] + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 23))] for f in firsts]
    warm = [p + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))] for p in cold]
    return cold, warm


def _in_process(engine, prompts, salt):
    """The same prompts submitted to the engine directly (concurrently, like the clients)."""
    opts = lambda i: PrefillOptions(request_id=f"{salt}-{i}", cache_salt=salt, top_logprobs=TOP)
    futures = [engine.submit(p, opts(i)) for i, p in enumerate(prompts)]
    return [f.result(timeout=60) for f in futures]


def _check(remote_bursts, engine, bursts, tag):
    for remote, prompts, name in zip(remote_bursts, bursts, ("cold", "warm"), strict=True):
        direct = _in_process(engine, prompts, f"{tag}-direct")
        for got, want in zip(remote, direct, strict=True):
            assert_same_result(got.result, want)
        cached = sum(r.result.cached_tokens for r in remote)
        assert (cached == 0) if name == "cold" else (cached > 0), (name, cached)


def test_sync_clients_at_concurrency_64_match_the_in_process_pipeline(engine, server):
    bursts = _bursts(seed=0)
    remote_bursts = []
    with PrefillClient(server.target) as client, ThreadPoolExecutor(64) as pool:
        for prompts in bursts:
            call = lambda p: client.prefill(p, cache_salt="sync-grpc", top_logprobs=TOP)
            remote_bursts.append(list(pool.map(call, prompts)))
    assert len({r.result.request_id for b in remote_bursts for r in b}) == 128
    _check(remote_bursts, engine, bursts, "sync")


def test_async_clients_at_concurrency_64_match_the_in_process_pipeline(engine, server):
    bursts = _bursts(seed=1)

    async def run():
        async with AsyncPrefillClient(server.target) as client:
            out = []
            for b, prompts in enumerate(bursts):
                calls = [
                    client.prefill(p, request_id=f"a{b}-{i}", cache_salt="async-grpc")
                    for i, p in enumerate(prompts)
                ]
                out.append(await asyncio.gather(*calls))  # all 64 in flight at once
            return out

    remote_bursts = asyncio.run(run())
    assert [r.result.request_id for r in remote_bursts[1]] == [f"a1-{i}" for i in range(64)]
    _check(remote_bursts, engine, bursts, "async")


def test_stream_and_load_report_the_pipeline(engine, server):
    prompts = _bursts(seed=2)[0][:8]
    requests = [
        build_request(p, request_id=f"st{i}", cache_salt="stream") for i, p in enumerate(prompts)
    ]
    requests.insert(3, build_request([VOCAB], request_id="bad"))
    with PrefillClient(server.target) as client:
        entries = {e.request_id: e for e in client.prefill_stream(requests)}
        load = client.load()
    assert entries["bad"].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert f"outside the vocabulary [0, {VOCAB})" in entries["bad"].error.message
    direct = _in_process(engine, prompts, "stream-direct")
    for i, want in enumerate(direct):
        assert entries[f"st{i}"].response.first_token_id == want.first_token_id
    assert [(s.stage, s.total_blocks, s.used_blocks) for s in load.stages] == [
        (0, BLOCKS, 0),
        (1, BLOCKS, 0),
    ]
    assert min(s.cached_blocks for s in load.stages) > 0


BAD = [
    (prefill_pb2.PrefillRequest(), "set token_ids or text"),
    (build_request([]), "prompt is empty"),
    (build_request([1, VOCAB + 5]), f"outside the vocabulary [0, {VOCAB})"),
    (build_request([1] * 257), "context is 256"),
    (build_request("hello"), "send token_ids"),
    (build_request([1, 2], top_logprobs=50), "maximum 20"),
]


def test_burst_of_bad_requests_leaves_every_stage_serving_and_intact(engine, server):
    with grpc.insecure_channel(server.target) as channel:
        stub = prefill_pb2_grpc.PrefillServiceStub(channel)

        def call(item):
            req, fragment = item
            try:
                stub.Prefill(req)
            except grpc.RpcError as exc:
                return exc.code(), fragment in exc.details()
            return grpc.StatusCode.OK, False

        with ThreadPoolExecutor(32) as pool:
            outcomes = list(pool.map(call, BAD * 20))
        assert set(outcomes) == {(grpc.StatusCode.INVALID_ARGUMENT, True)}
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE_NAME):
            status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        ok = stub.Prefill(build_request([3, 1, 4, 1, 5], cache_salt="after-burst"))
        assert (ok.prompt_tokens, ok.computed_tokens) == (5, 5)


def test_debug_service_checks_every_stage_and_counts_what_each_holds(engine):
    """``--debug-service``: CheckIntegrity runs check_integrity() on every stage and reports
    its blocks, KV WRITEs and leases (the soak's end-of-run leak check)."""
    from prefill_node.server.debug_servicer import IntegrityCheckable

    assert isinstance(engine, IntegrityCheckable)
    with (
        ServerThread(engine, pipeline_server_config(debug_service=True)) as srv,
        PrefillClient(srv.target) as client,
    ):
        client.prefill([7, 8, 9, 10, 11, 12, 13, 14, 15], cache_salt="debug-service")
        report = client.check_integrity()
    assert report.ok and report.error == "" and report.inflight_requests == 0
    assert [s.stage for s in report.stages] == [0, 1]
    assert all(s.used_blocks == 0 and s.cached_blocks >= 2 for s in report.stages)
    assert all((s.kv_held_blocks, s.kv_pushes, s.kv_leases) == (0, 0, 0) for s in report.stages)
    assert sum(s.free_blocks + s.cached_blocks for s in report.stages) == 2 * BLOCKS


def test_debug_service_is_not_served_unless_asked(server):
    with PrefillClient(server.target) as client, pytest.raises(grpc.RpcError) as err:
        client.check_integrity()
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
