"""KV hand-off over real NIXL (UCX, DRAM): two prefill stages in this process, decode workers
in spawned processes. Every wait is bounded; the decode pools differ from prefill's in block
size and/or dtype, and shipped tokens must equal the exact conversion bit for bit."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import socket
import sys
import time
from collections.abc import Iterator

import pytest
import torch

from kv_transfer.agent import KVAgent
from kv_transfer.allowlist import AllowList
from kv_transfer.convert import gather_tokens, kv_parts
from kv_transfer.errors import (
    DecodeUnreachable,
    DestinationNotAllowed,
    InvalidTransferRequest,
    TransferFailed,
    TransferTimeout,
)
from kv_transfer.lease import ReleaseReason
from kv_transfer.messages import Notification, PushDestination, StageManifest
from kv_transfer.plan import PageMap
from kv_transfer.progress import KVProgress
from kv_transfer.sender import KVSender, SenderConfig

pytestmark = pytest.mark.slow

LAYERS, HEADS, HEAD_DIM, PREFILL_BS, PREFILL_BLOCKS = 4, 2, 8, 4, 24
SENTINEL = 7.0
# decode pools: name -> (block size, dtype); "direct" moves bytes as-is, "convert" casts
POOLS = {"direct": (8, "float32"), "convert": (2, "bfloat16")}
# pools in vLLM's CPU cache layout (K and V strided views NIXL cannot address: staged READs)
VLLM_POOLS = {"vllm": (32, "float32"), "vllm-bf16": (16, "bfloat16")}
ALL_POOLS = POOLS | VLLM_POOLS


# ------------------------------------------------------------------ decode worker process
def decode_worker(conn, pools: dict[str, tuple[int, str]], timeout_s: float) -> None:
    """A decode loop: polls its receivers between commands (no NIXL progress thread)."""
    from kv_transfer.receiver import KVReceiver, ReceiverConfig
    from kv_transfer.vllm_decode.cache import paged_kv

    receivers, raw = {}, {}
    for name, (block_size, dtype) in pools.items():
        vllm = name in VLLM_POOLS
        shape = (
            (32, HEADS, block_size, 2 * HEAD_DIM) if vllm else (32, 2, block_size, HEADS, HEAD_DIM)
        )
        raw[name] = [
            torch.full(shape, SENTINEL, dtype=getattr(torch, dtype)) for _ in range(LAYERS)
        ]
        pool = [paged_kv(t, HEADS, HEAD_DIM) for t in raw[name]] if vllm else raw[name]
        agent = KVAgent(f"decode-{name}-{mp.current_process().pid}", progress=KVProgress.OWNER)
        rx = KVReceiver(agent, pool, ReceiverConfig(timeout_s=timeout_s), registered=not vllm)
        scrambled = rx.allocate(32)  # scramble the free list: destinations are not contiguous
        rx.free(scrambled[::-1][::2] + scrambled[::-1][1::2])
        receivers[name] = rx
    ended: dict[str, tuple] = {}

    def pump() -> None:
        for rx in receivers.values():
            for o in rx.poll():
                ended[o.request_id] = (type(o.error).__name__ if o.error else None, o.num_bytes)

    def outcome(request_id: str, timeout: float = 10.0) -> tuple | None:
        deadline = time.monotonic() + timeout
        while request_id not in ended and time.monotonic() < deadline:
            pump()
            time.sleep(0.0005)
        return ended.pop(request_id, None)

    conn.send({name: rx.endpoint for name, rx in receivers.items()})
    idle_until = time.monotonic() + 120
    while time.monotonic() < idle_until:
        if not conn.poll(0.001):
            pump()
            continue
        op, name, *args = conn.recv()
        rx = receivers.get(name)
        if op == "stop":
            break
        if op == "expect":
            request_id, num_tokens, skip, *timeout = args
            num_blocks = -(-(num_tokens - skip) // rx.layout.block_size)
            blocks = rx.allocate(num_blocks)
            try:
                conn.send(rx.expect(request_id, blocks, num_tokens, skip, *timeout).to_dict())
            except InvalidTransferRequest as exc:
                rx.free(blocks)
                rx.check_integrity()
                conn.send(("error", str(exc)))
        elif op == "pull":
            manifests, num_blocks, skip = args
            blocks = rx.allocate(num_blocks)
            rx.pull([StageManifest.from_dict(m) for m in manifests], blocks, skip)
            conn.send(outcome(manifests[0]["request_id"]) + (blocks,))
        elif op == "wait":
            result = outcome(args[0])
            rx.check_integrity()
            conn.send(result)
        elif op == "still_pending":
            conn.send(outcome(args[0], timeout=args[1]) is None)
        elif op == "tokens":
            blocks, skip, num_tokens = args
            pages = PageMap(tuple(blocks), rx.layout.block_size, skip)
            tail = torch.stack([part[blocks[-1]] for part in kv_parts(rx.kv_caches[0])])
            conn.send(([gather_tokens(t, pages, skip, num_tokens) for t in rx.kv_caches], tail))
        elif op == "changed":  # elements of the raw pool no longer SENTINEL (all layers)
            conn.send(sum(int((t != SENTINEL).sum()) for t in raw[name]))
        elif op == "sleep":  # a stalled decode: no NIXL progress at all
            time.sleep(args[0])
        elif op == "modules":  # what a decode worker importing only kv_transfer loaded
            conn.send(sorted({m.split(".")[0] for m in sys.modules}))
        elif op == "due":  # KVReceiver.due, after taking what arrived
            pump()
            conn.send(rx.due)
        elif op == "stats":
            pump()
            rx.check_integrity()
            conn.send(rx.ignored_notifications)
    for rx in receivers.values():
        rx.close()


class Decode:
    """Parent-side handle of a decode worker; every call is bounded."""

    def __init__(self, pools: dict[str, tuple[int, str]], timeout_s: float = 2.0) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=decode_worker, args=(child, pools, timeout_s), daemon=True)
        self.proc.start()
        self.endpoints = self._recv(60)

    def _recv(self, timeout: float):
        if not self.conn.poll(timeout):
            raise TimeoutError("decode worker did not answer")
        return self.conn.recv()

    def call(self, *cmd, timeout: float = 15, pump=None):
        """Send a command; ``pump`` runs while waiting (a prefill stage keeps polling)."""
        self.conn.send(cmd)
        deadline = time.monotonic() + timeout
        while pump is not None and not self.conn.poll(0.0005) and time.monotonic() < deadline:
            pump()
        return self._recv(max(deadline - time.monotonic(), 0.0))

    def stop(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(("stop", None))
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


# ------------------------------------------------------------------ prefill side
class Stages:
    """Two prefill stages (layers [0,2) and [2,4)), each with its own agent and pool."""

    def __init__(
        self,
        allow: AllowList | None = None,
        tag: str = "",
        timeout_s: float = 3.0,
        metadata_ports: tuple[int, int] = (0, 0),
    ) -> None:
        allow = allow or AllowList.loopback()
        gen = torch.Generator().manual_seed(0)
        self.kv = [
            torch.randn(PREFILL_BLOCKS, 2, PREFILL_BS, HEADS, HEAD_DIM, generator=gen)
            for _ in range(LAYERS)
        ]
        self.outcomes, self.lease_ends = [], []
        self.senders = [
            KVSender(
                KVAgent(f"stage{s}{tag}-{id(self)}", progress=KVProgress.OWNER),
                self.kv[2 * s : 2 * s + 2],
                2 * s,
                SenderConfig(
                    s,
                    2,
                    allow,
                    transfer_timeout_s=timeout_s,
                    handshake_timeout_s=0.5,
                    lease_ttl_s=5.0,
                    metadata_port=metadata_ports[s],
                ),
                on_complete=self.outcomes.append,
                on_lease_end=lambda lease, why: self.lease_ends.append((lease.request_id, why)),
            )
            for s in range(2)
        ]

    def push(self, dest: PushDestination, blocks, num_tokens, stages=(0, 1)):
        for s in stages:
            self.senders[s].push(dest, blocks, num_tokens)
        outcomes = [self.senders[s].wait(dest.request_id, 10) for s in stages]
        for sender in self.senders:
            sender.check_integrity()
        return outcomes

    def poll(self) -> None:
        for sender in self.senders:
            sender.poll()

    def poll_until(self, predicate, timeout_s: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for sender in self.senders:
                sender.poll()
            if predicate():
                return True
            time.sleep(0.001)
        return False

    def close(self) -> None:
        for sender in self.senders:
            sender.check_integrity()
            sender.close()


@pytest.fixture(scope="module")
def decode() -> Iterator[Decode]:
    worker = Decode(ALL_POOLS)
    yield worker
    worker.stop()


@pytest.fixture(scope="module")
def stages() -> Iterator[Stages]:
    pipeline = Stages()
    yield pipeline
    pipeline.close()


def prefill_blocks(num_tokens: int, seed: int) -> tuple[int, ...]:
    order = torch.randperm(PREFILL_BLOCKS, generator=torch.Generator().manual_seed(seed))
    return tuple(order[: -(-num_tokens // PREFILL_BS)].tolist())


def assert_shipped(decode, stages, pool, dst_blocks, skip, num_tokens, src_blocks):
    got, tail = decode.call("tokens", pool, dst_blocks, skip, num_tokens)
    dtype = getattr(torch, ALL_POOLS[pool][1])
    for layer in range(LAYERS):
        want = gather_tokens(stages.kv[layer], PageMap(src_blocks, PREFILL_BS), skip, num_tokens)
        assert torch.equal(got[layer].view(torch.uint8), want.to(dtype).view(torch.uint8)), layer
    filled = (num_tokens - skip) % ALL_POOLS[pool][0]
    if filled:  # the last destination block's unused slots are untouched
        assert bool((tail[:, filled:] == SENTINEL).all())


def dest_blocks(dest: dict) -> tuple[int, ...]:
    return tuple(dest["block_ids"])


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("skip_blocks", [0, 2])
def test_push_ships_exact_kv_and_skips_decodes_cached_prefix(decode, stages, pool, skip_blocks):
    num_tokens, bs = 19, POOLS[pool][0]
    skip = skip_blocks * bs
    src = prefill_blocks(num_tokens, seed=skip_blocks)
    request_id = f"push-{pool}-{skip}"
    dest = decode.call("expect", pool, request_id, num_tokens, skip)
    outcomes = stages.push(PushDestination.from_dict(dest), src, num_tokens)
    elem = torch.finfo(getattr(torch, POOLS[pool][1])).bits // 8
    assert [o.error for o in outcomes] == [None, None]
    assert [o.num_bytes for o in outcomes] == [
        (num_tokens - skip) * 2 * 2 * HEADS * HEAD_DIM * elem
    ] * 2
    assert decode.call("wait", pool, request_id) == (None, 0)
    assert_shipped(decode, stages, pool, dest_blocks(dest), skip, num_tokens, src)


@pytest.mark.parametrize("pool", POOLS)
def test_pull_reads_exact_kv_then_releases_every_lease(decode, stages, pool):
    num_tokens, bs = 23, POOLS[pool][0]
    src = prefill_blocks(num_tokens, seed=5)
    request_id = f"pull-{pool}"
    manifests = [s.lease(request_id, src, num_tokens).to_dict() for s in stages.senders]
    num_blocks = -(-(num_tokens - bs) // bs)
    error, num_bytes, blocks = decode.call(
        "pull", pool, manifests, num_blocks, bs, pump=stages.poll
    )
    assert error is None and num_bytes > 0
    assert stages.poll_until(lambda: all(len(s.leases) == 0 for s in stages.senders))
    assert [e for e in stages.lease_ends if e[0] == request_id] == [
        (request_id, ReleaseReason.RELEASED)
    ] * 2
    assert_shipped(decode, stages, pool, blocks, bs, num_tokens, src)


def test_a_stage_restarted_at_the_same_address_is_pulled_from_first_time(decode):
    """The receiver knows each stage by its metadata address; a stage restarted there is a
    new agent, and the first pull from it must handshake anew instead of failing once."""
    num_tokens, bs = 21, POOLS["direct"][0]
    src = prefill_blocks(num_tokens, seed=11)

    def pull(stages: Stages, request_id: str) -> tuple[str | None, tuple[int, ...]]:
        manifests = [s.lease(request_id, src, num_tokens).to_dict() for s in stages.senders]
        error, _, blocks = decode.call(
            "pull", "direct", manifests, -(-num_tokens // bs), 0, pump=stages.poll
        )
        assert stages.poll_until(lambda: all(len(s.leases) == 0 for s in stages.senders))
        return error, blocks

    old = Stages(tag="-before")
    ports = tuple(int(s.endpoint.rsplit(":", 1)[1]) for s in old.senders)
    try:
        assert pull(old, "restart-0")[0] is None  # the receiver now knows both stages
    finally:
        old.close()
    new = Stages(tag="-after", metadata_ports=ports)
    try:
        assert [s.endpoint for s in new.senders] == [f"127.0.0.1:{p}" for p in ports]
        error, blocks = pull(new, "restart-1")
        assert error is None
        assert_shipped(decode, new, "direct", blocks, 0, num_tokens, src)
        assert decode.call("stats", "direct") == 0  # check_integrity on the receiver
    finally:
        new.close()


@pytest.mark.parametrize("pool", VLLM_POOLS)
def test_pull_into_vllm_cpu_cache_layout_is_staged_and_exact(decode, stages, pool):
    """The receiver READs each stage into staging and copies into vLLM's K / V views: the
    gathered tokens are exact and no other element of the raw cache changed."""
    num_tokens, bs = 45, VLLM_POOLS[pool][0]  # spans several decode blocks
    src = prefill_blocks(num_tokens, seed=8)
    request_id = f"pull-{pool}"
    manifests = [s.lease(request_id, src, num_tokens).to_dict() for s in stages.senders]
    before = decode.call("changed", pool)
    error, num_bytes, blocks = decode.call(
        "pull", pool, manifests, -(-num_tokens // bs), 0, pump=stages.poll
    )
    assert error is None
    assert num_bytes == num_tokens * LAYERS * 2 * HEADS * HEAD_DIM * 4  # read as float32
    assert stages.poll_until(lambda: all(len(s.leases) == 0 for s in stages.senders))
    assert_shipped(decode, stages, pool, blocks, 0, num_tokens, src)
    written = num_tokens * LAYERS * 2 * HEADS * HEAD_DIM
    assert decode.call("changed", pool) == before + written


def test_push_into_an_unregistered_pool_is_refused(decode):
    answer = decode.call("expect", "vllm", "push-vllm", 9, 0)
    assert answer[0] == "error" and "pull" in answer[1]


def test_duplicate_and_late_notifications_are_ignored(decode, stages):
    src = prefill_blocks(9, seed=3)
    ignored = decode.call("stats", "direct")
    dest = PushDestination.from_dict(decode.call("expect", "direct", "dup", 9, 0))
    assert stages.push(dest, src, 9, stages=(0,))[0].ok
    stage0 = stages.senders[0]
    duplicate = Notification("done", dest.transfer_id, 0, 2, 0, 2).encode()
    decode_agent = stage0._peers[dest.endpoint].agent_name
    stage0.agent.nixl.send_notif(decode_agent, duplicate)
    assert decode.call("still_pending", "direct", "dup", 0.3)  # a repeat of stage 0 is not stage 1
    assert stages.push(dest, src, 9, stages=(1,))[0].ok
    assert decode.call("wait", "direct", "dup") == (None, 0)
    stage0.agent.nixl.send_notif(decode_agent, duplicate)  # late: the request has ended
    deadline = time.monotonic() + 3
    while decode.call("stats", "direct") < ignored + 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert decode.call("stats", "direct") == ignored + 2


def test_decode_times_out_when_a_stage_never_ships(decode, stages):
    dest = PushDestination.from_dict(decode.call("expect", "direct", "half", 9, 0))
    assert stages.push(dest, prefill_blocks(9, seed=4), 9, stages=(1,))[0].ok
    started = time.monotonic()
    assert decode.call("wait", "direct", "half") == ("TransferTimeout", 0)
    assert time.monotonic() - started < 5


def test_a_push_expected_for_longer_than_the_default_outlives_a_slow_prefill(decode, stages):
    """The stages WRITE only once the prefill runs: a reception given the prefill's deadline
    waits past the receiver's default timeout (2 s here) and still completes."""
    patient = PushDestination.from_dict(decode.call("expect", "direct", "slow", 9, 0, 30.0))
    decode.call("expect", "direct", "hasty", 9, 0)
    assert decode.call("still_pending", "direct", "slow", 2.5)  # past the 2 s default
    assert decode.call("wait", "direct", "hasty") == ("TransferTimeout", 0)  # ended meanwhile
    src = prefill_blocks(9, seed=5)
    assert [o.error for o in stages.push(patient, src, 9)] == [None, None]
    assert decode.call("wait", "direct", "slow")[0] is None
    assert_shipped(decode, stages, "direct", dest_blocks(patient.to_dict()), 0, 9, src)


