"""Pipeline-level KV events: a block is published while it is resident on ALL stages.

Each stage's block pool reports its own resident set (``BlockStored`` when the first copy
of a hash appears, ``BlockRemoved`` when the last one goes, ``AllBlocksCleared`` on a
reset). The router must only hear about blocks the whole pipeline can reuse: every stage
holds the KV of its own layers, and a prefix hit needs all of them. This aggregator turns
P per-stage feeds into that one feed:

- ``BlockStored`` for a hash once the last stage holds it (carrying the parent hash and
  token ids of the stage that stored it first), runs grouped in chain order;
- ``BlockRemoved`` for a published hash as soon as ANY stage drops it; it is published
  again only once every stage holds it again;
- ``AllBlocksCleared`` whenever any stage clears: the intersection is empty then. The
  other stages' resident sets are kept (they are still true), so their blocks come back
  as soon as the cleared stage stores them again.

Invariant (checked by ``check_integrity``): after every ``ingest`` the published set equals
the intersection of the stages' resident sets, and replaying the emitted events in order
from an empty set reproduces it. Within one ``ingest`` call a newly stored block is emitted
after its parent whenever both are newly stored in that call. A block whose parent is not
resident on every stage (a stage evicted the parent but kept the child) is still published:
a prefix match walks from the prompt's start, so such a block is simply never matched until
its parent comes back.

Feeds are read as set updates: a second ``BlockStored`` of a hash the stage already holds,
or a ``BlockRemoved`` of one it does not, changes nothing (counted in ``ignored``). A stage
that restarts empty must be reported with ``AllBlocksCleared``.

Sans-IO and not thread-safe: the owner (the leader's ``KVEventFeed``, on its result
collector thread, in either engine) serialises calls and publishes the returned events in
order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import chain
from typing import NamedTuple

from prefill_node.core.hashing import BlockHash
from prefill_node.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from prefill_node.errors import InvariantError


class StageEvents(NamedTuple):
    """One stage's drained events, oldest first (as ``BlockPool.drain_events`` returns)."""

    stage: int
    events: Sequence[KVEvent]


class _BlockMeta(NamedTuple):
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int


_STORE, _REMOVE, _CLEAR = 0, 1, 2


class _Op(NamedTuple):
    """One change of the published set, with the block's metadata as of that change."""

    kind: int
    block_hash: BlockHash | None = None
    meta: _BlockMeta | None = None


