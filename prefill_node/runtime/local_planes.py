"""In-process planes: the planes of P stages that run as threads of one process.

The same contracts as ``planes.py`` (``DataPlane`` / ``RoundsPlane`` / ``ReportPlane``), with
queues instead of
process groups, so ``Leader`` and ``StageWorker`` run unchanged on threads: the in-process
``LocalEngine`` is the multi-process pipeline with this transport.

- Data: one bounded queue into each stage s > 0 (``DEPTH`` frames, the back-pressure the
  pre-posted receives give across processes) and one return queue last stage -> leader.
  Frames pass by reference: a stage builds a fresh activation tensor per wave and never
  writes one it received, so nothing is copied.
- Rounds: the leader puts each message in every follower's inbox, answers for stage 0
  meanwhile, then takes the followers' replies in stage order. A follower whose handler
  raises still replies (with the failure), so the leader raises ``PlaneClosedError``
  instead of waiting forever, as a dead peer does across processes.
- Reports: one queue per stage s > 0 into the leader; ``close`` puts the end of the stream.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prefill_node.runtime.channels import DEPTH, Frame, PlaneClosedError
from prefill_node.runtime.planes import Planes


class LocalDataPlane:
    """``DataPlane`` between threads: ``links[s]`` carries frames into stage s (s > 0)."""

    def __init__(self, rank: int, world_size: int, links: list[queue.Queue], results: queue.Queue):
        self.rank = rank
        self.world_size = world_size
        self._links = links
        self._results = results

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1

    def send_next(self, frame: Frame) -> None:
        if self.is_last:
            raise ValueError("the last stage has no next stage")
        self._links[self.rank + 1].put(frame)

    def recv_prev(self) -> Frame:
        if self.rank == 0:
            raise ValueError("the leader has no previous stage")
        return self._links[self.rank].get()

    def send_result(self, frame: Frame) -> None:
        if not self.is_last or self.rank == 0:
            raise ValueError("only the last stage of a multi-stage pipeline sends results")
        self._results.put(frame)

    def recv_result(self) -> Frame:
        if self.rank != 0:
            raise ValueError("only the leader receives results")
        return self._results.get()

    def drain(self, timeout_s: float = 10.0) -> None:
        """Nothing to wait for: a frame is delivered once it is queued."""


@dataclass(frozen=True)
class _Failed:
    """A follower's handler raised: its reply, so the leader does not wait for it."""

    stage: int
    error: BaseException


class LocalRoundsPlane:
    """``RoundsPlane`` between threads: every stage takes part in every round, in order."""

    def __init__(
        self, rank: int, world_size: int, inboxes: list[queue.Queue], replies: list[queue.Queue]
    ):
        self.rank = rank
        self.world_size = world_size
        self._inboxes = inboxes
        self._replies = replies

    def lead(self, message: Any, answer: Callable[[Any], Any]) -> list[Any]:
        """Leader: hand ``message`` to every follower, answer for stage 0, gather replies."""
        followers = range(1, self.world_size)
        for s in followers:
            self._inboxes[s].put(message)
        replies = [answer(message)]
        replies += [self._replies[s].get() for s in followers]
        failed = next((r for r in replies if isinstance(r, _Failed)), None)
        if failed is not None:
            raise PlaneClosedError(f"stage {failed.stage} failed a round: {failed.error!r}")
        return replies

    def follow(self, handler: Callable[[Any], Any]) -> tuple[Any, list[Any]]:
        """Follower: the next round's message and this stage's reply (the others' replies
        stay with the leader)."""
        message = self._inboxes[self.rank].get()
        try:
            reply = handler(message)
        except BaseException as exc:
            self._replies[self.rank].put(_Failed(self.rank, exc))
            raise
        self._replies[self.rank].put(reply)
        return message, [reply]


_END = None  # the end of a stage's report stream


class LocalReportPlane:
    """``ReportPlane`` between threads: ``streams[s]`` carries stage s's batches."""

    def __init__(self, rank: int, streams: list[queue.SimpleQueue]):
        self.rank = rank
        self._streams = streams
        self._lock = threading.Lock()
        self._closed = rank == 0

    def send(self, outcomes: tuple[Any, ...]) -> None:
        with self._lock:
            if not self._closed:
                self._streams[self.rank].put(outcomes)

    def close(self, timeout_s: float = 10.0) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._streams[self.rank].put(_END)

    def recv(self, stage: int) -> tuple[Any, ...] | None:
        return self._streams[stage].get()


def local_planes(world_size: int) -> list[Planes]:
    """Connected planes for stages 0..world_size-1 of one in-process pipeline."""
    links: list[queue.Queue] = [queue.Queue(maxsize=DEPTH) for _ in range(world_size)]
    results: queue.Queue = queue.Queue()
    inboxes: list[queue.Queue] = [queue.Queue() for _ in range(world_size)]
    replies: list[queue.Queue] = [queue.Queue() for _ in range(world_size)]
    streams: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(world_size)]
    return [
        Planes(
            data=LocalDataPlane(rank, world_size, links, results),  # type: ignore[arg-type]
            rounds=LocalRoundsPlane(rank, world_size, inboxes, replies),  # type: ignore[arg-type]
            reports=LocalReportPlane(rank, streams),  # type: ignore[arg-type]
        )
        for rank in range(world_size)
    ]
