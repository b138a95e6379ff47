"""Buffered point-to-point frame channels over torch.distributed (the data plane's wire).

Why threads: gloo (and NCCL) p2p is a rendezvous - a send completes only once the peer has
posted the matching receive. Called straight from a stage's LOOP thread, every hand-off of a
wave would stall both stages until they meet, and each of the frame's messages would pay a
round of thread wake-ups. Here each direction has a dedicated thread: the receiver keeps a
receive for the next frame's head posted at all times and hands complete frames to the LOOP
through a small queue; the sender drains a small queue of outgoing frames. The LOOP only
blocks when the pipeline really is starved (nothing to receive) or backed up (``depth``
frames already queued), which is the back-pressure a pipeline needs.

Wire format of one frame, in order on the channel's process group (tag 0):

1. head: ``HEAD_BYTES`` uint8 - five little-endian int64 (header bytes, dtype code or -1,
   rows, cols, end-of-stream flag) then the pickled header, truncated to what fits;
2. the rest of the pickled header, only when it did not fit (its size is in the head);
3. the 2-D activation tensor, only when the frame has one (dtype and shape from the head).

Usually two messages per frame, one without activations. A frame marked ``last`` ends the
stream: both threads exit after it, so nothing is left blocked inside the process group when
it is destroyed. A failure of the peer (gloo raises promptly when it dies) surfaces as
``PlaneClosedError`` on the next ``send`` or ``recv`` of the channel.
"""

from __future__ import annotations

import logging
import pickle
import queue
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from prefill_node.errors import UnavailableError

log = logging.getLogger(__name__)

HEAD_BYTES = 16384
_META = struct.Struct("<5q")
_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
_POLL_S = 0.1


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


class SendChannel:
    """Frames to one peer; ``send`` queues (blocks only when ``depth`` frames are pending)."""

    def __init__(self, dst: int, group: Any, device: torch.device, name: str, depth: int = 2):
        self._dst = dst
        self._group = group
        self._device = device
        self._queue: queue.Queue[tuple[Frame, bool]] = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def send(self, frame: Frame, last: bool = False) -> None:
        """Queue ``frame``; ``last`` ends the stream. Raises PlaneClosedError once the
        channel has failed."""
        check_tensor(frame.tensor)
        while True:
            self._raise_if_failed()
            try:
                self._queue.put((frame, last), timeout=_POLL_S)
                return
            except queue.Full:
                continue

    def drain(self, timeout_s: float) -> None:
        """Wait (up to ``timeout_s``) until every queued frame is on the wire."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and self._thread.is_alive():
            if time.monotonic() > deadline:
                return
            time.sleep(0.001)
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise PlaneClosedError(f"data plane send to stage {self._dst} failed: {self._error}")

    def _run(self) -> None:
        try:
            while True:
                frame, last = self._queue.get()
                self._put(frame, last)
                self._queue.task_done()
                if last:
                    return
        except (RuntimeError, ValueError) as exc:
            self._error = exc
            log.debug("send channel to %d closed: %s", self._dst, exc)

    def _put(self, frame: Frame, last: bool) -> None:
        payload = pickle.dumps(frame.header, protocol=pickle.HIGHEST_PROTOCOL)
        t = frame.tensor
        meta = _META.pack(
            len(payload),
            -1 if t is None else _DTYPES.index(t.dtype),
            0 if t is None else t.shape[0],
            0 if t is None else t.shape[1],
            int(last),
        )
        cap = HEAD_BYTES - _META.size
        head = bytearray(HEAD_BYTES)
        head[: _META.size] = meta
        head[_META.size : _META.size + min(cap, len(payload))] = payload[:cap]
        dist.send(self._wire(head), dst=self._dst, group=self._group)
        if len(payload) > cap:
            dist.send(self._wire(bytearray(payload[cap:])), dst=self._dst, group=self._group)
        if t is not None:
            dist.send(t.to(self._device).contiguous(), dst=self._dst, group=self._group)

    def _wire(self, data: bytearray) -> torch.Tensor:
        return torch.frombuffer(data, dtype=torch.uint8).to(self._device)


class RecvChannel:
    """Frames from one peer, received ahead by a thread into a queue of ``depth`` frames."""

    def __init__(self, src: int, group: Any, device: torch.device, name: str, depth: int = 2):
        self._src = src
        self._group = group
        self._device = device
        self._queue: queue.Queue[Frame | BaseException] = queue.Queue(maxsize=depth)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def recv(self) -> Frame:
        """The next frame, in order; raises PlaneClosedError once the channel has failed."""
        item = self._queue.get()
        if isinstance(item, BaseException):
            self._queue.put(item)  # every later recv fails the same way
            raise PlaneClosedError(f"data plane recv from stage {self._src} failed: {item}")
        return item

    def _run(self) -> None:
        try:
            while True:
                frame, last = self._take()
                self._queue.put(frame)
                if last:
                    return
        except (RuntimeError, ValueError) as exc:
            log.debug("recv channel from %d closed: %s", self._src, exc)
            self._queue.put(exc)

    def _take(self) -> tuple[Frame, bool]:
        head = torch.empty(HEAD_BYTES, dtype=torch.uint8, device=self._device)
        dist.recv(head, src=self._src, group=self._group)
        raw = head.cpu().numpy().tobytes()
        nbytes, code, rows, cols, last = _META.unpack_from(raw)
        cap = HEAD_BYTES - _META.size
        payload = raw[_META.size : _META.size + min(cap, nbytes)]
        if nbytes > cap:
            rest = torch.empty(nbytes - cap, dtype=torch.uint8, device=self._device)
            dist.recv(rest, src=self._src, group=self._group)
            payload += rest.cpu().numpy().tobytes()
        tensor = None
        if code >= 0:
            tensor = torch.empty(rows, cols, dtype=_DTYPES[code], device=self._device)
            dist.recv(tensor, src=self._src, group=self._group)
        return Frame(pickle.loads(payload), tensor), bool(last)
