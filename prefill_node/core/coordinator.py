"""The leader's admission coordinator: FCFS queue and the phases of each admission round."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from prefill_node.core.admission_messages import (
    Aborted,
    AdmissionOutcome,
    Admitted,
    CommitOrder,
    Phase,
    Promise,
    Rejected,
    Reserved,
    ReserveOrder,
    ReserveStatus,
    RoundRequest,
    RoundResult,
    StageReply,
    StageReservation,
    Wait,
)
from prefill_node.core.hashing import BlockHash
from prefill_node.core.request import PromptBlocks, RequestSpec, blocks_needed, reused_tokens
from prefill_node.errors import InvalidRequestError, InvariantError


class DuplicateRequestError(InvalidRequestError):
    """A request id is already queued or being admitted; use a fresh id."""


@dataclass(frozen=True)
class CoordinatorConfig:
    """The pipeline as admission sees it: one block size, each stage's block count."""

    block_size: int
    stage_num_blocks: tuple[int, ...]
    max_requests_per_round: int = 16
    # share a prefix an admitted request is computing (``AdmissionCoordinator``): be
    # promised it, or wait for it. A driver that turns this on calls ``finished`` when each
    # admitted request completes (and ``computed`` as its chunks pass every stage), and
    # schedules a promised request behind its producer (``Admitted.promise``)
    share_inflight_prefix: bool = False

    def __post_init__(self) -> None:
        if self.block_size <= 0 or not self.stage_num_blocks or self.max_requests_per_round <= 0:
            raise InvalidRequestError(
                "coordinator needs block_size > 0, >= 1 stage, max_requests_per_round > 0"
            )
        if min(self.stage_num_blocks) <= 0:
            raise InvalidRequestError("every stage needs at least one block")

    @property
    def num_stages(self) -> int:
        return len(self.stage_num_blocks)


@dataclass
class _Round:
    round_id: int
    phase: Phase
    request_ids: list[str]
    committing: dict[str, int] = field(default_factory=dict)  # request id -> boundary
    promises: dict[str, tuple[int, str]] = field(default_factory=dict)  # -> (blocks, producer)
    outcomes: dict[str, AdmissionOutcome] = field(default_factory=dict)


