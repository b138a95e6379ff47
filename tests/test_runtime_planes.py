"""Planes over real gloo process groups in real processes: framing, rounds, peer death."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import threading
import time
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from prefill_node.runtime.dist_env import DistEnv, DistEnvError, free_local_port
from prefill_node.runtime.planes import Frame, PlaneClosedError, Planes

pytestmark = pytest.mark.timeout(60)


def _join(rank: int, world: int, port: int, inline: int = 0) -> Planes:
    store = dist.TCPStore(
        "127.0.0.1",
        port,
        world_size=world,
        is_master=rank == 0,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=30),
    )
    return Planes.join(rank, world, store, torch.device("cpu"), 30, inline_bytes=inline)


def _relay(rank: int, world: int, port: int, out: mp.Queue) -> None:
    """Stage s>0: pass frames on (adding rank to the tensor); answer rounds with rank**2;
    report one batch; the last stage dies, the others end their report streams."""
    torch.set_num_threads(1)
    planes = _join(rank, world, port)
    for _ in range(3):
        frame = planes.data.recv_prev()
        t = None if frame.tensor is None else frame.tensor + rank
        header = {**frame.header, "path": frame.header["path"] + [rank]}
        if rank == world - 1:
            planes.data.send_result(Frame(header, t))
        else:
            planes.data.send_next(Frame(header, t))
    planes.reports.send((("report", rank),))
    msg, replies = planes.rounds.follow(lambda m: (m, rank * rank))
    out.put((rank, msg, replies))
    out.close()
    out.join_thread()  # flush before a hard exit
    if rank == world - 1:
        os._exit(0)  # die without closing: the leader must notice
    planes.reports.close()
    planes.reports.send((("dropped", rank),))  # after the end: dropped, not sent
    Planes.close()


@pytest.mark.parametrize("world", [3])
def test_frames_and_rounds_cross_real_processes_and_peer_death_is_detected(world: int) -> None:
    ctx = mp.get_context("spawn")
    port = free_local_port()
    out: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_relay, args=(r, world, port, out)) for r in range(1, world)]
    for p in procs:
        p.start()
    planes = _join(0, world, port)
    try:
        sent = [
            torch.arange(6, dtype=torch.float32).view(2, 3),
            None,
            torch.ones(1, 4, dtype=torch.bfloat16),
        ]
        # gloo p2p is a rendezvous (a send returns once matched), so like the engine the
        # leader sends from one thread and collects results on another.
        sender = threading.Thread(
            target=lambda: [
                planes.data.send_next(Frame({"wave": i, "path": [0]}, t))
                for i, t in enumerate(sent)
            ]
        )
        sender.start()
        for i, t in enumerate(sent):
            got = planes.data.recv_result()
            assert got.header == {"wave": i, "path": list(range(world))}
            if t is None:
                assert got.tensor is None
            else:
                assert got.tensor.dtype == t.dtype
                torch.testing.assert_close(got.tensor, t + sum(range(world)), rtol=0, atol=0)
        sender.join()
        replies = planes.rounds.lead("admit-1", lambda m: (m, 0))
        assert replies == [("admit-1", r * r) for r in range(world)]
        for _ in range(world - 1):
            rank, msg, peer_replies = out.get(timeout=20)
            assert msg == "admit-1" and peer_replies == replies
        for s in range(1, world):  # each stage's report, on its own stream
            assert planes.reports.recv(s) == (("report", s),)
        t0 = time.monotonic()
        with pytest.raises(PlaneClosedError, match="data plane recv"):
            planes.data.recv_result()
        assert time.monotonic() - t0 < 10
        assert planes.reports.recv(1) is None  # ended by its stage
        assert planes.reports.recv(world - 1) is None  # its stage died
        assert time.monotonic() - t0 < 10
    finally:
        for p in procs:
            p.join(timeout=20)
        Planes.close()


def test_dist_env_parses_torchrun_variables_and_names_what_is_missing() -> None:
    env = DistEnv.from_env(
        {"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "pipe-0.pipe", "MASTER_PORT": "29500"}
    )
    assert env == DistEnv(2, 3, "pipe-0.pipe", 29500)
    assert not env.is_leader and env.with_rank(0).is_leader
    assert DistEnv.from_env(env.to_env()) == env
    with pytest.raises(DistEnvError, match="MASTER_ADDR, MASTER_PORT"):
        DistEnv.from_env({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(DistEnvError, match="RANK must be in"):
        DistEnv.from_env({"RANK": "3", "WORLD_SIZE": "3", "MASTER_ADDR": "a", "MASTER_PORT": "1"})
    with pytest.raises(DistEnvError, match="WORLD_SIZE must be an integer"):
        DistEnv.from_env({"RANK": "0", "WORLD_SIZE": "x", "MASTER_ADDR": "a", "MASTER_PORT": "1"})


@dataclass(frozen=True)
class _Stop:
    stop: bool = True


def _echo_big(port: int, inline: int, out: mp.Queue) -> None:
    """Stage 1 of 2: return each frame to the leader (the stop frame last); answer one round
    with a big reply."""
    torch.set_num_threads(1)
    planes = _join(1, 2, port, inline)
    for _ in range(5):  # 4 frames, then the stop frame
        frame = planes.data.recv_prev()
        planes.data.send_result(Frame(frame.header, frame.tensor))
    msg, replies = planes.rounds.follow(lambda m: [f"r{i}" for i in range(5000)])
    out.put((len(msg), [len(r) for r in replies]))
    out.close()
    out.join_thread()
    planes.data.drain()
    Planes.close()


@pytest.mark.parametrize("inline", [0, 8192])
def test_headers_and_round_messages_larger_than_one_buffer_arrive_whole(inline: int) -> None:
    """Frames whose pickled header exceeds HEAD_BYTES, tensors beyond the inline capacity
    (each alone and both in one frame) and round messages / replies beyond ROUND_BYTES take
    the overflow paths; order, content and tensors survive them, and a stop frame ends both
    streams with no receive left pending (the processes close their groups and exit)."""
    from prefill_node.runtime.channels import HEAD_BYTES
    from prefill_node.runtime.planes import ROUND_BYTES

    ctx = mp.get_context("spawn")
    port = free_local_port()
    out: mp.Queue = ctx.Queue()
    proc = ctx.Process(target=_echo_big, args=(port, inline, out))
    proc.start()
    planes = _join(0, 2, port, inline)
    try:
        headers = [{"i": i, "blob": list(range(n))} for i, n in enumerate((10, 9000, 3, 9000))]
        assert len(pickle.dumps(headers[1])) > HEAD_BYTES
        tensors = [torch.randn(3, 5), None, torch.randn(700, 64), torch.randn(40, 64)]
        assert tensors[3].numel() * 4 > inline and (not inline or inline >= 3 * 5 * 4)
        # Each frame's result is taken before the next frame goes out: a frame's tail
        # messages complete only when the receiver reads that frame, so a sender that never
        # receives while the peer's sends back up would deadlock (the engine receives
        # results on their own thread for this reason).
        for h, t in zip(headers, tensors, strict=True):
            planes.data.send_next(Frame(h, t))
            got = planes.data.recv_result()
            assert got.header == h
            if t is None:
                assert got.tensor is None
            else:
                torch.testing.assert_close(got.tensor, t, rtol=0, atol=0)
        planes.data.send_next(Frame(_Stop()))
        assert planes.data.recv_result().header == _Stop()
        with pytest.raises(PlaneClosedError, match="ended"):
            planes.data.recv_result()
        big = [f"m{i}" for i in range(6000)]
        assert len(pickle.dumps(big)) > ROUND_BYTES
        assert len(pickle.dumps([f"r{i}" for i in range(5000)])) > ROUND_BYTES
        replies = planes.rounds.lead(big, lambda m: ["r0"] * 10)
        assert replies == [["r0"] * 10, [f"r{i}" for i in range(5000)]]
        assert out.get(timeout=20) == (6000, [10, 5000])
    finally:
        proc.join(timeout=20)
        Planes.close()
