"""Random interleavings of admit / evict pressure / materialise / complete / abort on 2-4 stages,
with and without in-flight prefix sharing (promised blocks, kept or broken)."""

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefill_node.core.admission_messages import (
    Aborted,
    Admitted,
    Phase,
    Rejected,
    RoundResult,
    Wait,
)
from prefill_node.core.coordinator import AdmissionCoordinator, CoordinatorConfig
from prefill_node.core.execution_results import (
    BlockTable,
    Completion,
    MismatchReason,
    StageStateMismatch,
)
from prefill_node.core.hashing import ExtraKeys
from prefill_node.core.request import PromptBlocks, RequestSpec, blocks_needed
from prefill_node.core.stage_admission import StageAdmission, StageConfig

B = 4
EXTRA = ExtraKeys("prop")
FAMILIES = [list(range(1000 * f, 1000 * f + 48)) for f in range(3)]


def resident_chain(stage, prompt):
    """Independent authoritative walk: the leading blocks of ``prompt`` resident on
    ``stage``, as pool blocks."""
    chain = []
    for i, h in enumerate(prompt.hashes):
        block = stage.pool.lookup(h, prompt.parent_of(i), prompt.token_blocks[i], EXTRA)
        if block is None:
            break
        chain.append(block)
    return chain


def real_hit(stage, rid):
    """Full blocks of the request's prompt resident on ``stage``."""
    prompt = stage.prompt_blocks(rid) or stage.reservation(rid).prompt
    return len(resident_chain(stage, prompt))


