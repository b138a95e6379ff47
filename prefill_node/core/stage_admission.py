"""One stage's admission state: answers admission rounds, materialises and completes requests."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from prefill_node.core.admission_messages import (
    CommitOrder,
    Committed,
    Phase,
    Reserved,
    ReserveOrder,
    ReserveStatus,
    RoundRequest,
    StageReply,
)
from prefill_node.core.block import KVBlock
from prefill_node.core.block_pool import BlockPool
from prefill_node.core.execution_results import (
    BlockTable,
    Completion,
    MismatchReason,
    StageStateMismatch,
)
from prefill_node.core.kv_events import KVEvent
from prefill_node.core.lease import PrefixLease
from prefill_node.core.request import PromptBlocks, RequestSpec
from prefill_node.core.reservation import Reservation
from prefill_node.errors import InvalidRequestError, InvariantError


class InvalidStageConfigError(InvalidRequestError):
    """A stage's cache configuration is inconsistent."""


@dataclass(frozen=True)
class StageConfig:
    """One stage's cache: ``num_blocks`` blocks of ``block_size`` tokens for the
    ``num_layers`` layers it holds (informational here: sizing and metrics).

    ``headroom_blocks``: while other requests hold reservations, a new one is admitted only
    if the blocks pinned or escrowed stay within ``num_blocks - headroom_blocks`` (about
    2*P*M tokens of headroom, WAVEPP.md 2): pins never leave nothing evictable, and
    admission cannot run arbitrarily far ahead of execution by evicting the whole cache for
    far-future work. A lone request is never capped, so anything that fits the cache is
    admitted eventually. ``snapshot_interval_blocks``: for stages with recurrent-state
    layers, a snapshot is stored after every k-th full block and a prefix is reusable only
    up to a snapshot.
    """

    stage: int
    num_blocks: int
    block_size: int
    num_layers: int = 1
    headroom_blocks: int = 0
    snapshot_interval_blocks: int | None = None
    enable_kv_events: bool = False

    def __post_init__(self) -> None:
        if self.stage < 0 or self.num_blocks <= 0 or self.block_size <= 0 or self.num_layers <= 0:
            raise InvalidStageConfigError(
                f"stage {self.stage}: stage >= 0, num_blocks, block_size, num_layers > 0 needed"
            )
        if not 0 <= self.headroom_blocks < self.num_blocks:
            raise InvalidStageConfigError(
                f"stage {self.stage}: headroom_blocks must be in [0, num_blocks)"
            )
        if self.snapshot_interval_blocks is not None and self.snapshot_interval_blocks <= 0:
            raise InvalidStageConfigError(f"stage {self.stage}: snapshot interval must be > 0")


class FetchSkip(enum.Enum):
    """Why a stage copies nothing of a prefix another pipeline holds (``begin_fetch``)."""

    HELD = "held"  # it holds the whole prefix already
    NO_ROOM = "no_room"  # it cannot make room: every block is pinned or escrowed
    UNSUPPORTED = "unsupported"  # not whole blocks, or a stage resuming at snapshots


class FinalBlocks(NamedTuple):
    """Blocks whose KV became final, pinned once each for a streamed WRITE (``pin_final``):
    ``block_ids`` is the request's block table so far, ``[start, end)`` the tokens they
    hold (of a ``num_tokens``-token prompt)."""

    blocks: list[KVBlock]
    block_ids: tuple[int, ...]
    num_tokens: int
    start: int
    end: int


