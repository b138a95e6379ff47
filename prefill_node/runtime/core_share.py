"""Core sharing between stage processes on one host.

A pipeline of P stage processes on P cores runs one torch thread per stage. Whenever only
some stages compute - a lone prompt's first chunk on stage 0 and its last on stage P-1, a
short burst's fill and drain, any stage waiting for its neighbour - the idle stages' cores
sit unused. Core sharing gives them to the stages that compute: every stage marks itself
busy on a shared board while it runs a wave, and before each of its layers a busy stage
takes its share of the idle stages' cores as extra torch threads (``share_threads``).
When a neighbour turns busy, the borrower gives the core back at its next layer boundary.

The board is one byte per slot (a stage's busy flag) in memory shared by processes:
- a pipeline's own board (``CoreBoard.create``): P slots on an unlinked temporary file, slot
  r for stage r; the launcher hands its descriptor to each child, so nothing is left behind
  when they exit. Its stages share their P cores among themselves.
- a host board (``CoreBoard.host``, ``wavepp serve --core-board PATH``): a file of
  ``HOST_SLOTS`` slots that every pipeline started with the same PATH on this host joins,
  each claiming P free slots. Their stages share the cores every process may run on (its
  CPU affinity), so one pipeline computing alone uses the cores of the pipelines that idle
  (two one-stage pipelines behind a router on two cores: a lone long prompt gets both).
  A slot is claimed with an open-file-description lock on its byte (Linux), which the
  kernel drops when the pipeline's processes are gone, however they ended: a crashed
  pipeline's slots are free for the next one, and a claim resets the flag it finds there.
Stages started elsewhere (one pod per stage) share no cores and run no board.

``share_threads`` is sans-IO; ``CoreShare`` wraps one stage's view of the board and the
thread switch (torch's, unless told otherwise), counting the layers it ran wide.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from prefill_node.errors import InvalidRequestError

FD_ENV = "WAVEPP_CORE_SHARE"  # a stage child's seat on the board: "fd:slots:slot"
HOST_SLOTS = 64  # stages a host board holds


def share_threads(slot: int, busy: Sequence[bool], budget: int, base: int = 1) -> int:
    """Threads for the busy stage in ``slot``: its own ``base`` plus an even share of the
    threads the idle slots leave in ``budget`` (the cores the stages may use). The remainder
    of the split goes to the lowest busy slots, so the shares never add up to more than the
    budget. A stage is counted busy whatever ``busy[slot]`` says: it is about to compute.

    >>> share_threads(0, [True, False], budget=2)
    2
    >>> share_threads(0, [True, True], budget=2)
    1
    """
    if not 0 <= slot < len(busy):
        raise ValueError(f"slot {slot} outside a board of {len(busy)} slots")
    if base < 1 or budget < 1:
        raise ValueError(f"base ({base}) and budget ({budget}) must be >= 1")
    working = [r for r, b in enumerate(busy) if b or r == slot]
    spare = budget - base * len(working)
    if spare <= 0:
        return base
    extra, left = divmod(spare, len(working))
    return base + extra + (1 if working.index(slot) < left else 0)


def _claim_slot(fd: int, slot: int) -> bool:
    """Take the open-file-description lock on ``slot``'s byte (held until every descriptor
    of this open file is closed); False when another open of the file holds it (in any
    process, this one included)."""
    lock = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, slot, 1, 0)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, lock)
    except OSError:
        return False
    return True


class CoreBoard:
    """Busy flags, one byte per slot, in memory shared with other stage processes; ``slots``:
    the slots of this pipeline's stages, by rank (a child's board: its own slot only)."""

    def __init__(self, fd: int, num_slots: int, slots: Sequence[int]) -> None:
        if num_slots < 1 or not all(0 <= s < num_slots for s in slots):
            raise ValueError(f"slots {tuple(slots)} outside a board of {num_slots} slots")
        self.fd, self.num_slots, self.slots = fd, num_slots, tuple(slots)
        self._map = mmap.mmap(fd, num_slots)

    @classmethod
    def create(cls, num_stages: int) -> CoreBoard:
        """A pipeline's own board (all idle) on an unlinked temporary file, slot r for stage
        r; children attach by ``fd`` (``subprocess.Popen(pass_fds=...)``, ``seat``)."""
        if num_stages < 1:
            raise ValueError(f"a board needs >= 1 stage, got {num_stages}")
        fd, path = tempfile.mkstemp(prefix="wavepp-cores-")
        os.unlink(path)
        os.ftruncate(fd, num_stages)
        return cls(fd, num_stages, range(num_stages))

    @classmethod
    def host(cls, path: Path | str, num_stages: int) -> CoreBoard:
        """Join the host board at ``path`` (created on first use): claim ``num_stages`` free
        slots, reset to idle. The claim lasts while this descriptor (and the children's
        inherited copies) stays open. No room: InvalidRequestError."""
        if not hasattr(fcntl, "F_OFD_SETLK"):
            raise InvalidRequestError("--core-board needs Linux (open file description locks)")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise InvalidRequestError(f"--core-board {path}: cannot open it ({exc})") from None
        try:
            if os.fstat(fd).st_size < HOST_SLOTS:
                os.ftruncate(fd, HOST_SLOTS)  # never shrinks: every joiner sizes it alike
            slots: list[int] = []
            for slot in range(HOST_SLOTS):
                if len(slots) == num_stages:
                    break
                if _claim_slot(fd, slot):
                    slots.append(slot)
            if len(slots) < num_stages:
                raise InvalidRequestError(
                    f"--core-board {path}: {num_stages} stages need {num_stages} free slots, "
                    f"{len(slots)} of its {HOST_SLOTS} are free (one per stage of every "
                    "pipeline on it)"
                )
            board = cls(fd, HOST_SLOTS, slots)
        except BaseException:
            os.close(fd)  # drops the locks taken so far
            raise
        for slot in slots:
            board._map[slot] = 0  # a crashed owner may have left it busy
        return board

    @classmethod
    def attach(cls, seat: str) -> tuple[CoreBoard, int]:
        """A stage child's board and slot from its ``seat`` string (``FD_ENV``)."""
        fd, num_slots, slot = (int(x) for x in seat.split(":"))
        return cls(fd, num_slots, (slot,)), slot

    def seat(self, rank: int) -> str:
        """What stage ``rank``'s child needs to attach (``FD_ENV``; pass it ``fd`` too)."""
        return f"{self.fd}:{self.num_slots}:{self.slots[rank]}"

    def set_busy(self, slot: int, busy: bool) -> None:
        self._map[slot] = 1 if busy else 0

    def busy(self) -> list[bool]:
        return [b != 0 for b in self._map[: self.num_slots]]

    def close(self) -> None:
        """Mark this board's slots idle, unmap and close this process's descriptor (a host
        board's claim ends once the children's copies are closed too)."""
        if not self._map.closed:
            for slot in self.slots:
                self._map[slot] = 0
            self._map.close()
            os.close(self.fd)


