"""Wire types of the hand-off: push destinations, pull manifests, NIXL notifications.

Each has ``to_dict`` / ``from_dict`` so the gRPC proto (or JSON) can carry it verbatim.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kv_transfer.errors import InvalidTransferRequest, KVTransferError
from kv_transfer.layout import KVLayout

_MAGIC = b"kvx1 "
NOTIFICATION_KINDS = ("done", "hb", "rel", "part", "fail")


@dataclass(frozen=True)
class PushDestination:
    """Where prefill must WRITE a request's KV: sent by the decode side with the request.

    ``block_ids`` are decode blocks for tokens ``[skip_tokens, num_tokens)`` of the
    ``num_tokens``-token prompt; the first ``skip_tokens`` (decode's cached prefix, a
    multiple of its block size) are not sent. Nothing to send: no transfer, no notification.
    ``transfer_id`` is unique per attempt, so notifications of an older attempt of the
    same request are recognised as late.
    """

    request_id: str
    endpoint: str
    block_ids: tuple[int, ...]
    num_tokens: int
    skip_tokens: int = 0
    transfer_id: str = ""

    def __post_init__(self) -> None:
        if not self.request_id or not 0 <= self.skip_tokens <= self.num_tokens:
            raise InvalidTransferRequest(
                "push destination needs a request id and 0 <= skip_tokens <= num_tokens"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "endpoint": self.endpoint,
            "block_ids": list(self.block_ids),
            "num_tokens": self.num_tokens,
            "skip_tokens": self.skip_tokens,
            "transfer_id": self.transfer_id,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PushDestination:
        try:
            return cls(
                str(data["request_id"]),
                str(data["endpoint"]),
                tuple(int(b) for b in data["block_ids"]),
                int(data["num_tokens"]),
                int(data.get("skip_tokens", 0)),
                str(data.get("transfer_id", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, InvalidTransferRequest):
                raise
            raise InvalidTransferRequest(f"malformed push destination: {exc!r}") from exc


@dataclass(frozen=True)
class StageManifest:
    """Pull mode: where one stage holds a request's KV, pinned under ``lease_id``.

    ``layout`` covers the stage's layers (with its memory regions); ``block_ids`` hold
    tokens ``[0, num_tokens)`` in prompt order. Heartbeat within ``lease_ttl_s``.
    """

    request_id: str
    stage: int
    num_stages: int
    endpoint: str
    agent_name: str
    layout: KVLayout
    block_ids: tuple[int, ...]
    num_tokens: int
    lease_id: str
    lease_ttl_s: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "stage": self.stage,
            "num_stages": self.num_stages,
            "endpoint": self.endpoint,
            "agent_name": self.agent_name,
            "layout": self.layout.to_dict(),
            "block_ids": list(self.block_ids),
            "num_tokens": self.num_tokens,
            "lease_id": self.lease_id,
            "lease_ttl_s": self.lease_ttl_s,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StageManifest:
        try:
            return cls(
                str(data["request_id"]),
                int(data["stage"]),
                int(data["num_stages"]),
                str(data["endpoint"]),
                str(data["agent_name"]),
                KVLayout.from_dict(data["layout"]),
                tuple(int(b) for b in data["block_ids"]),
                int(data["num_tokens"]),
                str(data["lease_id"]),
                float(data["lease_ttl_s"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, InvalidTransferRequest):
                raise
            raise InvalidTransferRequest(f"malformed stage manifest: {exc!r}") from exc


@dataclass(frozen=True)
class Notification:
    """A NIXL notification: ``kind`` "done" (push: a stage's layers landed), "hb" (pull
    heartbeat), "rel" (pull: decode read the blocks, release the lease), "part" (streamed
    push: tokens up to ``end_token`` of a stage's layers landed; progress only, never
    "ready") or "fail" (a stage abandoned the push attempt ``transfer_id``)."""

    kind: str
    transfer_id: str = ""
    stage: int = 0
    num_stages: int = 0
    layer_start: int = 0
    layer_end: int = 0
    lease_id: str = ""
    end_token: int = 0

    def encode(self) -> bytes:
        fields = {k: v for k, v in self.__dict__.items() if v not in ("", 0)}
        return _MAGIC + json.dumps(fields, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Notification | None:
        """None for anything that is not ours (other NIXL users may share the agent)."""
        if not raw.startswith(_MAGIC):
            return None
        try:
            note = cls(**json.loads(raw[len(_MAGIC) :]))
        except (TypeError, ValueError):
            return None
        return note if note.kind in NOTIFICATION_KINDS else None


@dataclass(frozen=True)
class TransferOutcome:
    """How one stage's shipment of one request ended (sender side) or one request's
    reception ended (receiver side, ``stage`` = -1). ``error`` is None on success."""

    request_id: str
    stage: int
    num_bytes: int
    seconds: float
    error: KVTransferError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None