def test_disallowed_destinations_are_rejected_before_any_write(decode):
    by_cidr = Stages(AllowList.parse(["10.0.0.0/8"]), tag="cidr")
    by_name = Stages(AllowList.parse([], ["some-other-decode"]), tag="name")
    try:
        dest = PushDestination.from_dict(decode.call("expect", "direct", "deny", 9, 0))
        with pytest.raises(DestinationNotAllowed, match="allow-list"):
            by_cidr.senders[0].push(dest, prefill_blocks(9, seed=1), 9)
        assert by_cidr.senders[0].inflight == 0
        outcome = by_name.push(dest, prefill_blocks(9, seed=1), 9, stages=(0,))[0]
        assert isinstance(outcome.error, DestinationNotAllowed) and outcome.num_bytes == 0
        assert by_name.outcomes == [outcome]
        got, _ = decode.call("tokens", "direct", dest.block_ids, 0, 9)
        assert all(bool((layer == SENTINEL).all()) for layer in got)
    finally:
        by_cidr.close()
        by_name.close()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_decode_fails_fast_with_typed_error(stages):
    dest = PushDestination("unreachable", f"127.0.0.1:{_closed_port()}", (0, 1), 9)
    started = time.monotonic()
    outcomes = stages.push(dest, prefill_blocks(9, seed=2), 9)
    assert time.monotonic() - started < 2
    assert [type(o.error) for o in outcomes] == [DecodeUnreachable, DecodeUnreachable]
    assert all(o in stages.outcomes for o in outcomes)  # callback fired: blocks released
    assert all(s.inflight == 0 for s in stages.senders)


