"""Membership: which pipelines are behind the router, and which of them routing may choose.

The discovery (``PipelineDiscovery``) names the endpoints; for each one a ``PipelineLink``
learns the pipeline's identity, readiness, load and KV events and reports them here (this
object is the links' ``LinkListener``). Membership decides:

- **acceptance**: the first pipeline accepted defines the cluster's cache identity (model id
  with dtype, block size, snapshot interval); a router, a server without KV events, another
  model (``model_name``) or another identity is refused, counted in
  ``wavepp_router_pipelines_refused_total``;
- **the index**: a ready pipeline has an entry in the core's global prefix index (filled by
  its snapshot, then its events); one that is not ready, or whose event stream broke, has
  none until its next snapshot;
- **leaving**: a pipeline gone from the discovery leaves routing at once; its link stays open
  while calls forwarded there still run (the pod drains them) and closes after the last one
  ends (``close_if_drained``);
- **members**: each accepted, identified link as a ``PipelineMember`` for ``RouterCore``, made
  again only when the link's load, identity or readiness changed.

Threading: it shares the router's one lock with ``RouterEngine`` (the index lives in the
``RouterCore`` the engine drives too). Methods documented "caller holds the lock" are reads
the engine makes inside its own critical sections; the listener callbacks (on the links'
loop), the lifecycle and the copies for tests and the CLI take the lock themselves.
``on_capacity`` is called, without the lock, after a pipeline's readiness changed, so flow
control can hand out more slots (or fewer).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from prefill_node.client.prefill_client import RemoteServerInfo
from prefill_node.core.hashing import model_cache_name
from prefill_node.core.kv_events import KVEvent
from prefill_node.engine.types import CacheIdentity
from prefill_router.discovery import PipelineDiscovery, PipelineEndpoint
from prefill_router.index import UnknownPipelineError
from prefill_router.pipeline_link import LinkConfig, PipelineLink
from prefill_router.router_core import UNBOUNDED_BLOCKS, PipelineMember, RouterCore
from prefill_router.router_metrics import RouterMetrics

log = logging.getLogger(__name__)


class Membership:
    """See the module contract. ``start`` begins the discovery; ``close`` ends it."""

    def __init__(
        self,
        discovery: PipelineDiscovery,
        core: RouterCore,
        lock: threading.Lock,
        link_config: LinkConfig,
        model_name: str | None,
        metrics: RouterMetrics,
        on_capacity: Callable[[], None],
    ) -> None:
        self._discovery = discovery
        self._core = core
        self._lock = lock
        self._link_config = link_config
        self._model_name = model_name
        self._metrics = metrics
        self._on_capacity = on_capacity
        self._identity: CacheIdentity | None = None
        self._links: dict[str, PipelineLink] = {}
        # left the discovery with calls still forwarded there: closed when the last one ends
        self._leaving: dict[str, PipelineLink] = {}
        # per pipeline: (load, info, ready, its PipelineMember); see ``_member``
        self._members: dict[str, tuple] = {}
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None  # where the links run
        self.vocab_size = self.max_model_len = 0  # the largest over the pipelines accepted

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Begin the discovery; every link runs on ``loop``."""
        self._loop = loop
        self._discovery.start(self._on_endpoints)

    def close(self) -> list[PipelineLink]:
        """Stop the discovery (blocking) and take every link out; the caller stops them."""
        self._discovery.stop()
        with self._lock:
            links = [*self._links.values(), *self._leaving.values()]
            self._closed, self._links, self._leaving = True, {}, {}
        return links

    def _on_endpoints(self, endpoints: frozenset[PipelineEndpoint]) -> None:
        """The discovery's full set: start links for new endpoints, stop links for gone ones."""
        wanted = {e.id: e for e in endpoints}
        with self._lock:
            if self._closed:
                return
            gone = [link for pid, link in self._links.items() if pid not in wanted]
            stopping, draining = [], set()
            for link in gone:
                del self._links[link.pid]
                self._members.pop(link.pid, None)
                self._core.forget(link.pid)
                if not self._core.placed_requests(link.pid):
                    stopping.append(link)
                    continue
                # calls in flight there: the pod drains them; an older leaving link goes now
                older = self._leaving.pop(link.pid, None)
                if older is not None:
                    stopping.append(older)
                self._leaving[link.pid] = link
                draining.add(link.pid)
            new = [PipelineLink(e, self, self._link_config) for pid, e in wanted.items()
                   if pid not in self._links]  # fmt: skip
            for link in new:
                self._links[link.pid] = link
        for link in gone:
            log.info("pipeline %s left the discovery%s", link.pid,
                     "; its link closes when the calls on it end" if link.pid in draining
                     else "")  # fmt: skip
        for link in stopping:
            link.stop()
        for link in new:
            log.info("pipeline %s (%s) found", link.pid, link.endpoint.address)
            link.start(self._loop)

    def close_if_drained(self, pid: str) -> None:
        """A call forwarded to ``pid`` ended: a leaving pipeline's link closes after its last
        one (on the links' loop, not blocking the caller's)."""
        with self._lock:
            if pid not in self._leaving or self._core.placed_requests(pid):
                return
            drained = self._leaving.pop(pid)
        log.info("pipeline %s: the calls on it ended; closing its link", pid)
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(drained.stop)

    # -- LinkListener --------------------------------------------------------------------------
    def link_identified(self, link: PipelineLink, info: RemoteServerInfo) -> str | None:
        identity = CacheIdentity(
            info.cache_model_id, info.block_size, info.snapshot_interval_blocks or None
        )
        with self._lock:
            if info.router or not info.block_size or not info.kv_events:
                why = "not a pipeline publishing KV events (a router, or a server without them)"
            elif self._model_name not in (None, model_cache_name(identity.model_id)):
                why = f"serves {identity.model_id!r}, this router routes {self._model_name!r}"
            elif self._identity is not None and identity != self._identity:
                why = (f"serves {identity.model_id!r} with {identity.block_size}-token blocks; "
                       f"the cluster serves {self._identity.model_id!r} with "
                       f"{self._identity.block_size}-token blocks")  # fmt: skip
            else:
                why = None
                self.vocab_size = max(self.vocab_size, info.vocab_size)
                self.max_model_len = max(self.max_model_len, info.max_model_len)
                if self._identity is None:
                    self._identity = identity
                    self._core.start_scoring(identity.model_id, identity.block_size)
                    log.info("cluster cache identity: %s, %d-token blocks", *(
                        identity.model_id, identity.block_size))  # fmt: skip
        if why is not None:
            self._metrics.pipeline_refused(link.pid)
        return why

    def link_ready(self, link: PipelineLink, ready: bool, reason: str) -> None:
        with self._lock:
            if self._links.get(link.pid) is not link:
                return
            if ready:
                if link.pid not in self._core.index:
                    self._core.index.add_pipeline(link.pid)  # entries come with its snapshot
            else:
                self._drop_index(link.pid)
        self._on_capacity()  # more room, or none ready
        if not ready:
            self._metrics.pipeline_lost(link.pid)

    def link_batch(self, link: PipelineLink, sequence: int, events: tuple[KVEvent, ...]) -> bool:
        with self._lock:
            if self._links.get(link.pid) is not link:
                return False
            try:
                result = self._core.index.apply(link.pid, sequence, events)
            except UnknownPipelineError:  # dropped while the batch was on its way
                return False
        if sequence == 1:
            self._metrics.resync(link.pid)
        return not result.needs_resubscribe

    def link_stream_lost(self, link: PipelineLink, reason: str) -> None:
        with self._lock:
            index = self._core.index
            if self._links.get(link.pid) is not link or link.pid not in index:
                return
            self._drop_index(link.pid)
            if link.ready:
                index.add_pipeline(link.pid)  # awaiting the next snapshot
        log.info("pipeline %s: KV events %s; re-indexing from a new subscription", link.pid,
                 reason)  # fmt: skip

    def _drop_index(self, pid: str) -> None:
        """Caller holds the lock."""
        if pid in self._core.index:
            self._core.index.drop_pipeline(pid)

    # -- reads ---------------------------------------------------------------------------------
    @property
    def identity(self) -> CacheIdentity | None:
        """The cluster's cache identity (None before the first pipeline was accepted)."""
        return self._identity

    def link(self, pid: str) -> PipelineLink | None:
        """The current link to ``pid``. Caller holds the lock."""
        return self._links.get(pid)

    def current(self) -> list[PipelineLink]:
        """Every current link, refused ones included. Caller holds the lock."""
        return list(self._links.values())

    def members(self) -> list[PipelineMember]:
        """The links routing may choose from, as members. Caller holds the lock."""
        return [self._member(link) for link in self._links.values()
                if link.refused is None and link.info is not None]  # fmt: skip

    def ready_count(self) -> int:
        """Accepted pipelines that are ready. Caller holds the lock."""
        return sum(link.ready and link.refused is None for link in self._links.values())

    def any_ready(self) -> bool:
        with self._lock:
            return self.ready_count() > 0

    def _member(self, link: PipelineLink) -> PipelineMember:
        """``link`` as a member, made again only when its load, identity or readiness
        changed. Caller holds the lock."""
        load, info, ready = link.load, link.info, link.ready
        cached = self._members.get(link.pid)
        if cached is None or cached[0] is not load or cached[1] is not info or cached[2] != ready:
            stages = load.stages if load is not None else ()
            member = PipelineMember(
                link.pid, ready, info.max_model_len if info is not None else 0,
                min((st.total_blocks for st in stages), default=UNBOUNDED_BLOCKS),
                (info.snapshot_interval_blocks or None) if info is not None else None,
                load.inflight_tokens if load is not None else 0,
            )  # fmt: skip
            cached = self._members[link.pid] = (load, info, ready, member)
        return cached[3]

    def links(self) -> dict[str, PipelineLink]:
        """The current links by pipeline id (a copy; for tests and the CLI)."""
        with self._lock:
            return dict(self._links)

    def leaving(self) -> dict[str, PipelineLink]:
        """Links that left the discovery and still carry forwarded calls (a copy)."""
        with self._lock:
            return dict(self._leaving)

    def indexed_blocks(self, pid: str) -> int:
        """Confirmed blocks the index holds for ``pid`` (0 when it has none)."""
        with self._lock:
            index = self._core.index
            return index.num_blocks(pid) if pid in index else 0