class AdmissionMachine(RuleBasedStateMachine):
    @initialize(
        caps=st.lists(st.integers(5, 24), min_size=2, max_size=4),
        recurrent_last=st.booleans(),
        headroom=st.integers(0, 3),
        per_round=st.integers(1, 4),
        share=st.booleans(),
    )
    def setup(self, caps, recurrent_last, headroom, per_round, share):
        self._build(caps, recurrent_last, headroom, per_round, share)

    def _build(self, caps, recurrent_last, headroom, per_round, share):
        self.stages = []
        for s, n in enumerate(caps):
            interval = 2 if recurrent_last and s == len(caps) - 1 else None
            cfg = StageConfig(
                s,
                n,
                B,
                num_layers=s + 1,
                headroom_blocks=min(headroom, n - 1),
                snapshot_interval_blocks=interval,
            )
            self.stages.append(StageAdmission(cfg))
        self.share = share
        config = CoordinatorConfig(B, tuple(caps), per_round, share_inflight_prefix=share)
        self.coord = AdmissionCoordinator(config)
        self.min_cap = min(caps)
        self.specs: dict[str, RequestSpec] = {}
        self.queued: set[str] = set()
        self.admitted: dict[str, Admitted] = {}
        self.pos: dict[str, list[int]] = {}  # next token per stage
        self.first: dict[str, list[int | None]] = {}  # where the first chunk started, per stage
        self.tables: dict[str, list[tuple[int, ...]]] = {}
        self.completed: dict[str, set[int]] = {}
        self.n = 0

    @rule(
        family=st.integers(0, 2),
        shared=st.sampled_from([0, 3, 8, 16, 24, 40]),
        own=st.integers(1, 12),
    )
    def submit(self, family, shared, own):
        self.n += 1
        rid = f"r{self.n}"
        tokens = FAMILIES[family][:shared] + [50_000 + self.n * 100 + i for i in range(own)]
        spec = RequestSpec(rid, tuple(tokens), EXTRA)
        out = self.coord.enqueue(spec)
        if isinstance(out, Rejected):
            assert blocks_needed(len(tokens), B) > self.min_cap
        else:
            assert blocks_needed(len(tokens), B) <= self.min_cap
            self.specs[rid] = spec
            self.queued.add(rid)

    @rule(
        family=st.integers(0, 2),
        shared=st.sampled_from([16, 24, 40]),
        n=st.integers(2, 3),
        own=st.integers(1, 6),
    )
    def burst(self, family, shared, n, own):
        """Requests that arrive together sharing a long prefix (in-flight sharing's case)."""
        for _ in range(n):
            self.submit(family, shared, own)

    @rule(
        pressure_at=st.sampled_from([None, Phase.RESERVE, Phase.COMMIT]),
        s=st.integers(0, 3),
        n=st.integers(1, 6),
    )
    def admission_round(self, pressure_at=None, s=0, n=0):
        """One round; optionally evict on stage ``s`` right before the RESERVE or COMMIT
        phase, as the stage's own execution loop may do concurrently."""
        msg = self.coord.begin_round()
        outcomes = ()
        while msg is not None:
            event(f"phase {msg.phase.value}")
            if msg.phase is pressure_at:
                self._evict_candidate(msg, s) or self.evict_pressure(s, n)
            step = self.coord.finish_phase([stage.handle(msg) for stage in self.stages])
            if isinstance(step, RoundResult):
                outcomes = step.outcomes
                break
            msg = step
        for out in outcomes:
            event(f"outcome {type(out).__name__}")
            if isinstance(out, Admitted):
                self._on_admitted(out)
            elif isinstance(out, Aborted):
                self.queued.discard(out.request_id)
            else:
                assert isinstance(out, Wait) and out.request_id in self.queued

    def _evict_candidate(self, msg, s):
        """Right before the RESERVE, evict the last block of some request's cached prefix on
        stage s (with everything older in LRU order): that stage's lease falls short of the
        others', and a COMMIT phase lowers them to the common boundary."""
        stage = self.stages[s % len(self.stages)]
        for order in msg.reserves:
            chain = resident_chain(stage, PromptBlocks(self.specs[order.request_id], B))
            if not chain or chain[-1] not in stage.pool.free_queue:
                continue
            target = chain[-1]
            take = 1 + stage.pool.free_queue.block_ids().index(target.block_id)
            stage.pool.free(stage.pool.allocate(take))
            event("cached prefix evicted on one stage before the lease")
            return True
        return False

    def _on_admitted(self, out):
        rid = out.request_id
        self.queued.remove(rid)
        boundary = out.cached_len // B
        lease = boundary if out.promise is None else out.promise.leased_len // B
        event("admitted with reuse" if boundary else "admitted cold")
        if out.promise is not None:
            event("admitted with a promised prefix")
            assert self.share and lease < boundary
        assert out.cached_len % B == 0 and out.cached_len < out.num_tokens
        for stage in self.stages:
            assert lease <= real_hit(stage, rid)  # never more than any stage really has
            assert lease <= stage.reservation(rid).boundary_blocks <= boundary
        self.admitted[rid] = out
        self.pos[rid] = [out.cached_len] * len(self.stages)
        self.first[rid] = [None] * len(self.stages)
        self.tables[rid] = [()] * len(self.stages)
        self.completed[rid] = set()

    def _running(self):
        return sorted(self.admitted)

    def _chunk(self, rid, s, length=None, at_promise=True):
        """Run the next chunk of ``rid`` on stage ``s`` (to the prompt's end without
        ``length``) as a stage's loop does: materialise, then cache its full blocks. A
        promised request's first chunk starts at the promise (refused while the stage does
        not hold the promised blocks: then the leader's fallback, the lease) or, without
        ``at_promise``, at the lease."""
        stage, out = self.stages[s], self.admitted[rid]
        start, total = self.pos[rid][s], out.num_tokens
        rsv = stage.reservation(rid)
        promised = rsv is not None and rsv.promised > 0
        if promised and not at_promise:
            start = out.promise.leased_len
        n = total - start if length is None else length
        table = stage.materialise(rid, start, n)
        if isinstance(table, StageStateMismatch):
            assert at_promise and table.reason is MismatchReason.PROMISE_BROKEN, table
            event("a broken promise is refused")
            self._chunk(rid, s, length, at_promise=False)
            return
        assert isinstance(table, BlockTable), table
        if promised:
            event("promise kept" if at_promise else "promise dropped for the lease")
        prev = self.tables[rid][s]
        assert table.block_ids[: len(prev)] == prev  # earlier blocks never move
        assert len(table.block_ids) == blocks_needed(start + n, B)
        self.tables[rid][s] = table.block_ids
        self.pos[rid][s] = start + n
        if self.first[rid][s] is None:
            self.first[rid][s] = start
        if self.share and start + n < total:
            stage.cache_computed(rid, start + n)
            self.coord.computed(rid, min(self.pos[rid]))

    @precondition(lambda self: self.admitted)
    @rule(data=st.data())
    def materialise(self, data):
        rid = data.draw(st.sampled_from(self._running()))
        s = data.draw(st.integers(0, len(self.stages) - 1))
        start, total = self.pos[rid][s], self.admitted[rid].num_tokens
        if start == total:
            return
        length = data.draw(st.integers(1, total - start))
        self._chunk(rid, s, length, at_promise=data.draw(st.booleans()))

    @precondition(lambda self: self.admitted)
    @rule(data=st.data(), finish=st.booleans())
    def complete(self, data, finish):
        """Complete on every stage whose chunks are done; ``finish`` first runs the rest."""
        rid = data.draw(st.sampled_from(self._running()))
        total = self.admitted[rid].num_tokens
        for s, stage in enumerate(self.stages):
            if finish and self.pos[rid][s] < total:
                self._chunk(rid, s)
            if self.pos[rid][s] == total and s not in self.completed[rid]:
                assert isinstance(stage.complete(rid), Completion)
                self.completed[rid].add(s)
        if len(self.completed[rid]) == len(self.stages):
            self.coord.finished(rid)
            self._forget(rid)

    @precondition(lambda self: self.admitted or self.queued)
    @rule(data=st.data(), direct=st.booleans())
    def abort(self, data, direct):
        rid = data.draw(st.sampled_from(sorted(self.queued | set(self.admitted))))
        if rid in self.admitted and direct:
            for stage in self.stages:  # the runtime's path: every stage drops it at once
                stage.abort(rid)
            self.coord.finished(rid)  # (a failure) nothing more of it will be cached
        else:
            self.coord.abort(rid)  # the leader's path: dropped with the next message
        self.queued.discard(rid)
        self._forget(rid)

    def _forget(self, rid):
        for d in (self.admitted, self.pos, self.first, self.tables, self.completed):
            d.pop(rid, None)

    @rule(s=st.integers(0, 3), n=st.integers(1, 6))
    def evict_pressure(self, s, n):
        """Another consumer takes LRU blocks until ``n`` cached ones went, then frees them."""
        stage = self.stages[s % len(self.stages)]
        take = evicted = 0
        for block in stage.pool.free_queue:
            take += 1
            evicted += block.block_hash is not None
            if evicted == n:
                break
        stage.pool.free(stage.pool.allocate(take))

    @invariant()
    def stages_consistent(self):
        for stage in self.stages:
            stage.check_integrity()  # no double owner, pins == refs, committed escrows whole
        for rid, out in self.admitted.items():
            for s, stage in enumerate(self.stages):
                if s in self.completed[rid]:
                    continue
                rsv = stage.reservation(rid)
                if rsv is None:  # only after a leader abort not yet broadcast
                    continue
                assert rsv.committed and rsv.escrow.held == rsv.escrow.target
                if rsv.promised:  # before its first chunk here
                    assert rsv.promised * B == out.cached_len
                    assert rsv.leased * B == out.promise.leased_len
                else:
                    start = self.first[rid][s]
                    assert rsv.boundary_blocks * B == (out.cached_len if start is None else start)

    def teardown(self):
        """Every admitted request runs to the end; every queued one is admitted in time."""
        if not hasattr(self, "stages"):
            return
        for _ in range(4 * (len(self.queued) + len(self.admitted)) + 4):
            for rid in list(self.admitted):
                for s, stage in enumerate(self.stages):
                    if self.pos[rid][s] < self.admitted[rid].num_tokens:
                        self._chunk(rid, s)
                    if s not in self.completed[rid]:
                        assert isinstance(stage.complete(rid), Completion)
                        self.completed[rid].add(s)
                self.coord.finished(rid)
                self._forget(rid)
            if not self.queued and not self.coord.has_work():
                break
            self.admission_round()
        assert not self.queued and not self.admitted and not self.coord.has_work()
        for stage in self.stages:
            stats = stage.pool.stats()
            assert (stats.in_use, stats.claimed, stage.num_reservations) == (0, 0, 0)
            stage.check_integrity()


TestAdmission = AdmissionMachine.TestCase
TestAdmission.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


class PromiseMachine(AdmissionMachine):
    """The same rules where in-flight sharing is always on and can always promise (no
    recurrent-state stage, caches that hold a burst): promises made, kept, dropped for the
    lease and refused when broken, under eviction, aborts and failures."""

    @initialize(
        caps=st.lists(st.integers(16, 32), min_size=2, max_size=4),
        headroom=st.integers(0, 3),
        per_round=st.integers(2, 4),
    )
    def setup(self, caps, headroom, per_round):
        self._build(caps, False, headroom, per_round, True)


TestPromises = PromiseMachine.TestCase
TestPromises.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