def test_silent_decode_times_out(stages):
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)  # accepts connections, never answers
        dest = PushDestination("silent", f"127.0.0.1:{silent.getsockname()[1]}", (0, 1), 9)
        started = time.monotonic()
        outcome = stages.push(dest, prefill_blocks(9, seed=2), 9, stages=(0,))[0]
    assert isinstance(outcome.error, TransferTimeout)
    assert time.monotonic() - started < 3


def test_stalled_then_killed_decode_fails_cleanly_and_pipeline_keeps_serving(decode, stages):
    victim = Decode({"direct": POOLS["direct"]})
    impatient = Stages(tag="impatient", timeout_s=2.0)
    src = prefill_blocks(19, seed=6)
    try:
        dests = [
            PushDestination.from_dict(victim.call("expect", "direct", f"v{i}", 19, 0))
            for i in range(3)
        ]
        assert [o.error for o in stages.push(dests[0], src, 19)] == [None, None]  # healthy
        victim.conn.send(("sleep", None, 8.0))  # alive but stalled: slow past the timeout
        started = time.monotonic()
        outcomes = impatient.push(dests[1], src, 19)
        assert [type(o.error) for o in outcomes] == [TransferTimeout, TransferTimeout]
        assert time.monotonic() - started < 6
        for sender in impatient.senders:  # now die with writes in flight
            sender.push(dests[2], src, 19)
        assert not impatient.poll_until(lambda: len(impatient.outcomes) > 2, timeout_s=0.2)
        victim.proc.kill()
        victim.proc.join(5)
        assert impatient.poll_until(lambda: len(impatient.outcomes) == 4, timeout_s=5)
        errors = [type(o.error) for o in impatient.outcomes[2:]]
        assert all(e in (TransferFailed, TransferTimeout) for e in errors), errors
        assert all(s.inflight == 0 for s in impatient.senders)
    finally:
        victim.stop()
        impatient.close()
    dest3 = decode.call("expect", "direct", "after-kill", 19, 0)
    assert [o.error for o in stages.push(PushDestination.from_dict(dest3), src, 19)] == [None, None]
    assert_shipped(decode, stages, "direct", dest_blocks(dest3), 0, 19, src)


