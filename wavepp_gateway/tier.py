"""The prefill tier as the gateway uses it: a dry-run Score and a pull-mode Prefill, through
the router (``AsyncPrefillClient``), turned into vLLM ``kv_transfer_params``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from prefill_node.engine.types import ScoreReport

if TYPE_CHECKING:
    from prefill_node.client.prefill_client import ClientTLS


class TierError(Exception):
    """The tier did not prefill the request. ``unavailable``: it could not take it (down, no
    ready pipeline, connection refused), so local prefill may stand in; otherwise the
    request itself failed there (``status`` the gRPC code's name)."""

    def __init__(self, message: str, status: str, unavailable: bool) -> None:
        super().__init__(message)
        self.status = status
        self.unavailable = unavailable


@dataclass(frozen=True)
class TierPrefill:
    """A prompt whose KV waits, leased, on the pipeline that computed it."""

    kv_transfer_params: dict[str, Any]
    pipeline: str
    cached_tokens: int
    request_id: str


_UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class PrefillTier:
    """One channel to the router; create and use on the serving loop. ``prefill`` cancelled
    (a client gone) cancels the call: the router cancels it on the pipeline, which aborts
    the request and frees its blocks on every stage."""

    def __init__(
        self,
        address: str,
        score_timeout_s: float,
        prefill_timeout_s: float,
        tls: ClientTLS | None = None,
    ) -> None:
        from prefill_node.client.prefill_client import AsyncPrefillClient

        self.address = address
        self._client = AsyncPrefillClient(address, max_reconnect_backoff_s=2.0, tls=tls)
        self._score_timeout_s = score_timeout_s
        self._prefill_timeout_s = prefill_timeout_s

    async def score(
        self, prompt_ids: Sequence[int], cache_salt: str | None, trace: Sequence = ()
    ) -> ScoreReport | None:
        """The router's dry run; None when it does not answer in time (tier unavailable).
        ``trace``: W3C trace context headers for the call's metadata."""
        try:
            return await self._client.score(
                list(prompt_ids), cache_salt=cache_salt or "", timeout_s=self._score_timeout_s,
                metadata=trace or None,
            )  # fmt: skip
        except (TimeoutError, grpc.RpcError):
            return None

    async def prefill(
        self,
        prompt_ids: Sequence[int],
        request_id: str,
        cache_salt: str | None,
        trace: Sequence = (),
    ) -> TierPrefill:
        """Prefill in pull mode; raises TierError. ``trace``: W3C trace context headers for
        the call's metadata."""
        from kv_transfer.vllm_decode.params import pull_params
        from prefill_node.engine.types import KVPullDestination
        from prefill_node.wire.kv_handoff import wire_manifest

        ids = list(prompt_ids)
        try:
            remote = await self._client.prefill(
                ids,
                request_id=request_id,
                cache_salt=cache_salt or "",
                kv_destination=KVPullDestination(),
                deadline_s=self._prefill_timeout_s,
                metadata=trace or None,
            )
        except grpc.RpcError as exc:
            code = exc.code()
            raise TierError(f"prefill tier: {exc.details()}", code.name,
                            code in _UNAVAILABLE) from None  # fmt: skip
        stages = remote.result.stage_manifests
        manifests = [wire_manifest(m, request_id, len(stages)) for m in stages]
        return TierPrefill(pull_params(manifests, ids), remote.result.served_by,
                           remote.result.cached_tokens, request_id)  # fmt: skip

    async def release(self, request_id: str) -> bool:
        """Give back the leases of a prefill whose KV decode will not pull (Abort of an
        answered request: every stage revokes them instead of waiting for their TTL).
        False when nothing was held (decode pulled it already, or the tier is gone)."""
        try:
            return await self._client.abort(request_id, timeout_s=self._score_timeout_s)
        except (TimeoutError, grpc.RpcError):
            return False

    async def close(self) -> None:
        await self._client.close()
