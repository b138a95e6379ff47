"""Pull-mode leases: a request's blocks stay pinned on a prefill stage until decode releases.

Sans-IO: no threads, no sockets; the owner calls ``expire()`` from its loop and passes an
injectable clock. Contract: the prefill stage pins the blocks BEFORE ``grant``; this table
calls ``on_release(lease, reason)`` exactly once per lease (released, expired or revoked),
and that callback is where the stage unpins. After the callback the lease id is unknown.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

from kv_transfer.errors import InvalidTransferRequest, KVInvariantError


class ReleaseReason(enum.Enum):
    RELEASED = "released"  # decode read the blocks and said so
    EXPIRED = "expired"  # no heartbeat within the TTL
    REVOKED = "revoked"  # the prefill side gave up (abort, shutdown)


@dataclass(frozen=True)
class PullLease:
    """Blocks of one request pinned for decode to READ until ``deadline`` (clock seconds);
    each heartbeat moves the deadline to now + ``ttl_s``."""

    lease_id: str
    request_id: str
    block_ids: tuple[int, ...]
    deadline: float
    ttl_s: float


class PullLeaseTable:
    """The live leases of one stage, by id; renewing pushes the deadline to now + the lease's
    TTL (the table's ``ttl_s`` unless ``grant`` was given one)."""

    def __init__(
        self,
        ttl_s: float,
        on_release: Callable[[PullLease, ReleaseReason], None],
        clock: Callable[[], float] = time.monotonic,
        id_prefix: str = "lease",
    ) -> None:
        if ttl_s <= 0:
            raise InvalidTransferRequest(f"lease TTL must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        self._on_release = on_release
        self._clock = clock
        self._prefix = id_prefix
        self._ids = itertools.count()
        self._leases: dict[str, PullLease] = {}
        self._granted = 0
        self._ended = 0

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, lease_id: object) -> bool:
        return lease_id in self._leases

    def get(self, lease_id: str) -> PullLease | None:
        return self._leases.get(lease_id)

    def grant(
        self, request_id: str, block_ids: tuple[int, ...], ttl_s: float | None = None
    ) -> PullLease:
        """A new lease; ``ttl_s``: this lease's TTL (None: the table's)."""
        ttl = self.ttl_s if ttl_s is None else ttl_s
        if ttl <= 0:
            raise InvalidTransferRequest(f"lease TTL must be positive, got {ttl}")
        lease = PullLease(
            lease_id=f"{self._prefix}-{next(self._ids)}",
            request_id=request_id,
            block_ids=tuple(block_ids),
            deadline=self._clock() + ttl,
            ttl_s=ttl,
        )
        self._leases[lease.lease_id] = lease
        self._granted += 1
        return lease

    def renew(self, lease_id: str) -> bool:
        """Heartbeat: False when the lease is unknown (already released or expired)."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return False
        if self._clock() >= lease.deadline:
            self._end(lease, ReleaseReason.EXPIRED)
            return False
        self._leases[lease_id] = PullLease(
            lease.lease_id,
            lease.request_id,
            lease.block_ids,
            self._clock() + lease.ttl_s,
            lease.ttl_s,
        )
        return True

    def release(self, lease_id: str, reason: ReleaseReason = ReleaseReason.RELEASED) -> bool:
        """End a lease now; False (and no callback) when it is already gone."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return False
        self._end(lease, reason)
        return True

    def expire(self) -> list[PullLease]:
        """End every lease whose deadline has passed; returns them (oldest deadline first)."""
        now = self._clock()
        dead = sorted(
            (lease for lease in self._leases.values() if now >= lease.deadline),
            key=lambda lease: lease.deadline,
        )
        for lease in dead:
            self._end(lease, ReleaseReason.EXPIRED)
        return dead

    def next_deadline(self) -> float | None:
        return min((lease.deadline for lease in self._leases.values()), default=None)

    def revoke_all(self) -> int:
        leases = list(self._leases.values())
        for lease in leases:
            self._end(lease, ReleaseReason.REVOKED)
        return len(leases)

    def _end(self, lease: PullLease, reason: ReleaseReason) -> None:
        del self._leases[lease.lease_id]
        self._ended += 1
        self._on_release(lease, reason)

    def check_integrity(self) -> None:
        """Raise KVInvariantError unless granted == live + ended and every key matches."""
        if self._granted != len(self._leases) + self._ended:
            raise KVInvariantError(
                f"{self._granted} leases granted but {len(self._leases)} live + {self._ended} ended"
            )
        for lease_id, lease in self._leases.items():
            if lease_id != lease.lease_id:
                raise KVInvariantError(f"lease table key {lease_id} holds {lease.lease_id}")
