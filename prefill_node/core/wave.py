"""Wave schedule types: what the leader sends down the data plane and what the planner packs.

A wave is one micro-batch of request chunks that travels stage 0 -> P-1. The leader
sends each chunk as ``(request id, start token, length)``; every stage turns that into
its own block tables (WAVEPP.md section 5). ``UnscheduledWork`` is the planner's input:
the part of an ADMITTED request that no wave has taken yet.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefill_node.errors import InvariantError


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Tokens ``[start, start + length)`` of one request, computed in one wave.

    ``start`` counts from the first prompt token (cached tokens included), so a request
    whose first 4,096 tokens were reused starts its first chunk at 4096.
    """

    request_id: str
    start: int
    length: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.length <= 0:
            raise InvariantError(
                f"chunk of {self.request_id!r} must have start >= 0 and length > 0, "
                f"got start={self.start} length={self.length}"
            )

    @property
    def end(self) -> int:
        """One past the last token of the chunk."""
        return self.start + self.length


@dataclass(frozen=True, slots=True)
class Wave:
    """One micro-batch: at most one chunk per request, in the order the planner packed them."""

    wave_id: int
    chunks: tuple[ScheduledChunk, ...]

    def __post_init__(self) -> None:
        ids = [c.request_id for c in self.chunks]
        if len(set(ids)) != len(ids):
            raise InvariantError(f"wave {self.wave_id} holds two chunks of one request: {ids}")

    @property
    def num_tokens(self) -> int:
        """Tokens computed by this wave (its size against the budget)."""
        return sum(c.length for c in self.chunks)

    def __len__(self) -> int:
        return len(self.chunks)


@dataclass(frozen=True, slots=True)
class UnscheduledWork:
    """An admitted request's tokens ``[next_start, end)`` that no wave has taken yet.

    ``next_start`` is the cached length on admission and advances as waves take chunks;
    ``end`` is the prompt length. The planner never schedules past ``end``. ``first_start``
    (optional) is where the request's computation began, its cached length on admission;
    only the cost-aware planner reads it (``computed_from``), and without it takes
    ``next_start``.
    """

    request_id: str
    next_start: int
    end: int
    first_start: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.next_start < self.end:
            raise InvariantError(
                f"unscheduled work of {self.request_id!r} must satisfy "
                f"0 <= next_start < end, got {self.next_start}, {self.end}"
            )
        if self.first_start is not None and not 0 <= self.first_start <= self.next_start:
            raise InvariantError(
                f"unscheduled work of {self.request_id!r} must satisfy "
                f"0 <= first_start <= next_start, got {self.first_start}, {self.next_start}"
            )

    @property
    def computed_from(self) -> int:
        """Start of the tokens this request computes: ``first_start`` if known."""
        return self.next_start if self.first_start is None else self.first_start

    @property
    def remaining(self) -> int:
        """Tokens left to schedule."""
        return self.end - self.next_start
