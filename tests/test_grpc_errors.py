"""Every bad input gets its status and a message saying what to fix; the server stays healthy
after a burst of failures; deadlines and cancels free the request's blocks.

Bad inputs, bursts, deadline and cancel run against the real 2-stage LocalEngine (slowed
stages for timing, assertions on its real caches). The message-size / concurrency limits and
a cancelled stream use the threaded ToyEngine (exact control over what is held when). The
same abort paths on the real multi-process pipeline - client cancel, deadlines, the Abort
RPC, cancelled streams, a killed stage - are in test_grpc_pipeline_abort.py and
test_grpc_pipeline_failure.py."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefill_node.client.prefill_client import SERVICE_NAME, AsyncPrefillClient, PrefillClient
from prefill_node.server.server import ServerConfig
from tests.grpc_harness import ServerThread, stage_used_blocks, tiny_local_engine, wait_until
from tests.grpc_toy_engine import ToyEngine
from wavepp_proto.prefill.v1 import kv_layout_pb2, prefill_pb2, prefill_pb2_grpc

INVALID = grpc.StatusCode.INVALID_ARGUMENT


def _push(**overrides) -> kv_layout_pb2.KvDestination:
    push = kv_layout_pb2.KvPushDestination(
        agent_name="decode-0",
        metadata_endpoint="127.0.0.1:5555",
        block_ids=[7, 8],
        layout=kv_layout_pb2.KvLayout(
            block_size=4, num_kv_heads=2, head_dim=8, dtype=kv_layout_pb2.KV_DTYPE_FLOAT32
        ),
    )
    for key, value in overrides.items():
        if key == "layout":
            push.ClearField("layout")
        elif isinstance(value, list):
            push.ClearField(key)
            getattr(push, key).extend(value)
        else:
            setattr(push, key, value)
    return kv_layout_pb2.KvDestination(push=push)


def _req(ids=(1, 2, 3, 4, 5), **fields) -> prefill_pb2.PrefillRequest:
    req = prefill_pb2.PrefillRequest(**fields)
    if ids is not None:
        req.token_ids.ids.extend(ids)
    return req


BAD_REQUESTS = {
    "empty prompt": (_req(ids=[]), INVALID, "prompt is empty"),
    "no prompt": (_req(ids=None), INVALID, "set token_ids or text"),
    "token outside vocab": (_req(ids=[1, 61]), INVALID, "outside the vocabulary [0, 61)"),
    "prompt too long": (_req(ids=[1] * 65), INVALID, "context is 64"),
    "text without tokenizer": (
        prefill_pb2.PrefillRequest(text=prefill_pb2.TextPrompt(text="hi")),
        INVALID,
        "send token_ids",
    ),
    "top_logprobs too high": (_req(top_logprobs=21), INVALID, "maximum 20"),
    "push without agent": (_req(kv_destination=_push(agent_name="")), INVALID, "agent_name"),
    "push bad endpoint": (
        _req(kv_destination=_push(metadata_endpoint="nohost")),
        INVALID,
        "not 'host:port'",
    ),
    "push wrong block count": (
        _req(kv_destination=_push(block_ids=[1, 2, 3])),
        INVALID,
        "needs 2 decode blocks",
    ),
    "push duplicate blocks": (
        _req(kv_destination=_push(block_ids=[4, 4])),
        INVALID,
        "repeats a block id",
    ),
    "push without layout": (_req(kv_destination=_push(layout=None)), INVALID, "layout"),
    "never fits": (
        _req(ids=[1] * 64),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "needs 16 blocks of 4 tokens; stage 0 has only 12",
    ),
}


@pytest.fixture
def engine():
    eng = tiny_local_engine(num_blocks=12)
    yield eng
    eng.shutdown()


@pytest.fixture
def slow_engine():
    """Every stage sleeps 150 ms per wave: a 64-token prompt (4 waves of 16 tokens,
    pipelined over 2 stages) takes ~0.75 s, well past a 0.4 s deadline."""
    eng = tiny_local_engine(num_blocks=32, stage_delay_s=0.15)
    yield eng
    eng.shutdown()


@pytest.fixture
def toy_engine():
    eng = ToyEngine(stages=2, num_blocks=12, block_size=4, vocab_size=61, max_model_len=64)
    eng.compute_s = 30.0
    yield eng
    eng.shutdown()


def test_each_bad_input_gets_its_status_and_message(engine):
    with ServerThread(engine) as srv, grpc.insecure_channel(srv.target) as channel:
        stub = prefill_pb2_grpc.PrefillServiceStub(channel)
        for name, (req, code, fragment) in BAD_REQUESTS.items():
            with pytest.raises(grpc.RpcError) as err:
                stub.Prefill(req)
            assert err.value.code() == code, name
            assert fragment in err.value.details(), (name, err.value.details())
        with pytest.raises(grpc.RpcError) as err:
            stub.Abort(prefill_pb2.AbortRequest())
        assert err.value.code() == INVALID


def test_server_stays_healthy_after_a_burst_of_bad_requests(engine):
    burst = [req for req, _, _ in BAD_REQUESTS.values()] * 20
    with ServerThread(engine) as srv, grpc.insecure_channel(srv.target) as channel:
        stub = prefill_pb2_grpc.PrefillServiceStub(channel)

        def call(req):
            try:
                stub.Prefill(req)
            except grpc.RpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

        with ThreadPoolExecutor(32) as pool:
            codes = list(pool.map(call, burst))
        assert grpc.StatusCode.OK not in codes and grpc.StatusCode.INTERNAL not in codes
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE_NAME):
            status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        assert stub.Prefill(_req()).prompt_tokens == 5
    engine.check_integrity()
    assert stage_used_blocks(engine) == [0, 0]


def test_deadline_mid_flight_frees_the_real_engine_blocks(slow_engine):
    prompt = list(range(1, 61)) + [1, 2, 3, 4]
    with ServerThread(slow_engine) as srv, PrefillClient(srv.target) as client:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(client.prefill, prompt, timeout_s=0.4)
            wait_until(lambda: stage_used_blocks(slow_engine) == [16, 16], what="admission")
            with pytest.raises(grpc.RpcError) as err:
                pending.result(10)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "missed its deadline of 0.400s" in err.value.details()
        wait_until(lambda: stage_used_blocks(slow_engine) == [0, 0], what="blocks freed")
        with pytest.raises(grpc.RpcError) as err:
            client.prefill(prompt, deadline_s=0.4)  # the gRPC call deadline, same path
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_until(lambda: stage_used_blocks(slow_engine) == [0, 0], what="blocks freed")
        assert client.prefill([1, 2, 3]).result.prompt_tokens == 3  # still serving
    slow_engine.check_integrity()


def test_client_cancel_leaves_no_blocks_held_on_the_real_engine(slow_engine):
    async def run(target):
        async with AsyncPrefillClient(target) as client:
            call = client.prefill_call(list(range(1, 61)), request_id="c1")
            used = lambda: stage_used_blocks(slow_engine)
            await asyncio.to_thread(wait_until, lambda: used() == [15, 15], what="admission")
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            await asyncio.to_thread(wait_until, lambda: used() == [0, 0], what="blocks freed")

    with ServerThread(slow_engine) as srv:
        asyncio.run(run(srv.target))
        wait_until(lambda: _outcome(srv, "cancelled") == 1, what="cancel metric")
    slow_engine.check_integrity()


def test_cancelling_a_stream_aborts_all_its_requests(toy_engine):
    with ServerThread(toy_engine) as srv, grpc.insecure_channel(srv.target) as channel:
        stub = prefill_pb2_grpc.PrefillServiceStub(channel)
        call = stub.PrefillStream(iter([_req(request_id=f"s{i}") for i in range(4)]))
        wait_until(lambda: toy_engine.load().inflight_requests == 4, what="4 submitted")
        call.cancel()
        wait_until(lambda: toy_engine.load().inflight_requests == 0, what="all aborted")
    assert toy_engine.used_blocks() == 0
    toy_engine.check_integrity()


def _outcome(srv: ServerThread, outcome: str) -> float:
    return srv.server.metrics.registry.get_sample_value(
        "wavepp_requests_total", {"outcome": outcome}
    )


def test_message_size_and_concurrency_limits_answer_resource_exhausted(toy_engine):
    config = ServerConfig(
        host="127.0.0.1", port=0, max_message_bytes=2048, max_concurrent_rpcs=1, health_poll_s=1
    )
    with ServerThread(toy_engine, config) as srv, PrefillClient(srv.target) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.prefill([100_000] * 1000)  # 3-byte varints: ~3 KB > 2048 bytes
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(client.prefill, [1, 2, 3], request_id="holder")
            wait_until(lambda: toy_engine.used_blocks() == 1, what="admission")
            with pytest.raises(grpc.RpcError) as err:
                client.prefill([4, 5, 6])
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            with pytest.raises(grpc.RpcError):  # the limit covers every method, Abort too
                client.abort("holder")
            toy_engine.abort("holder")
            assert pending.exception(5).code() == grpc.StatusCode.CANCELLED
