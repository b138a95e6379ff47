"""PipelineLink: the router's connection to one pipeline: identity, health, load, KV events.

Two threads per link, both owned here and stopped by ``stop``:

- the MONITOR checks readiness (grpc.health.v1, the PrefillService) and fetches GetLoad every
  ``poll_s``; on (re)connect it reads GetServerInfo first. A refused or failed call,
  NOT_SERVING, or a new ``instance_id`` (the pipeline restarted) makes the link not ready at
  once; a timed-out health check only after ``slow_polls_before_unready`` in a row, and a
  failed GetLoad alone keeps the last load (a busy host answers late now and then). The
  owner hears every change through ``LinkListener``.
- the EVENTS thread holds a SubscribeKvEvents stream while the link is ready and accepted,
  hands every batch to the owner (which feeds its index) and resubscribes after any break,
  gap or restart, with a short backoff. A new subscription starts with AllBlocksCleared +
  a snapshot, so the owner's entries for this pipeline are rebuilt from scratch each time.

Contract: the listener's methods run on these threads and must not block for long; the
link's public attributes (``ready``, ``info``, ``load``) are plain reads of immutable
values, safe from any thread. Forwarded Prefill calls go over a grpc.aio channel of the
calling event loop (``aio_prefill``: one channel per loop, since aio channels are loop-bound).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from typing import Protocol

import grpc

from prefill_node.client.prefill_client import (
    DEFAULT_MAX_MESSAGE_BYTES,
    ClientTLS,
    PrefillClient,
    RemoteServerInfo,
    channel_options,
)
from prefill_node.core.kv_events import KVEvent
from prefill_node.engine.types import EngineLoad
from prefill_node.server.kv_convert import event_from_proto
from prefill_router.discovery import PipelineEndpoint

log = logging.getLogger(__name__)

PREFILL_METHOD = "/wavepp.prefill.v1.PrefillService/Prefill"
_RawCall = grpc.aio.UnaryUnaryMultiCallable  # bytes in, bytes out


class LinkListener(Protocol):
    """What a link reports to its owner (the router). Called from the link's threads."""

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
    """``poll_s``: health + load period (a dead pipeline leaves the candidate set within
    about ``poll_s + rpc_timeout_s``, a hung one within ``slow_polls_before_unready`` times
    that); ``retry_s``: resubscribe backoff cap, and the channels' reconnect backoff cap (a
    restarted pipeline is back within about that long, however long it was gone)."""

    poll_s: float = 0.5
    rpc_timeout_s: float = 1.0
    retry_s: float = 2.0
    # health checks in a row that time out before a pipeline counts as gone: a busy host
    # answers late now and then; a refused connection or NOT_SERVING counts at once
    slow_polls_before_unready: int = 3
    tls: ClientTLS | None = None


