"""The communication planes of a pipeline: data (waves, activations), rounds (admission) and
reports (KV hand-off outcomes, stage -> leader).

All sit on torch.distributed. Four process groups are created, in the same order on every
rank, right after the default group:

- ``fwd``: the data plane's forward path, stage s -> s+1 (wave header + activations). Used
  only by stage s's LOOP thread (sends) and stage s+1's LOOP thread (receives, channels.py),
  so its p2p ops are ordered by construction.
- ``ret``: the data plane's return path, last stage -> leader (per-wave results): the last
  stage's LOOP thread sends, the leader's collector thread receives.
- ``rounds``: the rounds plane, leader broadcast + all-gather of admission messages. Used only
  by each stage's WAVE thread, so admission never waits behind activations.
- ``reports``: each stage s > 0 -> the leader, the outcomes of its KV hand-offs as they
  happen (sent by the stage's hand-off thread, received by one leader thread per stage), so
  the leader never polls the stages for them. gloo, always: small pickled objects.

The data plane uses NCCL when the stage runs on CUDA and gloo otherwise. The rounds plane
always uses gloo: it carries small pickled Python objects, and a CPU group keeps admission
off the GPU stream (the same choice vLLM makes for its object broadcasts).

Failure: gloo raises promptly ("Connection closed by peer") when a peer process dies; every
method here converts that into ``PlaneClosedError`` so callers handle one error type.
"""

from __future__ import annotations

import datetime
import pickle
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from prefill_node.runtime.channels import Frame, PlaneClosedError, RecvChannel, SendChannel

__all__ = [
    "DataPlane",
    "Frame",
    "PlaneClosedError",
    "Planes",
    "ReportPlane",
    "RoundsPlane",
    "inline_activation_bytes",
]

# Idle waits on the data plane are normal (no traffic); liveness comes from heartbeats and
# from gloo's prompt error on a dead peer, not from this timeout.
_DATA_TIMEOUT = datetime.timedelta(hours=24)

# A round's message or reply travels in one fixed-size buffer (one collective per step);
# anything longer sends its tail in a second collective of the exact size.
ROUND_BYTES = 16384
_LEN = struct.Struct("<q")


# Activations up to this size travel inside the frame's one fixed-size message (CPU only).
MAX_INLINE_BYTES = 8 << 20


def inline_activation_bytes(
    max_wave_tokens: int, hidden: int, dtype: torch.dtype, device: torch.device
) -> int:
    """``inline_bytes`` for a pipeline: a whole wave's activations on CPU (one message per
    frame, the receive already posted), 0 on CUDA, where NCCL moves an exact-size second
    message and a fixed wave-sized buffer would waste bandwidth; 0 above MAX_INLINE_BYTES."""
    size = max_wave_tokens * hidden * torch.empty(0, dtype=dtype).element_size()
    return size if device.type == "cpu" and size <= MAX_INLINE_BYTES else 0


