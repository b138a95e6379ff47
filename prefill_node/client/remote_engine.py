"""RemoteEngine: the Engine protocol over gRPC, so engine-level tools run against a server.

``wavepp prefill --server HOST:PORT`` uses it: the same loop, report and greedy continuation
as in-process, with every prefill a Prefill call. Failures come back as the typed errors the
server's status codes stand for (INVALID_ARGUMENT -> InvalidRequestError, ...). Difference to
an in-process engine: validation errors arrive through the future, not from ``submit``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TypeVar

import grpc

from prefill_node.client.prefill_client import (
    ClientTLS,
    PrefillClient,
    RemoteResult,
    build_request,
    to_remote_result,
)
from prefill_node.engine.types import (
    CacheIdentity,
    EngineHealth,
    EngineLoad,
    PrefillOptions,
    PrefillResult,
)
from prefill_node.errors import (
    RequestAbortedError,
    UnavailableError,
)
from prefill_node.wire.status import error_from_rpc
from wavepp_proto.prefill.v1 import prefill_pb2

T = TypeVar("T")


class RemoteEngine:
    """An Engine whose pipeline is behind ``target``. Thread-safe (one channel)."""

    def __init__(self, target: str, *, tls: ClientTLS | None = None, connect_s: float = 30.0):
        self._client = PrefillClient(target, tls=tls)
        try:
            self.info = self._client.server_info(timeout_s=connect_s)
        except grpc.RpcError as exc:
            self._client.close()
            raise UnavailableError(
                f"cannot reach the prefill server at {target}: {exc.details()}"
            ) from None

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def cache_identity(self) -> CacheIdentity:
        return CacheIdentity(
            self.info.cache_model_id,
            self.info.block_size,
            self.info.snapshot_interval_blocks or None,
        )

    def submit(self, token_ids: Sequence[int], options: PrefillOptions) -> Future[PrefillResult]:
        """Send one Prefill call; ``options.deadline_s`` (monotonic) becomes the call deadline."""
        request = self._request(list(token_ids), options)
        return self._call(request, options, lambda remote: remote.result)

    def submit_text(
        self, text: str, options: PrefillOptions, *, chat: bool = False, system: str = ""
    ) -> Future[RemoteResult]:
        """Send ``text`` to be tokenised on the server (``chat``: in the model's chat template,
        after a ``system`` message if given). The RemoteResult carries the prompt's token ids
        as the server tokenised them (``prompt_token_ids``), e.g. to continue generation."""
        request = self._request(text, options, chat=chat, system=system)
        return self._call(request, options, lambda remote: remote)

    def _request(
        self, prompt: list[int] | str, options: PrefillOptions, **text_options
    ) -> prefill_pb2.PrefillRequest:
        return build_request(
            prompt,
            request_id=options.request_id or "",
            cache_salt=options.cache_salt or "",
            top_logprobs=options.top_logprobs,
            kv_destination=options.kv_destination,
            **text_options,
        )

    def _call(
        self,
        request: prefill_pb2.PrefillRequest,
        options: PrefillOptions,
        pick: Callable[[RemoteResult], T],
    ) -> Future[T]:
        timeout = None
        if options.deadline_s is not None:
            timeout = max(0.0, options.deadline_s - time.monotonic())
        result: Future[T] = Future()
        result.set_running_or_notify_cancel()
        call = self._client.prefill_future(request, deadline_s=timeout)

        def settle(done: grpc.Future) -> None:
            try:
                result.set_result(pick(to_remote_result(done.result())))
            except grpc.RpcError as exc:
                result.set_exception(error_from_rpc(exc))
            except grpc.FutureCancelledError:
                result.set_exception(RequestAbortedError("the call was cancelled"))

        call.add_done_callback(settle)
        return result

    def abort(self, request_id: str) -> bool:
        return self._client.abort(request_id)

    def load(self) -> EngineLoad:
        return self._client.load()

    def health(self) -> EngineHealth:
        try:
            live, ready = self._client.is_live(), self._client.is_ready()
        except grpc.RpcError as exc:
            return EngineHealth(live=False, ready=False, detail=f"server unreachable: {exc.code()}")
        return EngineHealth(live=live, ready=ready, detail="" if ready else "server not ready")

    def shutdown(self) -> None:
        """Close the channel (the server keeps running)."""
        self._client.close()
