"""Global prefix index: which pipelines hold each chained block hash, fed by their KV events."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from enum import Enum
from typing import TypeAlias

from prefill_node.core.hashing import BlockHash
from prefill_node.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from prefill_node.errors import InvalidRequestError, InvariantError

PipelineId: TypeAlias = str
"""A pipeline's name in the cluster (the ``pipeline_id`` of its KV event hub)."""


class UnknownPipelineError(InvalidRequestError):
    """The pipeline was never added, or was dropped (a late batch of a dropped pipeline)."""


class DuplicatePipelineError(InvalidRequestError):
    """The pipeline is already in the index."""


class InvalidKVBatchError(InvalidRequestError):
    """A KV event batch is malformed: a sequence below 1 or something that is not a KVEvent."""


class InvalidIndexInputError(InvalidRequestError):
    """A bad pending TTL or time: both must be finite (the TTL also positive)."""


class IndexIntegrityError(InvariantError):
    """The forward and reverse maps disagree: a bug in the index."""


class ApplyResult(Enum):
    """What ``GlobalPrefixIndex.apply`` did with a batch."""

    APPLIED = "applied"  # the next batch of the subscription, applied in order
    RESYNCED = "resynced"  # sequence 1: the batch replaced the pipeline's entries
    GAP = "gap"  # out of order: entries dropped, the caller must resubscribe
    IGNORED = "ignored"  # the pipeline awaits a sequence-1 batch; this one was dropped

    @property
    def needs_resubscribe(self) -> bool:
        """True only for GAP: IGNORED batches are leftovers of a subscription already replaced."""
        return self is ApplyResult.GAP


class _Pipeline:
    """One pipeline's slot and reverse maps (confirmed blocks, pending block -> expiry)."""

    __slots__ = ("pid", "slot", "bit", "sequence", "blocks", "pending")

    def __init__(self, pid: PipelineId, slot: int) -> None:
        self.pid = pid
        self.slot, self.bit = slot, 1 << slot
        self.sequence: int | None = None  # last applied; None = awaiting a sequence-1 batch
        self.blocks: set[BlockHash] = set()
        self.pending: dict[BlockHash, float] = {}


