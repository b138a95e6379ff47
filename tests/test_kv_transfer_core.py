"""kv_transfer without NIXL: layout serialisation, transfer planning, exact conversion,
allow-list, notifications and pull leases (injectable clock)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_transfer.allowlist import AllowList
from kv_transfer.convert import convert_kv, gather_tokens
from kv_transfer.errors import DestinationNotAllowed, InvalidTransferRequest, LayoutMismatch
from kv_transfer.layout import KVLayout, MemoryRegion, layout_of_tensors
from kv_transfer.lease import PullLeaseTable, ReleaseReason
from kv_transfer.messages import Notification, PushDestination, StageManifest
from kv_transfer.plan import PageMap, build_descriptors, token_runs


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_layout_round_trips_through_dict_and_describes_tensors():
    pool = [torch.zeros(6, 2, 4, 2, 8, dtype=torch.bfloat16) for _ in range(3)]
    layout = layout_of_tensors(5, pool)
    assert (layout.layer_start, layout.layer_end, layout.block_size) == (5, 8, 4)
    assert layout.dtype == "bfloat16" and layout.token_bytes == 2 * 8 * 2
    assert layout.regions[1] == MemoryRegion(pool[1].data_ptr(), 6 * 2 * 4 * 2 * 8 * 2)
    assert KVLayout.from_dict(layout.to_dict()) == layout
    assert layout.layer_slice(6, 8).regions == layout.regions[1:]
    with pytest.raises(InvalidTransferRequest, match="dtype"):
        KVLayout.from_dict({**layout.to_dict(), "dtype": "complex64"})
    with pytest.raises(InvalidTransferRequest, match="malformed"):
        KVLayout.from_dict({"layer_start": 0})
    other = KVLayout(0, 8, 4, 16, 4, 8, "float32")
    with pytest.raises(LayoutMismatch, match="heads"):
        other.check_compatible(layout)


def test_wire_types_round_trip():
    dest = PushDestination("r", "127.0.0.1:5", (3, 1), 20, 16, "r#d#0")
    assert PushDestination.from_dict(dest.to_dict()) == dest
    layout = KVLayout(0, 2, 4, 16, 2, 8, "float32", ())
    manifest = StageManifest("r", 1, 2, "h:1", "a", layout, (1, 2), 20, "a-lease-0", 3.0)
    assert StageManifest.from_dict(manifest.to_dict()) == manifest
    note = Notification("done", "r#d#0", 1, 2, 4, 8)
    assert Notification.decode(note.encode()) == note
    assert Notification.decode(b"somebody else's message") is None
    assert Notification.decode(b"kvx1 {not json") is None
    assert Notification.decode(b'kvx1 {"kind":"evil"}') is None


@settings(max_examples=200, deadline=None)
@given(
    src_bs=st.integers(1, 9),
    dst_bs=st.integers(1, 9),
    num_tokens=st.integers(0, 60),
    data=st.data(),
)
def test_token_runs_cover_the_range_once_and_stay_inside_blocks(src_bs, dst_bs, num_tokens, data):
    skip = data.draw(st.integers(0, num_tokens // dst_bs)) * dst_bs
    src = PageMap(tuple(range(100, 100 + -(-num_tokens // src_bs))), src_bs)
    dst = PageMap(tuple(range(50, 50 + -(-(num_tokens - skip) // dst_bs))), dst_bs, skip)
    runs = token_runs(src, dst, skip, num_tokens)
    assert runs[:, 4].sum() == num_tokens - skip
    position = skip
    for sb, so, db, do, n in runs.tolist():
        assert n > 0 and so + n <= src_bs and do + n <= dst_bs
        assert (sb - 100) * src_bs + so == position
        assert skip + (db - 50) * dst_bs + do == position
        position += n


def test_token_runs_reject_blocks_that_do_not_hold_the_range():
    with pytest.raises(InvalidTransferRequest, match="destination blocks hold"):
        token_runs(PageMap((0, 1), 4), PageMap((0,), 4, 0), 0, 8)


def test_descriptors_merge_contiguous_blocks_and_keep_bytes():
    src = KVLayout(
        0, 2, 8, 4, 1, 2, "float32", tuple(MemoryRegion(a, 8 * 64) for a in (4096, 65536))
    )
    dst = KVLayout(
        0, 2, 8, 4, 1, 2, "float32", tuple(MemoryRegion(a, 8 * 64) for a in (8192, 131072))
    )
    runs = token_runs(PageMap((2, 3, 5), 4), PageMap((0, 1, 2), 4), 0, 12)
    descs = build_descriptors(runs, src, dst, range(0, 2), src_is_local=True)
    # blocks 2,3 are adjacent on both sides -> one piece; 5 follows 3 only on the destination
    assert descs.local[:, :2].tolist() == [
        [4096 + 128, 128],
        [4096 + 320, 64],
        [65536 + 128, 128],
        [65536 + 320, 64],
    ]
    assert descs.remote[:, :2].tolist() == [
        [8192, 128],
        [8192 + 128, 64],
        [131072, 128],
        [131072 + 128, 64],
    ]
    assert descs.num_bytes == 2 * 12 * 2 * 8
    with pytest.raises(LayoutMismatch, match="dtype"):
        build_descriptors(runs, src, KVLayout(0, 2, 8, 4, 1, 2, "bfloat16", ()), range(2), True)


def _pieces(descs, token_bytes: int) -> list[tuple[int, int]]:
    """(source, destination) address of every token-sized piece a descriptor list moves."""
    out = []
    for (s, n, _), (d, m, _) in zip(descs.local.tolist(), descs.remote.tolist(), strict=True):
        assert n == m and n % token_bytes == 0
        out += [(s + k, d + k) for k in range(0, n, token_bytes)]
    return out


@settings(max_examples=150, deadline=None)
@given(
    src_bs=st.sampled_from([1, 2, 3, 4, 8]),
    dst_bs=st.sampled_from([1, 2, 4, 6, 8, 16]),
    planes=st.sampled_from([1, 2]),
    adjacent=st.booleans(),
    data=st.data(),
)
def test_descriptors_move_each_token_of_each_layer_once_merged_maximally(
    src_bs, dst_bs, planes, adjacent, data
):
    """The vectorized descriptors against a token-by-token model: the same (source,
    destination) pieces, each once; no two neighbours left mergeable
    (layer tensors packed back to back, ``adjacent``, merge across layers too)."""
    layers, blocks, token_bytes = 3, 10, 2 * 3 * 4

    def layout(bs: int, base: int) -> KVLayout:
        size = blocks * planes * bs * token_bytes
        gap = 0 if adjacent else 4096
        regions = tuple(MemoryRegion(base + i * (size + gap), size) for i in range(layers))
        return KVLayout(0, layers, blocks, bs, 2, 3, "float32", regions, planes)

    src, dst = layout(src_bs, 1 << 20), layout(dst_bs, 1 << 30)
    num_tokens = data.draw(st.integers(1, blocks * min(src_bs, dst_bs)))
    skip = data.draw(st.integers(0, (num_tokens - 1) // dst_bs)) * dst_bs
    start = data.draw(st.integers(skip, num_tokens))
    src_ids = data.draw(st.permutations(range(blocks)))[: -(-num_tokens // src_bs)]
    dst_ids = data.draw(st.permutations(range(blocks)))[: -(-(num_tokens - skip) // dst_bs)]
    chosen = data.draw(st.lists(st.integers(0, layers - 1), unique=True, min_size=1))
    which = data.draw(st.sampled_from([range(min(chosen), layers), sorted(chosen)]))
    src_pages, dst_pages = PageMap(tuple(src_ids), src_bs), PageMap(tuple(dst_ids), dst_bs, skip)
    descs = build_descriptors(
        token_runs(src_pages, dst_pages, start, num_tokens), src, dst, which, True
    )
    want = []
    for layer in which:
        for token in range(start, num_tokens):
            for plane in range(planes):
                at = []
                for lay, pages in ((src, src_pages), (dst, dst_pages)):
                    rel = token - pages.origin
                    at.append(
                        lay.regions[layer].base_addr
                        + pages.block_ids[rel // pages.block_size] * lay.block_bytes
                        + plane * lay.page_bytes
                        + rel % pages.block_size * token_bytes
                    )
                want.append(tuple(at))
    got = _pieces(descs, token_bytes)
    assert sorted(got) == sorted(want) and len(got) == len(want)  # each piece exactly once
    rows = list(zip(descs.local.tolist(), descs.remote.tolist(), strict=True))
    for ((s0, n0, _), (d0, _, _)), ((s1, _, _), (d1, _, _)) in zip(rows, rows[1:], strict=False):
        assert not (s1 == s0 + n0 and d1 == d0 + n0), "two mergeable neighbours"
    assert descs.local.dtype == descs.remote.dtype == np.uint64


@pytest.mark.parametrize(
    ("src_bs", "dst_bs", "src_dtype", "dst_dtype"),
    [
        (4, 8, torch.float32, torch.float32),
        (16, 4, torch.bfloat16, torch.float32),
        (4, 6, torch.float16, torch.float32),
    ],
)
def test_layout_conversion_round_trip_is_exact(src_bs, dst_bs, src_dtype, dst_dtype):
    gen = torch.Generator().manual_seed(1)
    num_tokens, skip = 37, 2 * dst_bs
    src_blocks = tuple(torch.randperm(20, generator=gen)[: -(-num_tokens // src_bs)].tolist())
    dst_blocks = tuple(
        torch.randperm(30, generator=gen)[: -(-(num_tokens - skip) // dst_bs)].tolist()
    )
    src = [torch.randn(20, 2, src_bs, 2, 3, generator=gen).to(src_dtype) for _ in range(2)]
    dst = [torch.full((30, 2, dst_bs, 2, 3), 7.0, dtype=dst_dtype) for _ in range(2)]
    back = [torch.zeros_like(t) for t in src]
    src_pages, dst_pages = PageMap(src_blocks, src_bs), PageMap(dst_blocks, dst_bs, skip)
    convert_kv(src, src_pages, dst, dst_pages, skip, num_tokens)
    convert_kv(dst, dst_pages, back, src_pages, skip, num_tokens)
    for s, d, b in zip(src, dst, back, strict=True):
        want = gather_tokens(s, src_pages, skip, num_tokens)
        assert torch.equal(gather_tokens(d, dst_pages, skip, num_tokens), want.to(dst_dtype))
        assert torch.equal(
            gather_tokens(b, src_pages, skip, num_tokens).view(torch.uint8), want.view(torch.uint8)
        )
        untouched = np.setdiff1d(np.arange(30), dst_blocks)
        assert bool((d[torch.as_tensor(untouched)] == 7.0).all())


def test_allow_list_by_cidr_and_by_agent_name():
    loop = AllowList.loopback()
    assert loop.check_host("127.0.0.1") and loop.check_host("localhost")
    with pytest.raises(DestinationNotAllowed, match="outside"):
        AllowList.parse(["10.0.0.0/8"]).check_host("127.0.0.1")
    with pytest.raises(DestinationNotAllowed):
        AllowList().check_host("127.0.0.1")
    names = AllowList.parse([], ["decode-a"])
    assert names.check_host("127.0.0.1") is False  # decided after the handshake
    names.check_agent(False, "decode-a")
    with pytest.raises(DestinationNotAllowed, match="decode-b"):
        names.check_agent(False, "decode-b")
    with pytest.raises(InvalidTransferRequest, match="CIDR"):
        AllowList.parse(["not-a-net"])


def test_lease_expires_without_heartbeat_and_heartbeat_renews():
    clock, ended = FakeClock(), []
    table = PullLeaseTable(10.0, lambda lease, why: ended.append((lease.request_id, why)), clock)
    a = table.grant("a", (1, 2))
    b = table.grant("b", (3,))
    clock.now += 6
    assert table.renew(a.lease_id)
    clock.now += 6  # b is 12 s old, a was renewed 6 s ago
    assert table.expire() == [b] and ended == [("b", ReleaseReason.EXPIRED)]
    assert not table.renew(b.lease_id) and not table.release(b.lease_id)
    assert table.release(a.lease_id)
    assert ended[-1] == ("a", ReleaseReason.RELEASED) and len(table) == 0
    assert not table.release(a.lease_id) and len(ended) == 2  # callbacks exactly once
    table.check_integrity()


def test_lease_heartbeat_after_deadline_expires_instead_of_renewing():
    clock, ended = FakeClock(), []
    table = PullLeaseTable(1.0, lambda lease, why: ended.append(why), clock)
    lease = table.grant("a", (1,))
    clock.now += 1.0
    assert not table.renew(lease.lease_id) and ended == [ReleaseReason.EXPIRED]
    table.grant("b", (2,))
    assert table.revoke_all() == 1 and ended[-1] == ReleaseReason.REVOKED
    table.check_integrity()


def test_a_lease_granted_with_its_own_ttl_keeps_it_across_heartbeats():
    clock, ended = FakeClock(), []
    table = PullLeaseTable(10.0, lambda lease, why: ended.append(lease.request_id), clock)
    short = table.grant("short", (1,), ttl_s=2.0)
    long = table.grant("long", (2,))
    assert (short.ttl_s, long.ttl_s) == (2.0, 10.0)
    clock.now += 1.5
    assert table.renew(short.lease_id)  # deadline now 1.5 + 2.0, not + 10
    clock.now += 2.0
    assert [lease.request_id for lease in table.expire()] == ["short"]
    assert ended == ["short"] and long.lease_id in table
    with pytest.raises(InvalidTransferRequest, match="positive"):
        table.grant("bad", (3,), ttl_s=0.0)
    table.check_integrity()


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["grant", "renew", "release", "tick"]), st.integers(0, 5)),
        max_size=40,
    )
)
def test_lease_table_ends_every_lease_exactly_once(ops):
    clock, ended = FakeClock(), []
    table = PullLeaseTable(3.0, lambda lease, why: ended.append(lease.lease_id), clock)
    granted = []
    for op, arg in ops:
        if op == "grant":
            granted.append(table.grant(f"r{arg}", (arg,)).lease_id)
        elif op == "renew" and granted:
            table.renew(granted[arg % len(granted)])
        elif op == "release" and granted:
            table.release(granted[arg % len(granted)])
        else:
            clock.now += arg
            table.expire()
        table.check_integrity()
    assert len(ended) == len(set(ended))
    assert set(ended) | {lid for lid in granted if lid in table} == set(granted)


def test_metadata_endpoint_serves_peer_info_and_rejects_garbage():
    from kv_transfer.errors import DecodeUnreachable
    from kv_transfer.handshake import MetadataServer, PeerInfo, fetch_peer, split_endpoint

    layout = KVLayout(0, 2, 4, 16, 2, 8, "bfloat16", ())
    info = PeerInfo("decode-0", bytes(range(256)), layout)
    server = MetadataServer(info)
    try:
        assert fetch_peer(server.endpoint, 2.0) == info
        server.update(PeerInfo("decode-0", b"new", layout))
        assert fetch_peer(server.endpoint, 2.0).metadata == b"new"
    finally:
        server.close()
    with pytest.raises(DecodeUnreachable):
        fetch_peer(server.endpoint, 2.0)  # closed now
    with pytest.raises(InvalidTransferRequest, match="malformed peer metadata"):
        PeerInfo.from_json(b'{"agent_name": "x"}')
    assert split_endpoint("[::1]:80") == ("::1", 80)
    for bad in ("no-port", "host:0", "host:http", ":80"):
        with pytest.raises(InvalidTransferRequest, match="host:port"):
            split_endpoint(bad)


def test_staging_pool_reuses_registered_buffers_and_caps_idle_bytes():
    from kv_transfer.staging import StagingPool

    registered, dropped = [], []
    pool = StagingPool(
        lambda t: registered.append(t.numel()) or len(registered),
        dropped.append,
        max_cached_bytes=3000,
    )
    cpu = torch.device("cpu")
    a = pool.acquire((2, 250), torch.float32, cpu)  # 2000 bytes
    b = pool.acquire((10,), torch.bfloat16, cpu)  # 20 bytes
    assert a.tensor.shape == (2, 250) and a.tensor.dtype == torch.float32
    assert registered == [2000, 20] and pool.in_use == 2
    pool.release(a)
    c = pool.acquire((100,), torch.float16, cpu)  # 200 bytes: reuses the idle 2000-byte one
    assert registered == [2000, 20] and c.registration == a.registration
    pool.release(b)
    pool.release(c)
    d = pool.acquire((400,), torch.float64, cpu)  # 3200 bytes: nothing fits, a new one
    pool.release(d)  # idle 20 + 2000 + 3200 > 3000: the largest goes
    assert dropped == [3] and pool.cached_bytes == 2020 and pool.in_use == 0
    pool.close()
    assert sorted(dropped) == [1, 2, 3]


def test_a_wildcard_metadata_endpoint_advertises_the_pod_ip_of_either_family(monkeypatch):
    """Bound to every address, the endpoint names $POD_IP (what Kubernetes routes to the pod,
    IPv6 included), not the hostname's IPv4 address; `::` binds IPv6 and is reachable there."""
    from kv_transfer.handshake import MetadataServer, PeerInfo, fetch_peer

    info = PeerInfo("stage-1", b"meta", KVLayout(0, 2, 4, 16, 2, 8, "bfloat16", ()))
    monkeypatch.setenv("POD_IP", "10.8.3.7")
    server = MetadataServer(info, host="0.0.0.0")
    try:
        assert server.endpoint.rpartition(":")[0] == "10.8.3.7"
    finally:
        server.close()
    monkeypatch.setenv("POD_IP", "::1")
    server = MetadataServer(info, host="::")
    try:
        host, _, port = server.endpoint.rpartition(":")
        assert host == "[::1]"
        assert fetch_peer(server.endpoint, 2.0) == info
    finally:
        server.close()
    monkeypatch.delenv("POD_IP")
    server = MetadataServer(info, host="0.0.0.0")
    try:  # no POD_IP (local runs): the hostname's address, reachable here
        assert fetch_peer(server.endpoint, 2.0) == info
    finally:
        server.close()