class PipelineLink:
    """One pipeline behind the router (see the module contract)."""

    def __init__(
        self, endpoint: PipelineEndpoint, listener: LinkListener, config: LinkConfig
    ) -> None:
        self.endpoint = endpoint
        self.config = config
        self.client = PrefillClient(
            endpoint.address, tls=config.tls, max_reconnect_backoff_s=config.retry_s
        )
        self._listener = listener
        self.info: RemoteServerInfo | None = None
        self.ready = False
        self.refused: str | None = None  # why the router refuses this pipeline (None: ok)
        self.load: EngineLoad | None = None
        self.slow_loads = 0  # GetLoad calls that failed while health said ready
        self._slow_polls = 0  # health checks in a row that timed out
        self._stop = threading.Event()
        # set while the link is ready AND its owner knows (may subscribe); stop() sets it too
        self._subscribable = threading.Event()
        self._recheck_identity = threading.Event()  # GetServerInfo on the next poll
        self._stream = None  # the live SubscribeKvEvents call (cancel() ends it)
        self._lock = threading.Lock()
        self._aio: dict[asyncio.AbstractEventLoop, tuple[grpc.aio.Channel, _RawCall]] = {}
        name = endpoint.id
        self._monitor = threading.Thread(target=self._run_monitor, name=f"link-{name}", daemon=True)
        self._events = threading.Thread(target=self._run_events, name=f"events-{name}", daemon=True)

    @property
    def pid(self) -> str:
        return self.endpoint.id

    def start(self) -> None:
        self._monitor.start()
        self._events.start()

    def stop(self) -> None:
        """End both threads and close the channels (bounded: a blocked RPC times out); aio
        channels close on their own loops, calls in flight on them are cancelled."""
        self._stop.set()
        self._subscribable.set()
        self._cancel_stream()
        for thread in (self._monitor, self._events):
            if thread.is_alive():
                thread.join(timeout=self.config.rpc_timeout_s + 2.0)
        self.client.close()
        for loop, (channel, _) in list(self._aio.items()):
            if not loop.is_closed():
                asyncio.run_coroutine_threadsafe(channel.close(), loop)
        self._aio.clear()

    def aio_prefill(self) -> _RawCall:
        """This pipeline's Prefill on the running event loop, bytes both ways: the router
        passes requests and answers on as encoded."""
        loop = asyncio.get_running_loop()
        entry = self._aio.get(loop)
        if entry is None:
            options = channel_options(DEFAULT_MAX_MESSAGE_BYTES, self.config.retry_s)
            address, tls = self.endpoint.address, self.config.tls
            channel = (
                grpc.aio.insecure_channel(address, options=options)
                if tls is None
                else grpc.aio.secure_channel(address, tls.credentials(), options=options)
            )
            prefill = channel.unary_unary(PREFILL_METHOD, _registered_method=True)
            entry = self._aio[loop] = (channel, prefill)
        return entry[1]

    # -- monitor ------------------------------------------------------------------------------
    def _run_monitor(self) -> None:
        while not self._stop.is_set():
            self._check()
            self._stop.wait(self.config.poll_s)

    def _check(self) -> None:
        """GetServerInfo only when the pipeline may have changed (first contact, after a
        failed call or a broken event stream: a restarted server breaks both); readiness
        and load on every poll."""
        timeout = self.config.rpc_timeout_s
        try:
            if self._recheck_identity.is_set() or self.info is None:
                self._recheck_identity.clear()
                info = self.client.server_info(timeout_s=timeout)
                if self.info is None or info.instance_id != self.info.instance_id:
                    self._identify(info)
            if self.refused is not None:
                self._recheck_identity.set()  # a refused server may be replaced: ask again
                return
            ready = self.client.is_ready(timeout_s=timeout)
        except grpc.RpcError as exc:
            self._recheck_identity.set()
            slow = exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            self._slow_polls = self._slow_polls + 1 if slow else 0
            if slow and self._slow_polls < self.config.slow_polls_before_unready:
                return  # late, not gone (yet)
            self._set_ready(False, f"unreachable: {exc.code().name}")
            return
        self._slow_polls = 0
        if ready:
            self._refresh_load(timeout)
        self._set_ready(ready, "" if ready else "NOT_SERVING")

    def _refresh_load(self, timeout: float) -> None:
        """GetLoad of a pipeline that just said it is ready. A slow answer means busy, not
        gone (its load asks every stage, behind their admission rounds): keep the last load
        and the pipeline. Dropping it would throw its index away under load."""
        try:
            self.load = self.client.load(timeout_s=timeout)
        except grpc.RpcError as exc:
            self.slow_loads += 1
            log.debug("pipeline %s: GetLoad failed (%s); keeping the last load", self.pid,
                      exc.code().name)  # fmt: skip

    def _identify(self, info: RemoteServerInfo) -> None:
        restarted = self.info is not None
        if restarted:  # same address, new server: everything known about it is gone
            self._set_ready(False, "restarted")
        self.info = info
        self.refused = self._listener.link_identified(self, info)
        if self.refused is not None:
            log.warning("pipeline %s refused: %s", self.pid, self.refused)

    def _set_ready(self, ready: bool, reason: str) -> None:
        with self._lock:
            if ready == self.ready:
                return
            self.ready = ready
        if not ready:
            log.warning("pipeline %s is not ready: %s", self.pid, reason)
            self._subscribable.clear()
            self._cancel_stream()
        self._listener.link_ready(self, ready, reason)
        if ready:  # after the owner made room for its entries: the snapshot goes there
            log.info("pipeline %s is ready", self.pid)
            self._subscribable.set()

    # -- events -------------------------------------------------------------------------------
    def _run_events(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            if not self._subscribable.wait(self.config.poll_s) or self._stop.is_set():
                continue
            reason = self._follow()
            if self._stop.is_set():
                return
            self._recheck_identity.set()
            self._listener.link_stream_lost(self, reason)
            self._stop.wait(backoff)
            backoff = min(self.config.retry_s, backoff * 2)
            if reason == "gap":
                backoff = 0.1

    def _follow(self) -> str:
        """Hold one subscription until it breaks; the reason it ended."""
        instance = self.info.instance_id if self.info is not None else ""
        stream = self.client.subscribe_kv_events()
        with self._lock:
            self._stream = stream
        try:
            for batch in stream:
                if batch.instance_id and batch.instance_id != instance:
                    return "restarted"
                events = tuple(event_from_proto(e) for e in batch.events)
                if not self._listener.link_batch(self, batch.sequence, events):
                    return "gap"
        except grpc.RpcError as exc:
            return f"stream ended: {exc.code().name}"
        finally:
            self._cancel_stream()
        return "stream ended"

    def _cancel_stream(self) -> None:
        with self._lock:
            stream, self._stream = self._stream, None
        if stream is not None:
            stream.cancel()
