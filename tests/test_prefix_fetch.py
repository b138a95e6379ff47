"""A pipeline fetches a prefix another pipeline holds, stage by stage over NIXL.

Two in-process pipelines, each stage with its own NIXL agent. Pipeline A computes a prefix
and leases its cached blocks (``lend_prefix``: one control round, nothing queued); pipeline
B's stages READ their layers of them (``fetch_prefix``) and cache the blocks as if
computed.
Checked: the fetched KV is bit-identical to A's, B's next request on that prefix reuses it
and its logits equal a cold prefill's (fp32 within 1e-4); block sizes and layer splits may
differ; a source gone or a lease expired before the copy leaves B holding nothing of it
(the request computes the prefix, exactly); A's leases end, and both pipelines' integrity
checks pass, after every test.
"""

from __future__ import annotations

import contextlib
import random
import time
from dataclasses import replace

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from prefill_node.client.prefill_client import PrefillClient, build_request
from prefill_node.core.cost_model import ChunkCostModel
from prefill_node.core.hashing import ExtraKeys
from prefill_node.core.request import PromptBlocks, RequestSpec
from prefill_node.engine.types import PrefillOptions
from prefill_node.errors import InvalidRequestError
from prefill_node.kv_handoff.config import KVHandoffConfig
from prefill_node.model.loader_hf import save_hf_checkpoint
from prefill_node.model.reference import reference_forward
from prefill_node.model.weights import random_weights
from prefill_node.runtime.dist_env import free_local_port as free_port
from prefill_node.runtime.engine_config import EngineConfig
from prefill_node.runtime.local_engine import LocalEngine
from prefill_node.server.kv_event_hub import KVEventHub
from prefill_node.server.server import ServerConfig
from prefill_router.calibration import CalibrationConfig
from prefill_router.discovery import StaticDiscovery
from prefill_router.router_engine import RouterConfig, RouterEngine
from prefill_router.scoring import RoutingPolicy
from prefill_router.transfer import TransferModel
from tests.grpc_harness import ServerThread, wait_until
from tests.router_harness import MODEL as ROUTER_MODEL
from tests.router_harness import serve, stop
from tests.tiny_models import tiny_llama
from wavepp_proto.prefill.v1 import prefill_pb2, prefill_pb2_grpc

pytestmark = pytest.mark.slow

CONFIG = tiny_llama("tiny-llama")
WEIGHTS = random_weights(CONFIG, seed=0)
HANDOFF = KVHandoffConfig(transfer_timeout_s=5.0, handshake_timeout_s=1.0, lease_ttl_s=5.0)


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(CONFIG.vocab_size) for _ in range(length)]


def engine(block_size: int, layers: tuple[tuple[int, int], ...], num_blocks: int = 40):
    config = EngineConfig(
        stages=len(layers),
        num_blocks=num_blocks,
        block_size=block_size,
        max_wave_tokens=16,
        layer_ranges=layers,
        kv_handoff=HANDOFF,
    )
    return LocalEngine.from_weights(CONFIG, WEIGHTS, config)


def used_blocks(e: LocalEngine) -> list[int]:
    return [stage.used_blocks for stage in e.load().stages]


