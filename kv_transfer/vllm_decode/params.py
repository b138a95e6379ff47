"""What a request hands the connector in vLLM's ``kv_transfer_params``, and what it gets back.

In: ``{"wavepp_pull": [StageManifest.to_dict(), ...], "wavepp_prompt": DIGEST}``, one
manifest per prefill stage, as the prefill response leased them, and a digest of the prompt's
token ids the stages computed (``pull_params`` builds it): the connector loads nothing for a
request whose prompt differs, so KV is never attached to other tokens. Out (``RequestOutput.
kv_transfer_params`` of a finished request): ``{"wavepp_loaded": {"tokens", "bytes", "ok",
"error"}}``: what the connector READ over NIXL for it. A traced request also carries
``{"wavepp_traceparent": W3C traceparent}``: decode's KV load is recorded under that span.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kv_transfer.errors import InvalidTransferRequest
from kv_transfer.messages import StageManifest

PULL_KEY = "wavepp_pull"
PROMPT_KEY = "wavepp_prompt"
LOADED_KEY = "wavepp_loaded"
TRACE_KEY = "wavepp_traceparent"  # optional: the gateway's decode span (docs/tracing.md)


@dataclass(frozen=True)
class LoadReport:
    """What the connector READ over NIXL for one request; ``error`` None when it succeeded."""

    tokens: int
    num_bytes: int
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "bytes": self.num_bytes, "ok": self.ok, "error": self.error}


def prompt_digest(token_ids: Sequence[int]) -> str:
    return hashlib.blake2b(json.dumps(list(token_ids)).encode(), digest_size=16).hexdigest()


def pull_params(manifests: Sequence[StageManifest], prompt_ids: Sequence[int]) -> dict[str, Any]:
    """``kv_transfer_params`` telling the connector to READ these stages' leased blocks,
    which hold the KV of ``prompt_ids`` (the ids the prefill computed)."""
    if not manifests:
        raise InvalidTransferRequest("pull needs one manifest per prefill stage, got none")
    if any(m.num_tokens != len(prompt_ids) for m in manifests):
        raise InvalidTransferRequest("the manifests do not hold a prompt of this length")
    return {PULL_KEY: [m.to_dict() for m in manifests], PROMPT_KEY: prompt_digest(prompt_ids)}


def prompt_mismatch(params: Mapping[str, Any], prompt_ids: Sequence[int]) -> str | None:
    """Why the stages' KV must not be attached to ``prompt_ids``, or None when it may."""
    if params.get(PROMPT_KEY) != prompt_digest(prompt_ids):
        return (
            f"the request's {len(prompt_ids)} prompt token ids are not the ones the prefill "
            "tier computed (or kv_transfer_params lack wavepp_prompt): send the same ids"
        )
    return None


def pull_manifests(params: Mapping[str, Any] | None, request_id: str) -> list[StageManifest] | None:
    """The stage manifests in ``params``, renamed to vLLM's ``request_id`` (the receiver keys
    a pull by it); None when the request carries none. Malformed -> InvalidTransferRequest."""
    raw = (params or {}).get(PULL_KEY)
    if raw is None:
        return None
    if not isinstance(raw, list) or not raw:
        raise InvalidTransferRequest(f"{PULL_KEY} must be a non-empty list of stage manifests")
    return [dataclasses.replace(StageManifest.from_dict(m), request_id=request_id) for m in raw]


def prompt_tokens(manifests: Sequence[StageManifest]) -> int:
    """Tokens the stages hold (the prefill's prompt length)."""
    return manifests[0].num_tokens