class DataPlane:
    """Frames stage s -> s+1 (``fwd``) and last stage -> leader (``ret``), see channels.py.

    Each rank owns at most one send channel (to s+1, or to the leader from the last stage)
    and one receive channel (from s-1, or from the last stage on the leader); each is used by
    one thread only and frames keep their order. ``inline_bytes`` is the largest activation
    tensor that travels inside the frame's single message on ``fwd`` (the wave limit times
    the hidden size times the element size; larger ones, and every tensor on ``ret``, follow
    as a second message). A frame whose header has ``stop=True`` ends its stream.
    ``send_next`` / ``send_result`` return once the frame is posted.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        fwd: Any,
        ret: Any,
        device: torch.device,
        inline_bytes: int = 0,
    ):
        self.rank = rank
        self.world_size = world_size
        self._send: SendChannel | None = None
        self._recv: RecvChannel | None = None
        if world_size > 1:
            if rank < world_size - 1:
                self._send = SendChannel(rank + 1, fwd, device, inline_bytes)
            else:
                self._send = SendChannel(0, ret, device)
            if rank > 0:
                self._recv = RecvChannel(rank - 1, fwd, device, inline_bytes)
            else:
                self._recv = RecvChannel(world_size - 1, ret, device)

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1

    def send_next(self, frame: Frame) -> None:
        """Send to stage rank+1 (not valid on the last stage)."""
        if self.is_last:
            raise ValueError("the last stage has no next stage")
        self._channel_send(frame)

    def recv_prev(self) -> Frame:
        """Receive from stage rank-1 (not valid on the leader)."""
        if self.rank == 0:
            raise ValueError("the leader has no previous stage")
        return self._channel_recv()

    def send_result(self, frame: Frame) -> None:
        """Last stage -> leader."""
        if not self.is_last or self.rank == 0:
            raise ValueError("only the last stage of a multi-stage pipeline sends results")
        self._channel_send(frame)

    def recv_result(self) -> Frame:
        """Leader <- last stage."""
        if self.rank != 0:
            raise ValueError("only the leader receives results")
        return self._channel_recv()

    def drain(self, timeout_s: float = 10.0) -> None:
        """Wait until every frame this rank posted is on the wire."""
        if self._send is not None:
            self._send.drain(timeout_s)

    def _channel_send(self, frame: Frame) -> None:
        if self._send is None:
            raise ValueError("a one-stage pipeline has no data plane")
        self._send.send(frame, last=getattr(frame.header, "stop", False) is True)

    def _channel_recv(self) -> Frame:
        if self._recv is None:
            raise ValueError("a one-stage pipeline has no data plane")
        return self._recv.recv()


class RoundsPlane:
    """Admission rounds: the leader broadcasts one message, every stage replies, all gather.

    Every rank must take part in every round, in order; the WAVE thread of each stage is the
    only user. ``lead`` (leader) and ``follow`` (others) return all P replies, indexed by stage.
    A round is one broadcast and one all-gather of ``ROUND_BYTES`` buffers (plus one more
    collective for a step whose longest message does not fit).
    """

    def __init__(self, rank: int, world_size: int, group: Any):
        self.rank = rank
        self.world_size = world_size
        self._group = group

    def lead(self, message: Any, answer: Callable[[Any], Any]) -> list[Any]:
        """Leader: broadcast ``message``, reply ``answer(message)`` for stage 0 (computed while
        the others compute theirs), gather all replies."""
        return self._round(message, local_reply_fn=answer)[1]

    def follow(self, handler: Callable[[Any], Any]) -> tuple[Any, list[Any]]:
        """Non-leader: receive the round's message, reply with ``handler(message)``."""
        return self._round(None, local_reply_fn=handler)

    def _round(self, message: Any, local_reply_fn: Callable[[Any], Any]) -> tuple[Any, list[Any]]:
        try:
            if self.world_size > 1:
                message = self._broadcast(message)
            reply = local_reply_fn(message)
            if self.world_size > 1:
                return message, self._all_gather(reply)
        except (RuntimeError, ValueError) as exc:
            raise PlaneClosedError(f"rounds plane failed on stage {self.rank}: {exc}") from exc
        return message, [reply]

    def _broadcast(self, message: Any) -> Any:
        buf = torch.zeros(ROUND_BYTES, dtype=torch.uint8)
        payload = b""
        if self.rank == 0:
            payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
            _fill(buf, payload)
        dist.broadcast(buf, src=0, group=self._group)
        size, head = _split(buf)
        if size > len(head):
            rest = torch.empty(size - len(head), dtype=torch.uint8)
            if self.rank == 0:
                rest.copy_(torch.frombuffer(bytearray(payload[len(head) :]), dtype=torch.uint8))
            dist.broadcast(rest, src=0, group=self._group)
            head += rest.numpy().tobytes()
        return pickle.loads(head)

    def _all_gather(self, reply: Any) -> list[Any]:
        payload = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        mine = torch.zeros(ROUND_BYTES, dtype=torch.uint8)
        _fill(mine, payload)
        bufs = [torch.empty(ROUND_BYTES, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(bufs, mine, group=self._group)
        parts = [_split(b) for b in bufs]
        longest = max(size - len(head) for size, head in parts)
        if longest > 0:
            tail = torch.zeros(longest, dtype=torch.uint8)
            own = payload[ROUND_BYTES - _LEN.size :]
            if own:
                tail[: len(own)] = torch.frombuffer(bytearray(own), dtype=torch.uint8)
            tails = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
            dist.all_gather(tails, tail, group=self._group)
            parts = [
                (size, head + tails[i][: size - len(head)].numpy().tobytes())
                for i, (size, head) in enumerate(parts)
            ]
        return [pickle.loads(head) for _, head in parts]


class ReportPlane:
    """Stage s > 0 -> leader: batches of KV hand-off outcomes, in order, as they happen.

    A stage ``send``s from its hand-off thread (thread-safe: ``close`` may come from
    another) and ``close``s once, after its hand-off stopped: that ends its stream, and
    later sends are dropped. The leader runs one thread per stage on ``recv(stage)``, which
    returns the next batch, or None once that stage closed its stream or failed.
    """

    def __init__(self, rank: int, world_size: int, group: Any):
        self.rank = rank
        self._lock = threading.Lock()
        self._send: SendChannel | None = None
        self._recv: dict[int, RecvChannel] = {}
        if world_size > 1 and rank > 0:
            self._send = SendChannel(0, group, torch.device("cpu"))
        elif world_size > 1:
            self._recv = {
                s: RecvChannel(s, group, torch.device("cpu")) for s in range(1, world_size)
            }

    def send(self, outcomes: tuple[Any, ...]) -> None:
        """Post one batch to the leader (dropped once closed). PlaneClosedError: the leader
        is gone."""
        with self._lock:
            if self._send is not None:
                self._send.send(Frame(outcomes))

    def close(self, timeout_s: float = 10.0) -> None:
        """End this stage's stream (idempotent; a no-op on the leader)."""
        with self._lock:
            channel, self._send = self._send, None
            if channel is not None:
                channel.send(Frame(()), last=True)
                channel.drain(timeout_s)

    def recv(self, stage: int) -> tuple[Any, ...] | None:
        """Leader: the next batch from ``stage``; None once its stream ended or failed."""
        try:
            outcomes = self._recv[stage].recv().header
        except PlaneClosedError:
            return None
        return outcomes if outcomes else self.recv(stage)


def _fill(buf: torch.Tensor, payload: bytes) -> None:
    """``buf`` = [len][as much of payload as fits]."""
    head = _LEN.pack(len(payload)) + payload[: ROUND_BYTES - _LEN.size]
    buf[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)


def _split(buf: torch.Tensor) -> tuple[int, bytes]:
    """(full payload length, the part of it inside ``buf``)."""
    raw = buf.numpy().tobytes()
    (size,) = _LEN.unpack_from(raw)
    return size, raw[_LEN.size : _LEN.size + min(size, ROUND_BYTES - _LEN.size)]


@dataclass
class Planes:
    """The default group plus the four plane groups of this rank; ``close`` tears them down."""

    data: DataPlane
    rounds: RoundsPlane
    reports: ReportPlane

    @classmethod
    def join(
        cls,
        rank: int,
        world_size: int,
        store: dist.Store,
        device: torch.device,
        rounds_timeout_s: float,
        inline_bytes: int = 0,
    ) -> Planes:
        """Collectively create the groups (every rank calls this with the same arguments;
        ``inline_bytes``: see ``DataPlane``)."""
        data_backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend="gloo" if data_backend == "gloo" else "cpu:gloo,cuda:nccl",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=_DATA_TIMEOUT,
        )
        fwd = dist.new_group(backend=data_backend, timeout=_DATA_TIMEOUT)
        ret = dist.new_group(backend=data_backend, timeout=_DATA_TIMEOUT)
        rounds = dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=rounds_timeout_s)
        )
        reports = dist.new_group(backend="gloo", timeout=_DATA_TIMEOUT)
        return cls(
            data=DataPlane(rank, world_size, fwd, ret, device, inline_bytes),
            rounds=RoundsPlane(rank, world_size, rounds),
            reports=ReportPlane(rank, world_size, reports),
        )

    @classmethod
    def join_stage(
        cls, rank: int, world_size: int, store: dist.Store, model: Any, max_wave_tokens: int
    ) -> Planes:
        """``join`` for a stage running ``model`` (a StageModel): its device, and inline
        activations sized for waves of up to ``max_wave_tokens``."""
        inline = inline_activation_bytes(
            max_wave_tokens, model.config.hidden_size, model.dtype, model.device
        )
        return cls.join(rank, world_size, store, model.device, 3600.0, inline)

    @staticmethod
    def close() -> None:
        """Destroy every group of this process (idempotent)."""
        if dist.is_initialized():
            dist.destroy_process_group()
