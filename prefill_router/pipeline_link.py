"""PipelineLink: the router's connection to one pipeline: identity, health, load, KV events.

A link lives on ONE asyncio event loop (``start(loop)``: the router's serving loop, so the
router runs no thread per pipeline and its monitoring never contends with the serving loop
for the GIL), as four tasks that ``aclose`` / ``stop`` end:

- READINESS: on (re)connect, GetServerInfo; then the pipeline PUSHES its readiness over a
  grpc.health.v1 ``Watch`` stream (the PrefillService's status now, then each change). A
  NOT_SERVING status, a broken stream (the pipeline died or restarted), a failed call or a new
  ``instance_id`` makes the link not ready at once; it reconnects every ``poll_s``. A
  pipeline whose health service lacks Watch (UNIMPLEMENTED), or ``LinkConfig.watch=False``,
  is polled with ``Check`` every ``poll_s`` instead; a Check past its deadline counts only
  after ``slow_polls_before_unready`` in a row (a busy host answers late now and then).
- CONNECTION: follows the monitoring channel's connectivity state. The channel leaving
  READY (the pipeline's process died, its host went away) makes the link not ready at once,
  whether readiness is watched or polled; the channel reaching READY again wakes the
  readiness task, so a new instance at the address is identified and back as soon as it is
  SERVING. ``connection_lost`` does the same for the router when a forwarded call found
  the connection gone.
- LOAD: GetLoad every ``poll_s`` while ready. A failed or late GetLoad keeps the last load
  (busy, not gone). Under Watch a late GetLoad is followed by a health Check, so a pipeline
  that hangs with its stream open still leaves: ``slow_polls_before_unready`` late probes in
  a row, as polling would.
- EVENTS: holds a SubscribeKvEvents stream while the link is ready and accepted, hands every
  batch to the owner (which feeds its index) and resubscribes after any break, gap or
  restart, with a short backoff. A new subscription starts with AllBlocksCleared + a
  snapshot, so the owner's entries for this pipeline are rebuilt from scratch each time.

Contract: the listener's methods run on the link's loop and must not block for long; the
link's public attributes (``ready``, ``info``, ``load``) are plain reads of immutable values,
safe from any thread. Forwarded Prefill calls go over a grpc.aio channel of the calling event
loop (``aio_prefill``: one channel per loop, since aio channels are loop-bound); on the link's
own loop that is the monitoring channel, so a router on one loop holds one channel per
pipeline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health_pb2

from prefill_node.client.prefill_client import (
    PREFILL_METHOD,
    AsyncPrefillClient,
    ClientTLS,
    RemoteServerInfo,
)
from prefill_node.core.kv_events import KVEvent
from prefill_node.engine.types import EngineLoad, PipelineLoad
from prefill_node.wire.kv_convert import event_from_proto
from prefill_router.discovery import PipelineEndpoint

__all__ = ["PREFILL_METHOD", "LinkConfig", "LinkListener", "PipelineLink", "start_loop_thread"]

log = logging.getLogger(__name__)

_RawCall = grpc.aio.UnaryUnaryMultiCallable  # bytes in, bytes out
_SERVING = health_pb2.HealthCheckResponse.SERVING
_DEADLINE = grpc.StatusCode.DEADLINE_EXCEEDED
_READY = grpc.ChannelConnectivity.READY


class LinkListener(Protocol):
    """What a link reports to its owner (the router). Called on the link's event loop."""

    def link_identified(self, link: PipelineLink, info: RemoteServerInfo) -> str | None:
        """A (re)connected pipeline's ServerInfo; return why it is refused, or None."""

    def link_ready(self, link: PipelineLink, ready: bool, reason: str) -> None:
        """Readiness changed (False: leave the candidate set and drop its index entries)."""

    def link_batch(self, link: PipelineLink, sequence: int, events: tuple[KVEvent, ...]) -> bool:
        """One KV-event batch; return False to resubscribe (a gap)."""

    def link_stream_lost(self, link: PipelineLink, reason: str) -> None:
        """The KV-event stream ended: the pipeline's index entries are stale."""


@dataclass(frozen=True)
class LinkConfig:
    """``poll_s``: load period, reconnect period, and the health period where readiness is
    polled (a dead pipeline leaves the candidate set as soon as its stream breaks under
    Watch, within about ``poll_s + rpc_timeout_s`` when polled; a hung one within
    ``slow_polls_before_unready`` times that); ``retry_s``: resubscribe backoff cap, and the
    channels' reconnect backoff cap (a restarted pipeline is back within about that long,
    however long it was gone); ``watch``: readiness from the health Watch stream (False:
    Check every ``poll_s``, as for a pipeline whose health service lacks Watch)."""

    poll_s: float = 0.5
    rpc_timeout_s: float = 1.0
    retry_s: float = 2.0
    # late health answers in a row before a pipeline counts as gone: a busy host answers late
    # now and then; a refused connection or NOT_SERVING counts at once
    slow_polls_before_unready: int = 3
    tls: ClientTLS | None = None
    watch: bool = True