def wait_idle(e: LocalEngine, timeout_s: float = 5.0) -> None:
    """No block pinned and no lease held anywhere (leases end asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while any(used_blocks(e)) or any(e.kv_held_blocks()):
        assert time.monotonic() < deadline, (used_blocks(e), e.kv_held_blocks())
        time.sleep(0.01)
    e.check_integrity()


def cached_kv(e: LocalEngine, tokens: list[int], salt: str | None = None) -> torch.Tensor | None:
    """The KV of every layer of ``tokens`` (whole blocks) as the pipeline's caches hold it,
    ``[layers, 2, tokens, heads, dim]``, or None when a block is not cached on every stage."""
    layers = []
    for stage in e.stages:
        size = stage.spec.block_size
        extra = ExtraKeys(e.model_id, salt)
        prompt = PromptBlocks(RequestSpec("probe", tuple(tokens), extra), size)
        ids, parent = [], None
        for block_hash, block_tokens in zip(prompt.hashes, prompt.token_blocks, strict=True):
            block = stage.admission.pool.lookup(block_hash, parent, block_tokens, extra)
            if block is None:
                return None
            ids.append(block.block_id)
            parent = block_hash
        for tensor in stage.kv.tensors:
            blocks = tensor[torch.tensor(ids)]  # [blocks, 2, size, heads, dim]
            layers.append(blocks.transpose(0, 1).reshape(2, -1, *blocks.shape[3:]))
    return torch.stack(layers)


def lease_prefix(source: LocalEngine, prefix: list[int], ttl_s: float | None = None):
    """What a fetching pipeline gets from the source: every stage's lease on its cached run
    of the prefix's blocks (``lend_prefix``, the LeasePrefix RPC's engine call), after A
    computed it (when not cached there yet)."""
    source.submit([*prefix, 0], PrefillOptions()).result(timeout=30)
    manifests = source.lend_prefix(prefix, None, ttl_s)
    assert manifests, "the source holds the prefix on every stage"
    return manifests


SAME = (4, ((0, 2), (2, 4)))  # block size, layer split


@contextlib.contextmanager
def pipelines(*shapes):
    """In-process pipelines of these shapes; shut down, then checked, on the way out."""
    engines = [engine(*shape) for shape in shapes]
    try:
        yield engines
    finally:
        for e in engines:
            e.shutdown()
    for e in engines:
        e.check_integrity()


def prefill_exactly(e: LocalEngine, prompt: list[int], cached: int) -> None:
    """``prompt`` reuses ``cached`` tokens and its logits equal the reference forward's."""
    got = e.prefill(prompt, PrefillOptions())
    want, _ = reference_forward(CONFIG, WEIGHTS, prompt)
    assert got.result.cached_tokens == cached
    assert got.result.computed_tokens == len(prompt) - cached
    torch.testing.assert_close(got.logits, want.float(), atol=1e-4, rtol=1e-4)
    wait_idle(e)