def _torch_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


class CoreShare:
    """The side of a board of the stage in ``slot``: ``computing`` marks it busy, ``adjust``
    (before each layer) sets its thread count from the board. ``budget``: cores the stages
    may use (default: this process's allowed cores, at most ``base`` per slot of the
    board)."""

    def __init__(
        self,
        board: CoreBoard,
        slot: int,
        *,
        base: int = 1,
        budget: int | None = None,
        set_threads: Callable[[int], None] = _torch_threads,
    ) -> None:
        allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        self.board, self.slot, self.base = board, slot, base
        self.budget = budget or max(base, min(allowed, base * board.num_slots))
        self._set_threads = set_threads
        self.threads = base
        self.layers = 0  # layers run since start
        self.wide_layers = 0  # of which with more than ``base`` threads

    def computing(self, busy: bool) -> None:
        """Mark this stage busy (a wave starts) or idle (it ended: back to ``base``)."""
        self.board.set_busy(self.slot, busy)
        if not busy:
            self._use(self.base)

    def adjust(self) -> None:
        """Before a layer: take this stage's share of the idle stages' cores."""
        self._use(share_threads(self.slot, self.board.busy(), self.budget, self.base))
        self.layers += 1
        if self.threads > self.base:
            self.wide_layers += 1

    def _use(self, threads: int) -> None:
        if threads != self.threads:
            self._set_threads(threads)
            self.threads = threads
