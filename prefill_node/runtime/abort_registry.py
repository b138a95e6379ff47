"""Abort flags of the requests an in-process engine has accepted but not finished.

``LocalEngine`` runs one request at a time; the others wait for its lock. ``abort`` cannot
interrupt a forward pass, so it raises a flag that the request checks where stopping is
safe: once it holds the lock (a queued request then never starts) and between chunks (a
running request stops, and its blocks are released by the normal failure path). Each
``track`` gets its own flag; ``abort(request_id)`` raises every flag under that id (two
in-flight requests sharing an id are both aborted). Thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from prefill_node.errors import RequestAbortedError


class AbortFlag:
    """One tracked request's flag; ``check`` raises RequestAbortedError once it is raised."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._event = threading.Event()

    @property
    def is_set(self) -> bool:
        return self._event.is_set()

    def set(self) -> None:
        self._event.set()

    def check(self, where: str) -> None:
        if self._event.is_set():
            raise RequestAbortedError(f"request {self.request_id!r} was aborted {where}")


class AbortRegistry:
    """request id -> the flags of the tracked requests carrying it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flags: dict[str, list[AbortFlag]] = {}

    @contextmanager
    def track(self, request_id: str) -> Iterator[AbortFlag]:
        """Track a request for the duration of the ``with`` block."""
        flag = AbortFlag(request_id)
        with self._lock:
            self._flags.setdefault(request_id, []).append(flag)
        try:
            yield flag
        finally:
            with self._lock:
                flags = self._flags[request_id]
                flags.remove(flag)
                if not flags:
                    del self._flags[request_id]

    def abort(self, request_id: str) -> bool:
        """Raise the flags of ``request_id``; False when no such request is tracked."""
        with self._lock:
            flags = list(self._flags.get(request_id, ()))
        for flag in flags:
            flag.set()
        return bool(flags)

    def __len__(self) -> int:
        """Requests tracked now (queued and running)."""
        with self._lock:
            return sum(len(flags) for flags in self._flags.values())
