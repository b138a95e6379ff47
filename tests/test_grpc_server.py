"""A real grpc.aio server on loopback serving a real 2-stage LocalEngine (tiny random model):
results equal the in-process engine at concurrency 64, streams, text prompts, health,
reflection, load, metrics and the KV-event stream."""

from __future__ import annotations

import asyncio
import random
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tokenizers import Tokenizer as Backend
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from prefill_node.client.prefill_client import (
    SERVICE_NAME,
    AsyncPrefillClient,
    PrefillClient,
    build_request,
)
from prefill_node.core.kv_events import BlockRemoved, BlockStored
from prefill_node.engine.types import KVPullDestination, PrefillOptions
from prefill_node.model.tokenizer import Tokenizer
from prefill_node.server.kv_event_hub import KVEventHub
from prefill_node.server.server import ServerConfig
from tests.grpc_harness import (
    ServerThread,
    assert_same_result,
    stage_used_blocks,
    tiny_local_engine,
    wait_until,
)
from wavepp_proto.prefill.v1 import kv_events_pb2, prefill_pb2, prefill_pb2_grpc

VOCAB = 61


@pytest.fixture
def engine():
    eng = tiny_local_engine()
    yield eng
    eng.shutdown()


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 24))] for _ in range(n)]


def _direct(prompts, top_logprobs=5):
    """The same prompts on a fresh identical engine, called in-process."""
    reference = tiny_local_engine()
    try:
        return [
            reference.submit(p, PrefillOptions(top_logprobs=top_logprobs)).result() for p in prompts
        ]
    finally:
        reference.shutdown()


def test_sync_clients_at_concurrency_64_match_the_engine(engine):
    prompts = _prompts(64, seed=0)
    pool = ThreadPoolExecutor(64)
    with ServerThread(engine) as srv, PrefillClient(srv.target) as client, pool:
        remote = list(pool.map(lambda p: client.prefill(p, top_logprobs=3), prompts))
    for got, want in zip(remote, _direct(prompts, top_logprobs=3), strict=True):
        assert_same_result(got.result, want)
    assert len({r.result.request_id for r in remote}) == len(prompts)
    engine.check_integrity()
    assert stage_used_blocks(engine) == [0, 0]


def test_async_clients_at_concurrency_64_match_the_engine(engine):
    prompts = _prompts(64, seed=1)

    async def run(target):
        async with AsyncPrefillClient(target) as client:
            slots = asyncio.Semaphore(64)

            async def one(i, p):
                async with slots:
                    return await client.prefill(p, request_id=f"async-{i}")

            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    with ServerThread(engine) as srv:
        remote = asyncio.run(run(srv.target))
    for got, want in zip(remote, _direct(prompts), strict=True):
        assert_same_result(got.result, want)
    assert [r.result.request_id for r in remote] == [f"async-{i}" for i in range(len(prompts))]
    engine.check_integrity()


def test_stream_carries_many_requests_and_survives_a_bad_one(engine):
    prompts = _prompts(12, seed=2)
    requests = [build_request(p, request_id=f"s{i}") for i, p in enumerate(prompts)]
    requests.insert(5, build_request([], request_id="bad"))
    with ServerThread(engine) as srv, PrefillClient(srv.target) as client:
        entries = list(client.prefill_stream(requests))
    by_id = {e.request_id: e for e in entries}
    assert len(entries) == 13
    assert by_id["bad"].WhichOneof("outcome") == "error"
    assert by_id["bad"].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "prompt is empty" in by_id["bad"].error.message
    for i, want in enumerate(_direct(prompts)):
        assert by_id[f"s{i}"].response.first_token_id == want.first_token_id
    engine.check_integrity()


