"""The decode fleet: instances from the router's discovery, each one's load from its
``/metrics`` and its prefix cache from its vLLM KV events, indexed with the router's index.

Runs on the serving loop: one poll task and, where the instance publishes KV events, one
ZMQ subscriber task per instance. Discovery may call from its own thread (Kubernetes); the
change is handed to the loop. An instance is ready after a successful ``/metrics`` read and
stops being ready at a failed one, or when a request to it fails to connect (``mark_down``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prefill_node.core.hashing import ExtraKeys, hash_block_tokens
from prefill_router.discovery import PipelineDiscovery, PipelineEndpoint
from prefill_router.index import GlobalPrefixIndex
from wavepp_gateway.decision import DecodeView
from wavepp_gateway.decode_load import DecodeLoad, parse_load
from wavepp_gateway.metrics import GatewayMetrics
from wavepp_gateway.vllm_kv_events import (
    MalformedEventError,
    VllmEventTranslator,
    decode_message,
)

log = logging.getLogger(__name__)
_LIMIT_ASKS = 3

EventsEndpoint = Callable[[PipelineEndpoint], str | None]
"""The ZMQ endpoint an instance publishes its KV events on (None: it publishes none)."""


@dataclass
class DecodeInstance:
    """One instance's state, owned by the serving loop."""

    endpoint: PipelineEndpoint
    events: str | None
    translator: VllmEventTranslator
    load: DecodeLoad = field(default_factory=DecodeLoad)
    ready: bool = False
    max_model_len: int | None = None  # from its /v1/models once it answers
    limit_asks: int = 0  # /v1/models reads so far (a few, until one states the limit)
    prefilling_tokens: int = 0  # prompt tokens sent to it to compute, not answered yet
    tasks: list[asyncio.Task] = field(default_factory=list)

    @property
    def id(self) -> str:
        return self.endpoint.id

    @property
    def url(self) -> str:
        return f"http://{self.endpoint.address}"


