"""Prepared WRITEs (kv_transfer/prepared.py) over real NIXL: a stage's sender with prepared
descriptor lists and one without push the same KV (clones) to a spawned decode process; the
two destinations must hold the same bytes, the exact source tokens, and leave a partial last
block's unused slots untouched. Prepared lists serve only whole blocks of one block size:
the partial last block, and a decode pool of another block size, go the general way."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kv_transfer.agent import KVAgent
from kv_transfer.allowlist import AllowList
from kv_transfer.convert import gather_tokens
from kv_transfer.layout import DTYPE_SIZES, KVLayout, MemoryRegion
from kv_transfer.messages import PushDestination
from kv_transfer.plan import PageMap
from kv_transfer.prepared import prepared_fits
from kv_transfer.progress import KVProgress
from kv_transfer.sender import KVSender, SenderConfig
from tests.test_kv_transfer_nixl import (
    HEAD_DIM,
    HEADS,
    LAYERS,
    PREFILL_BLOCKS,
    PREFILL_BS,
    SENTINEL,
    Decode,
    prefill_blocks,
)

POOLS = {"same": (PREFILL_BS, "float32"), "wide": (2 * PREFILL_BS, "float32")}


def test_prepared_writes_take_whole_blocks_of_one_block_size_only():
    def layout(bs: int, dtype: str = "float32", start: int = 0) -> KVLayout:
        size = 8 * 2 * bs * 2 * 4 * DTYPE_SIZES[dtype]
        regions = tuple(MemoryRegion(4096 * (i + 1) << 20, size) for i in range(2))
        return KVLayout(start, start + 2, 8, bs, 2, 4, dtype, regions)

    src, dst = PageMap((3, 1, 4), 4), PageMap((0, 5), 4, 4)  # decode holds tokens [0, 4)
    same = layout(4)
    assert prepared_fits(same, layout(4), (0, 2), src, dst, 4, 12)
    assert prepared_fits(same, layout(4), (1, 2), src, dst, 8, 12)  # a layer group
    assert not prepared_fits(same, layout(4), (0, 2), src, dst, 4, 11)  # partial last block
    assert not prepared_fits(same, layout(4), (0, 2), src, PageMap((0, 5), 4, 2), 6, 12)
    assert not prepared_fits(same, layout(8), (0, 2), src, PageMap((0,), 8, 4), 4, 12)
    assert not prepared_fits(same, layout(4, "bfloat16"), (0, 2), src, dst, 4, 12)
    assert not prepared_fits(same, layout(4, start=1), (0, 2), src, dst, 4, 12)  # lacks layer 0
    assert not prepared_fits(same, layout(4), (0, 2), src, dst, 8, 8)  # nothing to move


class Senders:
    """One stage holding every layer, twice: prepared lists on and off, same KV (clones)."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(7)
        self.kv = [
            torch.randn(PREFILL_BLOCKS, 2, PREFILL_BS, HEADS, HEAD_DIM, generator=gen)
            for _ in range(LAYERS)
        ]
        self.senders = {
            prepared: KVSender(
                KVAgent(f"prepared-{prepared}-{id(self)}", progress=KVProgress.OWNER),
                [t.clone() for t in self.kv],
                0,
                SenderConfig(
                    0, 1, AllowList.loopback(), transfer_timeout_s=5.0, prepared_writes=prepared
                ),
            )
            for prepared in (True, False)
        }

    def close(self) -> None:
        for sender in self.senders.values():
            sender.check_integrity()
            sender.close()


@pytest.fixture(scope="module")
def decode() -> Iterator[Decode]:
    worker = Decode(POOLS)
    yield worker
    worker.stop()


@pytest.fixture(scope="module")
def senders() -> Iterator[Senders]:
    pair = Senders()
    yield pair
    pair.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("pool", "num_tokens", "skip_blocks", "prepared_writes"),
    [
        ("same", 24, 0, 4),  # every WRITE whole blocks: ranges, a layer group, the final push
        ("same", 23, 1, 2),  # the layer group and the final push end in a partial block
        ("wide", 24, 0, 0),  # another block size: general
    ],
)
def test_prepared_and_general_writes_land_the_same_bytes(
    decode, senders, pool, num_tokens, skip_blocks, prepared_writes
):
    skip = skip_blocks * POOLS[pool][0]
    src = prefill_blocks(num_tokens, seed=num_tokens + skip)
    got = {}
    for prepared, sender in senders.senders.items():
        rid = f"prepared-{pool}-{num_tokens}-{prepared}"
        dest = PushDestination.from_dict(decode.call("expect", pool, rid, num_tokens, skip))
        before = (sender.prepared_posted, sender.writes_posted)
        for start, end in ((skip, 12), (12, 16)):
            sender.stream(dest, src, start, end)
        sender.stream(dest, src, 16, num_tokens, (0, 2))  # the last chunk's first layers
        sender.push(dest, src, num_tokens, 16, first_layer=2)
        outcome = sender.wait(rid, 10)
        assert outcome.ok, outcome.error
        assert decode.call("wait", pool, rid) == (None, 0)
        counts = (sender.prepared_posted - before[0], sender.writes_posted - before[1])
        assert counts == (prepared_writes if prepared else 0, 4)
        got[prepared] = decode.call("tokens", pool, dest.block_ids, skip, num_tokens)
        shipped, tail = got[prepared]
        for layer, tensor in enumerate(senders.kv):
            want = gather_tokens(tensor, PageMap(src, PREFILL_BS), skip, num_tokens)
            assert torch.equal(shipped[layer].view(torch.uint8), want.view(torch.uint8))
        filled = (num_tokens - skip) % POOLS[pool][0]
        if filled:  # the last destination block's unused slots are untouched
            assert bool((tail[:, filled:] == SENTINEL).all())
    (a, a_tail), (b, b_tail) = got[True], got[False]
    assert all(
        torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b, strict=True)
    )
    assert torch.equal(a_tail.view(torch.uint8), b_tail.view(torch.uint8))


@pytest.mark.slow
def test_a_peer_forgotten_releases_its_prepared_list(decode, senders):
    sender = senders.senders[True]
    peer = next(iter(sender._peers.values()))
    assert peer.agent_name in sender.agent._prepared and "" in sender.agent._prepared
    sender.agent.forget_remote(peer.agent_name)
    assert peer.agent_name not in sender.agent._prepared
    sender.agent.load_remote(peer.agent_name, peer.metadata)  # the next WRITE prepares again
