"""Proto <-> engine conversions round-trip exactly; the KV-event hub orders and bounds events."""

from __future__ import annotations

import asyncio

import pytest

from prefill_node.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from prefill_node.engine.types import (
    KVLayoutSpec,
    KVPullDestination,
    KVPushDestination,
    MemoryRegionSpec,
    StageKVManifest,
)
from prefill_node.errors import InvalidKVDestinationError
from prefill_node.server.kv_event_hub import KVEventHub
from prefill_node.wire.kv_convert import (
    destination_from_proto,
    destination_to_proto,
    event_from_proto,
    event_to_proto,
    manifest_from_proto,
    manifest_to_proto,
)

LAYOUT = KVLayoutSpec(
    block_size=16,
    num_kv_heads=2,
    head_dim=64,
    dtype="bfloat16",
    num_layers=2,
    block_bytes=8192,
    regions=(
        MemoryRegionSpec(0, 1 << 40, 1 << 20, 0, "dram"),
        MemoryRegionSpec(1, 7, 9, 3, "vram"),
    ),
)


def test_push_and_pull_destinations_round_trip():
    push = KVPushDestination(
        agent_name="decode-3",
        metadata_endpoint="[::1]:7000",
        block_ids=(9, 4),  # 40 tokens = 3 blocks of 16, the first cached on decode
        layout=LAYOUT,
        decode_cached_tokens=16,
        transfer_id="attempt-2",
    )
    assert destination_from_proto(destination_to_proto(push), prompt_tokens=40) == push
    staged = KVPushDestination(
        agent_name="d",
        agent_metadata=b"\x00meta",
        stage_block_ids=((0, (1, 2)), (1, (3, 4))),
        layout=LAYOUT,
    )
    assert destination_from_proto(destination_to_proto(staged), prompt_tokens=17) == staged
    pull = KVPullDestination(lease_ttl_s=1.5)
    assert destination_from_proto(destination_to_proto(pull), prompt_tokens=5) == pull
    assert destination_from_proto(destination_to_proto(None), prompt_tokens=5) is None


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"decode_cached_tokens": 8}, "multiple of layout.block_size=16"),
        ({"decode_cached_tokens": 48}, "below the prompt length 40"),
        ({"metadata_endpoint": "h:70000"}, "not 'host:port'"),
        ({"agent_metadata": b"x"}, "exactly one of metadata_endpoint"),
        ({"stage_block_ids": ((0, (1, 2, 3)),)}, "exactly one of block_ids and stage_block_ids"),
    ],
)
def test_malformed_push_destinations_say_what_to_fix(change, fragment):
    fields = dict(agent_name="d", metadata_endpoint="h:1", block_ids=(1, 2, 3), layout=LAYOUT)
    fields.update(change)
    msg = destination_to_proto(KVPushDestination(**fields))
    with pytest.raises(InvalidKVDestinationError, match=fragment.replace("(", r"\(")):
        destination_from_proto(msg, prompt_tokens=40)


def test_manifest_round_trips_with_lease_expiry():
    manifest = StageKVManifest(
        stage=1,
        layer_start=2,
        layer_end=4,
        block_ids=(5, 6),
        block_size=16,
        num_tokens=20,
        num_kv_heads=2,
        head_dim=64,
        dtype="bfloat16",
        agent_name="prefill-s1",
        metadata_endpoint="10.0.0.2:5600",
        regions=LAYOUT.regions,
        lease_id="lease-7",
        lease_expiry_unix_s=1_800_000_000.25,
        pushed=False,
        lease_ttl_s=2.5,
    )
    assert manifest_from_proto(manifest_to_proto(manifest)) == manifest


def test_kv_events_round_trip():
    for event in (
        BlockStored((1, 2**64 - 1), 42, tuple(range(32)), 16),
        BlockStored((3,), None, tuple(range(16)), 16),
        BlockRemoved((1, 2)),
        AllBlocksCleared(),
    ):
        assert event_from_proto(event_to_proto(event)) == event


def test_hub_delivers_in_order_then_drops_a_subscriber_that_falls_behind():
    async def run():
        hub = KVEventHub("p", max_pending=3)
        sub = hub.subscribe()
        assert await sub.next_batch() == (1, (AllBlocksCleared(),))
        hub.publish([BlockRemoved((1,))])
        hub.publish([BlockRemoved((2,))])
        await asyncio.sleep(0)
        assert await sub.next_batch() == (2, (BlockRemoved((1,)),))
        for i in range(5):  # more than max_pending while the subscriber is not reading
            hub.publish([BlockRemoved((10 + i,))])
        await asyncio.sleep(0)
        assert await sub.next_batch() is None and sub.overflowed
        assert hub.subscriber_count == 0

    asyncio.run(run())