class AdmissionCoordinator:
    """Runs admission rounds over P stages from the leader (sans-IO: it only makes messages).

    Usage: ``enqueue`` requests; ``begin_round`` returns the first phase's ``RoundRequest``
    (None when there is nothing to do); broadcast it, gather one ``StageReply`` per stage,
    pass them to ``finish_phase``; repeat with the ``RoundRequest`` it returns until it
    returns a ``RoundResult``. One round at a time; ``run_round`` does this in-process.
    Where every stage leases the same prefix a round is its RESERVE phase alone; a COMMIT
    phase lowers the stages that lease more to the common boundary (admission_messages).

    Policy: strict FCFS. A request that waits keeps its place at the head of the queue and
    every later request of the round waits too (stages block them), so no request is
    starved by smaller ones. Outcomes: Admitted (reserved on every stage), Wait (nothing
    held, retried next round), Rejected (bigger than some stage's whole cache: never
    queued), Aborted. Progress: a lone reservation is never capped and a prompt that fits
    in every stage's cache is admitted once the running requests have completed. After a
    Wait, run the next round when capacity may have changed (a completion, an abort, a new
    request), not in a busy loop. Request ids must be unique among live requests.

    In-flight prefixes (``share_inflight_prefix``): a request whose next blocks an admitted
    request is computing is admitted with a PROMISE of them (``_share_inflight``), so it
    runs right behind the producer's chunk instead of waiting for the blocks to be cached
    on every stage; where a promise cannot be made it waits, and rounds after the
    producer's ``computed`` / ``finished`` admit it.
    """

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self._queue: dict[str, RequestSpec] = {}  # FCFS order
        self._sent: set[str] = set()  # specs the stages hold
        self._forgets: list[str] = []
        self._aborted: set[str] = set()
        self._round: _Round | None = None
        self._next_round_id = 0
        self._hashes: dict[str, tuple[BlockHash, ...]] = {}  # queued, share_inflight_prefix
        self._producer: dict[BlockHash, str] = {}  # block being computed -> its request
        # request -> (block index, hash) of the blocks it computes and still claims
        self._produces: dict[str, tuple[tuple[int, BlockHash], ...]] = {}
        self._cuts: dict[str, set[int]] = {}  # producer -> token positions waiters wait for
        # claims dropped while a round runs: its RESERVE replies may predate those blocks'
        # caching, so the round still treats them as being computed (``_released``)
        self._released: dict[BlockHash, str] = {}
        self._dropped: set[str] = set()  # admitted requests aborted while this round runs

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    @property
    def in_round(self) -> bool:
        return self._round is not None

    def queued_ids(self) -> list[str]:
        return list(self._queue)

    def has_work(self) -> bool:
        """True if a round would do something (queued requests or pending stage cleanups)."""
        return bool(self._queue or self._forgets)

    def check_fits(self, request_id: str, num_tokens: int) -> Rejected | None:
        """Rejected if the prompt can never fit on some stage, else None."""
        need = blocks_needed(num_tokens, self.config.block_size)
        for stage, capacity in enumerate(self.config.stage_num_blocks):
            if need > capacity:
                return Rejected(
                    request_id,
                    f"needs {need} blocks of {self.config.block_size} tokens; stage {stage} "
                    f"holds {capacity} blocks ({capacity * self.config.block_size} tokens)",
                )
        return None

    def enqueue(self, spec: RequestSpec) -> Rejected | None:
        """Queue a request (FCFS); returns Rejected at once if it can never fit."""
        if spec.request_id in self._queue:
            raise DuplicateRequestError(f"request id {spec.request_id!r} is already queued")
        rejected = self.check_fits(spec.request_id, spec.num_tokens)
        if rejected is None:
            self._queue[spec.request_id] = spec
        return rejected

    def finished(self, request_id: str) -> bool:
        """An admitted request completed or failed on every stage: the blocks it computed
        are cached now (or never will be). True if requests may be waiting for them (run a
        round). Needed only with ``share_inflight_prefix``; unknown ids are ignored."""
        produced = self._produces.pop(request_id, ())
        self._unclaim(request_id, produced)
        self._cuts.pop(request_id, None)
        return bool(produced)

    def computed(self, request_id: str, num_tokens: int) -> bool:
        """An admitted request's chunks up to token ``num_tokens`` passed every stage, and
        every stage cached their full blocks (``StageAdmission.publish``): stop claiming
        those, so requests waiting for them are admitted by the next round while this one
        still runs. True if it claimed any (run a round); unknown ids are ignored."""
        produced = self._produces.get(request_id, ())
        done_below = num_tokens // self.config.block_size
        done = tuple(p for p in produced if p[0] < done_below)
        if not done:
            return False
        rest = produced[len(done) :]
        if rest:
            self._produces[request_id] = rest
        else:
            del self._produces[request_id]
        self._unclaim(request_id, done)
        return True

    def _unclaim(self, request_id: str, produced: Sequence[tuple[int, BlockHash]]) -> None:
        for _, h in produced:
            if self._producer.get(h) == request_id:
                del self._producer[h]
                if self._round is not None:
                    self._released[h] = request_id

    def abort(self, request_id: str) -> bool:
        """Stop admitting a request; True if it was queued (it will never be admitted).

        Whatever the stages hold for it (a spec, a reservation, even an admitted request's
        blocks) is dropped with the next message, so this is also how the leader aborts an
        admitted request on every stage. A request inside the running round ends Aborted.
        """
        queued = request_id in self._queue
        if self._round is not None and request_id in self._round.request_ids:
            self._aborted.add(request_id)  # forgotten once the round ends
            return queued
        self._queue.pop(request_id, None)
        self._hashes.pop(request_id, None)
        self._sent.discard(request_id)
        self._forgets.append(request_id)
        if self._round is not None:
            self._dropped.add(request_id)  # no promise on its blocks from this round
        self.finished(request_id)
        return queued

    # ---- phases ------------------------------------------------------------------------

    def begin_round(self) -> RoundRequest | None:
        """The RESERVE message of a new round, or None if there is nothing to do."""
        if self._round is not None:
            raise InvariantError("begin_round while a round is running")
        if not self.has_work():
            return None
        ids = list(self._queue)[: self.config.max_requests_per_round]
        new = tuple(self._queue[r] for r in ids if r not in self._sent)
        self._sent.update(ids)
        self._released = {}  # this round's RESERVE comes after their caching
        self._dropped = set()
        self._round = _Round(self._next_round_id, Phase.RESERVE, ids)
        self._next_round_id += 1
        if not ids:
            return self._message(Phase.RELEASE)  # forgets only
        return self._message(
            Phase.RESERVE, new_requests=new, reserves=tuple(ReserveOrder(r) for r in ids)
        )

    def finish_phase(self, replies: Sequence[StageReply]) -> RoundRequest | RoundResult:
        """Consume every stage's reply; return the next phase's message or the round result."""
        rnd = self._round
        if rnd is None:
            raise InvariantError("finish_phase without a running round")
        if sorted(r.stage for r in replies) != list(range(self.config.num_stages)) or any(
            r.round_id != rnd.round_id or r.phase is not rnd.phase for r in replies
        ):
            raise InvariantError(f"round {rnd.round_id} {rnd.phase}: replies do not match")
        if rnd.phase is Phase.RESERVE:
            return self._after_reserve(rnd, replies)
        if rnd.phase is Phase.COMMIT:
            return self._after_commit(rnd, replies)
        return self._finish(rnd)

    def _message(self, phase: Phase, **items) -> RoundRequest:
        rnd = self._round
        if rnd is None:
            raise InvariantError("no running round")
        rnd.phase = phase
        forgets, self._forgets = tuple(self._forgets), []
        return RoundRequest(rnd.round_id, phase, forgets=forgets, **items)

    def _after_reserve(self, rnd: _Round, replies: Sequence[StageReply]) -> RoundRequest:
        by_request: dict[str, list[Reserved]] = {rid: [] for rid in rnd.request_ids}
        for reply in sorted(replies, key=lambda r: r.stage):
            _check_items(rnd, reply, [i.request_id for i in reply.reserved], rnd.request_ids)
            for item in reply.reserved:
                by_request[item.request_id].append(item)
        releases: list[str] = []
        reserved: dict[str, int] = {}  # reserved on every stage -> common boundary
        for rid, items in by_request.items():
            failed = [(s, i) for s, i in enumerate(items) if i.status is not ReserveStatus.OK]
            if failed:
                # Report the stage that really lacked room, not one that only followed FCFS.
                stage, item = min(failed, key=lambda f: f[1].status is ReserveStatus.FCFS_BLOCKED)
                rnd.outcomes[rid] = Wait(rid, item.status, stage)
                if len(failed) < len(items):
                    releases.append(rid)
            else:
                reserved[rid] = _common_boundary(items)
        # block hash -> who computes it. Blocks whose claim was dropped since this round
        # began count as claimed: a stage may have answered the RESERVE before caching them
        # (a promise on them is fulfilled at once; a waiter finds them cached next round).
        claimed = {**self._released, **self._producer}
        for rid, boundary in reserved.items():  # FCFS: a producer before its waiters
            items = by_request[rid]
            start = boundary
            if self.config.share_inflight_prefix:
                shared = self._share_inflight(rnd, rid, boundary, items, claimed)
                if shared is None:
                    rnd.outcomes[rid] = Wait(rid, ReserveStatus.PREFIX_IN_FLIGHT, -1)
                    releases.append(rid)
                    continue
                start = shared
                for h in self._hashes_of(rid)[start:]:
                    claimed.setdefault(h, rid)
            if start == boundary and all(i.confirmed_blocks == boundary for i in items):
                # committed there already
                self._admit(rnd, rid, boundary, [(s, i.escrow_blocks) for s, i in enumerate(items)])
            else:
                rnd.committing[rid] = boundary
        commits = tuple(
            CommitOrder(rid, b, *rnd.promises.get(rid, (0, "")))
            for rid, b in rnd.committing.items()
        )
        if commits:
            return self._message(Phase.COMMIT, commits=commits, releases=tuple(releases))
        if releases:
            return self._message(Phase.RELEASE, releases=tuple(releases))
        return self._finish(rnd)

    def _share_inflight(
        self,
        rnd: _Round,
        rid: str,
        boundary: int,
        items: Sequence[Reserved],
        claimed: dict[BlockHash, str],
    ) -> int | None:
        """Where ``rid`` starts (in blocks) given the prefix blocks others are computing
        (``claimed``: block hash -> its producer), or None when it waits for them.

        A run of claimed blocks right after its lease is worth sharing when it is at least
        half of what the request would otherwise compute (a short shared head is not worth
        a dependency). Then it is PROMISED those blocks (``CommitOrder``; its first chunk
        runs in a wave after the producer's chunk that ends them, which the cut asks for)
        when the producer is admitted (in an earlier round, or earlier in this one without a
        COMMIT) and no stage resumes only at recurrent-state snapshots; otherwise it waits
        (``Wait(PREFIX_IN_FLIGHT)``), and the round that follows the producer's chunk finds
        the blocks cached. A promise stops before the block holding the prompt's last token
        (that block is computed, never copied). A stage that can no longer keep it (the
        producer finished there and the blocks were evicted) says so in its COMMIT reply,
        and the request is admitted at its lease."""
        hashes = self._hashes_of(rid)
        bs = self.config.block_size
        num_tokens = self._queue[rid].num_tokens
        run = 0
        while boundary + run < len(hashes) and hashes[boundary + run] in claimed:
            run += 1
        if not run or 2 * run * bs < num_tokens - boundary * bs:
            return boundary
        end = boundary + run
        producer = claimed[hashes[end - 1]]  # chained: the same position there
        self._cuts.setdefault(producer, set()).add(end * bs)
        promised = min(end, (num_tokens - 1) // bs)
        # admitted: in an earlier round or earlier in this one (claiming), or done with them
        admitted = producer in self._produces or producer in self._released.values()
        snapshots = any(i.boundaries is not None for i in items)
        if promised <= boundary or not admitted or snapshots:
            return None
        rnd.promises[rid] = (promised, producer)
        return promised

    def take_cuts(self) -> dict[str, set[int]]:
        """Per producer, the token positions where requests waiting for its blocks could
        start (the end of what they wait for), noted by the rounds since the last call. A
        chunk of the producer that ends there lets them in one chunk earlier
        (``WaveScheduler.cut``); a producer that is not admitted yet is noted again by the
        round that still finds waiters behind it."""
        cuts, self._cuts = self._cuts, {}
        return cuts

    def _hashes_of(self, request_id: str) -> tuple[BlockHash, ...]:
        hashes = self._hashes.get(request_id)
        if hashes is None:
            spec = self._queue[request_id]
            hashes = PromptBlocks(spec, self.config.block_size).hashes
            self._hashes[request_id] = hashes
        return hashes

    def _after_commit(self, rnd: _Round, replies: Sequence[StageReply]) -> RoundRequest:
        results: dict[str, list] = {rid: [] for rid in rnd.committing}
        for reply in sorted(replies, key=lambda r: r.stage):
            _check_items(rnd, reply, [c.request_id for c in reply.committed], rnd.committing)
            for item in reply.committed:
                results[item.request_id].append((reply.stage, item))
        releases: list[str] = []
        for rid, items in results.items():
            failed = [stage for stage, c in items if not c.ok]
            if failed:
                rnd.outcomes[rid] = Wait(rid, ReserveStatus.NO_CAPACITY, failed[0])
                if len(failed) < len(items):
                    releases.append(rid)
                continue
            if any(c.promise_lapsed for _, c in items):  # the stages drop it at its first chunk
                rnd.promises.pop(rid, None)
            self._admit(rnd, rid, rnd.committing[rid], [(s, c.escrow_blocks) for s, c in items])
        if releases:
            return self._message(Phase.RELEASE, releases=tuple(releases))
        return self._finish(rnd)

    def _admit(
        self, rnd: _Round, request_id: str, boundary: int, escrows: Sequence[tuple[int, int]]
    ) -> None:
        """Committed at ``boundary`` on every stage ((stage, escrowed blocks) each)."""
        spec = self._queue[request_id]
        bs = self.config.block_size
        promised, producer = rnd.promises.get(request_id, (0, ""))
        if producer in self._dropped:  # the stages' promise lapses at the first chunk
            promised = 0
            producer = ""
        start = max(boundary, promised)
        cached = reused_tokens(spec.num_tokens, bs, start)
        promise = None
        if promised:
            promise = Promise(producer, reused_tokens(spec.num_tokens, bs, boundary))
        reservations = tuple(StageReservation(s, boundary, e) for s, e in escrows)
        rnd.outcomes[request_id] = Admitted(
            request_id, spec.num_tokens, cached, reservations, promise
        )
        if self.config.share_inflight_prefix:
            self._claim(request_id, start)

    def _claim(self, request_id: str, boundary: int) -> None:
        """Record the full blocks an admitted request computes (those nobody else does),
        in prompt order."""
        hashes = self._hashes_of(request_id)
        mine = tuple(
            (i, hashes[i]) for i in range(boundary, len(hashes)) if hashes[i] not in self._producer
        )
        for _, h in mine:
            self._producer[h] = request_id
        if mine:
            self._produces[request_id] = mine

    def _finish(self, rnd: _Round) -> RoundResult:
        outcomes: list[AdmissionOutcome] = []
        for rid in rnd.request_ids:
            outcome = rnd.outcomes.get(rid)
            if rid in self._aborted:
                outcome = Aborted(rid)
                self._queue.pop(rid, None)
                self._hashes.pop(rid, None)
                self._sent.discard(rid)
                self._forgets.append(rid)
                self.finished(rid)
            elif isinstance(outcome, Admitted):
                del self._queue[rid]
                self._hashes.pop(rid, None)
                self._sent.discard(rid)
            if outcome is None:
                raise InvariantError(f"round {rnd.round_id}: no outcome for {rid!r}")
            outcomes.append(outcome)
        self._aborted.clear()
        self._round = None
        return RoundResult(rnd.round_id, tuple(outcomes))


def _check_items(rnd: _Round, reply: StageReply, got: list[str], expected) -> None:
    """A stage must answer every item of the phase, once each, in order."""
    if got != list(expected):
        raise InvariantError(
            f"round {rnd.round_id} {rnd.phase}: stage {reply.stage} answered {got}, "
            f"expected {list(expected)}"
        )


def _common_boundary(items: Sequence[Reserved]) -> int:
    """Highest boundary <= every confirmed lease that every stage can resume from."""
    top = min(i.confirmed_blocks for i in items)
    allowed = [set(i.boundaries) for i in items if i.boundaries is not None]
    for b in range(top, 0, -1):
        if all(b in s for s in allowed):
            return b
    return 0
