"""StageKVShipper streaming over real NIXL (issue 20): two stage shippers with real paged KV
pools in this process, a spawned decode process (block size 8 fp32, or 2 in bf16).

Checks the mechanism the runtime relies on: streamed ranges then the final push ship exactly
the tokens decode lacks (its cached prefix skipped); decode is not "ready" before the final
push; the in-flight bound queues and coalesces ranges (and the final push carries a queue
still waiting); every block reference handed over comes back exactly once; ``cancel``
mid-stream tells decode the attempt failed, later calls for that id are dropped until
``revive``, and the retry (a new transfer id) is exact; the poll that sees a request's last
range land posts its final push (no poll interval lost on the tail); the last chunk's layer
groups wait behind queued ranges, and the final push ships exactly the layers they left.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from kv_transfer.messages import Notification, PushDestination
from kv_transfer.progress import KVProgress
from prefill_node.core.block import KVBlock
from prefill_node.engine.types import KVLayoutSpec, KVPushDestination, StageKVManifest
from prefill_node.errors import InvalidRequestError
from prefill_node.kv_shipping.shipper import KVShippingConfig, StageKVShipper
from prefill_node.model.paged_kv import PagedKVCache
from prefill_node.model.partition import LayerRange
from tests.test_kv_transfer_nixl import (
    HEAD_DIM,
    HEADS,
    POOLS,
    PREFILL_BLOCKS,
    PREFILL_BS,
    Decode,
    assert_shipped,
    prefill_blocks,
)

pytestmark = pytest.mark.slow

CONFIG = KVShippingConfig(
    transfer_timeout_s=3.0,
    handshake_timeout_s=0.5,
    progress=KVProgress.OWNER,
    stream=True,
    stream_max_inflight=1,
)


class StreamStages:
    """Two stage shippers (layers [0, 2) and [2, 4)); counts every block reference handed
    to them and every one they give back."""

    def __init__(self, config: KVShippingConfig = CONFIG, tag: str = "") -> None:
        gen = torch.Generator().manual_seed(1)
        self.pools = []
        for s in range(2):
            kv = PagedKVCache(
                LayerRange(2 * s, 2 * s + 2), PREFILL_BLOCKS, PREFILL_BS, HEADS, HEAD_DIM
            )
            for t in kv.tensors:
                t.copy_(torch.randn(t.shape, generator=gen))
            self.pools.append(kv)
        self.kv = [t for kv in self.pools for t in kv.tensors]  # for assert_shipped
        self.handed: Counter[int] = Counter()
        self.returned: Counter[int] = Counter()
        self.shippers = [
            StageKVShipper(s, 2, self.pools[s], config, self._give_back, f"stream{tag}-stage{s}")
            for s in range(2)
        ]

    def _give_back(self, blocks) -> None:
        self.returned.update(b.block_id for b in blocks)

    def refs(self, block_ids) -> list[KVBlock]:
        self.handed.update(block_ids)
        return [KVBlock(b) for b in block_ids]

    def poll_until(self, predicate, timeout_s: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for shipper in self.shippers:
                shipper.poll()
            if predicate():
                return True
            time.sleep(0.001)
        return False

    def results(self, request_id: str, timeout_s: float = 8.0) -> list:
        got: dict[int, object] = {}

        def done() -> bool:
            for shipper in self.shippers:
                for r in shipper.take_results():
                    if r.request_id == request_id:
                        got[r.stage] = r
            return len(got) == 2

        assert self.poll_until(done, timeout_s)
        return [got[0], got[1]]

    def balanced(self) -> bool:
        return self.handed == self.returned and all(s.held_blocks == 0 for s in self.shippers)


@pytest.fixture(scope="module")
def decode() -> Iterator[Decode]:
    worker = Decode(POOLS)
    yield worker
    worker.stop()


@pytest.fixture(scope="module")
def stages() -> Iterator[StreamStages]:
    pipeline = StreamStages()
    yield pipeline
    for shipper in pipeline.shippers:
        shipper.check_integrity()
        shipper.close()
    assert pipeline.handed == pipeline.returned


def engine_dest(wire: dict, pool: str, skip_blocks: int) -> KVPushDestination:
    """The engine form of decode's expect: one block id per prompt block (prefix included)."""
    w = PushDestination.from_dict(wire)
    layout = KVLayoutSpec(POOLS[pool][0], HEADS, HEAD_DIM, POOLS[pool][1])
    return KVPushDestination(
        agent_name="",
        metadata_endpoint=w.endpoint,
        block_ids=(0,) * skip_blocks + w.block_ids,
        layout=layout,
        decode_cached_tokens=w.skip_tokens,
        transfer_id=w.transfer_id,
    )


