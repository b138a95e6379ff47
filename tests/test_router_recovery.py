"""The router's index recovers from what loses KV events in real clusters: a dropped event
stream (resync from a fresh snapshot, after which the index equals the pipeline's real
residency) and a pipeline restarted at the same address (new instance id: its entries go at
once, it comes back empty). In-process RouterEngine, real `wavepp serve` pipelines."""

from __future__ import annotations

import pytest

from prefill_node.client.prefill_client import PrefillClient
from prefill_node.core.hashing import ExtraKeys, hash_block_tokens
from prefill_node.core.kv_events import BlockStored
from prefill_node.model.loader_hf import save_hf_checkpoint
from prefill_node.model.weights import random_weights
from prefill_node.wire.kv_convert import event_from_proto
from prefill_router.discovery import StaticDiscovery
from prefill_router.pipeline_link import LinkConfig
from prefill_router.router_engine import RouterConfig, RouterEngine
from tests.grpc_harness import wait_until
from tests.router_harness import BS, MODEL, serve, stop

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PROMPTS = [[(7 * i + k) % 64 for i in range(40 + 8 * k)] for k in range(3)]


def residency(address: str) -> set[int]:
    """The pipeline's own snapshot: every block hash resident on all its stages."""
    with PrefillClient(address) as client:
        stream = client.subscribe_kv_events(timeout_s=10)
        first = next(iter(stream))
        stream.cancel()
    events = [event_from_proto(e) for e in first.events]
    return {h for e in events if isinstance(e, BlockStored) for h in e.block_hashes}


def indexed(engine: RouterEngine, pid: str, hashes_by_prompt) -> list[int]:
    with engine._lock:
        return [engine._core.index.match(h, 0.0).get(pid, 0) for h in hashes_by_prompt]


@pytest.fixture
def pipeline(tmp_path):
    save_hf_checkpoint(tmp_path, MODEL, random_weights(MODEL, seed=5))
    proc, port = serve(tmp_path)
    yield tmp_path, proc, port
    stop(proc)


def test_a_dropped_stream_resyncs_and_a_restart_starts_empty(pipeline):
    model_dir, proc, port = pipeline
    address = f"127.0.0.1:{port}"
    config = RouterConfig(link=LinkConfig(poll_s=0.1, rpc_timeout_s=0.5), pending_ttl_s=0.01)
    engine = RouterEngine(StaticDiscovery([address]), config)
    engine.start()
    try:
        wait_until(lambda: engine.health().ready, 30, "the pipeline ready behind the router")
        with PrefillClient(address) as direct:  # cache the prompts, behind the router's back
            for prompt in PROMPTS:
                direct.prefill(prompt)
        model_id = engine.cache_identity.model_id
        hashes = [hash_block_tokens(p, BS, ExtraKeys(model_id)) for p in PROMPTS]
        truth = residency(address)
        want = [sum(1 for h in hs if h in truth) for hs in hashes]
        assert want == [len(p) // BS for p in PROMPTS]  # every full block resident
        members = engine.membership
        wait_until(lambda: members.indexed_blocks(address) == len(truth), 10, "indexed")
        assert indexed(engine, address, hashes) == want

        # the stream drops (a network blip): entries go, a new snapshot rebuilds them
        resyncs = engine.metrics.resyncs[address]
        engine.membership.links()[address]._cancel_stream()
        wait_until(lambda: engine.metrics.resyncs[address] > resyncs, 10, "a resync")
        wait_until(lambda: members.indexed_blocks(address) == len(truth), 10, "re-indexed")
        assert indexed(engine, address, hashes) == want

        # a restart at the same address: a new instance, an empty cache
        old = engine.membership.links()[address].info.instance_id
        stop(proc)
        wait_until(lambda: not engine.health().ready, 5, "the stopped pipeline dropped")
        assert engine.membership.indexed_blocks(address) == 0
        proc, _ = serve(model_dir, port)
        wait_until(lambda: engine.health().ready, 30, "the restarted pipeline ready")
        assert engine.membership.links()[address].info.instance_id != old
        assert indexed(engine, address, hashes) == [0, 0, 0]
        result = engine.submit(PROMPTS[0], _options("after-restart")).result(30)
        assert (result.prompt_tokens, result.cached_tokens) == (len(PROMPTS[0]), 0)
    finally:
        engine.shutdown()
        stop(proc)


def _options(request_id: str):
    from prefill_node.engine.types import PrefillOptions

    return PrefillOptions(request_id=request_id)


@pytest.mark.asyncio
async def test_kubernetes_discovery_adds_and_removes_pipelines_in_the_router(kmock, pipeline):
    """EndpointSlices (kmock, the real kubernetes client) feed the router: a ready endpoint
    becomes a serving pipeline, a slice deleted takes it out of the router at once."""
    import asyncio

    from prefill_router.discovery import EndpointSliceDiscovery
    from tests.test_router_discovery import (
        NAMESPACE,
        RESOURCE,
        SERVICE,
        Cluster,
        api_client,
        endpoint,
        endpoint_slice,
        eventually,
        watch_subscribed,
    )

    _, _, port = pipeline
    kmock.resources[RESOURCE] = {}
    cluster = Cluster(__import__("kubernetes").client.DiscoveryV1Api(api_client(kmock)))
    discovery = EndpointSliceDiscovery(SERVICE, NAMESPACE, "grpc", api_client(kmock))
    config = RouterConfig(link=LinkConfig(poll_s=0.1, rpc_timeout_s=0.5))
    engine = RouterEngine(discovery, config)
    await asyncio.to_thread(engine.start)
    try:
        await eventually(lambda: watch_subscribed(kmock))
        assert engine.membership.links() == {}
        slice_ = endpoint_slice("wavepp-0", SERVICE, [endpoint("127.0.0.1", "pipeline-0")],
                                ports=(("grpc", port),))  # fmt: skip
        await cluster.create(slice_)
        await eventually(lambda: engine.health().ready, 30)
        assert list(engine.membership.links()) == ["pipeline-0"]
        assert engine.membership.links()["pipeline-0"].endpoint.address == f"127.0.0.1:{port}"
        await cluster.delete("wavepp-0")
        await eventually(lambda: engine.membership.links() == {}, 10)
        assert not engine.health().ready
    finally:
        await asyncio.to_thread(engine.shutdown)
