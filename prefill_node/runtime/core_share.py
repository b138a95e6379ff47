"""Core sharing between the stage processes of one local pipeline.

A pipeline of P stage processes on P cores runs one torch thread per stage. Whenever only
some stages compute - a lone prompt's first chunk on stage 0 and its last on stage P-1, a
short burst's fill and drain, any stage waiting for its neighbour - the idle stages' cores
sit unused. Core sharing gives them to the stages that compute: every stage marks itself
busy on a shared board while it runs a wave, and before each of its layers a busy stage
takes its share of the idle stages' cores as extra torch threads (``share_threads``).
When a neighbour turns busy, the borrower gives the core back at its next layer boundary.

The board is P bytes of memory shared by the stage processes of one host: the launcher
creates it as an unlinked temporary file and hands its descriptor to each child
(``CoreBoard.create`` / ``CoreBoard.attach``), so nothing is left behind when they exit.
Stages started elsewhere (one pod per stage) share no cores and run no board.

``share_threads`` is sans-IO; ``CoreShare`` wraps one stage's view of the board and the
thread switch (torch's, unless told otherwise), counting the layers it ran wide.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from collections.abc import Callable, Sequence

FD_ENV = "WAVEPP_CORE_SHARE_FD"  # the board's file descriptor in a stage child


def share_threads(rank: int, busy: Sequence[bool], budget: int, base: int = 1) -> int:
    """Threads for busy stage ``rank``: its own ``base`` plus an even share of the threads
    the idle stages leave in ``budget`` (the cores the pipeline may use). The remainder of
    the split goes to the lowest busy ranks, so the shares never add up to more than the
    budget. A stage is counted busy whatever ``busy[rank]`` says: it is about to compute.

    >>> share_threads(0, [True, False], budget=2)
    2
    >>> share_threads(0, [True, True], budget=2)
    1
    """
    if not 0 <= rank < len(busy):
        raise ValueError(f"rank {rank} outside a board of {len(busy)} stages")
    if base < 1 or budget < 1:
        raise ValueError(f"base ({base}) and budget ({budget}) must be >= 1")
    working = [r for r, b in enumerate(busy) if b or r == rank]
    spare = budget - base * len(working)
    if spare <= 0:
        return base
    extra, left = divmod(spare, len(working))
    return base + extra + (1 if working.index(rank) < left else 0)


class CoreBoard:
    """P busy flags (one byte each) in memory shared with the other stage processes."""

    def __init__(self, fd: int, num_stages: int) -> None:
        if num_stages < 1:
            raise ValueError(f"a board needs >= 1 stage, got {num_stages}")
        self.fd, self.num_stages = fd, num_stages
        self._map = mmap.mmap(fd, num_stages)

    @classmethod
    def create(cls, num_stages: int) -> CoreBoard:
        """A new board (all idle) on an unlinked temporary file; children attach by ``fd``
        (pass it with ``subprocess.Popen(pass_fds=...)``)."""
        fd, path = tempfile.mkstemp(prefix="wavepp-cores-")
        os.unlink(path)
        os.ftruncate(fd, num_stages)
        return cls(fd, num_stages)

    @classmethod
    def attach(cls, fd: int, num_stages: int) -> CoreBoard:
        return cls(fd, num_stages)

    def set_busy(self, rank: int, busy: bool) -> None:
        self._map[rank] = 1 if busy else 0

    def busy(self) -> list[bool]:
        return [b != 0 for b in self._map[: self.num_stages]]

    def close(self) -> None:
        """Unmap and close this process's descriptor (the others keep theirs)."""
        if not self._map.closed:
            self._map.close()
            os.close(self.fd)


def _torch_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


class CoreShare:
    """Stage ``rank``'s side of a board: ``computing`` marks it busy, ``adjust`` (before each
    layer) sets its thread count from the board. ``budget``: cores the pipeline may use
    (default: this process's allowed cores, at most ``base`` per stage of the board)."""

    def __init__(
        self,
        board: CoreBoard,
        rank: int,
        *,
        base: int = 1,
        budget: int | None = None,
        set_threads: Callable[[int], None] = _torch_threads,
    ) -> None:
        allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        self.board, self.rank, self.base = board, rank, base
        self.budget = budget or max(base, min(allowed, base * board.num_stages))
        self._set_threads = set_threads
        self.threads = base
        self.layers = 0  # layers run since start
        self.wide_layers = 0  # of which with more than ``base`` threads

    def computing(self, busy: bool) -> None:
        """Mark this stage busy (a wave starts) or idle (it ended: back to ``base``)."""
        self.board.set_busy(self.rank, busy)
        if not busy:
            self._use(self.base)

    def adjust(self) -> None:
        """Before a layer: take this stage's share of the idle stages' cores."""
        self._use(share_threads(self.rank, self.board.busy(), self.budget, self.base))
        self.layers += 1
        if self.threads > self.base:
            self.wide_layers += 1

    def _use(self, threads: int) -> None:
        if threads != self.threads:
            self._set_threads(threads)
            self.threads = threads
