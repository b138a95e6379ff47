"""SenderConfig: one prefill stage's KV sender settings (kv_transfer/sender.py)."""

from __future__ import annotations

from dataclasses import dataclass

from kv_transfer.allowlist import AllowList
from kv_transfer.errors import InvalidTransferRequest


@dataclass(frozen=True)
class SenderConfig:
    """Per-stage settings. ``metadata_host`` None: no endpoint, push mode only; otherwise
    pull manifests name ``metadata_advertise_host`` (or the bound address) as the endpoint.
    ``transfer_timeout_s`` bounds a push from ``push`` to completion, handshake included.
    ``prepared_writes``: a WRITE of whole blocks to a pool of the same block size uses NIXL
    descriptor lists prepared once (kv_transfer/prepared.py); False: always the general way."""

    stage: int
    num_stages: int
    allow: AllowList
    transfer_timeout_s: float = 30.0
    handshake_timeout_s: float = 2.0
    lease_ttl_s: float = 30.0
    metadata_host: str | None = "127.0.0.1"
    metadata_port: int = 0
    metadata_advertise_host: str | None = None
    prepared_writes: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.stage < self.num_stages:
            raise InvalidTransferRequest(f"stage {self.stage} not in [0, {self.num_stages})")
        if min(self.transfer_timeout_s, self.handshake_timeout_s, self.lease_ttl_s) <= 0:
            raise InvalidTransferRequest("timeouts and lease TTL must be positive")
