"""RouterEngine's cluster identity: the first pipeline defines it, others must match it;
routers, pipelines without KV events and other models are refused, counted in a metric."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import grpc
import pytest

from prefill_node.client.prefill_client import RemoteServerInfo
from prefill_router.discovery import StaticDiscovery
from prefill_router.router_engine import RouterConfig, RouterEngine


def info(model_id="tiny|float32", block_size=16, *, kv_events=True, router=False, snap=0):
    return RemoteServerInfo(
        "tiny", 64, 512, 2, False, "0.1.0", False, "inst", block_size, model_id, "p",
        kv_events, router, snap,
    )  # fmt: skip


def link(pid: str):
    return SimpleNamespace(pid=pid)


def test_the_first_pipeline_defines_the_identity_and_others_must_match():
    engine = RouterEngine(StaticDiscovery(["127.0.0.1:1"]), RouterConfig(model_name="tiny"))
    assert engine.membership.link_identified(link("a"), info()) is None
    assert engine.cache_identity.model_id == "tiny|float32"
    assert engine.cache_identity.block_size == 16
    assert engine.membership.link_identified(link("b"), info()) is None
    refusals = {
        "c": (info(block_size=32), "with 32-token blocks; the cluster serves"),
        "d": (info(model_id="tiny|bfloat16"), "'tiny|bfloat16'"),
        "e": (info(model_id="other|float32"), "this router routes 'tiny'"),
        "f": (info(router=True), "not a pipeline publishing KV events"),
        "g": (info(kv_events=False), "not a pipeline publishing KV events"),
    }
    for pid, (remote, why) in refusals.items():
        refused = engine.membership.link_identified(link(pid), remote)
        assert refused is not None and why in refused, (pid, refused)
    assert dict(engine.metrics.refused) == dict.fromkeys(refusals, 1)
    assert engine.cache_identity.block_size == 16  # refusals never change the identity


def test_without_a_model_name_any_first_model_is_accepted():
    engine = RouterEngine(StaticDiscovery(["127.0.0.1:1"]), RouterConfig())
    assert engine.membership.link_identified(link("a"), info(model_id="other|float32")) is None
    assert engine.cache_identity.model_id == "other|float32"


def test_a_recurrent_models_snapshot_interval_reaches_the_identity():
    """Pipelines of a model with recurrent layers report their snapshot interval; the
    router's identity (and so its own ServerInfo and reuse predictions) carries it."""
    engine = RouterEngine(StaticDiscovery(["127.0.0.1:1"]), RouterConfig())
    assert engine.membership.link_identified(link("a"), info(snap=1)) is None
    assert engine.cache_identity.snapshot_interval_blocks == 1
    plain = RouterEngine(StaticDiscovery(["127.0.0.1:1"]), RouterConfig())
    assert plain.membership.link_identified(link("a"), info()) is None
    assert plain.cache_identity.snapshot_interval_blocks is None


@pytest.mark.asyncio
async def test_started_on_a_loop_the_links_run_there_and_aclose_ends_them():
    """``wavepp router`` starts the engine on its serving loop: every pipeline link is tasks
    of that loop (no thread per pipeline), and ``aclose`` ends them and their channels."""
    # grpc.aio runs one poller thread per process while any aio object lives: start it first
    keep = grpc.aio.insecure_channel("127.0.0.1:1")
    before = {t.ident for t in threading.enumerate()}
    engine = RouterEngine(StaticDiscovery(["127.0.0.1:1", "127.0.0.1:2"]), RouterConfig())
    engine.start()
    links = engine.membership.links()
    assert sorted(links) == ["127.0.0.1:1", "127.0.0.1:2"]
    loop = asyncio.get_running_loop()
    await asyncio.sleep(0.2)  # the links try their (closed) ports
    for link in links.values():
        assert link._loop is loop and len(link._tasks) == 4
        assert not link.ready  # nothing listens there
    assert [t.name for t in threading.enumerate() if t.ident not in before] == []
    await engine.aclose()
    assert engine.membership.links() == {}
    for link in links.values():
        assert link._tasks == [] and link._clients == {}
    await keep.close()
