"""LocalKVShipping: drives one StageKVShipper per LocalEngine stage on a private thread.

All NIXL calls happen on that thread (the agents are created there). The engine thread talks
to it only through ``stage_finished`` / ``complete`` / ``abandon`` while holding the engine
lock, and the block pools are only ever changed under that lock: the shipping thread queues
the references it gives back and frees them itself only when it can take the lock without
waiting (the engine thread drains the queue whenever it holds the lock). So a push's blocks
are unpinned before ``complete`` returns, and a pull lease's blocks as soon as decode
released it (or it expired) and the engine is idle.

Pull leases live ``KVPullDestination.lease_ttl_s`` when the request sets it, else
``KVShippingConfig.lease_ttl_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING

from kv_transfer.errors import InvalidTransferRequest
from prefill_node.core.block import KVBlock
from prefill_node.engine.types import KVPullDestination, KVPushDestination, StageKVManifest
from prefill_node.errors import InvalidKVDestinationError, InvariantError, KVHandoffError
from prefill_node.kv_shipping.command_loop import CommandLoop
from prefill_node.kv_shipping.shipper import KVShippingConfig, StageKVShipper, StageShipResult

if TYPE_CHECKING:
    from prefill_node.runtime.stage_executor import StageExecutor

log = logging.getLogger(__name__)
Destination = KVPushDestination | KVPullDestination


class LocalKVShipping:
    """The KV hand-off of an in-process pipeline. Build it, pass it to ``LocalEngine``."""

    def __init__(
        self,
        config: KVShippingConfig | None = None,
        poll_interval_s: float = 0.0005,
        idle_interval_s: float = 1.0,
    ) -> None:
        """Polls every ``poll_interval_s`` while a WRITE or lease is live, else every
        ``idle_interval_s`` (a new command wakes it at once; an idle pipeline holds nothing
        that needs polling)."""
        self.config = config or KVShippingConfig()
        self._loop = CommandLoop("local KV shipping", poll_interval_s, idle_interval_s)
        self._stages: tuple[StageExecutor, ...] = ()
        self._shippers: list[StageKVShipper] = []
        self._engine_lock: threading.Lock | None = None
        self._unpins: deque[tuple[int, list[KVBlock]]] = deque()
        self._results: dict[tuple[str, int], StageShipResult] = {}
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    # ---- wiring (LocalEngine calls these) -------------------------------------------

    def attach(self, stages: Sequence[StageExecutor], engine_lock: threading.Lock) -> None:
        """Create every stage's agent and register its KV tensors, on the shipping thread."""
        if self._thread is not None:
            raise InvariantError("LocalKVShipping is already attached to an engine")
        self._stages, self._engine_lock = tuple(stages), engine_lock
        self._thread = threading.Thread(target=self._run, name="kv-shipping", daemon=True)
        self._thread.start()
        self._loop.call(self._build).result(timeout=60)

    def _build(self) -> None:
        for s, stage in enumerate(self._stages):
            self._shippers.append(
                StageKVShipper(
                    s,
                    len(self._stages),
                    stage.kv,
                    self.config,
                    unpin=lambda blocks, s=s: self._unpins.append((s, list(blocks))),
                )
            )

    @property
    def agent_names(self) -> tuple[str, ...]:
        return tuple(s.agent_name for s in self._shippers)

    # ---- engine thread, engine lock held ---------------------------------------------

    def stage_finished(
        self, stage: StageExecutor, request_id: str, destination: Destination
    ) -> None:
        """The request's last chunk left ``stage``: pin its blocks for the shipper and start
        the WRITE (push) or lease them (pull). Returns at once; the next stages keep going."""
        manifest = stage.manifest(request_id)
        blocks = [stage.pool.block(block_id) for block_id in manifest.block_ids]
        stage.pool.touch(blocks)
        shipper = self._shippers[stage.stage]
        if isinstance(destination, KVPullDestination):
            work = partial(shipper.publish, request_id, blocks, manifest, destination.lease_ttl_s)
        else:
            work = partial(shipper.push, request_id, blocks, manifest, destination)
        self._loop.call(work)

    def complete(
        self, request_id: str, manifests: Sequence[StageKVManifest]
    ) -> tuple[StageKVManifest, ...]:
        """Wait (bounded) for every stage's result; the shipped manifests, in stage order.

        On any failure every stage gives the request up (WRITEs aborted, leases revoked,
        blocks unpinned) before the typed error is raised.
        """
        deadline = time.monotonic() + self.config.wait_limit_s + 5.0
        keys = [(request_id, s) for s in range(len(self._stages))]
        with self._changed:
            while not all(k in self._results for k in keys) and time.monotonic() < deadline:
                self._changed.wait(timeout=0.05)
            results = [self._results.pop(k, None) for k in keys]
        failed = [r for r in results if r is None or not r.ok]
        if failed:
            self.abandon(request_id)
            raise _handoff_error(request_id, failed[0])
        self.drain()
        return tuple(r.manifest or m for r, m in zip(results, manifests, strict=True))

    def abandon(self, request_id: str) -> None:
        """Give the request up on every stage (failure or abort) and unpin its blocks."""

        def cancel_all() -> None:
            for shipper in self._shippers:
                shipper.cancel(request_id)

        self._loop.call(cancel_all).result(timeout=30)
        with self._changed:
            for s in range(len(self._stages)):
                self._results.pop((request_id, s), None)
        self.drain()

    def drain(self) -> None:
        """Give queued block references back to the pools (caller holds the engine lock)."""
        while self._unpins:
            s, blocks = self._unpins.popleft()
            self._stages[s].pool.free(blocks)

    def close(self) -> None:
        """Stop shipping: abort WRITEs, revoke leases, free the agents (engine lock held)."""
        if self._thread is None:
            return

        def close_all() -> None:
            for shipper in self._shippers:
                shipper.close()

        try:
            self._loop.call(close_all).result(timeout=30)
        finally:
            self._loop.stop()
            self._thread.join(timeout=10)
            self._thread = None
            self.drain()

    def check_integrity(self) -> None:
        self._loop.call(lambda: [s.check_integrity() for s in self._shippers]).result(timeout=10)

    def held_blocks(self) -> tuple[int, ...]:
        """Per stage: references the shippers hold now (in-flight WRITEs, live leases)."""
        return self._loop.call(lambda: tuple(s.held_blocks for s in self._shippers)).result(10)

    # ---- the shipping thread ---------------------------------------------------------

    def _run(self) -> None:
        while not self._loop.stopped:
            self._loop.run_pending()
            for shipper in self._shippers:
                try:
                    shipper.poll()
                except Exception:  # a bug in one poll must not stop every stage's shipping
                    log.exception("stage %d KV shipper poll failed", shipper.stage)
            self._collect()
            lock = self._engine_lock
            if self._unpins and lock is not None and lock.acquire(blocking=False):
                try:
                    self.drain()
                finally:
                    lock.release()
            self._loop.pause(busy=bool(self._unpins) or any(s.busy for s in self._shippers))

    def _collect(self) -> None:
        found = [r for shipper in self._shippers for r in shipper.take_results()]
        if found:
            with self._changed:
                for r in found:
                    self._results[(r.request_id, r.stage)] = r
                self._changed.notify_all()


def _handoff_error(request_id: str, result: StageShipResult | None) -> Exception:
    """The typed error a failed hand-off raises: bad destinations are the caller's fault."""
    if result is None:
        return KVHandoffError(f"not every stage finished the KV hand-off of {request_id} in time")
    cause = result.error
    if isinstance(cause, (InvalidTransferRequest, InvalidKVDestinationError)):
        return InvalidKVDestinationError(
            f"KV destination of {request_id} rejected by stage {result.stage}: {cause}"
        )
    return KVHandoffError(
        f"KV hand-off of {request_id} failed on stage {result.stage}: "
        f"{type(cause).__name__}: {cause}",
        cause,
    )
