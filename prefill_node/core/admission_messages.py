"""Admission-round messages (leader <-> stages) and the typed outcomes of a round.

One round is one to three phases; in each the leader broadcasts one ``RoundRequest`` and
every stage (stage 0 included) answers one ``StageReply`` (an all-gather). All messages are
small frozen dataclasses of ints, strs, enums and tuples, so they pickle cheaply; token ids
travel once, in the RESERVE message that first names a request.

Phases (``AdmissionCoordinator`` drives them, ``StageAdmission.handle`` answers):

1. RESERVE - stages register new specs; for each request, FCFS, each stage leases (pins)
   the longest prefix it really holds (the authoritative walk, cut back to a snapshot
   boundary on recurrent-state stages), escrows victims for the rest of the prompt and
   commits there at once. Its reply says how far its lease reaches.
2. COMMIT - only when the stages' leases end at different blocks, or when the request is
   promised blocks another admitted request is computing: at the common boundary (the
   highest one valid on every stage, <= every lease) the stages above it shrink their
   lease and top up their escrow (which may fail: that stage cleans up and says so), and
   each stage notes the promise (``CommitOrder``).
3. RELEASE - when a request reserved on some stages but not all (or failed a COMMIT on
   some), or the coordinator defers it: the others drop that reservation.

Where every stage holds the same prefix (the common case: stages cache the same chunks
and evict under the same pressure), a round is one broadcast and one all-gather.

Every message also carries ``releases`` (drop a reservation, keep the spec: the request
waits and will be retried) and ``forgets`` (drop everything: aborted or finished with),
which stages apply before the phase's own items.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from prefill_node.core.request import RequestSpec


class Phase(Enum):
    RESERVE = "reserve"
    COMMIT = "commit"
    RELEASE = "release"


class ReserveStatus(Enum):
    """Why a stage could (not) reserve a request; anything but OK means the request waits."""

    OK = "ok"
    NO_CAPACITY = "no_capacity"  # not enough free or evictable blocks right now
    ADMISSION_CAP = "admission_cap"  # would eat into the stage's lease headroom
    FCFS_BLOCKED = "fcfs_blocked"  # an earlier request of the round is waiting
    # (coordinator only, never a stage's answer) the next blocks it needs are being computed
    # by a request it cannot be promised them from (one still being committed in this
    # round, or a pipeline with recurrent-state snapshots): it waits for them to be cached
    # instead of computing them again
    PREFIX_IN_FLIGHT = "prefix_in_flight"
    # (``StageAdmission.follow`` only, under ``trtllm``) this stage's cache lacks part of the
    # prefix rank 0 decided to reuse: the request cannot run here
    PREFIX_MISSING = "prefix_missing"


@dataclass(frozen=True)
class ReserveOrder:
    """Lease the longest prefix this stage holds, escrow the rest of the prompt, commit."""

    request_id: str


@dataclass(frozen=True)
class CommitOrder:
    """Settle the reservation at ``boundary_blocks`` (<= what this stage leased): shrink the
    lease to it and top up the escrow for the longer suffix.

    ``promised_blocks`` > ``boundary_blocks``: the request will also reuse prompt blocks
    ``[boundary_blocks, promised_blocks)``, which request ``producer`` is computing now (an
    in-flight prefix). The stage keeps the escrow for the whole rest of the prompt and
    extends the lease to ``promised_blocks`` once the producer's chunk has cached those
    blocks here (``StageAdmission`` keeps the promise; ``Reservation`` says the invariant).
    """

    request_id: str
    boundary_blocks: int
    promised_blocks: int = 0
    producer: str = ""


@dataclass(frozen=True)
class RoundRequest:
    """What the leader broadcasts for one phase of round ``round_id``."""

    round_id: int
    phase: Phase
    new_requests: tuple[RequestSpec, ...] = ()
    reserves: tuple[ReserveOrder, ...] = ()
    commits: tuple[CommitOrder, ...] = ()
    releases: tuple[str, ...] = ()
    forgets: tuple[str, ...] = ()


@dataclass(frozen=True)
class Reserved:
    """A stage's answer to a ReserveOrder; with status OK the reservation is committed at
    ``confirmed_blocks``.

    ``confirmed_blocks``: blocks leased (pinned after the authoritative check) on this stage.
    ``boundaries``: the boundaries <= confirmed_blocks this stage can resume from, or None
    when any is fine; a stage with recurrent-state layers lists its snapshot positions.
    ``escrow_blocks``: victims reserved for the rest of the prompt (0 unless status is OK).
    """

    request_id: str
    status: ReserveStatus
    confirmed_blocks: int
    boundaries: tuple[int, ...] | None
    escrow_blocks: int


@dataclass(frozen=True)
class Committed:
    """A stage's answer to a CommitOrder; ``ok`` False means it already cleaned up.
    ``promise_lapsed``: the promised blocks are neither cached here nor still being
    computed by their producer here (it finished and they were evicted), so the request
    must start at its lease."""

    request_id: str
    ok: bool
    escrow_blocks: int
    promise_lapsed: bool = False


@dataclass(frozen=True)
class StageReply:
    """What stage ``stage`` answers to the leader for one phase."""

    round_id: int
    phase: Phase
    stage: int
    reserved: tuple[Reserved, ...] = ()
    committed: tuple[Committed, ...] = ()


# ---- outcomes -------------------------------------------------------------------------


@dataclass(frozen=True)
class StageReservation:
    """What one stage holds for an admitted request: pinned prefix + escrowed suffix."""

    stage: int
    leased_blocks: int
    escrow_blocks: int


@dataclass(frozen=True)
class Promise:
    """Part of an admitted request's prefix is still being computed by ``producer``: the
    request reuses tokens ``[leased_len, Admitted.cached_len)`` once the producer's chunk
    that ends there has run on every stage, so its first chunk must run in a later wave.
    If the producer is dropped before that chunk was scheduled, the request starts at
    ``leased_len`` instead and computes those tokens itself (``WaveScheduler``)."""

    producer: str
    leased_len: int  # tokens leased (really cached) on every stage at admission


@dataclass(frozen=True)
class Admitted:
    """Reserved on every stage: the first ``cached_len`` tokens are reused, the rest computed.

    Capacity for the whole prompt is held on every stage until ``complete`` or ``abort``.
    With a ``promise`` some of the reused tokens are not cached yet (``Promise``).
    """

    request_id: str
    num_tokens: int
    cached_len: int
    reservations: tuple[StageReservation, ...]
    promise: Promise | None = None


@dataclass(frozen=True)
class Wait:
    """Not admitted now (no reservation is held); the request stays queued, FCFS."""

    request_id: str
    reason: ReserveStatus
    stage: int


@dataclass(frozen=True)
class Rejected:
    """Can never be admitted, e.g. larger than some stage's whole cache; never queued."""

    request_id: str
    reason: str


@dataclass(frozen=True)
class Aborted:
    """Aborted while its admission round ran; every stage drops what it held."""

    request_id: str


AdmissionOutcome = Admitted | Wait | Rejected | Aborted


@dataclass(frozen=True)
class RoundResult:
    """The end of a round: one outcome per request the round looked at, in FCFS order."""

    round_id: int
    outcomes: tuple[AdmissionOutcome, ...]
