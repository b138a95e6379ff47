"""The router in front of two real `wavepp serve` pipelines (2 stage processes each), all real
processes on loopback: prefix-aware placement with exact cached-token predictions, tenant
isolation by cache_salt, a pending burst sticking to one pipeline, results equal to the
pipeline's own, a client cancel, an Abort and a deadline stopping the pipeline part-way
(its blocks freed, less than the prompt computed), and SIGKILL failover."""

from __future__ import annotations

import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from prefill_node.client.prefill_client import PrefillClient, build_request
from prefill_node.model.loader_hf import save_hf_checkpoint
from prefill_node.model.weights import random_weights
from tests.grpc_harness import wait_until
from tests.router_harness import BS, MODEL, SYSTEM, serve, spawn, stop

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("tiny-router")
    save_hf_checkpoint(model_dir, MODEL, random_weights(MODEL, seed=3))
    pipelines = [serve(model_dir) for _ in range(2)]
    addresses = [f"127.0.0.1:{port}" for _, port in pipelines]
    # the bare cost model's predictions (no calibration by answers): a request with a short
    # deadline is admitted and must be stopped on the pipeline (test_router_overload.py has
    # calibration's own rejections)
    router, port, metrics = spawn(
        ["router", "--model", str(model_dir), *sum((["--pipeline", a] for a in addresses), []),
         "--host", "127.0.0.1", "--port", "0", "--metrics-host", "127.0.0.1", "--metrics-port",
         "0", "--poll-interval", "0.2", "--log-level", "WARNING", "--calibration-alpha", "0"],
        "wavepp router:",
    )  # fmt: skip
    client = PrefillClient(f"127.0.0.1:{port}")
    try:
        wait_until(lambda: _ready(client) == {a: True for a in addresses}, 60, "both ready")
        wait_until(client.is_ready, 10, "the router SERVING")
        yield {"client": client, "addresses": addresses, "pipelines": pipelines,
               "router": router, "metrics": metrics}  # fmt: skip
    finally:
        client.close()
        for proc in (router, *(p for p, _ in pipelines)):
            stop(proc)


def _ready(client: PrefillClient) -> dict[str, bool]:
    return {p.address: p.ready for p in client.load().pipelines}


def _indexed(client: PrefillClient) -> dict[str, int]:
    return {p.address: p.indexed_blocks for p in client.load().pipelines}


def _holders(addresses, prompt, salt="") -> list[int]:
    """Cached tokens each pipeline reports for ``prompt`` asked DIRECTLY (then it holds it)."""
    out = []
    for address in addresses:
        with PrefillClient(address) as direct:
            out.append(direct.prefill(prompt, cache_salt=salt).result.cached_tokens)
    return out


def _metric(port: int, name: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(name)}  # fmt: skip


def test_shared_prefix_lands_where_it_is_cached_and_the_prediction_is_exact(cluster):
    client = cluster["client"]
    first = client.prefill([*SYSTEM, 1, 2, 3], cache_salt="t-prefix").result
    assert first.cached_tokens == 0 and first.served_by in cluster["addresses"]
    # the pipeline's KV events reach the router's index: 16 blocks of the 67-token prompt
    wait_until(lambda: max(_indexed(client).values()) >= 16, 10, "the prefix indexed")
    for suffix in ([4, 5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17]):
        again = client.prefill([*SYSTEM, *suffix], cache_salt="t-prefix").result
        assert again.cached_tokens == len(SYSTEM)  # all 16 shared blocks reused
        assert again.served_by == first.served_by
    counts = _metric(cluster["metrics"], "wavepp_router_cached_tokens_total")
    predicted = sum(v for k, v in counts.items() if 'kind="predicted"' in k)
    actual = sum(v for k, v in counts.items() if 'kind="actual"' in k)
    assert predicted == actual > 0


