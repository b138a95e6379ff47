"""A request's ``prefix_source``: copy its prefix from the pipeline that holds it, then prefill.

A router that finds a prompt's prefix cached on a busy pipeline may send the request to
another one with ``prefix_source`` (that pipeline's address, the prefix's length in whole
blocks). Before submitting the request, this server:

1. checks the request: a prefix of whole blocks of this pipeline's block size (else
   INVALID_ARGUMENT), the source's host on the KV allow-list (the stages READ from its
   agents, whose names and hosts the stages check too);
2. asks the source to lease the prefix's blocks (``LeasePrefix``: one control round on
   the source's stages, each leasing the cached run it holds; nothing waits in its queue)
   and checks its answer names the same cache identity (model, dtype: ``cache_model_id``,
   in every answer, since a source restarted at the same address may serve another model);
3. has every stage READ its layers of the blocks it lacks, up to the shortest run the
   source's stages hold, from the source's stages (``fetch_prefix``), which release the
   leases at the end.

Then the request is submitted as usual: admission finds the copied blocks cached on every
stage. Whatever fails (source unreachable or another model, lease expired, a READ
failed) is logged and counted (``wavepp_prefix_fetches{outcome="failed"}``) and the request
computes what this pipeline lacks: a fetch never fails a request, and nothing runs on KV
that did not land whole.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from functools import partial
from typing import Protocol, runtime_checkable

from kv_transfer.allowlist import AllowList
from kv_transfer.handshake import split_endpoint
from prefill_node.client.prefill_client import AsyncPrefillClient
from prefill_node.engine.types import (
    CacheIdentity,
    PrefixFetchResult,
    StageKVManifest,
)
from prefill_node.errors import InvalidRequestError
from prefill_node.server.metrics import ServerMetrics
from prefill_node.wire.convert import ParsedRequest

log = logging.getLogger(__name__)

SOURCE_TIMEOUT_S = 10.0  # the most a source's pull prefill may take (or the request's deadline)


@runtime_checkable
class PrefixFetching(Protocol):
    """An engine whose stages can copy a prefix from another pipeline (``LeaderEngine``)."""

    kv_allow: AllowList | None  # hosts and agents its stages exchange KV with

    cache_identity: CacheIdentity

    def fetch_prefix(
        self,
        token_ids: tuple[int, ...],
        cache_salt: str | None,
        manifests: tuple[StageKVManifest, ...],
    ) -> PrefixFetchResult: ...

    def lend_prefix(
        self, token_ids: tuple[int, ...], cache_salt: str | None, lease_ttl_s: float | None
    ) -> tuple[StageKVManifest, ...]: ...

    def release_sources(self, manifests: tuple[StageKVManifest, ...]) -> None: ...


@dataclass(frozen=True)
class FetchOutcome:
    """What one ``prefix_source`` gave: ``tokens`` copied (the prefix length copied, when
    some stage copied blocks and none failed; else 0) in ``seconds``."""

    tokens: int
    seconds: float


class PrefixFetcher:
    """Copies requests' prefixes from their sources for one server (its event loop)."""

    def __init__(
        self, engine: PrefixFetching, metrics: ServerMetrics, pool: Executor | None
    ) -> None:
        """``pool``: where the blocking calls run (None: the loop's default executor)."""
        self._engine = engine
        self._metrics = metrics
        self._pool = pool
        self._clients: dict[str, AsyncPrefillClient] = {}

    async def fetch(self, parsed: ParsedRequest) -> FetchOutcome:
        """Copy ``parsed``'s prefix from its ``prefix_source`` (see the module contract).
        InvalidRequestError for a prefix that is not whole blocks here (the caller's
        fault); never raises for the source's or the copy's failures."""
        if parsed.prefix_source is None:
            return FetchOutcome(0, 0.0)
        address, count = parsed.prefix_source
        identity = self._engine.cache_identity
        size = identity.block_size
        if count % size:
            raise InvalidRequestError(
                f"prefix_source.num_tokens={count} is not a multiple of this pipeline's "
                f"block size ({size})"
            )
        started = time.perf_counter()
        outcome, copied, read = "failed", 0, 0
        try:
            result, length = await self._copy(parsed, address, count, identity)
            read = result.bytes_read
            if not result.ok:
                log.warning("prefix fetch from %s failed: %s", address, "; ".join(result.errors))
            elif any(result.copied_blocks):
                outcome, copied = "copied", length
            elif all(skip == "held" for skip in result.skipped):
                outcome = "held"
            else:  # some stage could not make room (every block pinned or escrowed)
                outcome = "no_room"
        except Exception as exc:  # noqa: BLE001 - the request computes the prefix instead
            log.warning("prefix fetch from %s failed: %s: %s", address, type(exc).__name__, exc)
        seconds = time.perf_counter() - started
        self._metrics.observe_fetch(outcome, read, seconds)
        return FetchOutcome(copied, seconds)

    async def _copy(
        self, parsed: ParsedRequest, address: str, count: int, identity: CacheIdentity
    ) -> tuple[PrefixFetchResult, int]:
        """The copy's result and the prefix length it copied (the source may hold less of
        the prefix than asked for: the whole blocks of what every stage there holds)."""
        loop = asyncio.get_running_loop()
        allow = self._engine.kv_allow
        if allow is None:
            raise ValueError("this pipeline runs without KV agents (--no-kv-shipping)")
        host = split_endpoint(address)[0]
        if not await loop.run_in_executor(self._pool, allow.host_allowed, host):
            raise ValueError(f"source host {host!r} is outside the KV allow-list")
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = AsyncPrefillClient(address)
        timeout = SOURCE_TIMEOUT_S
        if parsed.timeout_s is not None:
            timeout = min(timeout, max(0.001, parsed.options.deadline_s - time.monotonic()))
        salt = parsed.options.cache_salt
        leased = await client.lease_prefix(
            parsed.token_ids[:count], cache_salt=salt or "", timeout_s=timeout
        )
        manifests = leased.manifests
        if leased.cache_model_id != identity.model_id:  # asked every time: a source restarted
            # at the same address may serve another model
            await loop.run_in_executor(self._pool, self._engine.release_sources, manifests)
            raise ValueError(
                f"the source serves {leased.cache_model_id!r}, this pipeline {identity.model_id!r}"
            )
        held = min((m.num_tokens for m in manifests), default=0)
        copy = min(count, held) // identity.block_size * identity.block_size
        if copy == 0:  # the source holds too little of it: nothing to copy
            await loop.run_in_executor(self._pool, self._engine.release_sources, manifests)
            raise ValueError(f"the source holds {held} of the prefix's {count} tokens")
        fetch = partial(self._engine.fetch_prefix, parsed.token_ids[:copy], salt, manifests)
        return await loop.run_in_executor(self._pool, fetch), copy

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.close()
