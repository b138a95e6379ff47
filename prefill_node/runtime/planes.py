"""The two communication planes of a pipeline: data (waves, activations) and rounds (admission).

Both sit on torch.distributed. Three process groups are created, in the same order on every
rank, right after the default group:

- ``fwd``: the data plane's forward path, stage s -> s+1 (wave header + activations). Used
  only by each stage's LOOP thread, so its p2p ops are ordered by construction.
- ``ret``: the data plane's return path, last stage -> leader (per-wave results). Used by the
  last stage's LOOP thread and the leader's collector thread.
- ``rounds``: the rounds plane, leader broadcast + all-gather of admission messages. Used only
  by each stage's WAVE thread, so admission never waits behind activations.

The data plane uses NCCL when the stage runs on CUDA and gloo otherwise. The rounds plane
always uses gloo: it carries small pickled Python objects, and a CPU group keeps admission
off the GPU stream (the same choice vLLM makes for its object broadcasts).

Failure: gloo raises promptly ("Connection closed by peer") when a peer process dies; every
method here converts that into ``PlaneClosedError`` so callers handle one error type.
"""

from __future__ import annotations

import datetime
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from prefill_node.errors import UnavailableError

# Idle waits on the data plane are normal (no traffic); liveness comes from heartbeats and
# from gloo's prompt error on a dead peer, not from this timeout.
_DATA_TIMEOUT = datetime.timedelta(hours=24)

_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)


class PlaneClosedError(UnavailableError):
    """A peer stage died or the process group was torn down while communicating."""


@dataclass(frozen=True)
class Frame:
    """One data-plane message: a picklable header and an optional activation tensor."""

    header: Any
    tensor: torch.Tensor | None = None


class DataPlane:
    """p2p frames stage s -> s+1 (``fwd``) and last stage -> leader (``ret``).

    A frame is sent as: int64[4] (payload bytes, tensor dtype code or -1, rows, cols), the
    pickled header as uint8, then the 2-D tensor if any. Send and receive are blocking; a
    stage's LOOP thread is the only user of ``fwd``.
    """

    def __init__(self, rank: int, world_size: int, fwd: Any, ret: Any, device: torch.device):
        self.rank = rank
        self.world_size = world_size
        self._fwd = fwd
        self._ret = ret
        self._device = device

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1

    def send_next(self, frame: Frame) -> None:
        """Send to stage rank+1 (not valid on the last stage)."""
        self._send(frame, self.rank + 1, self._fwd)

    def recv_prev(self) -> Frame:
        """Receive from stage rank-1 (not valid on the leader)."""
        return self._recv(self.rank - 1, self._fwd)

    def send_result(self, frame: Frame) -> None:
        """Last stage -> leader."""
        self._send(frame, 0, self._ret)

    def recv_result(self) -> Frame:
        """Leader <- last stage."""
        return self._recv(self.world_size - 1, self._ret)

    def _send(self, frame: Frame, dst: int, group: Any) -> None:
        payload = pickle.dumps(frame.header, protocol=pickle.HIGHEST_PROTOCOL)
        t = frame.tensor
        if t is not None and (t.dim() != 2 or t.dtype not in _DTYPES):
            raise ValueError(
                f"data plane carries 2-D float tensors, got {t.dtype} {tuple(t.shape)}"
            )
        meta = torch.tensor(
            [len(payload), -1 if t is None else _DTYPES.index(t.dtype)]
            + ([0, 0] if t is None else list(t.shape)),
            dtype=torch.int64,
            device=self._device,
        )
        body = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self._device)
        try:
            dist.send(meta, dst=dst, group=group)
            dist.send(body, dst=dst, group=group)
            if t is not None:
                dist.send(t.to(self._device).contiguous(), dst=dst, group=group)
        except (RuntimeError, ValueError) as exc:
            raise PlaneClosedError(f"data plane send to stage {dst} failed: {exc}") from exc

    def _recv(self, src: int, group: Any) -> Frame:
        try:
            meta = torch.empty(4, dtype=torch.int64, device=self._device)
            dist.recv(meta, src=src, group=group)
            nbytes, code, rows, cols = (int(v) for v in meta.tolist())
            body = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
            dist.recv(body, src=src, group=group)
            tensor = None
            if code >= 0:
                tensor = torch.empty(rows, cols, dtype=_DTYPES[code], device=self._device)
                dist.recv(tensor, src=src, group=group)
        except (RuntimeError, ValueError) as exc:
            raise PlaneClosedError(f"data plane recv from stage {src} failed: {exc}") from exc
        return Frame(pickle.loads(body.cpu().numpy().tobytes()), tensor)


class RoundsPlane:
    """Admission rounds: the leader broadcasts one message, every stage replies, all gather.

    Every rank must take part in every round, in order; the WAVE thread of each stage is the
    only user. ``lead`` (leader) and ``follow`` (others) return all P replies, indexed by stage.
    """

    def __init__(self, rank: int, world_size: int, group: Any):
        self.rank = rank
        self.world_size = world_size
        self._group = group

    def lead(self, message: Any, answer: Callable[[Any], Any]) -> list[Any]:
        """Leader: broadcast ``message``, reply ``answer(message)`` for stage 0 (computed while
        the others compute theirs), gather all replies."""
        return self._round([message], local_reply_fn=answer)[1]

    def follow(self, handler: Callable[[Any], Any]) -> tuple[Any, list[Any]]:
        """Non-leader: receive the round's message, reply with ``handler(message)``."""
        return self._round([None], local_reply_fn=handler)

    def _round(self, box: list[Any], local_reply_fn: Callable[[Any], Any]) -> tuple[Any, list[Any]]:
        try:
            if self.world_size > 1:
                dist.broadcast_object_list(box, src=0, group=self._group)
            reply = local_reply_fn(box[0])
            replies: list[Any] = [None] * self.world_size
            if self.world_size > 1:
                dist.all_gather_object(replies, reply, group=self._group)
            else:
                replies[0] = reply
        except (RuntimeError, ValueError) as exc:
            raise PlaneClosedError(f"rounds plane failed on stage {self.rank}: {exc}") from exc
        return box[0], replies


@dataclass
class Planes:
    """The default group plus the three plane groups of this rank; ``close`` tears them down."""

    data: DataPlane
    rounds: RoundsPlane

    @classmethod
    def join(
        cls,
        rank: int,
        world_size: int,
        store: dist.Store,
        device: torch.device,
        rounds_timeout_s: float,
    ) -> Planes:
        """Collectively create the groups (every rank calls this with the same arguments)."""
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
        return cls(
            data=DataPlane(rank, world_size, fwd, ret, device),
            rounds=RoundsPlane(rank, world_size, rounds),
        )

    @staticmethod
    def close() -> None:
        """Destroy every group of this process (idempotent)."""
        if dist.is_initialized():
            dist.destroy_process_group()