class PipelineKVEventAggregator:
    """Intersection of ``num_stages`` per-stage resident sets, as an event feed."""

    def __init__(self, num_stages: int) -> None:
        if num_stages < 1:
            raise InvariantError(f"a pipeline has >= 1 stage, got {num_stages}")
        self.num_stages = num_stages
        self._resident: list[set[BlockHash]] = [set() for _ in range(num_stages)]
        self._holders: dict[BlockHash, int] = {}  # number of stages holding the hash
        self._meta: dict[BlockHash, _BlockMeta] = {}  # while any stage holds the hash
        self._published: set[BlockHash] = set()
        self.ignored = 0  # redundant per-stage updates (duplicate store, unknown removal)

    # ---- queries -------------------------------------------------------------------

    @property
    def published(self) -> frozenset[BlockHash]:
        """Hashes resident on every stage (what the router has been told)."""
        return frozenset(self._published)

    def resident(self, stage: int) -> frozenset[BlockHash]:
        return frozenset(self._resident[self._stage(stage)])

    def snapshot(self) -> list[BlockStored]:
        """The published set as ``BlockStored`` runs in chain order: what a new subscriber
        needs after its ``AllBlocksCleared`` to catch up."""
        return self._assemble([_Op(_STORE, h, self._meta[h]) for h in self._published])

    # ---- ingest --------------------------------------------------------------------

    def ingest(self, stage: int, events: Sequence[KVEvent]) -> list[KVEvent]:
        """Apply one stage's events; the pipeline-level events they cause, in order."""
        return self.ingest_many((StageEvents(stage, events),))

    def ingest_many(self, batches: Iterable[StageEvents]) -> list[KVEvent]:
        """Apply several stages' batches in the given order (e.g. all stages' events of
        one round, stage 0 first); one coalesced, chain-ordered list of events."""
        ops: list[_Op] = []
        for stage, events in batches:
            s = self._stage(stage)
            for event in events:
                if isinstance(event, BlockStored):
                    self._store(s, event, ops)
                elif isinstance(event, BlockRemoved):
                    self._remove(s, event.block_hashes, ops)
                elif isinstance(event, AllBlocksCleared):
                    self._clear(s, ops)
                else:
                    raise InvariantError(f"not a KV event: {event!r}")
        return self._assemble(ops)

    def _store(self, s: int, event: BlockStored, ops: list[_Op]) -> None:
        size = event.block_size
        if size < 1 or len(event.token_ids) != len(event.block_hashes) * size:
            raise InvariantError(
                f"BlockStored with {len(event.block_hashes)} hashes carries "
                f"{len(event.token_ids)} tokens for block_size {size}"
            )
        parent = event.parent_hash
        resident = self._resident[s]
        for i, h in enumerate(event.block_hashes):
            if h in resident:
                self.ignored += 1
            else:
                resident.add(h)
                count = self._holders.get(h, 0) + 1
                self._holders[h] = count
                if count == 1:
                    tokens = tuple(event.token_ids[i * size : (i + 1) * size])
                    self._meta[h] = _BlockMeta(parent, tokens, size)
                if count == self.num_stages:
                    self._published.add(h)
                    ops.append(_Op(_STORE, h, self._meta[h]))
            parent = h

    def _remove(self, s: int, hashes: Sequence[BlockHash], ops: list[_Op]) -> None:
        resident, published = self._resident[s], self._published
        for h in hashes:
            if h not in resident:
                self.ignored += 1
                continue
            resident.remove(h)
            self._drop_holder(h)
            if h in published:
                published.remove(h)
                ops.append(_Op(_REMOVE, h))

    def _clear(self, s: int, ops: list[_Op]) -> None:
        for h in self._resident[s]:
            self._drop_holder(h)
        self._resident[s] = set()
        self._published.clear()
        ops.append(_Op(_CLEAR))

    def _drop_holder(self, h: BlockHash) -> None:
        count = self._holders[h] - 1
        if count:
            self._holders[h] = count
        else:
            del self._holders[h]
            del self._meta[h]

    # ---- output --------------------------------------------------------------------

    @staticmethod
    def _assemble(ops: list[_Op]) -> list[KVEvent]:
        """Coalesce consecutive ops of one kind into events; stores in chain order."""
        out: list[KVEvent] = []
        start = 0
        while start < len(ops):
            kind = ops[start].kind
            end = start
            while end < len(ops) and ops[end].kind == kind:
                end += 1
            if kind == _STORE:
                metas = {
                    op.block_hash: op.meta
                    for op in ops[start:end]
                    if op.block_hash is not None and op.meta is not None
                }
                out.extend(_stored_runs(metas))
            elif kind == _REMOVE:
                removed = (op.block_hash for op in ops[start:end] if op.block_hash is not None)
                out.append(BlockRemoved(tuple(removed)))
            else:
                out.append(AllBlocksCleared())
            start = end
        return out

    # ---- integrity -----------------------------------------------------------------

    def check_integrity(self) -> None:
        """Holder counts, metadata and the published set agree with the resident sets."""
        counts: dict[BlockHash, int] = {}
        for resident in self._resident:
            for h in resident:
                counts[h] = counts.get(h, 0) + 1
        if counts != self._holders:
            raise InvariantError("aggregator holder counts disagree with the resident sets")
        if self._meta.keys() != counts.keys():
            raise InvariantError("aggregator keeps metadata for hashes no stage holds")
        full = {h for h, c in counts.items() if c == self.num_stages}
        if full != self._published:
            raise InvariantError(
                f"published set differs from the intersection: {len(self._published)} "
                f"published, {len(full)} resident on every stage"
            )

    def _stage(self, stage: int) -> int:
        if not 0 <= stage < self.num_stages:
            raise InvariantError(f"stage {stage} is outside [0, {self.num_stages})")
        return stage


def _stored_runs(metas: dict[BlockHash, _BlockMeta]) -> list[BlockStored]:
    """The blocks of ``metas`` (insertion order) reordered so that parents precede
    children, otherwise stable, and cut into runs where each block's parent is the
    previous block."""
    pending = set(metas)
    ordered: list[BlockHash] = []
    for h in metas:
        ancestors: list[BlockHash] = []
        node: BlockHash | None = h
        while node is not None and node in pending:
            pending.discard(node)
            ancestors.append(node)
            node = metas[node].parent_hash
        ordered.extend(reversed(ancestors))
    runs: list[BlockStored] = []
    run: list[BlockHash] = []

    def close_run() -> None:
        first = metas[run[0]]
        tokens = tuple(chain.from_iterable(metas[h].token_ids for h in run))
        runs.append(BlockStored(tuple(run), first.parent_hash, tokens, first.block_size))
        run.clear()

    for h in ordered:
        meta = metas[h]
        if run and (meta.parent_hash != run[-1] or meta.block_size != metas[run[0]].block_size):
            close_run()
        run.append(h)
    if run:
        close_run()
    return runs
