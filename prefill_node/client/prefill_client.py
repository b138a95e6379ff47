"""Clients of the PrefillService (sync and asyncio) for tools, tests and the router.

Both return engine-side types (``RemoteResult`` wraps a PrefillResult) and raise
``grpc.RpcError`` with the server's status code and message on failure.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefill_node.engine.types import (
    EngineLoad,
    KVPullDestination,
    KVPushDestination,
    PrefillResult,
    ScoreReport,
    StageKVManifest,
)
from prefill_node.wire.convert import load_from_proto, result_from_proto
from prefill_node.wire.kv_convert import destination_to_proto, manifest_from_proto
from wavepp_proto.prefill.v1 import (
    debug_pb2,
    debug_pb2_grpc,
    kv_events_pb2,
    prefill_pb2,
    prefill_pb2_grpc,
)

SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name
PREFILL_METHOD = f"/{SERVICE_NAME}/Prefill"
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class RemoteResult(NamedTuple):
    """A prefill result as the server returned it."""

    result: PrefillResult
    prompt_token_ids: tuple[int, ...]  # only for text prompts (server-side tokenisation)
    server_s: float  # request received -> response ready, inside the server


class LeasedPrefix(NamedTuple):
    """What LeasePrefix returns: the source's cache model id and its stages' leases."""

    cache_model_id: str
    manifests: tuple[StageKVManifest, ...]


class RemoteServerInfo(NamedTuple):
    """What GetServerInfo reports."""

    model_name: str
    vocab_size: int
    max_model_len: int
    num_stages: int
    text_prompts: bool
    server_version: str
    chat_template: bool  # text prompts may ask for the model's chat template
    instance_id: str = ""  # new at every server start
    block_size: int = 0
    cache_model_id: str = ""  # ExtraKeys.model_id inside the server's block hashes
    pipeline_id: str = ""
    kv_events: bool = False  # SubscribeKvEvents is served
    router: bool = False
    snapshot_interval_blocks: int = 0  # > 0: recurrent layers (CacheIdentity)


def _info(msg: prefill_pb2.ServerInfo) -> RemoteServerInfo:
    return RemoteServerInfo(
        msg.model_name,
        msg.vocab_size,
        msg.max_model_len,
        msg.num_stages,
        msg.text_prompts,
        msg.server_version,
        msg.chat_template,
        msg.instance_id,
        msg.block_size,
        msg.cache_model_id,
        msg.pipeline_id,
        msg.kv_events,
        msg.router,
        msg.snapshot_interval_blocks,
    )


@dataclass(frozen=True)
class ClientTLS:
    """Trust ``ca_file``; ``cert_file`` + ``key_file`` present a client certificate (mTLS)."""

    ca_file: Path
    cert_file: Path | None = None
    key_file: Path | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("give both a client certificate and its key, or neither")
        read = lambda p: Path(p).read_bytes() if p is not None else None
        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca_file),
            private_key=read(self.key_file),
            certificate_chain=read(self.cert_file),
        )


def build_request(
    prompt: Sequence[int] | str,
    *,
    request_id: str = "",
    chat: bool = False,
    system: str = "",
    cache_salt: str = "",
    top_logprobs: int | None = None,
    kv_destination: KVPushDestination | KVPullDestination | None = None,
    timeout_s: float | None = None,
    priority: int = 0,
    tenant_id: str = "",
) -> prefill_pb2.PrefillRequest:
    """A PrefillRequest for token ids or text. Text is tokenised on the server; ``chat``
    wraps it as a user message in the model's chat template, after a ``system`` message if
    given (``system`` needs ``chat``). ``priority`` and ``tenant_id`` order what waits at a
    router."""
    req = prefill_pb2.PrefillRequest(
        request_id=request_id, cache_salt=cache_salt, tenant_id=tenant_id
    )
    if priority:
        req.priority = priority
    if isinstance(prompt, str):
        req.text.text = prompt
        req.text.apply_chat_template = chat
        req.text.system_prompt = system
    else:
        req.token_ids.ids.extend(prompt)
    if top_logprobs is not None:
        req.top_logprobs = top_logprobs
    if kv_destination is not None:
        req.kv_destination.CopyFrom(destination_to_proto(kv_destination))
    if timeout_s is not None:
        req.timeout.FromNanoseconds(round(timeout_s * 1e9))
    return req


def to_remote_result(resp: prefill_pb2.PrefillResponse) -> RemoteResult:
    return RemoteResult(
        result_from_proto(resp), tuple(resp.prompt_token_ids), resp.timings.server_seconds
    )


def to_score_report(resp: prefill_pb2.ScoreResponse) -> ScoreReport:
    return ScoreReport(
        resp.pipeline_id,
        resp.reason,
        resp.prompt_tokens,
        resp.cached_tokens,
        resp.queued_seconds,
        resp.prefill_seconds,
        resp.ready_pipelines,
    )


def channel_options(
    max_message_bytes: int, max_reconnect_backoff_s: float | None = None
) -> list[tuple[str, int]]:
    """Message limits; with ``max_reconnect_backoff_s``, a server that comes back is
    reconnected to within that long (gRPC's own backoff grows to 120 s while it is gone)."""
    options = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]
    if max_reconnect_backoff_s is not None:
        ms = max(1, round(max_reconnect_backoff_s * 1000))
        options += [
            ("grpc.initial_reconnect_backoff_ms", min(ms, 100)),
            ("grpc.max_reconnect_backoff_ms", ms),
        ]
    return options


