"""What a request hands the connector in vLLM's ``kv_transfer_params``, and what it gets back.

In: ``{"wavepp_pull": [StageManifest.to_dict(), ...]}``, one manifest per prefill stage, as
the prefill response leased them (``pull_params`` builds it). Out (``RequestOutput.
kv_transfer_params`` of a finished request): ``{"wavepp_loaded": {"tokens", "bytes", "ok",
"error"}}``: what the connector READ over NIXL for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from kv_transfer.errors import InvalidTransferRequest
from kv_transfer.messages import StageManifest

PULL_KEY = "wavepp_pull"
LOADED_KEY = "wavepp_loaded"


def pull_params(manifests: Sequence[StageManifest]) -> dict[str, Any]:
    """``kv_transfer_params`` telling the connector to READ these stages' leased blocks."""
    if not manifests:
        raise InvalidTransferRequest("pull needs one manifest per prefill stage, got none")
    return {PULL_KEY: [m.to_dict() for m in manifests]}


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
