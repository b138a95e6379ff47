"""Fan-out of a pipeline's KV events from the engine's threads to router subscriptions.

``publish`` may be called from any thread and never blocks the engine. Each subscription owns
a bounded queue on its event loop; a subscriber that falls ``max_pending`` batches behind is
closed (``overflowed``) rather than slowing the engine down, and must resubscribe. Every
subscription starts with one batch holding ``AllBlocksCleared`` ("forget what you knew about this
pipeline") followed by ``BlockStored`` chains for every block published and not removed so far
(the hub mirrors the feed), so a router that (re)subscribes late still learns what is cached;
later batches continue exactly where that snapshot ends.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

from prefill_node.core.kv_event_aggregator import PipelineKVEventAggregator
from prefill_node.core.kv_events import AllBlocksCleared, KVEvent


class KVEventSubscription:
    """One subscriber's ordered batches: ``await next_batch()`` -> (sequence, events)."""

    def __init__(
        self,
        hub: KVEventHub,
        loop: asyncio.AbstractEventLoop,
        max_pending: int,
        snapshot: tuple[KVEvent, ...] = (),
    ):
        self._hub = hub
        self._loop = loop
        self._queue: asyncio.Queue[tuple[KVEvent, ...]] = asyncio.Queue(max_pending)
        self._sequence = 0
        self.overflowed = False
        self._queue.put_nowait((AllBlocksCleared(), *snapshot))

    async def next_batch(self) -> tuple[int, tuple[KVEvent, ...]] | None:
        """The next batch, or None once the subscription overflowed (resubscribe)."""
        if self.overflowed and self._queue.empty():
            return None
        events = await self._queue.get()
        if not events:  # the overflow wake-up
            return None
        self._sequence += 1
        return self._sequence, events

    def close(self) -> None:
        self._hub._remove(self)

    def _offer(self, events: tuple[KVEvent, ...]) -> None:
        """Runs on the subscriber's loop."""
        if self.overflowed:
            return
        if self._queue.full():
            self.overflowed = True
            self._hub._remove(self)
            self._drain_and_wake()
            return
        self._queue.put_nowait(events)

    def _drain_and_wake(self) -> None:
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queue.put_nowait(())


class KVEventHub:
    """Thread-safe publisher side; hand ``publish`` to the engine as its KV-event callback."""

    def __init__(self, pipeline_id: str, max_pending: int = 4096) -> None:
        if max_pending < 2:
            raise ValueError("max_pending must be >= 2")
        self.pipeline_id = pipeline_id
        self._max_pending = max_pending
        self._lock = threading.Lock()
        self._subscriptions: list[KVEventSubscription] = []
        self._mirror = PipelineKVEventAggregator(1)  # what subscribers have been told

    def subscribe(self) -> KVEventSubscription:
        """Call on the event loop that will consume the subscription."""
        loop = asyncio.get_running_loop()
        with self._lock:  # atomic with publish: no batch is both in the snapshot and sent
            snapshot = tuple(self._mirror.snapshot())
            sub = KVEventSubscription(self, loop, self._max_pending, snapshot)
            self._subscriptions.append(sub)
        return sub

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Deliver ``events`` (in order) to every subscriber; from any thread, never blocks."""
        if not events:
            return
        batch = tuple(events)
        gone = []
        with self._lock:  # scheduling under the lock keeps concurrent publishers' order
            self._mirror.ingest(0, batch)
            for sub in self._subscriptions:
                try:
                    sub._loop.call_soon_threadsafe(sub._offer, batch)
                except RuntimeError:  # the subscriber's loop is closed: it is gone
                    gone.append(sub)
        for sub in gone:
            self._remove(sub)

    @property
    def subscriber_count(self) -> int:
        with self._lock:
            return len(self._subscriptions)

    def _remove(self, sub: KVEventSubscription) -> None:
        with self._lock:
            if sub in self._subscriptions:
                self._subscriptions.remove(sub)