class PrefillClient:
    """Blocking client; thread-safe (one channel, many concurrent calls)."""

    def __init__(
        self,
        target: str,
        *,
        tls: ClientTLS | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_reconnect_backoff_s: float | None = None,
    ) -> None:
        options = channel_options(max_message_bytes, max_reconnect_backoff_s)
        if tls is None:
            self._channel = grpc.insecure_channel(target, options=options)
        else:
            self._channel = grpc.secure_channel(target, tls.credentials(), options=options)
        self._stub = prefill_pb2_grpc.PrefillServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._debug = debug_pb2_grpc.DebugServiceStub(self._channel)

    def prefill(
        self,
        prompt: Sequence[int] | str,
        *,
        deadline_s: float | None = None,
        metadata: Sequence[tuple[str, str]] | None = None,
        **kwargs,
    ) -> RemoteResult:
        """One Prefill call; ``deadline_s`` is the gRPC call deadline, ``metadata`` extra call
        metadata (e.g. a W3C ``traceparent``), kwargs: build_request."""
        return to_remote_result(
            self._stub.Prefill(
                build_request(prompt, **kwargs), timeout=deadline_s, metadata=metadata
            )
        )

    def score(
        self, prompt: Sequence[int] | str, *, cache_salt: str = "", timeout_s: float | None = 30.0
    ) -> ScoreReport:
        """A router's dry run (Score): where this prompt would be prefilled now."""
        request = build_request(prompt, cache_salt=cache_salt)
        return to_score_report(self._stub.Score(request, timeout=timeout_s))

    def prefill_stream(
        self, requests: Iterable[prefill_pb2.PrefillRequest]
    ) -> Iterator[prefill_pb2.PrefillStreamResponse]:
        """Many requests on one call; entries arrive in completion order."""
        return self._stub.PrefillStream(iter(requests))

    def abort(self, request_id: str) -> bool:
        return self._stub.Abort(prefill_pb2.AbortRequest(request_id=request_id)).aborted

    def load(self, timeout_s: float | None = None) -> EngineLoad:
        return load_from_proto(self._stub.GetLoad(prefill_pb2.GetLoadRequest(), timeout=timeout_s))

    def server_info(self, timeout_s: float | None = 30.0) -> RemoteServerInfo:
        req = prefill_pb2.GetServerInfoRequest()
        return _info(self._stub.GetServerInfo(req, timeout=timeout_s))

    def prefill_future(
        self, request: prefill_pb2.PrefillRequest, deadline_s: float | None = None
    ) -> grpc.Future:
        """A non-blocking Prefill call; the future resolves to a PrefillResponse."""
        return self._stub.Prefill.future(request, timeout=deadline_s)

    def subscribe_kv_events(self, timeout_s: float | None = None) -> Any:
        """The server's KV-event stream: an iterator of KvEventBatch that is also a grpc call
        (``cancel()`` ends it). The first batch is AllBlocksCleared + a snapshot."""
        request = kv_events_pb2.SubscribeKvEventsRequest()
        return self._stub.SubscribeKvEvents(request, timeout=timeout_s)

    def check_integrity(self, timeout_s: float = 60.0) -> debug_pb2.IntegrityReport:
        """The pipeline's DebugService report (``wavepp serve --debug-service``)."""
        req = debug_pb2.CheckIntegrityRequest()
        return self._debug.CheckIntegrity(req, timeout=timeout_s)

    def is_live(self, timeout_s: float = 5.0) -> bool:
        """Liveness as the health service reports it ("" service)."""
        resp = self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    def is_ready(self, timeout_s: float = 5.0) -> bool:
        """Readiness as the health service reports it for the PrefillService."""
        req = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
        resp = self._health.Check(req, timeout=timeout_s)
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> PrefillClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncPrefillClient:
    """asyncio client; create and use it inside one running event loop."""

    def __init__(
        self,
        target: str,
        *,
        tls: ClientTLS | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_reconnect_backoff_s: float | None = None,
    ) -> None:
        options = channel_options(max_message_bytes, max_reconnect_backoff_s)
        if tls is None:
            self._channel = grpc.aio.insecure_channel(target, options=options)
        else:
            self._channel = grpc.aio.secure_channel(target, tls.credentials(), options=options)
        self._stub = prefill_pb2_grpc.PrefillServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def prefill(
        self,
        prompt: Sequence[int] | str,
        *,
        deadline_s: float | None = None,
        metadata: Sequence[tuple[str, str]] | None = None,
        **kwargs,
    ) -> RemoteResult:
        request = build_request(prompt, **kwargs)
        call = self._stub.Prefill(request, timeout=deadline_s, metadata=metadata)
        return to_remote_result(await call)

    def prefill_call(
        self, prompt: Sequence[int] | str, *, deadline_s: float | None = None, **kwargs
    ) -> grpc.aio.UnaryUnaryCall:
        """The raw call object (cancel() it to cancel the request)."""
        return self._stub.Prefill(build_request(prompt, **kwargs), timeout=deadline_s)

    async def score(
        self,
        prompt: Sequence[int] | str,
        *,
        cache_salt: str = "",
        timeout_s: float | None = None,
        metadata: Sequence[tuple[str, str]] | None = None,
    ) -> ScoreReport:
        """A router's dry run (Score): where this prompt would be prefilled now."""
        request = build_request(prompt, cache_salt=cache_salt)
        call = self._stub.Score(request, timeout=timeout_s, metadata=metadata)
        return to_score_report(await call)

    async def lease_prefix(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str = "",
        lease_ttl_s: float | None = None,
        timeout_s: float | None = None,
    ) -> LeasedPrefix:
        """LeasePrefix: per stage, a pull lease on the cached run of ``token_ids``' blocks
        (none when some stage holds none); release with a "rel" notification, as decode."""
        request = prefill_pb2.LeasePrefixRequest(cache_salt=cache_salt)
        request.token_ids.ids.extend(token_ids)
        if lease_ttl_s is not None:
            request.lease_ttl_ms = max(1, round(lease_ttl_s * 1e3))
        response = await self._stub.LeasePrefix(request, timeout=timeout_s)
        manifests = tuple(manifest_from_proto(m) for m in response.stage_manifests)
        return LeasedPrefix(response.cache_model_id, manifests)

    async def prefill_stream(
        self, requests: Iterable[prefill_pb2.PrefillRequest]
    ) -> AsyncIterator[prefill_pb2.PrefillStreamResponse]:
        async for item in self._stub.PrefillStream(iter(requests)):
            yield item

    async def abort(self, request_id: str, timeout_s: float | None = None) -> bool:
        request = prefill_pb2.AbortRequest(request_id=request_id)
        return (await self._stub.Abort(request, timeout=timeout_s)).aborted

    async def load(self, timeout_s: float | None = None) -> EngineLoad:
        call = self._stub.GetLoad(prefill_pb2.GetLoadRequest(), timeout=timeout_s)
        return load_from_proto(await call)

    async def server_info(self, timeout_s: float | None = None) -> RemoteServerInfo:
        req = prefill_pb2.GetServerInfoRequest()
        return _info(await self._stub.GetServerInfo(req, timeout=timeout_s))

    async def is_ready(self, timeout_s: float = 5.0) -> bool:
        """Readiness as the health service reports it for the PrefillService (Check)."""
        req = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
        resp = await self._health.Check(req, timeout=timeout_s)
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    def watch_readiness(self) -> grpc.aio.UnaryStreamCall:
        """The PrefillService's readiness pushed by the server (grpc.health.v1 Watch): a
        stream of HealthCheckResponse, the current status first, then each change; no
        deadline (``cancel()`` ends it). UNIMPLEMENTED where the health service lacks it."""
        return self._health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))

    def subscribe_kv_events(self) -> grpc.aio.UnaryStreamCall:
        """The server's KV-event stream (KvEventBatch; ``cancel()`` ends it). The first batch
        is AllBlocksCleared + a snapshot."""
        return self._stub.SubscribeKvEvents(kv_events_pb2.SubscribeKvEventsRequest())

    def raw_prefill(self) -> grpc.aio.UnaryUnaryMultiCallable:
        """Prefill with bytes both ways (an encoded PrefillRequest in, the encoded
        PrefillResponse out): for a proxy that passes both on as they are."""
        return self._channel.unary_unary(PREFILL_METHOD, _registered_method=True)

    def connectivity(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        """The channel's connectivity state now (``try_to_connect``: leave IDLE)."""
        return self._channel.get_state(try_to_connect)

    async def connectivity_changed(self, last: grpc.ChannelConnectivity) -> None:
        """Return once the channel's state is no longer ``last``."""
        await self._channel.wait_for_state_change(last)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncPrefillClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
