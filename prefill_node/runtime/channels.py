"""Point-to-point frame channels over torch.distributed, receives pre-posted (the data wire).

Why pre-posted receives: gloo (and NCCL) p2p is a rendezvous - a send completes only once the
peer has posted the matching receive. Each receiving end keeps ``depth`` receives for the
next frames posted at all times (``irecv`` into fixed-size buffers), so the transport threads
move a frame while the receiving stage is still computing; the stage's own thread only
unpacks a frame that has already arrived. Sends are ``isend``s from fixed buffers: the caller
blocks only when ``depth`` earlier frames are still unacknowledged, the back-pressure a
pipeline needs. No Python thread sits in between (an earlier design had one per direction:
each woke up per message and competed with the stage's forward for its core and the GIL).

Wire format of one frame (one message in the common case):

- tag 0, exactly ``HEAD_BYTES + inline_bytes`` bytes: five little-endian int64 (header
  bytes, dtype code or -1, rows, cols, flags), the pickled header (as much as fits in
  ``HEAD_BYTES``), then - at offset ``HEAD_BYTES`` - the activation tensor's bytes when they
  fit in ``inline_bytes``;
- tag 1, only when needed, in this order: the rest of the pickled header, then the tensor
  when it was not inline (exact sizes, known from the head).

Both ends must use the same ``inline_bytes`` and ``depth``. A frame marked ``last`` ends the
stream; the sender then sends ``depth - 1`` filler heads so that every receive the peer has
posted completes and nothing is left pending when the process group is destroyed. A failure
of the peer (gloo raises promptly when it dies) surfaces as ``PlaneClosedError`` on the next
``send`` or ``recv``.
"""

from __future__ import annotations

import datetime
import pickle
import struct
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from prefill_node.errors import UnavailableError

HEAD_BYTES = 16384
DEPTH = 2
_META = struct.Struct("<5q")
_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
_LAST, _FILLER = 1, 2
_FRAME_TAG, _TAIL_TAG = 0, 1


class PlaneClosedError(UnavailableError):
    """A peer stage died or the process group was torn down while communicating."""


@dataclass(frozen=True)
class Frame:
    """One data-plane message: a picklable header and an optional activation tensor."""

    header: Any
    tensor: torch.Tensor | None = None


def check_tensor(t: torch.Tensor | None) -> None:
    if t is not None and (t.dim() != 2 or t.dtype not in _DTYPES):
        raise ValueError(f"data plane carries 2-D float tensors, got {t.dtype} {tuple(t.shape)}")


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