def test_fully_cached_prompt_ships_only_the_stage_notifications(decode, stages):
    dest = PushDestination.from_dict(decode.call("expect", "direct", "all-cached", 16, 16))
    outcomes = stages.push(dest, prefill_blocks(16, seed=7), 16)
    assert [(o.error, o.num_bytes) for o in outcomes] == [(None, 0), (None, 0)]
    assert decode.call("wait", "direct", "all-cached") == (None, 0)


def test_unread_lease_expires_and_releases_its_blocks():
    class Clock:
        now = 0.0

        def __call__(self) -> float:
            return self.now

    clock, ended = Clock(), []
    sender = KVSender(
        KVAgent("stage-lease", progress=KVProgress.OWNER),
        [torch.zeros(4, 2, PREFILL_BS, HEADS, HEAD_DIM)],
        0,
        SenderConfig(0, 1, AllowList.loopback(), lease_ttl_s=2.0),
        on_lease_end=lambda lease, why: ended.append((lease.block_ids, why)),
        clock=clock,
    )
    try:
        manifest = sender.lease("unread", (2, 0), 5)
        assert StageManifest.from_dict(manifest.to_dict()) == manifest
        clock.now = 1.9
        sender.poll()
        assert ended == [] and len(sender.leases) == 1
        clock.now = 2.0
        sender.poll()
        assert ended == [((2, 0), ReleaseReason.EXPIRED)] and len(sender.leases) == 0
        sender.check_integrity()
    finally:
        sender.close()


def test_decode_side_runs_without_prefill_node(decode):
    loaded = decode.call("modules", None)
    assert "kv_transfer" in loaded and "nixl" in loaded
    assert "prefill_node" not in loaded
