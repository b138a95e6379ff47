"""CommandLoop: hands work to one owner thread and paces that thread's polling.

NIXL agents are used from one thread only, so the KV hand-off threads (in-process stages and
runtime stage processes) run every call on their own thread: other threads ``call`` work and
get a Future; the owner thread's loop runs ``run_pending`` then its own polling, then ``pause``.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

from kv_transfer.errors import KVTransferError

log = logging.getLogger(__name__)


class CommandLoop:
    """Contract: ``call`` from any thread; ``run_pending`` / ``pause`` from the owner only.
    A command that raises fails its Future (and is logged: with its traceback unless it is
    a transfer's own KVTransferError, which its caller reports); the loop goes on."""

    def __init__(self, name: str, poll_interval_s: float, idle_interval_s: float) -> None:
        self.name = name
        self._poll_interval_s = poll_interval_s
        self._idle_interval_s = idle_interval_s
        self._commands: deque[tuple[Callable[[], object], Future]] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def call(self, work: Callable[[], object]) -> Future:
        """Queue ``work`` for the owner thread and wake it; the Future holds its result."""
        future: Future = Future()
        self._commands.append((work, future))
        self._wake.set()
        return future

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def run_pending(self) -> None:
        while self._commands:
            work, future = self._commands.popleft()
            try:
                future.set_result(work())
            except KVTransferError as exc:  # a transfer's own failure: its caller reports it
                log.debug("%s: command failed: %r", self.name, exc)
                future.set_exception(exc)
            except Exception as exc:  # noqa: BLE001 - the caller of call() sees it
                log.exception("%s: command failed", self.name)
                future.set_exception(exc)

    def pause(self, busy: bool) -> None:
        """Sleep one poll interval (short while ``busy``), or until woken."""
        self._wake.wait(self._poll_interval_s if busy else self._idle_interval_s)
        self._wake.clear()