class SendChannel:
    """Frames to one peer from the calling thread; ``send`` returns once the frame is posted."""

    def __init__(
        self, dst: int, group: Any, device: torch.device, inline_bytes: int = 0, depth: int = DEPTH
    ):
        self._dst = dst
        self._group = group
        self._inline = inline_bytes
        self._size = HEAD_BYTES + inline_bytes
        self._bufs = [
            torch.zeros(self._size, dtype=torch.uint8, device=device) for _ in range(depth)
        ]
        self._pending: list[list[Any]] = [[] for _ in range(depth)]  # works (+ tensors they read)
        self._next = 0
        self._closed = False

    def send(self, frame: Frame, last: bool = False) -> None:
        """Post ``frame``; ``last`` ends the stream. Blocks only while the oldest of the
        ``depth`` slots is still on the wire. Raises PlaneClosedError once the peer failed."""
        check_tensor(frame.tensor)
        if self._closed:
            raise PlaneClosedError(f"data plane to stage {self._dst} was already ended")
        try:
            self._post(frame, _LAST if last else 0)
            if last:
                for _ in range(len(self._bufs) - 1):
                    self._post(Frame(None), _FILLER)
                self._closed = True
        except (RuntimeError, ValueError) as exc:
            raise PlaneClosedError(f"data plane send to stage {self._dst} failed: {exc}") from exc

    def drain(self, timeout_s: float) -> None:
        """Wait (up to ``timeout_s`` per message) until every posted frame is on the wire."""
        try:
            for slot in range(len(self._bufs)):
                self._settle(slot, timeout_s)
        except (RuntimeError, ValueError) as exc:
            raise PlaneClosedError(f"data plane send to stage {self._dst} failed: {exc}") from exc

    def _settle(self, slot: int, timeout_s: float | None = None) -> None:
        for item in self._pending[slot]:
            if isinstance(item, dist.Work):
                if timeout_s is None:
                    item.wait()
                else:
                    item.wait(datetime.timedelta(seconds=timeout_s))
        self._pending[slot] = []

    def _post(self, frame: Frame, flags: int) -> None:
        slot = self._next
        self._next = (slot + 1) % len(self._bufs)
        self._settle(slot)  # the slot's buffer is ours again
        buf = self._bufs[slot]
        payload = b"" if flags & _FILLER else pickle.dumps(frame.header, pickle.HIGHEST_PROTOCOL)
        t = frame.tensor
        nbytes = 0 if t is None else t.numel() * t.element_size()
        meta = _META.pack(
            len(payload),
            -1 if t is None else _DTYPES.index(t.dtype),
            0 if t is None else t.shape[0],
            0 if t is None else t.shape[1],
            flags,
        )
        cap = HEAD_BYTES - _META.size
        head = meta + payload[:cap]
        buf[: len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
        inline = t is not None and nbytes <= self._inline
        if inline and nbytes:
            buf[HEAD_BYTES : HEAD_BYTES + nbytes].copy_(_as_bytes(t))
        pending: list[Any] = [dist.isend(buf, self._dst, group=self._group, tag=_FRAME_TAG)]
        if len(payload) > cap:
            rest = torch.frombuffer(bytearray(payload[cap:]), dtype=torch.uint8).to(buf.device)
            pending += [rest, dist.isend(rest, self._dst, group=self._group, tag=_TAIL_TAG)]
        if t is not None and not inline:
            data = _as_bytes(t.to(buf.device))
            pending += [data, dist.isend(data, self._dst, group=self._group, tag=_TAIL_TAG)]
        self._pending[slot] = pending


class RecvChannel:
    """Frames from one peer; ``depth`` receives stay posted so frames arrive while we compute."""

    def __init__(
        self, src: int, group: Any, device: torch.device, inline_bytes: int = 0, depth: int = DEPTH
    ):
        self._src = src
        self._group = group
        self._size = HEAD_BYTES + inline_bytes
        self._bufs = [
            torch.empty(self._size, dtype=torch.uint8, device=device) for _ in range(depth)
        ]
        self._works: list[Any] = [None] * depth
        self._next = 0
        self._error: BaseException | None = None
        self._ended = False
        for slot in range(depth):
            self._repost(slot)

    def recv(self) -> Frame:
        """The next frame, in order; raises PlaneClosedError once the channel has failed."""
        if self._error is not None:
            raise PlaneClosedError(f"data plane recv from stage {self._src} failed: {self._error}")
        if self._ended:
            raise PlaneClosedError(f"data plane from stage {self._src} has ended")
        try:
            frame, flags = self._take()
        except (RuntimeError, ValueError) as exc:
            self._error = exc
            raise PlaneClosedError(f"data plane recv from stage {self._src} failed: {exc}") from exc
        return frame

    def _repost(self, slot: int) -> None:
        self._works[slot] = dist.irecv(
            self._bufs[slot], self._src, group=self._group, tag=_FRAME_TAG
        )

    def _take(self) -> tuple[Frame, int]:
        slot = self._next
        self._next = (slot + 1) % len(self._bufs)
        self._works[slot].wait()
        buf = self._bufs[slot]
        raw = buf[:HEAD_BYTES].cpu().numpy().tobytes()
        nbytes, code, rows, cols, flags = _META.unpack_from(raw)
        cap = HEAD_BYTES - _META.size
        payload = raw[_META.size : _META.size + min(cap, nbytes)]
        if nbytes > cap:
            rest = torch.empty(nbytes - cap, dtype=torch.uint8, device=buf.device)
            dist.recv(rest, self._src, group=self._group, tag=_TAIL_TAG)
            payload += rest.cpu().numpy().tobytes()
        tensor = None
        if code >= 0:
            dtype = _DTYPES[code]
            size = rows * cols * torch.empty(0, dtype=dtype).element_size()
            if size <= self._size - HEAD_BYTES:
                tensor = buf[HEAD_BYTES : HEAD_BYTES + size].clone().view(dtype).view(rows, cols)
            else:
                tensor = torch.empty(rows, cols, dtype=dtype, device=buf.device)
                dist.recv(_as_bytes(tensor), self._src, group=self._group, tag=_TAIL_TAG)
        if flags & _LAST:
            self._ended = True
            for other in range(1, len(self._bufs)):  # the sender's fillers complete these
                self._works[(slot + other) % len(self._bufs)].wait()
        else:
            self._repost(slot)
        return Frame(pickle.loads(payload), tensor), flags