@pytest.mark.parametrize(
    "source_shape, target_shape",
    [
        (SAME, SAME),
        (SAME, (8, ((0, 1), (1, 4)))),  # other block size, other split
        ((8, ((0, 3), (3, 4))), (4, ((0, 4),))),  # one stage reading from two
    ],
    ids=["same", "block-size-and-split", "one-stage"],
)
def test_fetched_prefix_is_the_sources_kv_and_is_reused(source_shape, target_shape):
    prefix, suffix = prompt_of(48, seed=1), prompt_of(7, seed=2)
    with pipelines(source_shape, target_shape) as (a, b):
        a.submit(prefix + suffix, PrefillOptions()).result(timeout=30)  # A computed it
        manifests = lease_prefix(a, prefix)
        assert all(m.lease_id for m in manifests)

        fetched = b.fetch_prefix(prefix, None, manifests)

        assert fetched.ok, fetched.errors
        size = target_shape[0]
        assert fetched.copied_blocks == (len(prefix) // size,) * len(target_shape[1])
        assert fetched.bytes_read > 0 and fetched.read_s > 0
        assert torch.equal(cached_kv(b, prefix), cached_kv(a, prefix))  # bit-identical
        wait_idle(a)  # B released A's leases
        wait_idle(b)
        prefill_exactly(b, prefix + suffix, cached=len(prefix))


def test_a_stage_fetches_only_what_it_lacks():
    prefix = prompt_of(32, seed=3)
    with pipelines(SAME, SAME) as (a, b):
        b.submit(prefix[:16] + [1], PrefillOptions()).result(timeout=30)  # B holds 4 blocks
        fetched = b.fetch_prefix(prefix, None, lease_prefix(a, prefix))
        assert fetched.copied_blocks == (4, 4)
        assert torch.equal(cached_kv(b, prefix), cached_kv(a, prefix))
        again = b.fetch_prefix(prefix, None, lease_prefix(a, prefix))  # B holds it all
        assert again.copied_blocks == (0, 0) and again.bytes_read == 0 and again.ok
        assert again.skipped == ("held", "held")
        wait_idle(a)
        wait_idle(b)


def test_source_gone_before_the_copy_caches_nothing_and_the_request_computes():
    prefix, suffix = prompt_of(32, seed=4), prompt_of(5, seed=5)
    with pipelines(SAME, SAME) as (a, b):
        manifests = lease_prefix(a, prefix)
        a.shutdown()  # its agents and leases are gone
        fetched = b.fetch_prefix(prefix, None, manifests)
        assert not fetched.ok and len(fetched.errors) == 2
        assert fetched.copied_blocks == (0, 0)
        assert cached_kv(b, prefix) is None
        wait_idle(b)
        prefill_exactly(b, prefix + suffix, cached=0)


def test_an_expired_lease_is_never_read():
    """After its lease expired the source may reuse the blocks: B must not read them."""
    prefix = prompt_of(32, seed=6)
    with pipelines(SAME, SAME) as (a, b):
        manifests = lease_prefix(a, prefix, ttl_s=0.3)
        wait_idle(a)  # expired: A unpinned the blocks
        fetched = b.fetch_prefix(prefix, None, manifests)
        assert not fetched.ok and all("expire" in e for e in fetched.errors)
        assert fetched.copied_blocks == (0, 0) and fetched.bytes_read == 0
        assert cached_kv(b, prefix) is None
        wait_idle(b)


def test_bad_fetches_are_refused_before_any_stage_moves():
    prefix = prompt_of(32, seed=7)
    with pipelines(SAME, SAME) as (a, b):
        manifests = lease_prefix(a, prefix)
        with pytest.raises(InvalidRequestError, match="whole 4-token blocks"):
            b.fetch_prefix(prefix[:30], None, manifests)
        with pytest.raises(InvalidRequestError, match="fewer tokens"):
            b.fetch_prefix(prefix + prompt_of(8, seed=8), None, manifests)
        # a prefix under another tenant's salt is cached under that salt only
        fetched = b.fetch_prefix(prefix, "tenant-b", manifests)
        assert fetched.ok
        assert cached_kv(b, prefix) is None
        assert torch.equal(cached_kv(b, prefix, "tenant-b"), cached_kv(a, prefix))
        wait_idle(a)
        wait_idle(b)


# ---- over the prefill API: a request's prefix_source ------------------------------------


def fetch_request(prompt: list[int], source: str, count: int, **kw):
    request = build_request(prompt, top_logprobs=3, **kw)
    request.prefix_source.address = source
    request.prefix_source.num_tokens = count
    return request


@contextlib.contextmanager
def channel(target: str):
    with grpc.insecure_channel(target) as chan:
        yield prefill_pb2_grpc.PrefillServiceStub(chan)


def fetch_counts(server: ServerThread) -> dict[str, int]:
    return dict(server.server.metrics.fetches)


def test_prefix_source_copies_the_prefix_before_the_prefill():
    prefix, suffix = prompt_of(40, seed=9), prompt_of(6, seed=10)
    with (
        pipelines(SAME, (8, ((0, 1), (1, 4)))) as (a, b),
        ServerThread(a) as sa,
        ServerThread(b) as sb,
        channel(sb.target) as client,
    ):
        a.submit(prefix + [3], PrefillOptions()).result(timeout=30)  # A holds the prefix
        cold = a.prefill(prefix + suffix, PrefillOptions(cache_salt="cold"))

        answer = client.Prefill(fetch_request(prefix + suffix, sa.target, 40))

        assert answer.fetched_tokens == 40 and answer.timings.fetch_seconds > 0
        assert answer.cached_tokens == 40 and answer.computed_tokens == len(suffix)
        assert answer.first_token_id == int(cold.logits.argmax())
        assert fetch_counts(sb)["copied"] == 1
        assert torch.equal(cached_kv(b, prefix), cached_kv(a, prefix))

        again = client.Prefill(fetch_request(prefix + suffix, sa.target, 40))
        assert again.fetched_tokens == 0 and again.cached_tokens == 40
        assert fetch_counts(sb)["held"] == 1

        # a source that is gone: counted, logged, and the request computes its prefix
        other = prompt_of(24, seed=11)
        lost = client.Prefill(fetch_request(other, f"127.0.0.1:{free_port()}", 16))
        assert lost.fetched_tokens == 0 and lost.cached_tokens == 0
        assert fetch_counts(sb)["failed"] == 1

        with pytest.raises(grpc.RpcError) as err:  # a lease on no tokens at all
            client.LeasePrefix(prefill_pb2.LeasePrefixRequest())
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT

        # the caller's mistakes are INVALID_ARGUMENT, and nothing was asked of A
        for count in (12, len(other), 0):
            with pytest.raises(grpc.RpcError) as err:
                client.Prefill(fetch_request(other, sa.target, count))
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "prefix_source" in err.value.details()
        wait_idle(a)
        wait_idle(b)


def test_a_source_serving_another_model_is_never_read():
    prefix = prompt_of(32, seed=12)
    other = LocalEngine.from_weights(
        tiny_llama("another-model"),
        WEIGHTS,
        EngineConfig(stages=1, num_blocks=40, block_size=4, kv_handoff=HANDOFF),
    )
    try:
        with (
            pipelines(SAME) as (b,),
            ServerThread(other) as so,
            ServerThread(b) as sb,
            channel(sb.target) as client,
        ):
            other.submit(prefix + [1], PrefillOptions()).result(timeout=30)
            answer = client.Prefill(fetch_request(prefix + [2, 3], so.target, 32))
            assert answer.fetched_tokens == 0 and answer.cached_tokens == 0
            assert fetch_counts(sb) == {"copied": 0, "held": 0, "no_room": 0, "failed": 1}
            wait_until(lambda: other.kv_held_blocks() == (0,), 5, "its lease released")
            wait_idle(b)
    finally:
        other.shutdown()


# ---- through the router: the fetch policy places a fetch and learns its cost -----------


def pipeline_with_events(name: str, wave_delay_s: float = 0.0):
    hub = KVEventHub(name)
    config = EngineConfig(
        stages=2,
        num_blocks=80,
        block_size=4,
        max_wave_tokens=16,
        kv_handoff=HANDOFF,
        debug_wave_delay_s=wave_delay_s,
    )
    return LocalEngine.from_weights(CONFIG, WEIGHTS, config, kv_events=hub.publish), hub


def indexed(router: RouterEngine, address: str) -> int:
    return next(p.indexed_blocks for p in router.load().pipelines if p.address == address)


def test_the_fetch_policy_copies_a_busy_pipelines_prefix_to_an_idle_one():
    """A holds the prefix and is busy with a long request the router placed there; the
    router's cost model (per token 1 ms, set high so the choice is deterministic) says
    copying the prefix to idle B (the transfer prior: 20 ms + 10 us per block) beats both
    waiting for A and computing it on B, while the long request itself stays on A (idle
    then: a fetch would only add its 20 ms)."""
    prefix, long_tail, short_tail = prompt_of(64, 13), prompt_of(160, 14), prompt_of(6, 15)
    a, hub_a = pipeline_with_events("a", wave_delay_s=0.2)  # the long one: >= 2 s
    b, hub_b = pipeline_with_events("b")
    try:
        with (
            ServerThread(a, kv_events=hub_a) as sa,
            ServerThread(b, kv_events=hub_b) as sb,
            channel(sa.target) as to_a,
        ):
            router = RouterEngine(
                StaticDiscovery([sa.target, sb.target]),
                RouterConfig(
                    policy=RoutingPolicy.FETCH,
                    cost_model=ChunkCostModel(per_token_s=1e-3, per_token_context_s=0.0),
                    calibration=CalibrationConfig(alpha=0.0),
                    transfer=TransferModel(20e-3, 1e-5),
                ),
            )
            router.start()
            config = ServerConfig(host="127.0.0.1", port=0, blocking_submit=False)
            with ServerThread(router, config) as sr, channel(sr.target) as client:
                wait_until(lambda: router.membership.ready_count() == 2, 30, "both ready")
                to_a.Prefill(build_request([*prefix, 1]))  # A holds the prefix
                wait_until(lambda: indexed(router, sa.target) >= 16, 10, "A's blocks indexed")

                busy = client.Prefill.future(build_request(prefix + long_tail))
                wait_until(lambda: router.metrics.decisions.total() == 1, 10, "long placed")
                answer = client.Prefill(build_request(prefix + short_tail, top_logprobs=3))
                first = busy.result(timeout=60)

                assert first.served_by == sa.target and first.fetched_tokens == 0
                assert answer.served_by == sb.target
                assert answer.fetched_tokens == 64 and answer.cached_tokens == 64
                want, _ = reference_forward(CONFIG, WEIGHTS, prefix + short_tail)
                assert answer.first_token_id == int(want.argmax())
                assert router.metrics.decisions["fetch"] == 1
                assert router.metrics.fetches == {(sb.target, "copied"): 1}
                assert router._core.transfer.num_samples == 1
                registry = CollectorRegistry()
                registry.register(router.metrics.collector())
                text = generate_latest(registry).decode()
                copied = f'outcome="copied",pipeline="{sb.target}"'
                assert f"wavepp_router_fetches_total{{{copied}}} 1.0" in text
                assert 'wavepp_router_transfer_model{term="fixed"} 0.02' in text  # the prior
                with pytest.raises(grpc.RpcError) as err:  # a router lends nothing
                    client.LeasePrefix(prefill_pb2.LeasePrefixRequest())
                assert err.value.code() is grpc.StatusCode.UNIMPLEMENTED
            router.shutdown()
            wait_idle(a)
            wait_idle(b)
    finally:
        a.shutdown()
        b.shutdown()


# ---- real `wavepp serve` pipelines: every stage its own process --------------------------


def test_pipelines_of_processes_fetch_over_their_stages_agents(tmp_path):
    """Each stage process READs its layers from the source pipeline's stage processes (the
    FETCH round travels the rounds plane); the answer equals the reference forward's."""
    weights = random_weights(ROUTER_MODEL, seed=21)
    save_hf_checkpoint(tmp_path, ROUTER_MODEL, weights)
    rng = random.Random(22)
    prefix, tail = [rng.randrange(64) for _ in range(48)], [rng.randrange(64) for _ in range(5)]
    flags = ("--kv-lease-ttl", "5", "--debug-service")
    pipelines = [serve(tmp_path, 0, 0.0, *flags) for _ in range(2)]
    targets = [f"127.0.0.1:{port}" for _, port in pipelines]
    try:
        clients = [PrefillClient(t) for t in targets]
        for client in clients:
            wait_until(client.is_ready, 60, "pipeline ready")
        with channel(targets[1]) as b:
            clients[0].prefill([*prefix, 7])
            answer = b.Prefill(fetch_request(prefix + tail, targets[0], 48))
        want, _ = reference_forward(ROUTER_MODEL, weights, prefix + tail)
        assert answer.fetched_tokens == 48 and answer.cached_tokens == 48
        assert answer.first_token_id == int(want.argmax())
        for client in clients:  # leases released, nothing pinned, integrity on every stage
            wait_until(lambda c=client: held(c.check_integrity()) == 0, 10, "unpinned")
            assert client.check_integrity().ok
            client.close()
    finally:
        for proc, _ in pipelines:
            stop(proc)


def held(report) -> int:
    return sum(s.used_blocks + s.kv_held_blocks for s in report.stages)


def test_the_source_lends_what_each_stage_holds_and_nothing_when_a_stage_has_none():
    """Stages evict independently: A's small stage 1 keeps less of the prefix than its stage
    0. The fetch copies the shorter run; once stage 1 holds none of it, A lends nothing
    (and stage 0's lease is revoked at once)."""
    prefix, tail = prompt_of(32, seed=16), prompt_of(5, seed=17)
    config = EngineConfig(
        stages=2, num_blocks=(40, 12), block_size=4, max_wave_tokens=16, kv_handoff=HANDOFF
    )
    a = LocalEngine.from_weights(CONFIG, WEIGHTS, config)
    b = engine(4, ((0, 2), (2, 4)))
    try:
        a.submit([*prefix, 0], PrefillOptions()).result(timeout=30)
        a.submit(prompt_of(20, seed=18), PrefillOptions()).result(timeout=30)  # evicts some
        manifests = a.lend_prefix(prefix, None)
        held = [m.num_tokens for m in manifests]
        assert 0 < held[1] < held[0] == 32, held
        b.release_sources(manifests)  # as B does after its copy
        wait_idle(a)
        with ServerThread(a) as sa, ServerThread(b) as sb, channel(sb.target) as client:
            answer = client.Prefill(fetch_request(prefix + tail, sa.target, 32))
            assert answer.fetched_tokens == held[1] and answer.cached_tokens == held[1]
            want, _ = reference_forward(CONFIG, WEIGHTS, prefix + tail)
            assert answer.first_token_id == int(want.argmax())
            wait_idle(a)
            wait_idle(b)
        for seed in (19, 20):  # stage 1 evicts the rest of the prefix
            a.submit(prompt_of(40, seed=seed), PrefillOptions()).result(timeout=30)
        assert a.lend_prefix(prefix, None) == ()
        wait_idle(a)  # stage 0's lease was revoked, its pins given back
    finally:
        a.shutdown()
        b.shutdown()
    a.check_integrity()
    b.check_integrity()


def test_a_stage_whose_read_fails_gives_its_blocks_back_and_the_request_stays_exact():
    """Stage 1's manifest names blocks outside the source's pool, so its READ fails; stage
    0's lands. Stage 0 caches the copy, stage 1 nothing; the request reuses what both hold
    (nothing) and is exact; the source's leases are released all the same."""
    prefix, suffix = prompt_of(32, seed=23), prompt_of(5, seed=24)
    with pipelines(SAME, SAME) as (a, b):
        good, bad = lease_prefix(a, prefix)
        outside = tuple(10_000 + i for i in range(len(bad.block_ids)))
        fetched = b.fetch_prefix(prefix, None, (good, replace(bad, block_ids=outside)))
        assert fetched.copied_blocks == (8, 0)
        assert len(fetched.errors) == 1 and fetched.errors[0].startswith("stage 1:")
        assert b.stages[1].pool_stats().cached == 0  # nothing of the failed copy was kept
        wait_idle(a)
        wait_idle(b)
        prefill_exactly(b, prefix + suffix, cached=0)