def start_loop_thread(name: str) -> asyncio.AbstractEventLoop:
    """A new event loop running forever on a daemon thread (for callers without a loop);
    ``loop.call_soon_threadsafe(loop.stop)`` ends it."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name=name, daemon=True).start()
    return loop


def _on(loop: asyncio.AbstractEventLoop) -> bool:
    """True when the calling thread is running ``loop``."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _cancelled_here() -> bool:
    """Inside ``except CancelledError``: True when the TASK is being cancelled (stop), False
    when only a call it awaited was cancelled (grpc.aio raises CancelledError for both)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class PipelineLink:
    """One pipeline behind the router (see the module contract)."""

    def __init__(
        self, endpoint: PipelineEndpoint, listener: LinkListener, config: LinkConfig
    ) -> None:
        self.endpoint = endpoint
        self.config = config
        self._listener = listener
        self.info: RemoteServerInfo | None = None
        self.ready = False
        self.refused: str | None = None  # why the router refuses this pipeline (None: ok)
        self.load: EngineLoad | None = None
        self.slow_loads = 0  # GetLoad calls that failed while the link was ready
        self.watching = False  # readiness comes from a live Watch stream (else: Check polls)
        self._slow_polls = 0  # late health answers in a row
        self._loop: asyncio.AbstractEventLoop | None = None
        self._own_loop = False  # started without a loop: a loop thread of its own
        self._tasks: list[asyncio.Task] = []
        self._aborts: set[asyncio.Task] = set()  # Abort calls under way (``abort``)
        self._closing: asyncio.Task | None = None
        self._stopping = False
        # set while the link is ready AND its owner knows (may subscribe); loop-side only
        self._subscribable = asyncio.Event()
        self._recheck_identity = False  # GetServerInfo before the next readiness step
        self._wake = asyncio.Event()  # ends the readiness task's pause (the connection is back)
        self._stream: grpc.aio.UnaryStreamCall | None = None  # the live SubscribeKvEvents
        self._watch: grpc.aio.UnaryStreamCall | None = None  # the live health Watch
        self._clients: dict[asyncio.AbstractEventLoop, tuple[AsyncPrefillClient, _RawCall]] = {}

    @property
    def pid(self) -> str:
        return self.endpoint.id

    def described(self, inflight_requests: int, indexed_blocks: int) -> PipelineLoad:
        """This pipeline as a router's GetLoad reports it (the counts are the router's)."""
        load = self.load
        return PipelineLoad(
            pipeline_id=self.pid,
            address=self.endpoint.address,
            ready=self.ready and self.refused is None,
            queue_depth=load.queue_depth if load else 0,
            inflight_requests=inflight_requests,
            inflight_tokens=load.inflight_tokens if load else 0,
            indexed_blocks=indexed_blocks,
            stages=load.stages if load else (),
        )

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Run the link on ``loop`` (default: the calling thread's running loop, else a loop
        thread of its own). Callable from any thread."""
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop, self._own_loop = start_loop_thread(f"link-{self.pid}"), True
        self._loop = loop
        if _on(loop):
            self._spawn()
        else:
            loop.call_soon_threadsafe(self._spawn)

    def _spawn(self) -> None:
        if self._stopping:
            return
        loop = self._loop
        self._tasks = [loop.create_task(self._run_readiness(), name=f"link-{self.pid}"),
                       loop.create_task(self._run_load(), name=f"load-{self.pid}"),
                       loop.create_task(self._run_connection(), name=f"conn-{self.pid}"),
                       loop.create_task(self._run_events(), name=f"events-{self.pid}")]  # fmt: skip

    async def aclose(self) -> None:
        """End the tasks and close the channels, on the link's loop; aio channels of other
        loops close on theirs, calls in flight on them are cancelled."""
        self._stopping = True
        self._subscribable.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        clients, self._clients = dict(self._clients), {}
        for loop, (client, _) in clients.items():
            if loop is self._loop:
                await client.close()
            elif not loop.is_closed():
                asyncio.run_coroutine_threadsafe(client.close(), loop)

    def stop(self) -> None:
        """``aclose`` from any thread: bounded wait off the loop; on the loop it runs in the
        background (nothing may block the loop)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            self._stopping = True
            return
        if _on(loop):
            self._closing = loop.create_task(self.aclose())  # held: a task is weakly kept
            return
        if loop.is_running():
            done = asyncio.run_coroutine_threadsafe(self.aclose(), loop)
            try:
                done.result(self.config.rpc_timeout_s + 2.0)
            except concurrent.futures.TimeoutError:
                log.warning("pipeline %s: the link did not close in time", self.pid)
        self._stopping = True
        if self._own_loop:
            loop.call_soon_threadsafe(loop.stop)

    # -- channels ------------------------------------------------------------------------------
    def aio_prefill(self) -> _RawCall:
        """This pipeline's Prefill on the running event loop, bytes both ways: the router
        passes requests and answers on as encoded."""
        entry = self._clients.get(asyncio.get_running_loop())
        return (entry or self._connect())[1]

    def abort(self, request_id: str) -> None:
        """Abort ``request_id`` on the pipeline (from any thread; fire and forget: a failure
        leaves its leases to their TTL)."""
        loop = self._loop
        if loop is None or loop.is_closed() or self._stopping:
            return

        async def send() -> None:
            with contextlib.suppress(grpc.RpcError, TimeoutError):
                await self._client().abort(request_id, timeout_s=self.config.rpc_timeout_s)

        def start() -> None:
            task = loop.create_task(send())
            self._aborts.add(task)
            task.add_done_callback(self._aborts.discard)

        loop.call_soon_threadsafe(start)

    def _client(self) -> AsyncPrefillClient:
        """The monitoring client (on the link's loop)."""
        entry = self._clients.get(self._loop)
        return (entry or self._connect())[0]

    def _connect(self) -> tuple[AsyncPrefillClient, _RawCall]:
        client = AsyncPrefillClient(self.endpoint.address, tls=self.config.tls,
                                    max_reconnect_backoff_s=self.config.retry_s)  # fmt: skip
        entry = self._clients[asyncio.get_running_loop()] = (client, client.raw_prefill())
        return entry

    # -- readiness -----------------------------------------------------------------------------
    async def _run_readiness(self) -> None:
        watch = self.config.watch
        while True:
            if await self._identified():
                if watch:
                    watch = await self._follow_health()
                    if not watch:
                        continue  # no Watch there: poll at once
                else:
                    await self._check()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.poll_s)
            self._wake.clear()

    async def _run_connection(self) -> None:
        client = self._client()
        state = client.connectivity(try_to_connect=True)
        while True:
            await client.connectivity_changed(state)
            new = client.connectivity(try_to_connect=True)  # down: keep reconnecting
            if state is _READY and new is not _READY:
                self._lost(f"connection {new.name}")
            elif new is _READY and not self.ready:
                self._wake.set()  # connected again: identify and follow readiness now
            state = new

    def connection_lost(self, detail: str) -> None:
        """The connection to the pipeline is gone (from any thread): leave the candidate set
        at once; a new instance comes back through identity and readiness."""
        self._call_soon(lambda: self._lost(detail))

    def _lost(self, detail: str) -> None:
        self._set_ready(False, f"unreachable: {detail}")
        self._rewatch()
        self._wake.set()

    async def _identified(self) -> bool:
        """GetServerInfo when the pipeline may have changed (first contact, after a failed
        call or a broken stream: a restarted server breaks them); True: go on to readiness."""
        if self._recheck_identity or self.info is None:
            self._recheck_identity = False
            try:
                info = await self._client().server_info(timeout_s=self.config.rpc_timeout_s)
            except grpc.aio.AioRpcError as exc:
                self._failed(exc)
                return False
            if self.info is None or info.instance_id != self.info.instance_id:
                self._identify(info)
        if self.refused is not None:
            self._recheck_identity = True  # a refused server may be replaced: ask again
            return False
        return True

    async def _follow_health(self) -> bool:
        """Follow the pipeline's readiness stream until it breaks; False: the pipeline's
        health service has no Watch (poll it instead)."""
        call = self._watch = self._client().watch_readiness()
        self.watching = True
        try:
            async for reply in call:
                self._slow_polls = 0
                await self._readiness(reply.status == _SERVING)
            self._recheck_identity = True
            self._set_ready(False, "unreachable: the health stream ended")
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.info("pipeline %s: no health Watch; polling Check every %gs", self.pid,
                         self.config.poll_s)  # fmt: skip
                return False
            self._recheck_identity = True
            self._set_ready(False, f"unreachable: {exc.code().name}")
        except asyncio.CancelledError:
            if _cancelled_here():
                raise
            # ended here (``_rewatch``): identity first, then watch again, readiness as is
        finally:
            self.watching = False
            if self._watch is call:
                self._watch = None
        return True

    def _rewatch(self) -> None:
        """Re-identify and watch anew: a new Watch reports the status as it is now."""
        self._recheck_identity = True
        if self._watch is not None:
            self._watch.cancel()

    async def _check(self) -> None:
        """One readiness poll (Check), where the pipeline has no Watch."""
        try:
            ready = await self._client().is_ready(timeout_s=self.config.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            self._failed(exc)
            return
        self._slow_polls = 0
        await self._readiness(ready)

    async def _readiness(self, ready: bool) -> None:
        if ready and not self.ready:
            await self._refresh_load()  # its first candidate view has a load
        self._set_ready(ready, "" if ready else "NOT_SERVING")

    def _failed(self, exc: grpc.aio.AioRpcError) -> None:
        """A failed health or identity call: not ready at once, or after
        ``slow_polls_before_unready`` late ones in a row."""
        self._recheck_identity = True
        slow = exc.code() == _DEADLINE
        self._slow_polls = self._slow_polls + 1 if slow else 0
        if slow and self._slow_polls < self.config.slow_polls_before_unready:
            return  # late, not gone (yet)
        self._set_ready(False, f"unreachable: {exc.code().name}")

    def _identify(self, info: RemoteServerInfo) -> None:
        restarted = self.info is not None
        if restarted:  # same address, new server: everything known about it is gone
            self._set_ready(False, "restarted")
        self.info = info
        self.refused = self._listener.link_identified(self, info)
        if self.refused is not None:
            log.warning("pipeline %s refused: %s", self.pid, self.refused)

    def _set_ready(self, ready: bool, reason: str) -> None:
        if ready == self.ready or self._stopping:
            return
        self.ready = ready
        if not ready:
            log.warning("pipeline %s is not ready: %s", self.pid, reason)
            self._subscribable.clear()
            self._end_stream()
        self._listener.link_ready(self, ready, reason)
        if ready:  # after the owner made room for its entries: the snapshot goes there
            log.info("pipeline %s is ready", self.pid)
            self._subscribable.set()

    # -- load ----------------------------------------------------------------------------------
    async def _run_load(self) -> None:
        while True:
            await asyncio.sleep(self.config.poll_s)
            if self.ready:
                await self._refresh_load()

    async def _refresh_load(self) -> None:
        """GetLoad. A slow answer means busy, not gone (its load asks every stage, behind
        their admission rounds): keep the last load and the pipeline. Dropping it would
        throw its index away under load. Under Watch a health Check tells busy from hung."""
        try:
            self.load = await self._client().load(timeout_s=self.config.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            self.slow_loads += 1
            log.debug("pipeline %s: GetLoad failed (%s); keeping the last load", self.pid,
                      exc.code().name)  # fmt: skip
            if self.watching and self.ready:
                await self._probe()
            return
        if self.watching:
            self._slow_polls = 0

    async def _probe(self) -> None:
        try:
            ready = await self._client().is_ready(timeout_s=self.config.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            self._failed(exc)
        else:
            self._slow_polls = 0
            if not ready:
                self._set_ready(False, "NOT_SERVING")
        if not self.ready:  # the Watch saw nothing: a new one reports the status as it is
            self._rewatch()

    # -- events --------------------------------------------------------------------------------
    async def _run_events(self) -> None:
        backoff = 0.1
        while True:
            await self._subscribable.wait()
            if self._stopping:
                return
            reason = await self._follow()
            if self._stopping:
                return
            if reason == "restarted":
                self._rewatch()  # another server answers there: identify it now
            else:
                self._recheck_identity = True  # on the next poll or reconnect
            self._listener.link_stream_lost(self, reason)
            await asyncio.sleep(backoff)
            backoff = min(self.config.retry_s, backoff * 2)
            if reason == "gap":
                backoff = 0.1

    async def _follow(self) -> str:
        """Hold one subscription until it breaks; the reason it ended."""
        instance = self.info.instance_id if self.info is not None else ""
        call = self._stream = self._client().subscribe_kv_events()
        try:
            async for batch in call:
                if batch.instance_id and batch.instance_id != instance:
                    return "restarted"
                events = tuple(event_from_proto(e) for e in batch.events)
                if not self._listener.link_batch(self, batch.sequence, events):
                    return "gap"
        except grpc.aio.AioRpcError as exc:
            return f"stream ended: {exc.code().name}"
        except asyncio.CancelledError:
            if _cancelled_here():
                raise
            return "stream ended: CANCELLED"
        finally:
            if self._stream is call:
                self._end_stream()
        return "stream ended"

    def _end_stream(self) -> None:
        """Loop-side: cancel the live subscription."""
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.cancel()

    def _cancel_stream(self) -> None:
        """End the live KV-event subscription, from any thread (the link resubscribes)."""
        self._call_soon(self._end_stream)

    def _call_soon(self, fn: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        if _on(loop):
            fn()
        else:
            loop.call_soon_threadsafe(fn)