def test_score_predicts_the_prefill_without_computing_or_reserving(cluster):
    client = cluster["client"]
    prompt = [*SYSTEM[1:], 7, 7, 7, 7, 7]  # 68 tokens, a prefix nobody holds
    cold = client.score(prompt, cache_salt="t-score")
    assert cold.cached_tokens == 0 and cold.prompt_tokens == 68 and cold.ready_pipelines == 2
    assert cold.pipeline_id in cluster["addresses"] and cold.prefill_s > 0
    assert client.score(prompt, cache_salt="t-score").cached_tokens == 0  # nothing pending
    served = client.prefill(prompt, cache_salt="t-score").result
    assert served.cached_tokens == 0
    wait_until(lambda: client.score(prompt, cache_salt="t-score").cached_tokens == 67, 10,
               "the prefix indexed")  # fmt: skip
    warm = client.score([*prompt, 1], cache_salt="t-score")
    assert (warm.pipeline_id, warm.cached_tokens) == (served.served_by, 68)
    assert warm.prefill_s < cold.prefill_s
    with PrefillClient(warm.pipeline_id) as direct, pytest.raises(grpc.RpcError) as err:
        direct.score(prompt)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_salts_never_share_and_a_burst_sticks_to_one_pipeline(cluster):
    client, addresses = cluster["client"], cluster["addresses"]
    prompt = [*SYSTEM[::-1], 3, 1]
    assert client.prefill(prompt, cache_salt="tenant-a").result.cached_tokens == 0
    assert client.prefill(prompt, cache_salt="tenant-b").result.cached_tokens == 0
    # a burst sharing a NEW prefix, all at once: pending entries keep it on one pipeline
    # (within the scorer's affinity slack: a few followers, each costing one more block)
    burst_prefix = [(3 * i + 2) % 64 for i in range(48)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(
            lambda i: client.prefill([*burst_prefix, i], cache_salt="burst").result, range(4)
        ))  # fmt: skip
    assert len(results) == 4
    held = _holders(addresses, [*burst_prefix, 63], salt="burst")
    assert sorted(held) == [0, 48]  # exactly one pipeline computed and holds the prefix


