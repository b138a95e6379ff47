"""KVHandoffConfig: the settings every stage's KV hand-off shares (stage_handoff.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kv_transfer.allowlist import AllowList
from kv_transfer.progress import KVProgress
from kv_transfer.sender import SenderConfig
from prefill_node.errors import InvalidRequestError


@dataclass(frozen=True)
class KVHandoffConfig:
    """Settings of every stage's hand-off. ``allow``: decode destinations a stage may write to
    (CIDRs or agent names; default loopback only). ``lease_ttl_s``: pull leases (renewed by
    decode's heartbeats). ``progress``: how each stage's NIXL agent progresses (``KVProgress``;
    the default sleeps until traffic arrives). ``stream``: push mode WRITEs each chunk's
    final blocks while the request still runs (False: all of it after the last chunk);
    ``stream_max_inflight``: streamed WRITEs in flight per stage, beyond which ranges queue.
    ``stream_layer_groups``: the last chunk's layers on a stage are split into up to this
    many groups; each but the last is WRITten as soon as the forward wrote it (1: the whole
    last chunk after the forward). ``debug_post_before_push`` (tests only): a final push
    first waits until every range handed over before it is posted, instead of taking the
    unposted ones back to carry them itself, so which ranges stream does not depend on
    when the hand-off thread gets a core (it makes the push wait for them to land)."""

    allow: AllowList = field(default_factory=AllowList.loopback)
    transfer_timeout_s: float = 30.0
    handshake_timeout_s: float = 2.0
    lease_ttl_s: float = 30.0
    metadata_host: str = "127.0.0.1"
    agent_prefix: str = "wavepp"
    progress: KVProgress = KVProgress.EVENT
    stream: bool = True
    stream_max_inflight: int = 8
    stream_layer_groups: int = 4
    debug_post_before_push: bool = False

    def __post_init__(self) -> None:
        if self.stream_max_inflight < 1 or self.stream_layer_groups < 1:
            raise InvalidRequestError(
                "stream_max_inflight and stream_layer_groups must be >= 1, got "
                f"{self.stream_max_inflight} and {self.stream_layer_groups}"
            )
        if min(self.transfer_timeout_s, self.handshake_timeout_s, self.lease_ttl_s) <= 0:
            raise InvalidRequestError(
                "KV hand-off timeouts and lease TTL must be positive, got "
                f"{self.transfer_timeout_s}, {self.handshake_timeout_s}, {self.lease_ttl_s}"
            )
        if not self.agent_prefix:
            raise InvalidRequestError("KV hand-off agent_prefix must be non-empty")

    def sender_config(self, stage: int, num_stages: int) -> SenderConfig:
        return SenderConfig(
            stage,
            num_stages,
            self.allow,
            transfer_timeout_s=self.transfer_timeout_s,
            handshake_timeout_s=self.handshake_timeout_s,
            lease_ttl_s=self.lease_ttl_s,
            metadata_host=self.metadata_host,
        )

    def layer_group_ends(self, layer_start: int, layer_end: int) -> tuple[int, ...]:
        """Where the groups of a stage holding layers ``[layer_start, layer_end)`` end
        (global layer index, exclusive), but the last group's (it rides the final push);
        the later groups are the smaller ones. Empty when not streaming."""
        n = layer_end - layer_start
        groups = min(self.stream_layer_groups, n) if self.stream else 1
        return tuple(layer_start - (-i * n // groups) for i in range(1, groups))

    @property
    def wait_limit_s(self) -> float:
        """Upper bound on how long one push can take before its outcome is reported."""
        return self.handshake_timeout_s + self.transfer_timeout_s + 1.0