class GlobalPrefixIndex:
    """Chained block hash -> bitmask of the pipelines holding it, confirmed or pending.

    Confirmed entries mirror each pipeline's published residency exactly: ``apply`` reads
    its KV event feed as set updates (stored adds, removed removes, cleared empties; a
    duplicate store or an unknown removal changes nothing). A subscription's batch 1
    (AllBlocksCleared + snapshot) replaces the pipeline's entries in one call; batch n + 1
    follows batch n; any other sequence is a GAP: the pipeline's entries (pending too) are
    dropped, ``ApplyResult.GAP`` asks the caller to resubscribe, and later batches are
    IGNORED until a sequence-1 batch arrives. A pipeline starts in that waiting state.

    Pending entries (``record_pending``) stand for prompts just routed to a pipeline: they
    count in ``match`` for ``pending_ttl_s`` seconds, until the pipeline's own BlockStored
    of that hash arrives (the confirmed entry takes over), its BlockRemoved arrives (newer
    than the guess), or a GAP, a resubscribe or ``drop_pipeline`` clears them. Blocks the
    pipeline already holds get no pending entry. A mid-stream AllBlocksCleared keeps them:
    the routed prompts still store their blocks after it. Time is passed in: every call
    taking ``now`` first expires pending entries; a ``now`` earlier than one seen before
    counts as that latest time (time never goes back here).

    Batches for an unknown pipeline raise ``UnknownPipelineError`` rather than adding it:
    a late batch of a dropped pipeline must not bring it back. Sans-IO, not thread-safe.
    """

    def __init__(self, pending_ttl_s: float = 2.0) -> None:
        if not (math.isfinite(pending_ttl_s) and pending_ttl_s > 0):
            raise InvalidIndexInputError(f"pending_ttl_s must be finite and > 0: {pending_ttl_s}")
        self.pending_ttl_s = pending_ttl_s
        self._pipelines: dict[PipelineId, _Pipeline] = {}
        self._slots: list[_Pipeline | None] = []
        self._live_mask = 0
        self._holders: dict[BlockHash, int] = {}  # confirmed
        self._pending_holders: dict[BlockHash, int] = {}
        self._expiry: deque[tuple[float, _Pipeline, tuple[BlockHash, ...]]] = deque()
        self._now = -math.inf

    @property
    def pipelines(self) -> tuple[PipelineId, ...]:
        """Pipelines in the order they were added."""
        return tuple(self._pipelines)

    def __contains__(self, pid: object) -> bool:
        """True while ``pid`` is in the index (O(1), unlike ``pipelines``)."""
        return pid in self._pipelines

    def add_pipeline(self, pid: PipelineId) -> None:
        """Register a pipeline with no entries, awaiting its first sequence-1 batch."""
        if pid in self._pipelines:
            raise DuplicatePipelineError(f"pipeline {pid!r} is already in the index")
        if None not in self._slots:
            self._slots.append(None)
        slot = self._slots.index(None)  # the lowest free slot keeps masks short
        p = self._slots[slot] = _Pipeline(pid, slot)
        self._pipelines[pid] = p
        self._live_mask |= p.bit

    def drop_pipeline(self, pid: PipelineId) -> int:
        """Forget a pipeline and all its entries (pending too) at once; its confirmed blocks."""
        p = self._get(pid)
        held = len(p.blocks)
        self._clear(p)
        del self._pipelines[pid]
        self._slots[p.slot] = None
        self._live_mask &= ~p.bit
        return held

    def synced(self, pid: PipelineId) -> bool:
        """True while the pipeline's entries follow a live subscription (not awaiting batch 1)."""
        return self._get(pid).sequence is not None

    def apply(self, pid: PipelineId, sequence: int, events: Sequence[KVEvent]) -> ApplyResult:
        """Apply one batch of ``pid``'s subscription (see the class contract). Validates the
        whole batch before changing anything, so a bad batch leaves the index untouched."""
        p = self._get(pid)
        if sequence < 1:
            raise InvalidKVBatchError(f"pipeline {pid!r}: sequence must be >= 1, got {sequence}")
        for event in events:
            if not isinstance(event, BlockStored | BlockRemoved | AllBlocksCleared):
                raise InvalidKVBatchError(f"pipeline {pid!r}: not a KV event: {event!r}")
        if sequence == 1:
            self._clear(p)
            self._apply_events(p, events)
            p.sequence = 1
            return ApplyResult.RESYNCED
        if p.sequence is None:
            return ApplyResult.IGNORED
        if sequence != p.sequence + 1:
            self._clear(p)
            p.sequence = None
            return ApplyResult.GAP
        self._apply_events(p, events)
        p.sequence = sequence
        return ApplyResult.APPLIED

    def _apply_events(self, p: _Pipeline, events: Sequence[KVEvent]) -> None:
        holders, bit, blocks = self._holders, p.bit, p.blocks
        for event in events:
            if isinstance(event, BlockStored):
                for h in event.block_hashes:
                    if h not in blocks:
                        blocks.add(h)
                        holders[h] = holders.get(h, 0) | bit
                if p.pending:
                    self._unpend(p, event.block_hashes)
            elif isinstance(event, BlockRemoved):
                gone = blocks.intersection(event.block_hashes)
                blocks.difference_update(gone)
                _withdraw(holders, gone, bit)
                if p.pending:  # newer than the routing guess that recorded it
                    self._unpend(p, event.block_hashes)
            else:
                _withdraw(holders, blocks, bit)
                blocks.clear()

    def record_pending(self, pid: PipelineId, hashes: Sequence[BlockHash], now: float) -> None:
        """Mark ``hashes`` as soon held by ``pid`` until ``now + pending_ttl_s`` (refreshes
        an existing pending entry's expiry). Hashes ``pid`` already holds get no entry: no
        BlockStored would ever confirm it, and its BlockRemoved must withdraw it at once."""
        now = self.expire(now)
        p = self._get(pid)
        if not hashes:
            return
        expiry = now + self.pending_ttl_s
        pending, holders, bit, confirmed = p.pending, self._pending_holders, p.bit, p.blocks
        hashes = [h for h in hashes if h not in confirmed]
        if not hashes:  # all held already (a cached prompt): nothing to expire later
            return
        for h in hashes:
            if h not in pending:
                holders[h] = holders.get(h, 0) | bit
            pending[h] = expiry
        self._expiry.append((expiry, p, tuple(hashes)))

    def expire(self, now: float) -> float:
        """Drop the pending entries expired at ``now`` (live while ``now < expiry``); returns
        the index's time, ``max(now, latest now seen)``."""
        if not math.isfinite(now):
            raise InvalidIndexInputError(f"now must be finite, got {now}")
        if now > self._now:
            self._now = now
        now, queue = self._now, self._expiry
        while queue and queue[0][0] <= now:
            expiry, p, hashes = queue.popleft()
            if p.pending:  # a stale queue entry (refreshed, confirmed, dropped) matches nothing
                self._unpend(p, [h for h in hashes if p.pending.get(h) == expiry])
        return now

    def _unpend(self, p: _Pipeline, hashes: Sequence[BlockHash]) -> None:
        gone = [h for h in hashes if p.pending.pop(h, None) is not None]
        _withdraw(self._pending_holders, gone, p.bit)

    def _clear(self, p: _Pipeline) -> None:
        _withdraw(self._holders, p.blocks, p.bit)
        _withdraw(self._pending_holders, p.pending, p.bit)
        p.blocks, p.pending = set(), {}

    def match(
        self, hashes: Sequence[BlockHash], now: float, *, pending: bool = True
    ) -> dict[PipelineId, int]:
        """For every pipeline, how many LEADING blocks of ``hashes`` it holds (confirmed or
        live pending; confirmed only with ``pending`` False: blocks that exist there now):
        block i counts only if blocks 0..i-1 count too."""
        self.expire(now)
        result = dict.fromkeys(self._pipelines, 0)
        mask = self._live_mask
        confirmed = self._holders.get
        pend = self._pending_holders.get if pending and self._pending_holders else None
        for i, h in enumerate(hashes):
            held = confirmed(h, 0)
            if pend is not None:
                held |= pend(h, 0)
            held &= mask
            if held != mask:
                self._settle(result, mask & ~held, i)
                mask = held
                if not mask:
                    return result
        self._settle(result, mask, len(hashes))
        return result

    def _settle(self, result: dict[PipelineId, int], mask: int, blocks: int) -> None:
        slots = self._slots
        while mask:
            low = mask & -mask
            result[slots[low.bit_length() - 1].pid] = blocks  # type: ignore[union-attr]
            mask ^= low

    def num_blocks(self, pid: PipelineId | None = None) -> int:
        """Confirmed blocks of ``pid``; for None, distinct confirmed hashes in the index."""
        return len(self._holders) if pid is None else len(self._get(pid).blocks)

    def num_pending(self, pid: PipelineId | None = None) -> int:
        """Pending entries not expired as of the latest ``now`` (of ``pid``, or of all)."""
        pipes = self._pipelines.values() if pid is None else (self._get(pid),)
        return sum(len(p.pending) for p in pipes)

    def _get(self, pid: PipelineId) -> _Pipeline:
        p = self._pipelines.get(pid)
        if p is None:
            raise UnknownPipelineError(f"pipeline {pid!r} is not in the index")
        return p

    def check_integrity(self) -> None:
        """Forward maps equal the union of the reverse maps (no bits of free slots), slots
        agree, waiting pipelines hold nothing, and every pending entry is live and queued."""
        live = 0
        for pid, p in self._pipelines.items():
            if p.pid != pid or self._slots[p.slot] is not p or p.bit != 1 << p.slot:
                raise IndexIntegrityError(f"pipeline {pid!r}: slot bookkeeping is broken")
            if p.sequence is None and p.blocks:
                raise IndexIntegrityError(f"pipeline {pid!r} awaits batch 1 but holds blocks")
            live |= p.bit
        if live != self._live_mask or len(self._pipelines) != sum(map(bool, self._slots)):
            raise IndexIntegrityError("live mask or slot table disagrees with the pipelines")
        pipes = self._pipelines.values()
        _check_map(self._holders, [(p.bit, p.blocks) for p in pipes], "confirmed")
        _check_map(self._pending_holders, [(p.bit, p.pending) for p in pipes], "pending")
        expiries = [expiry for expiry, _, _ in self._expiry]
        if expiries != sorted(expiries):
            raise IndexIntegrityError("pending expiry queue is out of order")
        queued = {(id(p), h, expiry) for expiry, p, hashes in self._expiry for h in hashes}
        for p in pipes:
            for h, expiry in p.pending.items():
                if not self._now < expiry <= self._now + self.pending_ttl_s:
                    raise IndexIntegrityError(f"{p.pid!r}: pending {h:#x} expired or too late")
                if (id(p), h, expiry) not in queued:
                    raise IndexIntegrityError(f"{p.pid!r}: pending {h:#x} has no expiry entry")


def _withdraw(holders: dict[BlockHash, int], hashes, bit: int) -> None:
    """Clear ``bit`` on each of ``hashes`` (all must be present), deleting emptied entries."""
    keep = ~bit
    for h in hashes:
        mask = holders[h] & keep
        if mask:
            holders[h] = mask
        else:
            del holders[h]


def _check_map(holders: dict[BlockHash, int], reverse, kind: str) -> None:
    expected: dict[BlockHash, int] = {}
    for bit, hashes in reverse:
        for h in hashes:
            expected[h] = expected.get(h, 0) | bit
    for h in expected.keys() | holders.keys():
        forward, reverse = holders.get(h), expected.get(h)  # a 0 mask is wrong too
        if forward != reverse:
            raise IndexIntegrityError(f"{kind} map of {h:#x}: forward {forward}, reverse {reverse}")