class StageAdmission:
    """The admission and cache state of one stage (sans-IO; one per stage process).

    Two callers share it, and the owner serialises them (the stage's cache lock):
    - the admission side: ``handle`` answers every ``RoundRequest`` of the leader;
    - the execution loop: ``materialise`` before running a chunk, ``cache_computed`` after
      a non-last one, ``complete`` after the last chunk, ``abort`` at any time.
    A request reserved here holds its whole prompt's capacity (lease + escrow + blocks)
    until ``complete`` / ``abort`` / a release from the leader. Specs of requests that
    wait stay registered (token ids travel once) until admitted and finished or forgotten.
    """

    def __init__(self, config: StageConfig) -> None:
        self.config = config
        self.stage = config.stage
        self.pool = BlockPool(
            config.num_blocks, config.block_size, enable_events=config.enable_kv_events
        )
        self._prompts: dict[str, PromptBlocks] = {}
        self._reservations: dict[str, Reservation] = {}
        self._transfer_pins: dict[int, int] = {}  # block id -> references a KV WRITE holds
        self._waiters: dict[str, list[str]] = {}  # producer -> requests promised its blocks

    # ---- rounds plane ----------------------------------------------------------------

    def handle(self, msg: RoundRequest) -> StageReply:
        """Apply forgets and releases, then answer the phase's items in FCFS order."""
        for request_id in msg.forgets:
            self.abort(request_id)
        for request_id in msg.releases:
            self._release(request_id)
        if msg.phase is Phase.RESERVE:
            for spec in msg.new_requests:
                self._register(PromptBlocks(spec, self.config.block_size))
            reserved: list[Reserved] = []
            blocked = False
            for order in msg.reserves:
                answer = self._reserve(order, blocked)
                blocked = blocked or answer.status is not ReserveStatus.OK
                reserved.append(answer)
            return StageReply(msg.round_id, msg.phase, self.stage, reserved=tuple(reserved))
        if msg.phase is Phase.COMMIT:
            committed = tuple(self._commit(order) for order in msg.commits)
            return StageReply(msg.round_id, msg.phase, self.stage, committed=committed)
        return StageReply(msg.round_id, msg.phase, self.stage)

    def _register(self, prompt: PromptBlocks) -> None:
        if prompt.request_id in self._prompts:
            raise InvariantError(f"stage {self.stage}: request {prompt.request_id!r} sent twice")
        if prompt.num_blocks > self.config.num_blocks:
            raise InvariantError(
                f"stage {self.stage}: {prompt.request_id!r} needs {prompt.num_blocks} blocks of "
                f"{self.config.num_blocks}; the coordinator must reject it"
            )
        self._prompts[prompt.request_id] = prompt

    def _prompt(self, request_id: str) -> PromptBlocks:
        prompt = self._prompts.get(request_id)
        if prompt is None:
            raise InvariantError(f"stage {self.stage}: unknown request {request_id!r}")
        return prompt

    @property
    def _needs_snapshot(self) -> bool:
        return self.config.snapshot_interval_blocks is not None

    def _reuse_limit(self, prompt: PromptBlocks) -> int:
        """``max_reusable_blocks`` (the one reuse rule), one block less when copying a wholly
        cached prompt's last block would need more blocks than this stage has (then its last
        block is recomputed instead: the only case the router's prediction misses)."""
        limit = prompt.max_reusable_blocks(needs_snapshot=self._needs_snapshot)
        copies = limit * prompt.block_size >= prompt.num_tokens
        if copies and prompt.num_blocks + 1 > self.config.num_blocks:
            limit -= 1
        return limit

    def _reserve(self, order: ReserveOrder, blocked: bool, *, capped: bool = True) -> Reserved:
        """Lease the longest prefix this stage really holds (at a snapshot boundary where
        recurrent state needs one), escrow the rest and commit there; nothing is held
        unless the answer is OK. ``capped=False``: no headroom cap (a prefix fetch, whose
        blocks come back when its READ ends, whatever the waves do)."""
        rid = order.request_id
        prompt = self._prompt(rid)
        if rid in self._reservations:
            raise InvariantError(f"stage {self.stage}: {rid!r} reserved twice")
        if blocked:
            return Reserved(rid, ReserveStatus.FCFS_BLOCKED, 0, None, 0)
        rsv = Reservation(prompt)
        confirmed = rsv.lease.acquire(
            self.pool, prompt, self._reuse_limit(prompt), self._may_take_over
        )
        boundaries = None
        if self._needs_snapshot:
            snaps = rsv.lease.snapshot_boundaries()
            rsv.lease.shrink(self.pool, snaps[-1] if snaps else 0)
            confirmed = len(rsv.lease)
            boundaries = (0, *rsv.lease.snapshot_boundaries())
        if not rsv.commit(self.pool, confirmed):
            rsv.release(self.pool)
            return Reserved(rid, ReserveStatus.NO_CAPACITY, confirmed, boundaries, 0)
        if capped and self._reservations and self._tied_up() > self._cap:
            rsv.release(self.pool)
            return Reserved(rid, ReserveStatus.ADMISSION_CAP, confirmed, boundaries, 0)
        self._reservations[rid] = rsv
        return Reserved(rid, ReserveStatus.OK, confirmed, boundaries, rsv.escrow.target)

    @property
    def _cap(self) -> int:
        return self.config.num_blocks - self.config.headroom_blocks

    def _tied_up(self) -> int:
        """Distinct blocks admission holds: pinned (leases, running requests) or escrowed."""
        stats = self.pool.stats()
        return stats.in_use + stats.claimed

    def _may_take_over(self, victim: KVBlock) -> bool:
        """A lease hit an escrowed victim: take it over only if its escrow gets a substitute
        (every reservation here is committed, and a committed escrow is never left short)."""
        owner = self._reservations.get(victim.claimed_by or "")
        if owner is None:
            raise InvariantError(f"stage {self.stage}: {victim!r} claimed by no reservation")
        return owner.escrow.replace(self.pool, victim)

    def _commit(self, order: CommitOrder) -> Committed:
        rid = order.request_id
        rsv = self._reservations.get(rid)
        if rsv is None or order.boundary_blocks > rsv.boundary_blocks:
            raise InvariantError(f"stage {self.stage}: cannot commit {rid!r} at {order}")
        if self._needs_snapshot and order.boundary_blocks not in (
            0,
            *rsv.lease.snapshot_boundaries(),
        ):
            raise InvariantError(f"stage {self.stage}: {order} is not a snapshot boundary")
        if not rsv.commit(self.pool, order.boundary_blocks):
            self._release(rid)
            return Committed(rid, False, 0)
        if order.promised_blocks > order.boundary_blocks:
            if self._needs_snapshot:
                raise InvariantError(f"stage {self.stage}: a promise where snapshots rule reuse")
            rsv.promise(order.promised_blocks)
            if not self._fulfil(rsv):
                producer = self._reservations.get(order.producer)
                if producer is None or producer.completed:  # it will cache nothing more
                    return Committed(rid, True, rsv.escrow.target, promise_lapsed=True)
                self._waiters.setdefault(order.producer, []).append(rid)
        return Committed(rid, True, rsv.escrow.target)

    def _fulfil(self, rsv: Reservation) -> bool:
        return rsv.fulfil(self.pool, self._may_take_over)

    def _fulfil_waiters(self, producer: str, *, last: bool) -> None:
        """``producer`` cached blocks here: lease them for the requests they were promised
        to (before the producer unpins them, so nothing can evict them in between). With
        ``last`` the producer caches nothing more here: forget its waiters (one whose
        promise is still short fails at its first chunk, or starts where its lease ends)."""
        waiting = self._waiters.pop(producer, [])
        left = [
            rid
            for rid in waiting
            if (rsv := self._reservations.get(rid)) is not None
            and rsv.promise_pending
            and not self._fulfil(rsv)
        ]
        if left and not last:
            self._waiters[producer] = left

    def _release(self, request_id: str) -> None:
        rsv = self._reservations.pop(request_id, None)
        if rsv is not None:
            rsv.release(self.pool)

    # ---- trtllm: follow rank 0's decision ---------------------------------------------

    def follow(self, spec: RequestSpec, cached_tokens: int) -> ReserveStatus:
        """Take rank 0's admission of a request this stage first sees in a wave (``trtllm``,
        stages > 0), as TensorRT-LLM's ranks > 0 take rank 0's schedule: re-check it on this
        stage's own cache (``_pp_retry_until_can_schedule`` -> ``can_schedule``), then
        allocate (``add_sequence``). No negotiation: lease exactly the prefix rank 0 reuses
        (``cached_tokens``, the first chunk's start), escrow the rest and commit at once, with
        no headroom cap (rank 0's capacity decision stands).

        Returns OK (reserved and committed, as after a round), PREFIX_MISSING (this stage's
        cache holds less of that prefix than rank 0's, or not at a snapshot boundary: the
        request cannot run here) or NO_CAPACITY (the suffix does not fit now; the caller may
        retry while capacity is being released). Nothing is held unless OK."""
        rid = spec.request_id
        if rid in self._reservations or rid in self._prompts:
            raise InvariantError(f"stage {self.stage}: {rid!r} followed twice")
        prompt = PromptBlocks(spec, self.config.block_size)
        if prompt.num_blocks > self.config.num_blocks:
            return ReserveStatus.NO_CAPACITY
        boundary = -(-cached_tokens // self.config.block_size)
        rsv = Reservation(prompt)
        confirmed = rsv.lease.acquire(self.pool, prompt, boundary, self._may_take_over)
        status = ReserveStatus.OK
        snaps = (0, *rsv.lease.snapshot_boundaries()) if self._needs_snapshot else (boundary,)
        if confirmed < boundary or boundary not in snaps:
            status = ReserveStatus.PREFIX_MISSING
        elif not rsv.commit(self.pool, boundary):
            status = ReserveStatus.NO_CAPACITY
        if status is not ReserveStatus.OK:
            rsv.release(self.pool)
            return status
        self._prompts[rid] = prompt
        self._reservations[rid] = rsv
        return status

    # ---- execution loop --------------------------------------------------------------

    def materialise(
        self, request_id: str, start: int, length: int
    ) -> BlockTable | StageStateMismatch:
        """Turn escrowed victims into the blocks of chunk [start, start + length) (evicting
        them now) and return the request's block table; a mismatch if this stage's state
        does not agree with the chunk (the request must then fail, never run)."""
        rsv = self._reservations.get(request_id)
        if rsv is None:
            return StageStateMismatch(
                request_id, self.stage, MismatchReason.UNKNOWN_REQUEST, "no reservation here"
            )
        if rsv.promise_pending:
            self._fulfil(rsv)  # cached by other means than the producer's chunks
        return rsv.materialise(self.pool, self.stage, start, length)

    def cache_computed(self, request_id: str, computed: int) -> int:
        """A chunk ending at token ``computed`` ran on this stage (its KV is final here):
        cache the request's full blocks below it now rather than at ``complete``, so a
        request sharing them can lease them while this one still runs. The coordinator
        lets requests wait for them (``AdmissionCoordinator.computed``) only once every
        stage did this. Returns the blocks cached now (0 for an unknown or finished one)."""
        rsv = self._reservations.get(request_id)
        if rsv is None or rsv.completed:
            return 0
        cached = rsv.cache_computed(self.pool, computed, self.config.snapshot_interval_blocks)
        if cached and request_id in self._waiters:
            self._fulfil_waiters(request_id, last=False)
        return cached

    def complete(
        self, request_id: str, *, keep_pinned: bool = False
    ) -> Completion | StageStateMismatch:
        """The last chunk left this stage: cache its new full blocks, then unpin everything
        (or keep the blocks pinned until ``unpin`` when decode will pull the KV)."""
        rsv = self._reservations.get(request_id)
        if rsv is None:
            return StageStateMismatch(
                request_id, self.stage, MismatchReason.UNKNOWN_REQUEST, "no reservation here"
            )
        done = rsv.complete(self.pool, self.stage, self.config.snapshot_interval_blocks, True)
        if isinstance(done, Completion):
            self._fulfil_waiters(request_id, last=True)
            self._prompts.pop(request_id, None)
            if not keep_pinned:
                self._release(request_id)
                done = replace(done, kept_pinned=False)
        return done

    def unpin(self, request_id: str) -> bool:
        """Drop the pins a ``complete(keep_pinned=True)`` kept; False if none were kept."""
        rsv = self._reservations.get(request_id)
        if rsv is None or not rsv.completed:
            return False
        self._release(request_id)
        return True

    def pin_final(
        self, request_id: str, start: int, end: int, *, to_prompt_end: bool = False
    ) -> FinalBlocks | None:
        """Tokens ``[start, end)`` of the request just ran here: one more reference on each
        block whose KV became final since the previous chunk, held by a streamed KV WRITE
        (the blocks stay in use, even if the request is aborted meanwhile, until
        ``unpin_transfer`` gives each back once). The block holding the prompt's last token
        is left to the final push (a partial block is sent once, when final); the first
        chunk also covers the prefix this stage reused. ``to_prompt_end`` (the last chunk,
        during its forward): every block from the chunk's first one to the prompt's end,
        the partial last one too. None when no block is final yet, or the request no longer
        runs here."""
        rsv = self._reservations.get(request_id)
        if rsv is None or rsv.completed:
            return None
        bs = self.config.block_size
        num_tokens = rsv.prompt.num_tokens
        keep = (num_tokens - 1) // bs  # the last block's index
        last = keep + 1 if to_prompt_end else min(end // bs, keep)
        first = 0 if start == rsv.cached_len else min(start // bs, keep)  # first chunk: prefix
        if last <= first:
            return None
        table = rsv.block_ids()
        if last > len(table):
            raise InvariantError(
                f"blocks [{first}, {last}) outside {request_id!r}'s {len(table)} blocks"
            )
        blocks = [self.pool.block(b) for b in table[first:last]]
        self.pool.touch(blocks)
        for block in blocks:
            self._transfer_pins[block.block_id] = self._transfer_pins.get(block.block_id, 0) + 1
        return FinalBlocks(blocks, table, num_tokens, first * bs, min(last * bs, num_tokens))

    def unpin_transfer(self, blocks: Sequence[KVBlock]) -> None:
        """Give back the references ``pin_final`` took (a WRITE ended or was dropped)."""
        for block in blocks:
            held = self._transfer_pins.get(block.block_id, 0)
            if held <= 0:
                raise InvariantError(f"block {block.block_id} holds no transfer pin")
            if held == 1:
                del self._transfer_pins[block.block_id]
            else:
                self._transfer_pins[block.block_id] = held - 1
        self.pool.free(list(blocks))

    @property
    def transfer_pins(self) -> int:
        """Block references streamed KV WRITEs hold now."""
        return sum(self._transfer_pins.values())

    # ---- prefix fetch: blocks copied from another pipeline -------------------------

    def pin_cached(self, spec: RequestSpec) -> FinalBlocks | None:
        """The longest run of ``spec``'s full blocks this stage holds cached, pinned once
        each for another pipeline to READ (a prefix fetch's source side): transfer pins,
        as a streamed WRITE's, given back by ``unpin_transfer``. A block some escrow holds
        as a victim ends the run. None when it holds none of them, or resumes only at
        recurrent-state snapshots (a copy does not carry them)."""
        if self._needs_snapshot:
            return None
        prompt = PromptBlocks(spec, self.config.block_size)
        lease = PrefixLease()
        found = lease.acquire(self.pool, prompt, prompt.num_full_blocks, lambda victim: False)
        if not found:
            return None
        for block in lease.blocks:
            self._transfer_pins[block.block_id] = self._transfer_pins.get(block.block_id, 0) + 1
        end = found * self.config.block_size
        return FinalBlocks(lease.blocks, tuple(b.block_id for b in lease.blocks), end, 0, end)

    def begin_fetch(self, spec: RequestSpec) -> BlockTable | FetchSkip:
        """Hold room for a prefix another pipeline holds (``spec``: whole blocks of it, under
        an id of its own) as a request of its own: lease what this stage holds of it, escrow
        the rest and materialise the blocks after the lease for the copy to land in (their
        KV is garbage until then; nothing else can lease them). The headroom cap does not
        apply: the blocks come back when the READ ends, whatever the waves do, so the
        copy cannot hold the cache hostage. A ``FetchSkip`` when this stage holds the
        whole prefix already, cannot make room (every block pinned or escrowed), or resumes
        only at recurrent-state snapshots (a copy does not carry them): nothing is held.
        ``end_fetch`` caches the blocks or gives them back."""
        size = self.config.block_size
        if spec.num_tokens % size or self._needs_snapshot:
            return FetchSkip.UNSUPPORTED
        prompt = PromptBlocks(spec, size)
        if prompt.num_blocks > self.config.num_blocks:
            return FetchSkip.NO_ROOM
        self._register(prompt)
        reserved = self._reserve(ReserveOrder(spec.request_id), blocked=False, capped=False)
        start = reserved.confirmed_blocks * size
        if reserved.status is not ReserveStatus.OK or start >= spec.num_tokens:
            self.abort(spec.request_id)
            ok = reserved.status is ReserveStatus.OK
            return FetchSkip.HELD if ok else FetchSkip.NO_ROOM
        self._commit(CommitOrder(spec.request_id, reserved.confirmed_blocks))
        table = self.materialise(spec.request_id, start, spec.num_tokens - start)
        if isinstance(table, StageStateMismatch):
            self.abort(spec.request_id)
            raise InvariantError(f"stage {self.stage}: fetch of {spec.request_id!r}: {table}")
        return table

    def end_fetch(self, request_id: str, landed: bool) -> int:
        """The copy ``begin_fetch`` made room for ended: ``landed`` caches its blocks as if
        this stage had computed them (KV events, reuse and eviction as usual), else they go
        back unhashed. Returns the blocks cached."""
        if not landed:
            self.abort(request_id)
            return 0
        done = self.complete(request_id)
        if isinstance(done, StageStateMismatch):
            raise InvariantError(f"stage {self.stage}: fetch of {request_id!r}: {done}")
        return done.cached_blocks

    def abort(self, request_id: str) -> bool:
        """Drop whatever this stage holds for the request (any state); False if nothing."""
        known = self._prompts.pop(request_id, None) is not None
        self._waiters.pop(request_id, None)
        rsv = self._reservations.pop(request_id, None)
        if rsv is not None:
            rsv.release(self.pool)
        return known or rsv is not None

    # ---- observation -----------------------------------------------------------------

    def prompt_blocks(self, request_id: str) -> PromptBlocks | None:
        """The registered prompt (hashes, token blocks) of a request not yet finished here."""
        return self._prompts.get(request_id)

    def reservation(self, request_id: str) -> Reservation | None:
        """Read-only view for tests and metrics."""
        return self._reservations.get(request_id)

    @property
    def num_reservations(self) -> int:
        return len(self._reservations)

    def drain_events(self) -> list[KVEvent]:
        return self.pool.drain_events()

    def check_integrity(self) -> None:
        """The pool's own checks plus: every claim and pin belongs to exactly one reservation,
        every reservation is committed with its escrow full and covers its prompt (a
        promised prefix's leased blocks on top, until the first chunk), and every lease
        block really holds its prompt block."""
        self.pool.check_integrity()
        claims: dict[int, str] = {}
        pins: dict[int, int] = {}
        for rid, rsv in self._reservations.items():
            for victim in rsv.escrow.victims():
                if victim.block_id in claims:
                    raise InvariantError(f"block {victim.block_id} claimed twice")
                claims[victim.block_id] = rid
            if not rsv.committed:
                raise InvariantError(f"reservation of {rid!r} is held but not committed")
            if rsv.escrow.held != rsv.escrow.target:
                raise InvariantError(f"committed escrow of {rid!r} is short")
            if not rsv.completed and rsv.held_blocks != rsv.needed_blocks + rsv.promise_surplus:
                raise InvariantError(f"reservation of {rid!r} does not cover its prompt")
            if rsv.promised and (
                rsv.new_blocks or not rsv.leased <= len(rsv.lease) <= rsv.promised
            ):
                raise InvariantError(f"promise of {rid!r} outlived its first chunk or overran")
            p = rsv.prompt
            for i, block in enumerate(rsv.lease.blocks):
                if not block.matches(p.parent_of(i), p.token_blocks[i], p.spec.extra):
                    raise InvariantError(f"lease of {rid!r} holds a wrong block at {i}")
            for block in rsv.lease.blocks + rsv.new_blocks:
                pins[block.block_id] = pins.get(block.block_id, 0) + 1
        for block_id, n in self._transfer_pins.items():
            pins[block_id] = pins.get(block_id, 0) + n
        if self.pool.stats().claimed != len(claims):
            raise InvariantError("claimed blocks held by no reservation")
        for block_id, n in pins.items():
            if self.pool.block(block_id).ref_cnt != n:
                raise InvariantError(f"block {block_id}: {n} pins but ref_cnt differs")
        if self.pool.stats().in_use != len(pins):
            raise InvariantError("blocks in use that no reservation holds")