class DecodeFleet:
    """See the module contract. ``views`` is what the decision reads per request."""

    def __init__(
        self,
        discovery: PipelineDiscovery,
        model_id: str,
        metrics: GatewayMetrics,
        *,
        poll_s: float = 1.0,
        events_endpoint: EventsEndpoint = lambda e: None,
    ) -> None:
        self._discovery = discovery
        self._model_id = model_id
        self._metrics = metrics
        self._poll_s = poll_s
        self._events_endpoint = events_endpoint
        self._instances: dict[str, DecodeInstance] = {}
        self._index = GlobalPrefixIndex()
        self._index_seq: dict[str, int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._http = None
        self._extra: dict[str | None, ExtraKeys] = {}

    async def start(self) -> None:
        import aiohttp

        self._loop = asyncio.get_running_loop()
        # aiohttp, as vLLM's own disaggregated proxy uses: its C parser costs a fraction of
        # httpx's per request (docs/gateway.md, the added latency); polls time out in 2 s
        self._http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=2.0),
            connector=aiohttp.TCPConnector(limit=0),
            auto_decompress=False,
        )
        self._discovery.start(self._on_change)

    def _on_change(self, endpoints: frozenset[PipelineEndpoint]) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._apply(endpoints)
        else:
            loop.call_soon_threadsafe(self._apply, endpoints)

    def _apply(self, endpoints: frozenset[PipelineEndpoint]) -> None:
        wanted = {e.id: e for e in endpoints}
        for iid in [i for i in self._instances if i not in wanted]:
            self._remove(iid)
        for iid, endpoint in wanted.items():
            known = self._instances.get(iid)
            if known is not None and known.endpoint == endpoint:
                continue
            if known is not None:
                self._remove(iid)
            inst = DecodeInstance(endpoint, self._events_endpoint(endpoint),
                                  VllmEventTranslator(self._model_id))  # fmt: skip
            self._instances[iid] = inst
            self._index.add_pipeline(iid)
            inst.tasks.append(asyncio.create_task(self._poll(inst)))
            if inst.events is not None:
                inst.tasks.append(asyncio.create_task(self._follow_events(inst)))
            log.info("decode instance %s at %s (KV events: %s)", iid, inst.url, inst.events)

    def _remove(self, iid: str, why: str = "left the discovery") -> None:
        inst = self._instances.pop(iid)
        for task in inst.tasks:
            task.cancel()
        self._index.drop_pipeline(iid)
        self._index_seq.pop(iid, None)
        m = self._metrics
        for gauge in (m.decode_ready, m.decode_running, m.decode_waiting, m.decode_blocks,
                      m.decode_prefilling):  # fmt: skip
            with contextlib.suppress(KeyError):  # never polled yet
                gauge.remove(iid)
        log.info("decode instance %s %s", iid, why)

    async def _poll(self, inst: DecodeInstance) -> None:
        while True:
            try:
                async with self._http.get(f"{inst.url}/metrics") as reply:
                    reply.raise_for_status()
                    inst.load = parse_load(await reply.text())
                if inst.max_model_len is None and inst.limit_asks < _LIMIT_ASKS:
                    inst.limit_asks += 1
                    inst.max_model_len = await self._max_model_len(inst)
                if not inst.ready:
                    log.info("decode instance %s is ready (max_model_len %s)", inst.id,
                             inst.max_model_len)  # fmt: skip
                inst.ready = True
            except Exception as exc:  # any failure: not ready until the next good read
                if inst.ready:
                    log.warning("decode instance %s not ready: %s", inst.id, exc)
                inst.ready = False
            m = self._metrics
            m.decode_ready.labels(inst.id).set(inst.ready)
            m.decode_running.labels(inst.id).set(inst.load.running)
            m.decode_waiting.labels(inst.id).set(inst.load.waiting)
            m.decode_blocks.labels(inst.id).set(self._index.num_blocks(inst.id))
            await asyncio.sleep(self._poll_s)

    async def _max_model_len(self, inst: DecodeInstance) -> int | None:
        """The context limit the instance's ``/v1/models`` states (vLLM's card field), or
        None when it states none."""
        try:
            async with self._http.get(f"{inst.url}/v1/models") as reply:
                reply.raise_for_status()
                card = await reply.json(content_type=None)
            lengths = [c.get("max_model_len") for c in card.get("data", ())]
        except Exception:  # not an OpenAI server, or no answer: the limit stays unknown
            return None
        known = [n for n in lengths if isinstance(n, int) and n > 0]
        return min(known) if known else None

    async def _follow_events(self, inst: DecodeInstance) -> None:
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(inst.events)
        last: int | None = None
        try:
            while True:
                frames = await sock.recv_multipart()
                try:
                    batch = decode_message(frames)
                except MalformedEventError as exc:
                    log.warning("decode instance %s: bad KV event message: %s", inst.id, exc)
                    continue
                if last is None or batch.sequence != last + 1:  # first, or a gap: start over
                    inst.translator.reset()
                    self._index_seq[inst.id] = 0
                last = batch.sequence
                self._apply_events(inst, batch.events)
        finally:
            sock.close(0)

    def _apply_events(self, inst: DecodeInstance, events) -> None:
        if inst.id not in self._index:
            return
        seq = self._index_seq.get(inst.id, 0) + 1
        translated = inst.translator.translate(events)
        if seq == 1:  # a new subscription: what came before it is unknown here
            from prefill_node.core.kv_events import AllBlocksCleared

            translated = (AllBlocksCleared(), *translated)
        self._index.apply(inst.id, seq, translated)
        self._index_seq[inst.id] = seq

    def mark_down(self, iid: str) -> None:
        """A request could not reach ``iid``: not ready until its next good ``/metrics``."""
        inst = self._instances.get(iid)
        if inst is not None:
            inst.ready = False

    def instance(self, iid: str) -> DecodeInstance | None:
        return self._instances.get(iid)

    def num_ready(self) -> int:
        return sum(i.ready for i in self._instances.values())

    def views(self, prompt_ids: Sequence[int], cache_salt: str | None) -> list[DecodeView]:
        """The ready instances with their load and the prompt tokens each one caches (the
        last prompt token never counts: decode computes it to sample)."""
        ready = [i for i in self._instances.values() if i.ready]
        matches: dict[str, int] = {}
        by_size: dict[int, list[DecodeInstance]] = {}
        for inst in ready:
            by_size.setdefault(inst.translator.block_size, []).append(inst)
        now = time.monotonic()
        for size, group in by_size.items():
            if size <= 0:
                continue
            hashes = hash_block_tokens(prompt_ids, size, self._extra_keys(cache_salt))
            found = self._index.match(hashes, now)
            for inst in group:
                matches[inst.id] = min(found.get(inst.id, 0) * size, len(prompt_ids) - 1)
        return [
            DecodeView(
                i.id,
                matches.get(i.id, 0),
                i.load.running,
                i.load.waiting,
                i.load.kv_usage,
                i.max_model_len,
                i.prefilling_tokens,
            )  # fmt: skip
            for i in ready
        ]

    def _extra_keys(self, salt: str | None) -> ExtraKeys:
        keys = self._extra.get(salt)
        if keys is None:
            if len(self._extra) > 4096:
                self._extra.clear()
            keys = self._extra[salt] = ExtraKeys(self._model_id, salt)
        return keys

    @property
    def http(self):
        """The fleet's shared aiohttp.ClientSession (also used for the requests to decode)."""
        return self._http

    async def aclose(self) -> None:
        await asyncio.to_thread(self._discovery.stop)
        for iid in list(self._instances):
            self._remove(iid, "no longer followed: the gateway stops")
        if self._http is not None:
            await self._http.close()