def test_results_through_the_router_equal_the_pipelines_own(cluster):
    client, addresses = cluster["client"], cluster["addresses"]
    prompt = [(11 * i + 7) % 64 for i in range(37)]
    request = build_request(prompt, request_id="eq", cache_salt="eq-router", top_logprobs=5)
    via_router = client._stub.Prefill(request, timeout=30)  # the router's fast path: bytes
    assert via_router.served_by in addresses and via_router.request_id == "eq"
    assert via_router.timings.server_seconds > 0  # the router's own, merged in
    with PrefillClient(via_router.served_by) as direct:  # the same pipeline, a fresh salt
        request.cache_salt = "eq-direct"
        own = direct._stub.Prefill(request, timeout=30)
    assert (via_router.prompt_tokens, via_router.cached_tokens) == (37, 0)
    for field in ("first_token_id", "prompt_tokens", "cached_tokens", "computed_tokens"):
        assert getattr(via_router, field) == getattr(own, field), field
    assert [e.token_id for e in via_router.top_logprobs] == [e.token_id for e in own.top_logprobs]
    for a, b in zip(via_router.top_logprobs, own.top_logprobs, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
    # manifests: everything but the block ids (a fresh salt allocates other blocks)
    assert len(via_router.stage_manifests) == len(own.stage_manifests) == 2
    for a, b in zip(via_router.stage_manifests, own.stage_manifests, strict=True):
        assert len(a.block_ids) == len(b.block_ids) > 0
        a.ClearField("block_ids")
        b.ClearField("block_ids")
        assert a == b
    # bad input gets the pipeline's typed status through the router
    with pytest.raises(grpc.RpcError) as err:
        client.prefill([64])  # vocab is 64
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# A long prompt: 480 tokens in waves of 16 are >= 30 waves of >= 10 ms each (the pipelines'
# --debug-wave-delay) on stage 0 alone, so it cannot finish within 0.3 s.
LONG = 480
FULL = LONG - 1  # what a later request finds cached had it run to the end (one to compute)


def test_client_cancel_through_the_router_stops_the_pipeline_part_way(cluster):
    client, addresses = cluster["client"], cluster["addresses"]
    long = [(13 * i + 5) % 64 for i in range(LONG)]
    call = client._stub.Prefill.future(build_request(long, cache_salt="cancel"), timeout=60)

    wait_until(lambda: _part_way(addresses, LONG), 10, "part-way through its pipeline")
    call.cancel()
    wait_until(lambda: _idle(addresses), 10, "the cancelled request's blocks freed on every stage")
    _assert_stopped_part_way(addresses, long, salt="cancel")


def test_stream_info_and_abort_through_the_router(cluster):
    client, addresses = cluster["client"], cluster["addresses"]
    info = client.server_info()
    assert info.router and not info.kv_events and info.block_size == BS
    with pytest.raises(grpc.RpcError) as err:
        next(iter(client.subscribe_kv_events(timeout_s=5)))
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "subscribe to its pipelines" in err.value.details()
    requests = [build_request([*SYSTEM, i], request_id=f"s{i}", cache_salt="stream")
                for i in range(3)]  # fmt: skip
    answers = list(client.prefill_stream(requests))
    assert sorted(a.request_id for a in answers) == ["s0", "s1", "s2"]
    assert all(a.WhichOneof("outcome") == "response" for a in answers)

    long = [(17 * i + 3) % 64 for i in range(LONG)]
    call = client._stub.Prefill.future(build_request(long, request_id="abort-me"), timeout=60)
    wait_until(lambda: _part_way(addresses, LONG), 10, "part-way through")
    assert client.abort("abort-me")
    with pytest.raises(grpc.RpcError) as err:
        call.result()
    assert err.value.code() == grpc.StatusCode.CANCELLED
    wait_until(lambda: _idle(addresses), 10, "the aborted request's blocks freed")
    _assert_stopped_part_way(addresses, long)


@pytest.mark.parametrize("via", ["request timeout", "call deadline"])
def test_a_deadline_through_the_router_stops_the_pipeline_part_way(cluster, via):
    """A request timeout travels in the request the router forwards; a call deadline the
    router must pass on as its own call's (or cancel that call when it passes)."""
    client, addresses = cluster["client"], cluster["addresses"]
    late = [(19 * i + len(via)) % 64 for i in range(LONG)]
    limit = {"timeout_s": 0.3} if via == "request timeout" else {"deadline_s": 0.3}
    with pytest.raises(grpc.RpcError) as err:
        client.prefill(late, cache_salt=via, **limit)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: _idle(addresses), 10, "the late request's blocks freed")
    _assert_stopped_part_way(addresses, late, salt=via)


def _part_way(addresses, prompt_tokens: int) -> bool:
    """A pipeline is running the prompt with at least half of it still to compute (>= 15
    waves of >= 10 ms: time enough for a cancel to arrive before it could end)."""
    loads = [PrefillClient(a).load() for a in addresses]
    return any(prompt_tokens // 2 <= load.inflight_tokens < prompt_tokens for load in loads)


def _idle(addresses) -> bool:
    loads = [PrefillClient(a).load() for a in addresses]
    idle = all(load.inflight_requests == 0 for load in loads)
    return idle and all(s.used_blocks == 0 for load in loads for s in load.stages)


def _assert_stopped_part_way(addresses, prompt, salt="") -> None:
    """Its pipeline computed some of the prompt and stopped: a chunk's blocks are cached as
    soon as every stage ran it, so asking again finds more than nothing and less than the
    whole prompt. Had the pipeline not been told, it would have run it to the end (FULL)."""
    held = _holders(addresses, prompt, salt)
    assert sorted(held)[0] == 0 and 0 < max(held) < FULL, held


def test_sigkill_of_a_pipeline_fails_over_and_the_router_stays_serving(cluster):
    client, addresses, pipelines = cluster["client"], cluster["addresses"], cluster["pipelines"]
    victim, _ = pipelines[0]
    victim.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    wait_until(lambda: not _ready(client)[addresses[0]], 5, "the dead pipeline dropped")
    assert time.monotonic() - killed < 2.0
    assert _indexed(client)[addresses[0]] == 0
    assert client.is_ready()
    for i in range(4):
        result = client.prefill([*SYSTEM, 40 + i], cache_salt="after-kill").result
        assert result.prompt_tokens == len(SYSTEM) + 1
