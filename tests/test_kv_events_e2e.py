"""KV events end to end: a 2-stage LocalEngine (tiny random model) publishes the blocks
resident on ALL its stages; a real gRPC server streams them to a SubscribeKvEvents client."""

from __future__ import annotations

import random
import re
import signal
import subprocess
import sys

import grpc
import pytest

from prefill_node.client.prefill_client import PrefillClient
from prefill_node.core.hashing import ExtraKeys, hash_block_tokens
from prefill_node.core.kv_event_aggregator import StageEvents
from prefill_node.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from prefill_node.engine.types import PrefillOptions
from prefill_node.model.loader_hf import load_hf_config, save_hf_checkpoint
from prefill_node.model.weights import random_weights
from prefill_node.runtime.engine_config import EngineConfig
from prefill_node.runtime.kv_event_feed import KVEventFeed
from prefill_node.runtime.local_engine import LocalEngine
from prefill_node.server.kv_event_hub import KVEventHub
from prefill_node.wire.kv_convert import event_from_proto
from tests.grpc_harness import TINY_CONFIG, ServerThread, wait_until
from wavepp_proto.prefill.v1 import kv_events_pb2, prefill_pb2_grpc

BS = 4


def engine_with_events(num_blocks: tuple[int, ...], sink) -> LocalEngine:
    config = EngineConfig(
        stages=len(num_blocks), num_blocks=num_blocks, block_size=BS, max_wave_tokens=16
    )
    weights = random_weights(TINY_CONFIG, seed=5)
    return LocalEngine.from_weights(TINY_CONFIG, weights, config, kv_events=sink)


def prompt_hashes(engine: LocalEngine, prompt: list[int]) -> tuple[int, ...]:
    return tuple(hash_block_tokens(prompt, BS, ExtraKeys(model_id=engine.model_id)))


def resident_on_all(engine: LocalEngine) -> set[int]:
    return set.intersection(*(set(s.pool.index.counts()) for s in engine.stages))


def chained(events: list[KVEvent]) -> dict[int, tuple[int | None, tuple[int, ...]]]:
    """Stored blocks as hash -> (parent hash, tokens), however the chains were cut."""
    blocks = {}
    for e in events:
        assert isinstance(e, BlockStored)
        parent = e.parent_hash
        for i, h in enumerate(e.block_hashes):
            blocks[h] = (parent, e.token_ids[i * BS : (i + 1) * BS])
            parent = h
    return blocks


def apply(view: set[int], events: list[KVEvent]) -> None:
    for event in events:
        if isinstance(event, AllBlocksCleared):
            view.clear()
        elif isinstance(event, BlockRemoved):
            view.difference_update(event.block_hashes)
        else:
            view.update(event.block_hashes)


def test_subscriber_sees_stored_chain_then_eviction_over_grpc():
    hub = KVEventHub("pipeline-e2e")
    # stage 1 is small: a second prompt must evict the first one's cached blocks there
    engine = engine_with_events((32, 6), hub.publish)
    first = [random.Random(1).randrange(61) for _ in range(14)]  # 3 full blocks + 2 tokens
    second = [random.Random(2).randrange(61) for _ in range(20)]  # 5 full blocks
    h1, h2 = prompt_hashes(engine, first), prompt_hashes(engine, second)
    with (
        ServerThread(engine, kv_events=hub) as srv,
        grpc.insecure_channel(srv.target) as channel,
        PrefillClient(srv.target) as client,
    ):
        stream = prefill_pb2_grpc.PrefillServiceStub(channel).SubscribeKvEvents(
            kv_events_pb2.SubscribeKvEventsRequest(), timeout=60
        )
        hello = next(stream)
        assert [event_from_proto(e) for e in hello.events] == [AllBlocksCleared()]

        assert client.prefill(first).result.computed_tokens == 14
        batch = next(stream)
        assert batch.pipeline_id == "pipeline-e2e" and batch.sequence == hello.sequence + 1
        assert [event_from_proto(e) for e in batch.events] == [
            BlockStored(h1, None, tuple(first[:12]), BS)
        ]

        assert client.prefill(second).result.cached_tokens == 0
        # events leave with each wave (<= 16 tokens) and every stage stores a chunk's full
        # blocks as it passes: the 20-token prompt's chain arrives in pieces, in order
        events: list[KVEvent] = []
        while sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored)) < 5:
            events += [event_from_proto(e) for e in next(stream).events]
        stored = [e for e in events if isinstance(e, BlockStored)]
        assert [h for e in stored for h in e.block_hashes] == list(h2)
        assert [t for e in stored for t in e.token_ids] == second
        assert [e.parent_hash for e in stored] == [None] + [e.block_hashes[-1] for e in stored[:-1]]
        # stage 1 (6 blocks) hands out the first prompt's uncached tail block and its two
        # never-used blocks, then evicts LRU tail first: block 2, then block 1
        removed = [h for e in events if not isinstance(e, BlockStored) for h in e.block_hashes]
        assert all(isinstance(e, BlockStored | BlockRemoved) for e in events)
        assert removed == [h1[2], h1[1]]
        assert resident_on_all(engine) == {h1[0], *h2}

        # a late subscriber starts from a snapshot of what is resident on every stage
        late = prefill_pb2_grpc.PrefillServiceStub(channel).SubscribeKvEvents(
            kv_events_pb2.SubscribeKvEventsRequest(), timeout=60
        )
        snapshot = [event_from_proto(e) for e in next(late).events]
        late.cancel()
        assert snapshot[0] == AllBlocksCleared()
        assert chained(snapshot[1:]) == chained(
            [
                BlockStored(h1[:1], None, tuple(first[:4]), BS),
                BlockStored(h2, None, tuple(second), BS),
            ]
        )

        # what the subscribers were told is what the pipeline reuses: block 0 survived
        assert client.prefill(first[:4] + second[:3]).result.cached_tokens == 4
        stream.cancel()
        wait_until(lambda: hub.subscriber_count == 0, what="unsubscribe")
    engine.check_integrity()


