"""Admission-round messages (leader <-> stages) and the typed outcomes of a round.

One round is a few phases; in each the leader broadcasts one ``RoundRequest`` and every
stage (stage 0 included) answers one ``StageReply`` (an all-gather). All messages are
small frozen dataclasses of ints, strs, enums and tuples, so they pickle cheaply over
``torch.distributed.broadcast_object_list`` / ``all_gather_object``; token ids travel once,
in the LOOKUP message that first names a request.

Phases (``AdmissionCoordinator`` drives them, ``StageAdmission.handle`` answers):

1. LOOKUP - stages register new specs and answer hint boundaries (full blocks).
2. RESERVE - at the candidate (minimum of the hints) each stage leases (re-checks and
   pins) what it really holds, then escrows victims for the rest of the prompt.
3. COMMIT - at the final boundary (highest one valid on every stage, <= every confirmed
   lease) each stage shrinks its lease, tops up and re-checks its escrow, and commits.
4. RELEASE - only when some stage failed a commit: the others drop that reservation.

Every message also carries ``releases`` (drop a reservation, keep the spec: the request
waits and will be retried) and ``forgets`` (drop everything: aborted or finished with),
which stages apply before the phase's own items.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from prefill_node.core.request import RequestSpec


class Phase(Enum):
    LOOKUP = "lookup"
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
    # by an admitted request: it waits for them to be cached instead of computing them again
    PREFIX_IN_FLIGHT = "prefix_in_flight"
    # (``StageAdmission.follow`` only, under ``trtllm``) this stage's cache lacks part of the
    # prefix rank 0 decided to reuse: the request cannot run here
    PREFIX_MISSING = "prefix_missing"


@dataclass(frozen=True)
class ReserveOrder:
    """Lease up to ``candidate_blocks`` full blocks, escrow the rest of the prompt."""

    request_id: str
    candidate_blocks: int


@dataclass(frozen=True)
class CommitOrder:
    """Settle the reservation at ``boundary_blocks`` (<= what this stage confirmed)."""

    request_id: str
    boundary_blocks: int


@dataclass(frozen=True)
class RoundRequest:
    """What the leader broadcasts for one phase of round ``round_id``."""

    round_id: int
    phase: Phase
    new_requests: tuple[RequestSpec, ...] = ()
    lookups: tuple[str, ...] = ()
    reserves: tuple[ReserveOrder, ...] = ()
    commits: tuple[CommitOrder, ...] = ()
    releases: tuple[str, ...] = ()
    forgets: tuple[str, ...] = ()


@dataclass(frozen=True)
class Hint:
    """A stage's approximate reusable prefix of a request, in full blocks."""

    request_id: str
    blocks: int


@dataclass(frozen=True)
class Reserved:
    """A stage's answer to a ReserveOrder.

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
    """A stage's answer to a CommitOrder; ``ok`` False means it already cleaned up."""

    request_id: str
    ok: bool
    escrow_blocks: int


@dataclass(frozen=True)
class StageReply:
    """What stage ``stage`` answers to the leader for one phase."""

    round_id: int
    phase: Phase
    stage: int
    hints: tuple[Hint, ...] = ()
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
class Admitted:
    """Reserved on every stage: the first ``cached_len`` tokens are reused, the rest computed.

    Capacity for the whole prompt is held on every stage until ``complete`` or ``abort``.
    """

    request_id: str
    num_tokens: int
    cached_len: int
    reservations: tuple[StageReservation, ...]


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