def test_text_prompt_is_tokenised_on_the_server_with_the_chat_template(engine):
    words = ["<unk>", "<|user|>", "<|assistant|>", "what", "is", "the", "capital", "of", "france"]
    words.append("<|system|>")
    backend = Backend(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    backend.add_special_tokens(["<|user|>", "<|assistant|>", "<|system|>"])
    template = (
        "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    tokenizer = Tokenizer(backend, {"chat_template": template})
    text = "what is the capital of france"
    with ServerThread(engine, tokenizer=tokenizer) as srv, PrefillClient(srv.target) as client:
        plain = client.prefill(text)
        chat = client.prefill(text, chat=True)
        system = client.prefill(text, chat=True, system="france")
        with pytest.raises(grpc.RpcError) as err:
            client.prefill(text, system="france")  # a system prompt only fits a chat
        assert client.server_info().chat_template is True
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "system_prompt needs text.apply_chat_template" in err.value.details()
    assert plain.prompt_token_ids == (3, 4, 5, 6, 7, 8)
    assert chat.prompt_token_ids == (1, 3, 4, 5, 6, 7, 8, 2)
    assert system.prompt_token_ids == (9, 8, 1, 3, 4, 5, 6, 7, 8, 2)
    assert chat.result.prompt_tokens == 8
    want = _direct([list(chat.prompt_token_ids)])[0]
    assert chat.result.first_token_id == want.first_token_id


def test_health_reflection_and_load(engine):
    with ServerThread(engine) as srv, grpc.insecure_channel(srv.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE_NAME):
            status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        req = reflection_pb2.ServerReflectionRequest(list_services="")
        answer = next(iter(refl.ServerReflectionInfo(iter([req]))))
        names = {s.name for s in answer.list_services_response.service}
        assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names
        with PrefillClient(srv.target) as client:
            client.prefill(list(range(12)))
            load = client.load()
    assert [s.stage for s in load.stages] == [0, 1]
    assert [(s.total_blocks, s.cached_blocks, s.used_blocks) for s in load.stages] == [
        (256, 3, 0),
        (256, 3, 0),
    ]
    assert load.queue_depth == 0 and load.inflight_requests == 0


def test_health_goes_not_serving_when_the_engine_reports_unhealthy(engine):
    with ServerThread(engine) as srv, grpc.insecure_channel(srv.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        status = lambda s: health.Check(health_pb2.HealthCheckRequest(service=s)).status
        assert status(SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING
        engine.shutdown()
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        wait_until(lambda: status(SERVICE_NAME) == not_serving, what="readiness")
        assert status("") == not_serving  # shut down: not live either
        with pytest.raises(grpc.RpcError) as err:
            PrefillClient(srv.target).prefill([1, 2, 3])
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "engine shut down" in err.value.details()


def test_metrics_endpoint_counts_outcomes_and_exports_stage_blocks(engine):
    config = ServerConfig(host="127.0.0.1", port=0, metrics_host="127.0.0.1", metrics_port=0)
    with ServerThread(engine, config) as srv, PrefillClient(srv.target) as client:
        client.prefill([1, 2, 3, 4, 5])
        client.prefill([1, 2, 3, 4, 5, 6])
        with pytest.raises(grpc.RpcError):
            client.prefill([1000])
        url = f"http://127.0.0.1:{srv.server.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    assert 'wavepp_requests_total{outcome="ok"} 2.0' in text
    assert 'wavepp_requests_total{outcome="invalid_argument"} 1.0' in text
    assert 'wavepp_prompt_tokens_total{kind="cached"} 4.0' in text
    assert 'wavepp_prompt_tokens_total{kind="computed"} 7.0' in text
    assert "wavepp_ttft_seconds_count 2.0" in text
    assert 'wavepp_stage_blocks{stage="1",state="cached"} 1.0' in text
    assert 'wavepp_stage_blocks{stage="1",state="free"} 255.0' in text
    assert 'wavepp_admission_conflicts_total{kind="lease"} 0.0' in text
    assert 'wavepp_stage_wide_layers_total{stage="1"} 0.0' in text


def test_kv_event_subscription_streams_published_events(engine):
    hub = KVEventHub("pipeline-a")
    stored = BlockStored((11, 12), None, tuple(range(8)), 4)
    with ServerThread(engine, kv_events=hub) as srv, grpc.insecure_channel(srv.target) as ch:
        stream = prefill_pb2_grpc.PrefillServiceStub(ch).SubscribeKvEvents(
            kv_events_pb2.SubscribeKvEventsRequest()
        )
        first = next(stream)
        hub.publish([stored, BlockRemoved((12,))])
        second = next(stream)
        stream.cancel()
        wait_until(lambda: hub.subscriber_count == 0, what="unsubscribe")
    assert (first.sequence, first.events[0].WhichOneof("event")) == (1, "cleared")
    assert second.sequence == 2 and second.pipeline_id == "pipeline-a"
    assert list(second.events[0].stored.block_hashes) == [11, 12]
    assert not second.events[0].stored.HasField("parent_block_hash")
    assert list(second.events[1].removed.block_hashes) == [12]


def test_kv_destination_reaches_the_engine_options(engine):
    seen = []
    submit = engine.submit
    engine.submit = lambda ids, opts: seen.append(opts) or submit(ids, opts)
    with ServerThread(engine) as srv, PrefillClient(srv.target) as client:
        try:
            client.prefill([1, 2, 3], kv_destination=KVPullDestination(lease_ttl_s=2.5))
        except grpc.RpcError as exc:  # an engine without KV hand-off rejects it, and says so
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "kv_destination" in exc.details()
    assert seen[0].kv_destination == KVPullDestination(lease_ttl_s=2.5)


def test_request_round_trips_the_wire_format():
    req = build_request([1, 2], request_id="x", top_logprobs=0, timeout_s=1.5)
    back = prefill_pb2.PrefillRequest.FromString(req.SerializeToString())
    assert back.HasField("top_logprobs") and back.top_logprobs == 0
    assert back.timeout.ToNanoseconds() == 1_500_000_000


def test_server_info_and_remote_engine_behave_like_the_engine(engine):
    from prefill_node.client.remote_engine import RemoteEngine
    from prefill_node.errors import DeadlineExceededError, InvalidRequestError

    config = ServerConfig(host="127.0.0.1", port=0, model_name="tiny-grpc")
    with ServerThread(engine, config) as srv:
        remote = RemoteEngine(srv.target)
        try:
            assert remote.info.model_name == "tiny-grpc" and remote.info.num_stages == 2
            assert (remote.vocab_size, remote.max_model_len) == (VOCAB, 64)
            assert remote.info.text_prompts is False
            prompt = [3, 1, 4, 1, 5, 9, 2, 6]
            got = remote.submit(prompt, PrefillOptions(request_id="re-1")).result(10)
            assert_same_result(got, _direct([prompt])[0])
            with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
                remote.submit([VOCAB], PrefillOptions()).result(10)
            slow = PrefillOptions(deadline_s=0.0)  # already passed: the call's deadline expires
            with pytest.raises(DeadlineExceededError, match="DEADLINE_EXCEEDED"):
                remote.submit(prompt, slow).result(10)
            assert remote.health().ready and remote.load().stages[1].stage == 1
        finally:
            remote.shutdown()


def test_debug_service_needs_an_engine_that_can_check_its_stages():
    from prefill_node.server.server import PrefillServer, ServerConfig
    from tests.grpc_toy_engine import ToyEngine

    with pytest.raises(ValueError, match="cannot check its stages"):
        PrefillServer(ToyEngine(), ServerConfig(port=0, debug_service=True))
