"""StageKVHandoff streaming over real NIXL (issue 20): two stages' hand-offs with real paged
KV pools in this process, a spawned decode process (block size 8 fp32, or 2 in bf16). Each
hand-off runs on the test's thread (``own_thread=False``), so the test orders every poll.

Checks the mechanism the runtime relies on: streamed ranges then the final push ship exactly
the tokens decode lacks (its cached prefix skipped); decode is not "ready" before the final
push; the in-flight bound queues and coalesces ranges (and the final push carries a queue
still waiting); every block reference handed over comes back exactly once; ``cancel``
mid-stream tells decode the attempt failed, later calls for that id are dropped until
it is admitted again (``supersede``), and the retry (a new transfer id) is exact; the poll
that sees a request's last range land posts its final push (no poll interval lost on the
tail); the last chunk's layer groups wait behind queued ranges, and the final push ships
exactly the layers they left.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import replace

import pytest
import torch

from kv_transfer.messages import Notification, PushDestination
from kv_transfer.progress import KVProgress
from prefill_node.core.block import KVBlock
from prefill_node.core.stage_admission import FinalBlocks
from prefill_node.engine.types import KVLayoutSpec, KVPushDestination, StageKVManifest
from prefill_node.errors import InvalidRequestError
from prefill_node.kv_handoff.config import KVHandoffConfig
from prefill_node.kv_handoff.stage_handoff import HandoffOutcome, StageKVHandoff
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

CONFIG = KVHandoffConfig(
    transfer_timeout_s=3.0,
    handshake_timeout_s=0.5,
    progress=KVProgress.OWNER,
    stream=True,
    stream_max_inflight=1,
)


class TableOwner:
    """A stage's cache as its hand-off sees it (``HandoffOwner``), over the block table the
    test gives each request; counts every reference handed over and given back."""

    def __init__(self, handed: Counter[int], returned: Counter[int]) -> None:
        self.handed, self.returned = handed, returned
        self.tables: dict[str, tuple[tuple[int, ...], int]] = {}
        self.shipped: dict[str, list[tuple[int, ...]]] = {}
        self.given_back = 0  # references given back to this stage

    def pin_final(self, request_id, start, end, *, to_prompt_end=False) -> FinalBlocks:
        src, num_tokens = self.tables[request_id]
        end = num_tokens if to_prompt_end else end
        ids = src[start // PREFILL_BS : len(src) if to_prompt_end else end // PREFILL_BS]
        self.handed.update(ids)
        return FinalBlocks([KVBlock(b) for b in ids], src, num_tokens, start, end)

    def ship(self, request_id: str, src: tuple[int, ...]) -> list[KVBlock]:
        self.shipped.setdefault(request_id, []).append(src)
        self.handed.update(src)
        return [KVBlock(b) for b in src]

    def release(self, request_id: str) -> None:
        src = self.shipped[request_id].pop(0)
        self.returned.update(src)
        self.given_back += len(src)

    def release_transfer(self, blocks: Sequence[KVBlock]) -> None:
        self.returned.update(b.block_id for b in blocks)
        self.given_back += len(blocks)


class StreamStages:
    """Two stages' hand-offs (layers [0, 2) and [2, 4)), polled by the test; every
    outcome they report is kept per stage."""

    def __init__(self, config: KVHandoffConfig = CONFIG, tag: str = "") -> None:
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
        self.owners = [TableOwner(self.handed, self.returned) for _ in range(2)]
        self.outcomes: list[list[HandoffOutcome]] = [[], []]
        self.handoffs = []
        for s in range(2):
            handoff = StageKVHandoff(
                s, 2, self.pools[s], config, self.owners[s],
                agent_name=f"stream{tag}-stage{s}", own_thread=False,
            )  # fmt: skip
            handoff.report_to(self.outcomes[s].extend)
            self.handoffs.append(handoff)

    def table(self, request_id: str, src: tuple[int, ...], num_tokens: int) -> None:
        for owner in self.owners:
            owner.tables[request_id] = (src, num_tokens)

    def poll_until(self, predicate, timeout_s: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for handoff in self.handoffs:
                handoff.poll()
            if predicate():
                return True
            time.sleep(0.001)
        return False

    def results(self, request_id: str, timeout_s: float = 8.0) -> list[HandoffOutcome]:
        got: dict[int, HandoffOutcome] = {}

        def done() -> bool:
            for stage, outcomes in enumerate(self.outcomes):
                got.update((stage, o) for o in outcomes if o.request_id == request_id)
            return len(got) == 2

        assert self.poll_until(done, timeout_s)
        for outcomes in self.outcomes:
            outcomes[:] = [o for o in outcomes if o.request_id != request_id]
        return [got[0], got[1]]

    def balanced(self) -> bool:
        return self.handed == self.returned and all(h.held_blocks == 0 for h in self.handoffs)


@pytest.fixture(scope="module")
def decode() -> Iterator[Decode]:
    worker = Decode(POOLS)
    yield worker
    worker.stop()


@pytest.fixture(scope="module")
def stages() -> Iterator[StreamStages]:
    pipeline = StreamStages()
    yield pipeline
    for handoff in pipeline.handoffs:
        handoff.check_integrity()
        handoff.close()
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
    stages.table(request_id, src, num_tokens)
    for handoff in stages.handoffs:
        for start, end in ranges:
            handoff.stream(request_id, start, end, dest)


def push_final(stages, request_id, src, dest, num_tokens) -> None:
    for owner, handoff in zip(stages.owners, stages.handoffs, strict=True):
        blocks = owner.ship(request_id, src)
        handoff.ship(request_id, blocks, manifest(src, num_tokens), dest)


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("skip_blocks", [0, 1])
def test_streamed_ranges_then_final_push_ship_exactly_the_delta(decode, stages, pool, skip_blocks):
    num_tokens, skip = 29, skip_blocks * POOLS[pool][0]
    src = prefill_blocks(num_tokens, seed=10 + skip_blocks)
    rid = f"stream-{pool}-{skip}"
    dest = engine_dest(decode.call("expect", pool, rid, num_tokens, skip), pool, skip_blocks)
    posted = [s.parts_posted for s in stages.handoffs]
    # three chunks' ranges at once: one WRITE in flight per stage, the others queue ...
    stream_ranges(stages, rid, src, dest, num_tokens, [(0, 8), (8, 16), (16, 24)])
    assert [s.parts_posted - p for s, p in zip(stages.handoffs, posted, strict=True)] == [1, 1]
    # ... and go as ONE coalesced WRITE once the first landed
    assert stages.poll_until(
        lambda: all(
            s.parts_posted - p == 2 and not s.busy
            for s, p in zip(stages.handoffs, posted, strict=True)
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
    posted = [s.parts_posted for s in stages.handoffs]
    stream_ranges(stages, rid, src, dest, num_tokens, [(0, 8), (8, 16)])
    for handoff in stages.handoffs:
        handoff.poll()  # posts (0, 8)
    push_final(stages, rid, src, dest, num_tokens)  # (8, 16) never got a WRITE of its own
    assert all(r.ok for r in stages.results(rid))
    assert [s.parts_posted - p for s, p in zip(stages.handoffs, posted, strict=True)] == [1, 1]
    assert decode.call("wait", pool, rid) == (None, 0)
    assert_shipped(decode, stages, pool, dest.block_ids, 0, num_tokens, src)
    assert stages.balanced()


def test_cancel_mid_stream_fails_decodes_attempt_and_a_retry_is_exact(decode, stages):
    num_tokens, pool = 27, "direct"  # (the bf16 pool is used up by the tests above)
    src = prefill_blocks(num_tokens, seed=30)
    rid = "stream-cancel"
    dest = engine_dest(decode.call("expect", pool, rid, num_tokens, 0), pool, 0)
    stream_ranges(stages, rid, src, dest, num_tokens, [(0, 12)])
    assert stages.poll_until(lambda: not any(s.busy for s in stages.handoffs))
    for handoff in stages.handoffs:
        handoff.cancel(rid)
    assert decode.call("wait", pool, rid) == ("TransferFailed", 0)  # told, not timed out
    assert stages.balanced()
    # late calls of the cancelled request are dropped, their references given back at once
    stream_ranges(stages, rid, src, dest, num_tokens, [(12, 20)])
    push_final(stages, rid, src, dest, num_tokens)
    for handoff in stages.handoffs:
        handoff.poll()
    assert stages.balanced() and not any(h.busy for h in stages.handoffs)
    assert not any(o.request_id == rid for outcomes in stages.outcomes for o in outcomes)
    for handoff in stages.handoffs:  # the id is admitted again: a new attempt
        handoff.supersede([rid])
    retry = engine_dest(decode.call("expect", pool, rid, num_tokens, 0), pool, 0)
    assert retry.transfer_id != dest.transfer_id
    ignored = decode.call("stats", pool)
    sender = stages.handoffs[0].sender  # late notes of the old attempt: ignored by the retry
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
    for handoff in stages.handoffs:
        handoff.check_integrity()


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
                for handoff in stages.handoffs:
                    handoff.poll()  # posts the range (the peer is known)
            for owner, handoff in zip(stages.owners, stages.handoffs, strict=True):
                back, posted = owner.given_back, handoff.sender.writes_posted
                blocks = owner.ship(rid, src)  # its final push: queued behind the range
                handoff.ship(rid, blocks, manifest(src, num_tokens), dest)
                deadline = time.monotonic() + 5.0
                while owner.given_back - back < 16 // PREFILL_BS:
                    assert time.monotonic() < deadline, "the streamed range never landed"
                    handoff.poll()
                    time.sleep(0.001)
                if attempt == "tail":  # the range's end seen, and the final push posted
                    assert handoff.sender.writes_posted == posted + 1
            assert all(r.ok for r in stages.results(rid))
            assert decode.call("wait", pool, rid) == (None, 0)
            assert_shipped(decode, stages, pool, dest.block_ids, 0, num_tokens, src)
        assert stages.balanced()
    finally:
        for handoff in stages.handoffs:
            handoff.check_integrity()
            handoff.close()


def test_layer_group_ends_split_a_stage_with_the_smallest_group_last():
    config = KVHandoffConfig()
    assert config.layer_group_ends(0, 15) == (4, 8, 12)  # groups of 4, 4, 4 and 3 layers
    assert config.layer_group_ends(2, 4) == (3,)
    assert config.layer_group_ends(5, 6) == ()  # one layer: one group, the final push's
    assert replace(config, stream_layer_groups=1).layer_group_ends(0, 15) == ()
    assert replace(config, stream=False).layer_group_ends(0, 15) == ()
    with pytest.raises(InvalidRequestError):
        KVHandoffConfig(stream_layer_groups=0)


def stream_first_layer(stages, request_id, src, dest, num_tokens, start) -> None:
    """The last chunk (from ``start``) of stage s's first layer [2s, 2s + 1), every block
    to the prompt's end (the partial last one too)."""
    stages.table(request_id, src, num_tokens)
    for s, handoff in enumerate(stages.handoffs):
        handoff.stream(request_id, start, num_tokens, dest, layer_end=2 * s + 1)


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
    posted = [s.parts_posted for s in stages.handoffs]
    stream_ranges(stages, rid, src, dest, num_tokens, [(0, 8), (8, 16)])
    stream_first_layer(stages, rid, src, dest, num_tokens, 16)
    assert [s.parts_posted - p for s, p in zip(stages.handoffs, posted, strict=True)] == [1, 1]
    assert stages.poll_until(
        lambda: all(
            s.parts_posted - p == 3 and not s.busy
            for s, p in zip(stages.handoffs, posted, strict=True)
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
    assert stages.poll_until(lambda: not any(s.busy for s in stages.handoffs))
    posted = [(s.parts_posted, s.sender.writes_posted) for s in stages.handoffs]
    stream_first_layer(stages, rid, src, dest, num_tokens, 16)  # handed to the sender ...
    assert all(s.sender.parts_inflight == 1 for s in stages.handoffs)
    push_final(stages, rid, src, dest, num_tokens)  # ... and taken back, unposted
    assert all(s.sender.parts_inflight == 0 for s in stages.handoffs)
    assert all(r.ok for r in stages.results(rid))
    after = [(s.parts_posted, s.sender.writes_posted) for s in stages.handoffs]
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
    assert stages.poll_until(lambda: not any(s.busy for s in stages.handoffs))
    for handoff in stages.handoffs:
        handoff.cancel(rid)
    assert convert_decode.call("wait", pool, rid) == ("TransferFailed", 0)
    assert stages.balanced()
    for handoff in stages.handoffs:
        handoff.check_integrity()


def test_a_reception_is_due_once_a_stage_streamed_its_last_token(direct_decode, stages):
    """KVReceiver.due (what makes a decode worker poll at its fastest): not while streamed
    parts stop short of the prompt's end, yes once a stage's layer group reached it (its
    final push follows within about one group's compute), and no longer once it ended."""
    num_tokens, pool = 21, "direct"
    src = prefill_blocks(num_tokens, seed=40)
    rid = "stream-due"
    dest = engine_dest(direct_decode.call("expect", pool, rid, num_tokens, 0), pool, 0)
    stream_ranges(stages, rid, src, dest, num_tokens, [(0, 16)])
    assert stages.poll_until(lambda: not any(s.busy for s in stages.handoffs))
    assert direct_decode.call("still_pending", pool, rid, 0.2)
    assert not direct_decode.call("due", pool)
    first = stages.handoffs[0]  # its first layer of the last chunk, to the prompt's end
    first.stream(rid, 16, num_tokens, dest, layer_end=1)
    assert stages.poll_until(lambda: not first.busy)
    assert direct_decode.call("still_pending", pool, rid, 0.2) and direct_decode.call("due", pool)
    push_final(stages, rid, src, dest, num_tokens)
    assert all(r.ok for r in stages.results(rid))
    assert direct_decode.call("wait", pool, rid) == (None, 0)
    assert not direct_decode.call("due", pool)
    assert_shipped(direct_decode, stages, pool, dest.block_ids, 0, num_tokens, src)
    assert stages.balanced()