def manifest(src: tuple[int, ...], num_tokens: int) -> StageKVManifest:
    return StageKVManifest(0, 0, 2, src, PREFILL_BS, num_tokens, HEADS, HEAD_DIM, "float32")


def stream_ranges(stages, request_id, src, dest, num_tokens, ranges) -> None:
    for shipper in stages.shippers:
        for start, end in ranges:
            blocks = stages.refs(src[start // PREFILL_BS : end // PREFILL_BS])
            shipper.stream(request_id, blocks, src, dest, num_tokens, start, end)


def push_final(stages, request_id, src, dest, num_tokens) -> None:
    for shipper in stages.shippers:
        shipper.push(request_id, stages.refs(src), manifest(src, num_tokens), dest)


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("skip_blocks", [0, 1])
def test_streamed_ranges_then_final_push_ship_exactly_the_delta(decode, stages, pool, skip_blocks):
    num_tokens, skip = 29, skip_blocks * POOLS[pool][0]
    src = prefill_blocks(num_tokens, seed=10 + skip_blocks)
    rid = f"stream-{pool}-{skip}"
    dest = engine_dest(decode.call("expect", pool, rid, num_tokens, skip), pool, skip_blocks)
    posted = [s.parts_posted for s in stages.shippers]
    # three chunks' ranges at once: one WRITE in flight per stage, the others queue ...
    stream_ranges(stages, rid, src, dest, num_tokens, [(0, 8), (8, 16), (16, 24)])
    assert [s.parts_posted - p for s, p in zip(stages.shippers, posted, strict=True)] == [1, 1]
    # ... and go as ONE coalesced WRITE once the first landed
    assert stages.poll_until(
        lambda: all(
            s.parts_posted - p == 2 and not s.busy
            for s, p in zip(stages.shippers, posted, strict=True)
        )
    )
    assert decode.call("still_pending", pool, rid, 0.2)  # parts landed; nobody said "done"
    assert not decode.call("due", pool)  # and none reached the prompt's end: poll slowly
    push_final(stages, rid, src, dest, num_tokens)
    assert all(r.ok and r.manifest.pushed for r in stages.results(rid))
    assert decode.call("wait", pool, rid) == (None, 0)
    assert_shipped(decode, stages, pool, dest.block_ids[skip_blocks:], skip, num_tokens, src)
    assert stages.balanced()


def test_the_final_push_carries_ranges_still_queued(decode, stages):
    num_tokens, pool = 21, "direct"
    src = prefill_blocks(num_tokens, seed=20)
    rid = "stream-queued"
    dest = engine_dest(decode.call("expect", pool, rid, num_tokens, 0), pool, 0)
    posted = [s.parts_posted for s in stages.shippers]
    stream_ranges(stages, rid, src, dest, num_tokens, [(0, 8), (8, 16)])
    for shipper in stages.shippers:
        shipper.poll()  # posts (0, 8)
    push_final(stages, rid, src, dest, num_tokens)  # (8, 16) never got a WRITE of its own
    assert all(r.ok for r in stages.results(rid))
    assert [s.parts_posted - p for s, p in zip(stages.shippers, posted, strict=True)] == [1, 1]
    assert decode.call("wait", pool, rid) == (None, 0)
    assert_shipped(decode, stages, pool, dest.block_ids, 0, num_tokens, src)
    assert stages.balanced()


def test_cancel_mid_stream_fails_decodes_attempt_and_a_retry_is_exact(decode, stages):
    num_tokens, pool = 27, "direct"  # (the bf16 pool is used up by the tests above)
    src = prefill_blocks(num_tokens, seed=30)
    rid = "stream-cancel"
    dest = engine_dest(decode.call("expect", pool, rid, num_tokens, 0), pool, 0)
    stream_ranges(stages, rid, src, dest, num_tokens, [(0, 12)])
    assert stages.poll_until(lambda: not any(s.busy for s in stages.shippers))
    for shipper in stages.shippers:
        shipper.cancel(rid)
    assert decode.call("wait", pool, rid) == ("TransferFailed", 0)  # told, not timed out
    assert stages.balanced()
    # late calls of the cancelled request are dropped, their references given back at once
    stream_ranges(stages, rid, src, dest, num_tokens, [(12, 20)])
    push_final(stages, rid, src, dest, num_tokens)
    assert stages.balanced() and not any(s.busy or s.take_results() for s in stages.shippers)
    for shipper in stages.shippers:  # the id is admitted again: a new attempt
        shipper.revive(rid)
    retry = engine_dest(decode.call("expect", pool, rid, num_tokens, 0), pool, 0)
    assert retry.transfer_id != dest.transfer_id
    ignored = decode.call("stats", pool)
    sender = stages.shippers[0].sender  # late notes of the old attempt: ignored by the retry
    decode_agent = sender._peers[dest.metadata_endpoint].agent_name
    for kind in ("part", "done"):
        note = Notification(
            kind, dest.transfer_id, 0, 2, 0, 2, end_token=12 if kind == "part" else 0
        )
        sender.agent.nixl.send_notif(decode_agent, note.encode())
    assert decode.call("still_pending", pool, rid, 0.3)
    assert decode.call("stats", pool) == ignored + 2
    stream_ranges(stages, rid, src, retry, num_tokens, [(0, 12), (12, 24)])
    push_final(stages, rid, src, retry, num_tokens)
    assert all(r.ok for r in stages.results(rid))
    assert decode.call("wait", pool, rid) == (None, 0)
    assert_shipped(decode, stages, pool, retry.block_ids, 0, num_tokens, src)
    assert stages.balanced()
    for shipper in stages.shippers:
        shipper.check_integrity()


def test_the_poll_that_sees_the_last_range_land_posts_the_final_push(decode):
    """The last range landed (NIXL moved it) while the final push was already queued: the
    one poll that sees the range end posts the push too, instead of the next poll."""
    stages = StreamStages(replace(CONFIG, progress=KVProgress.EVENT), tag="-event")
    num_tokens, pool = 21, "direct"
    try:
        for attempt, seed in (("warm", 40), ("tail", 41)):  # the first one connects
            src = prefill_blocks(num_tokens, seed=seed)
            rid = f"stream-{attempt}"
            dest = engine_dest(decode.call("expect", pool, rid, num_tokens, 0), pool, 0)
            stream_ranges(stages, rid, src, dest, num_tokens, [(0, 16)])
            if attempt == "tail":
                for shipper in stages.shippers:
                    shipper.poll()  # posts the range (the peer is known)
            push_final(stages, rid, src, dest, num_tokens)  # queued behind the range
            for shipper in stages.shippers:
                back, posted = sum(stages.returned.values()), shipper.sender.writes_posted
                deadline = time.monotonic() + 5.0
                while sum(stages.returned.values()) - back < 16 // PREFILL_BS:
                    assert time.monotonic() < deadline, "the streamed range never landed"
                    shipper.poll()
                    time.sleep(0.001)
                if attempt == "tail":  # the range's end seen, and the final push posted
                    assert shipper.sender.writes_posted == posted + 1
            assert all(r.ok for r in stages.results(rid))
            assert decode.call("wait", pool, rid) == (None, 0)
            assert_shipped(decode, stages, pool, dest.block_ids, 0, num_tokens, src)
        assert stages.balanced()
    finally:
        for shipper in stages.shippers:
            shipper.check_integrity()
            shipper.close()


def test_layer_group_ends_split_a_stage_with_the_smallest_group_last():
    config = KVShippingConfig()
    assert config.layer_group_ends(0, 15) == (4, 8, 12)  # groups of 4, 4, 4 and 3 layers
    assert config.layer_group_ends(2, 4) == (3,)
    assert config.layer_group_ends(5, 6) == ()  # one layer: one group, the final push's
    assert replace(config, stream_layer_groups=1).layer_group_ends(0, 15) == ()
    assert replace(config, stream=False).layer_group_ends(0, 15) == ()
    with pytest.raises(InvalidRequestError):
        KVShippingConfig(stream_layer_groups=0)


def stream_first_layer(stages, request_id, src, dest, num_tokens, start) -> None:
    """The last chunk (from ``start``) of stage s's first layer [2s, 2s + 1), every block
    to the prompt's end (the partial last one too)."""
    for s, shipper in enumerate(stages.shippers):
        blocks = stages.refs(src[start // PREFILL_BS :])
        shipper.stream(request_id, blocks, src, dest, num_tokens, start, num_tokens, 2 * s + 1)


@pytest.fixture(scope="module")
def convert_decode() -> Iterator[Decode]:
    worker = Decode({"convert": POOLS["convert"]})  # a fresh bf16 pool (the shared one is full)
    yield worker
    worker.stop()


@pytest.mark.parametrize("pool", POOLS)
def test_a_layer_group_waits_for_queued_ranges_and_the_final_push_sends_the_rest(
    decode, convert_decode, stages, pool
):
    """Bound 1: the second all-layer range queues, the last chunk's first layer group waits
    behind it (posted only after it, so the final push is one rectangle); decode is not ready
    on parts alone; the final push WRITEs the last layer of the tail; every token of every
    layer lands exactly (fp32 with decode blocks of 8, or converted to bf16 blocks of 2)."""
    worker = decode if pool == "direct" else convert_decode
    num_tokens = 27
    src = prefill_blocks(num_tokens, seed=50)
    rid = f"groups-{pool}"
    dest = engine_dest(worker.call("expect", pool, rid, num_tokens, 0), pool, 0)
    posted = [s.parts_posted for s in stages.shippers]
    stream_ranges(stages, rid, src, dest, num_tokens, [(0, 8), (8, 16)])
    stream_first_layer(stages, rid, src, dest, num_tokens, 16)
    assert [s.parts_posted - p for s, p in zip(stages.shippers, posted, strict=True)] == [1, 1]
    assert stages.poll_until(
        lambda: all(
            s.parts_posted - p == 3 and not s.busy
            for s, p in zip(stages.shippers, posted, strict=True)
        )
    )
    assert worker.call("still_pending", pool, rid, 0.2)
    push_final(stages, rid, src, dest, num_tokens)
    assert all(r.ok and r.manifest.pushed for r in stages.results(rid))
    assert worker.call("wait", pool, rid) == (None, 0)
    assert_shipped(worker, stages, pool, dest.block_ids, 0, num_tokens, src)
    assert stages.balanced()


def test_a_final_push_carries_a_layer_group_still_queued(decode, stages):
    """Both all-layer ranges and the layer group still queued at the final push: it WRITEs
    every layer from where the posted range stopped (one rectangle), exactly once."""
    num_tokens, pool = 23, "direct"
    src = prefill_blocks(num_tokens, seed=51)
    rid = "groups-queued"
    dest = engine_dest(decode.call("expect", pool, rid, num_tokens, 0), pool, 0)
    stream_ranges(stages, rid, src, dest, num_tokens, [(0, 8), (8, 16)])
    stream_first_layer(stages, rid, src, dest, num_tokens, 16)
    push_final(stages, rid, src, dest, num_tokens)
    assert all(r.ok for r in stages.results(rid))
    assert decode.call("wait", pool, rid) == (None, 0)
    assert_shipped(decode, stages, pool, dest.block_ids, 0, num_tokens, src)
    assert stages.balanced()


@pytest.fixture(scope="module")
def direct_decode() -> Iterator[Decode]:
    worker = Decode({"direct": POOLS["direct"]})  # a fresh fp32 pool (the shared one is full)
    yield worker
    worker.stop()


def test_a_layer_group_handed_over_but_not_posted_rides_the_final_push(direct_decode, stages):
    """The final push comes in the same pass as the layer group before it (no poll between):
    the group is taken back from the sender unposted and the final push WRITEs its layers
    too, instead of waiting for it to land; every byte lands once, every block comes back."""
    num_tokens, pool = 22, "direct"
    src = prefill_blocks(num_tokens, seed=53)
    rid = "groups-unposted"
    dest = engine_dest(direct_decode.call("expect", pool, rid, num_tokens, 0), pool, 0)
    stream_ranges(stages, rid, src, dest, num_tokens, [(0, 8), (8, 16)])
    assert stages.poll_until(lambda: not any(s.busy for s in stages.shippers))
    posted = [(s.parts_posted, s.sender.writes_posted) for s in stages.shippers]
    stream_first_layer(stages, rid, src, dest, num_tokens, 16)  # handed to the sender ...
    assert all(s.sender.parts_inflight == 1 for s in stages.shippers)
    push_final(stages, rid, src, dest, num_tokens)  # ... and taken back, unposted
    assert all(s.sender.parts_inflight == 0 for s in stages.shippers)
    assert all(r.ok for r in stages.results(rid))
    after = [(s.parts_posted, s.sender.writes_posted) for s in stages.shippers]
    assert [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, posted, strict=True)] == [(0, 1)] * 2
    assert direct_decode.call("wait", pool, rid) == (None, 0)
    assert_shipped(direct_decode, stages, pool, dest.block_ids, 0, num_tokens, src)
    assert stages.balanced()


def test_cancel_after_a_layer_group_fails_decodes_attempt_and_gives_every_block_back(
    convert_decode, stages
):
    num_tokens, pool = 19, "convert"  # (the fp32 pool is used up by the tests above)
    src = prefill_blocks(num_tokens, seed=52)
    rid = "groups-cancel"
    dest = engine_dest(convert_decode.call("expect", pool, rid, num_tokens, 0), pool, 0)
    stream_ranges(stages, rid, src, dest, num_tokens, [(0, 8)])
    stream_first_layer(stages, rid, src, dest, num_tokens, 8)
    assert stages.poll_until(lambda: not any(s.busy for s in stages.shippers))
    for shipper in stages.shippers:
        shipper.cancel(rid)
    assert convert_decode.call("wait", pool, rid) == ("TransferFailed", 0)
    assert stages.balanced()
    for shipper in stages.shippers:
        shipper.check_integrity()


def test_a_reception_is_due_once_a_stage_streamed_its_last_token(direct_decode, stages):
    """KVReceiver.due (what makes a decode worker poll at its fastest): not while streamed
    parts stop short of the prompt's end, yes once a stage's layer group reached it (its
    final push follows within about one group's compute), and no longer once it ended."""
    num_tokens, pool = 21, "direct"
    src = prefill_blocks(num_tokens, seed=40)
    rid = "stream-due"
    dest = engine_dest(direct_decode.call("expect", pool, rid, num_tokens, 0), pool, 0)
    stream_ranges(stages, rid, src, dest, num_tokens, [(0, 16)])
    assert stages.poll_until(lambda: not any(s.busy for s in stages.shippers))
    assert direct_decode.call("still_pending", pool, rid, 0.2)
    assert not direct_decode.call("due", pool)
    first = stages.shippers[0]  # its first layer of the last chunk, to the prompt's end
    first.stream(rid, stages.refs(src[1:]), src, dest, num_tokens, 16, num_tokens, layer_end=1)
    assert stages.poll_until(lambda: not first.busy)
    assert direct_decode.call("still_pending", pool, rid, 0.2) and direct_decode.call("due", pool)
    push_final(stages, rid, src, dest, num_tokens)
    assert all(r.ok for r in stages.results(rid))
    assert direct_decode.call("wait", pool, rid) == (None, 0)
    assert not direct_decode.call("due", pool)
    assert_shipped(direct_decode, stages, pool, dest.block_ids, 0, num_tokens, src)
    assert stages.balanced()