def test_published_view_equals_the_blocks_resident_on_every_stage():
    """Many random prompts over uneven stage caches: replaying what the engine published
    always gives exactly the hashes every stage's pool holds."""
    batches: list[list[KVEvent]] = []
    engine = engine_with_events((12, 7, 9), lambda events: batches.append(list(events)))
    rng = random.Random(7)
    shared = [rng.randrange(61) for _ in range(8)]
    view: set[int] = set()
    for _ in range(25):
        prompt = (shared if rng.random() < 0.5 else []) + [
            rng.randrange(61) for _ in range(rng.randrange(1, 20))
        ]
        engine.submit(prompt, PrefillOptions()).result()
        for events in batches:
            apply(view, events)
        batches.clear()
        assert view == resident_on_all(engine)
        engine.check_integrity()
    assert view, "the workload must leave something cached on every stage"


def test_engine_without_a_sink_buffers_no_events():
    engine = engine_with_events((16, 16), None)
    engine.submit(list(range(12)), PrefillOptions()).result()
    assert all(not s.pool.events_enabled and not s.pool.drain_events() for s in engine.stages)


@pytest.mark.slow
def test_wavepp_serve_streams_the_pipelines_kv_events(tmp_path):
    """The real `wavepp serve` process publishes its engine's events on SubscribeKvEvents."""
    save_hf_checkpoint(tmp_path, TINY_CONFIG, random_weights(TINY_CONFIG, seed=9))
    server = subprocess.Popen(
        [sys.executable, "-m", "prefill_node.cli.main", "serve", "--model", str(tmp_path),
         "--stages", "2", "--num-blocks", "64", "--block-size", str(BS), "--host", "127.0.0.1",
         "--port", "0", "--metrics-port", "-1", "--threads", "1", "--log-level", "WARNING",
         "--pipeline-id", "cli-pipe"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        line = server.stdout.readline()
        match = re.search(r"listening on (127\.0\.0\.1:\d+)", line)
        assert match, f"unexpected first line {line!r}; stderr: {server.stderr.read()}"
        target = match.group(1)
        prompt = list(range(1, 14))  # 3 full blocks of 4 + 1 token
        with grpc.insecure_channel(target) as channel, PrefillClient(target) as client:
            stream = prefill_pb2_grpc.PrefillServiceStub(channel).SubscribeKvEvents(
                kv_events_pb2.SubscribeKvEventsRequest(), timeout=60
            )
            assert [event_from_proto(e) for e in next(stream).events] == [AllBlocksCleared()]
            client.prefill(prompt)
            batch = next(stream)
            stream.cancel()
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    model_id = f"{load_hf_config(tmp_path).name}|float32"
    hashes = tuple(hash_block_tokens(prompt, BS, ExtraKeys(model_id=model_id)))
    assert batch.pipeline_id == "cli-pipe"
    assert [event_from_proto(e) for e in batch.events] == [
        BlockStored(hashes, None, tuple(prompt[:12]), BS)
    ]


def test_a_failing_sink_never_fails_a_request():
    def broken(events):
        raise ConnectionError("router gone")

    engine = engine_with_events((16, 16), broken)
    result = engine.submit(list(range(12)), PrefillOptions()).result()
    assert result.computed_tokens == 12
    feed = KVEventFeed(1, broken)
    stored = BlockStored((1,), None, (0, 1, 2, 3), BS)
    assert feed.publish([StageEvents(0, [stored])]) == [stored]
    assert (feed.sink_failures, feed.published_batches) == (1, 0)
