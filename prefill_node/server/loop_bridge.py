"""Hands engine futures' outcomes to an asyncio event loop with one wakeup per burst.

``asyncio.wrap_future`` wakes the loop once per completed future (a self-pipe write, a loop
iteration, a read). A pipeline settles the requests of a wave back to back from one thread,
so a burst of completions here costs one wakeup: completing threads append to a queue, and
only the first of a burst schedules the loop-side drain.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class LoopBridge:
    """Create and use on one running loop. ``watch`` may only be called on that loop;
    engine threads complete the watched futures from anywhere.

    Cancelling the returned asyncio future does NOT cancel the engine's future (engines
    settle their own futures; the caller aborts the request in the engine instead)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._ready: deque[tuple[asyncio.Future[Any], Future[Any]]] = deque()
        self._scheduled = False

    def watch(self, future: Future[T]) -> asyncio.Future[T]:
        """An asyncio future on this loop that settles like ``future``."""
        waiter: asyncio.Future[T] = self.loop.create_future()
        future.add_done_callback(lambda done: self._push(waiter, done))
        return waiter

    def _push(self, waiter: asyncio.Future[Any], done: Future[Any]) -> None:
        with self._lock:
            self._ready.append((waiter, done))
            if self._scheduled:
                return  # the drain already scheduled takes this one too
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            with self._lock:
                self._ready.clear()
                self._scheduled = False

    def _drain(self) -> None:
        with self._lock:
            batch = list(self._ready)
            self._ready.clear()
            self._scheduled = False
        for waiter, done in batch:
            if waiter.done():  # cancelled meanwhile (call cancelled, deadline passed)
                continue
            if done.cancelled():
                waiter.cancel()
                continue
            exc = done.exception()
            if exc is None:
                waiter.set_result(done.result())
            else:
                waiter.set_exception(exc)
