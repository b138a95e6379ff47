"""RouterCore: the router's routing state and decisions, sans-IO (no sockets, no threads, no
clock of its own), so the router's server (``RouterEngine``) and the cluster simulator
(``prefill_router/cluster_sim.py``) place requests with the same code.

It holds the global prefix index (``GlobalPrefixIndex``), each pipeline's measured / predicted
time ratio (``PredictionCalibration``), the ``Scorer`` (made once the cluster's block size is
known), the per-``cache_salt`` hashing keys, and the accounting of the requests it placed and
that have not finished: per pipeline, their cost-model seconds, computed tokens and count.

Per request: ``hashes`` (the prompt's block hashes for the cluster and the request's salt),
then ``route`` (decide among the ``members`` the caller passes, record the prompt as pending
on the chosen pipeline, count it there: a ``Placement``, which names the pipeline to fetch
the prefix from under the FETCH policy), ``observe`` when the answer came (a calibration
sample), ``observe_fetch`` when a fetch it asked for ended (a transfer-model sample),
``finish`` when it ended either way. ``decide`` and ``assess`` score
without recording anything (the Score RPC, flow control). Membership is the caller's: each
call takes the pipelines as ``PipelineMember`` values (readiness, limits, the load a pipeline
last reported), and a pipeline's index entries come and go through ``index`` and ``forget``.

Not thread-safe: the caller serialises calls (``RouterEngine`` holds its lock around them).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prefill_node.core.cost_model import ChunkCostModel
from prefill_node.core.hashing import BlockHash, ExtraKeys, hash_block_tokens
from prefill_node.errors import UnavailableError
from prefill_router.calibration import CalibrationConfig, PredictionCalibration
from prefill_router.index import GlobalPrefixIndex, PipelineId
from prefill_router.scoring import (
    DEFAULT_AFFINITY_SLACK,
    CandidateScore,
    PipelineView,
    RoutingDecision,
    RoutingPolicy,
    Scorer,
)
from prefill_router.transfer import TransferFit, TransferModel

UNBOUNDED_BLOCKS = 1 << 40  # a pipeline's capacity before it reported one
_MAX_SALTS = 4096  # ExtraKeys kept per cache_salt (tenants); beyond it the table starts over


@dataclass(frozen=True, slots=True)
class PipelineMember:
    """A pipeline the caller offers for routing, as it last saw it. ``reported_tokens``: the
    prompt tokens in flight there by its own last load report (requests from elsewhere
    count through it: what exceeds this core's own placements there)."""

    pid: PipelineId
    ready: bool
    max_model_len: int
    capacity_blocks: int = UNBOUNDED_BLOCKS
    snapshot_interval_blocks: int | None = None
    reported_tokens: int = 0


@dataclass(slots=True)
class Placement:
    """One request placed on ``pid`` (``RouterCore.route``). ``cost_s``: its prefill's
    cost-model seconds (what it adds to the pipeline's queue); ``predicted_cost_s``: queued +
    prefill cost-model seconds there when it was placed (the calibration's prediction).
    ``fetch_from``: the pipeline to copy ``fetch_blocks`` blocks of the prefix from before
    computing the rest (FETCH only; ``cached_tokens`` counts them)."""

    pid: PipelineId
    cost_s: float
    computed_tokens: int
    cached_tokens: int
    predicted_cost_s: float
    reason: str
    finished: bool = False
    fetch_from: PipelineId | None = None
    fetch_blocks: int = 0


_NO_PLACEMENTS = (0.0, 0, 0)  # (cost_s, computed_tokens, requests)


class RouterCore:
    """See the module contract."""

    def __init__(
        self,
        cost_model: ChunkCostModel,
        policy: RoutingPolicy = RoutingPolicy.PREFIX,
        *,
        pending_ttl_s: float = 2.0,
        affinity_slack: float = DEFAULT_AFFINITY_SLACK,
        calibration: CalibrationConfig | None = None,
        transfer: TransferModel | None = None,
    ) -> None:
        """``transfer``: the FETCH policy's prior transfer model (refitted by
        ``observe_fetch``)."""
        self.cost_model, self.policy, self.affinity_slack = cost_model, policy, affinity_slack
        self.transfer = TransferFit(transfer) if transfer is not None else None
        self._links_free: dict[PipelineId, float] = {}  # FETCH: when placed fetches end
        self.index = GlobalPrefixIndex(pending_ttl_s)
        self.calibration = PredictionCalibration(calibration or CalibrationConfig())
        self.scorer: Scorer | None = None
        self._model_id = ""
        self._block_size = 0
        self._extra: dict[str | None, ExtraKeys] = {}
        self._placed: dict[PipelineId, tuple[float, int, int]] = {}

    @property
    def block_size(self) -> int:
        """The cluster's block size (0 before ``start_scoring``)."""
        return self._block_size

    def start_scoring(self, model_id: str, block_size: int) -> None:
        """Fix the cluster's cache identity (the first pipeline's); routing starts here."""
        self._model_id, self._block_size = model_id, block_size
        self._extra.clear()
        self.scorer = Scorer(self.cost_model, block_size, self.policy, self.affinity_slack,
                             self.transfer.model if self.transfer else None)  # fmt: skip

    def hashes(self, token_ids: Sequence[int], cache_salt: str | None) -> list[BlockHash]:
        """The prompt's full-block hashes, as every pipeline of the cluster computes them
        for ``cache_salt`` (its ExtraKeys made once per salt: their digest is the costly
        part; the table starts over when it outgrows ``_MAX_SALTS``)."""
        self._scoring()
        extra = self._extra.get(cache_salt)
        if extra is None:
            if len(self._extra) >= _MAX_SALTS:
                self._extra.clear()
            extra = self._extra[cache_salt] = ExtraKeys(self._model_id, cache_salt)
        return hash_block_tokens(token_ids, self._block_size, extra)

    # -- decisions -------------------------------------------------------------------------
    def decide(
        self,
        prompt_tokens: int,
        hashes: Sequence[BlockHash],
        members: Iterable[PipelineMember],
        now: float,
        tried: Sequence[PipelineId] = (),
    ) -> RoutingDecision:
        """Where the prompt would go now (not to one of ``tried``), recording nothing (only
        round-robin's rotation moves)."""
        return self._scoring().choose(prompt_tokens, *self._inputs(hashes, members, now, tried))

    def assess(
        self,
        prompt_tokens: int,
        hashes: Sequence[BlockHash],
        members: Iterable[PipelineMember],
        now: float,
    ) -> tuple[CandidateScore, ...]:
        """Every member's score for the prompt, choosing nothing."""
        return self._scoring().assess(prompt_tokens, *self._inputs(hashes, members, now, ()))

    def route(
        self,
        prompt_tokens: int,
        hashes: Sequence[BlockHash],
        members: Iterable[PipelineMember],
        now: float,
        tried: Sequence[PipelineId] = (),
        *,
        record_pending: bool = True,
    ) -> tuple[RoutingDecision, Placement | None]:
        """``decide``, then place the request on the chosen pipeline: its blocks pending
        there in the index (unless ``record_pending`` is False) and its cost counted there
        until ``finish``. The placement is None when no pipeline was chosen (the decision
        says why)."""
        decision = self.decide(prompt_tokens, hashes, members, now, tried)
        pid = decision.pipeline
        if pid is None:
            return decision, None
        chosen = next(c for c in decision.candidates if c.pid == pid)
        if record_pending:
            self.index.record_pending(pid, hashes, now)
        if chosen.fetch_from is not None:  # both pipelines' links carry it until it ends
            for p in (chosen.fetch_from, pid):
                self._links_free[p] = max(self._links_free.get(p, now), now + chosen.fetch_s)
        placement = Placement(pid, chosen.prefill_cost_s, prompt_tokens - decision.cached_tokens,
                              decision.cached_tokens,
                              chosen.queued_cost_s + chosen.prefill_cost_s,
                              decision.reason.value, fetch_from=chosen.fetch_from,
                              fetch_blocks=chosen.fetch_blocks)  # fmt: skip
        self._count(placement, 1)
        return decision, placement

    def finish(self, placement: Placement) -> None:
        """The placed request ended (answered, failed or aborted): its cost leaves its
        pipeline's queue. Idempotent."""
        if not placement.finished:
            placement.finished = True
            self._count(placement, -1)

    def observe(self, placement: Placement, seconds: float, now: float) -> None:
        """The placed request was answered ``seconds`` after it was forwarded: a calibration
        sample for its pipeline."""
        self.calibration.observe(placement.pid, placement.predicted_cost_s, seconds, now)

    def observe_fetch(self, blocks: int, seconds: float) -> None:
        """A fetch of ``blocks`` blocks that a placement asked for took ``seconds`` on the
        links (from its start, after the fetches ahead of it, to the blocks being usable):
        refit the transfer model."""
        if self.transfer is None:
            return
        model = self.transfer.observe(blocks, seconds)
        if self.scorer is not None:
            self.scorer.transfer = model

    def forget(self, pid: PipelineId) -> None:
        """``pid`` left: its index entries and calibration go; its unfinished placements stay
        counted until they finish."""
        if pid in self.index:
            self.index.drop_pipeline(pid)
        self.calibration.forget(pid)
        self._links_free.pop(pid, None)

    def placed_requests(self, pid: PipelineId) -> int:
        """Unfinished requests placed on ``pid``."""
        return self._placed.get(pid, _NO_PLACEMENTS)[2]

    def placed_by_pipeline(self) -> dict[PipelineId, int]:
        """Unfinished placed requests per pipeline (pipelines with none are absent)."""
        return {pid: placed[2] for pid, placed in self._placed.items()}

    # -- internals -------------------------------------------------------------------------
    def _scoring(self) -> Scorer:
        if self.scorer is None:
            raise UnavailableError("no pipeline has connected to the router yet; retry later")
        return self.scorer

    def _count(self, placement: Placement, sign: int) -> None:
        cost, tokens, count = self._placed.get(placement.pid, _NO_PLACEMENTS)
        count += sign
        if count:
            cost = max(0.0, cost + sign * placement.cost_s)  # float sums drift: never below 0
            tokens += sign * placement.computed_tokens
            self._placed[placement.pid] = (cost, tokens, count)
        else:
            self._placed.pop(placement.pid, None)

    def _inputs(
        self,
        hashes: Sequence[BlockHash],
        members: Iterable[PipelineMember],
        now: float,
        tried: Sequence[PipelineId],
    ) -> tuple[
        dict[PipelineId, int],
        list[PipelineView],
        dict[PipelineId, int] | None,
        dict[PipelineId, float] | None,
    ]:
        """The index's matches, a view per member not in ``tried`` (queued work is this
        core's own placements there plus what the pipeline reports beyond them, at the
        cost model's per-token rate) and, under FETCH, the confirmed matches (what a
        pipeline could serve a fetch from) and how long each pipeline's links stay busy with
        the fetches this core placed."""
        index, per_token_s = self.index, self.cost_model.per_token_s
        views = []
        for m in members:
            if m.pid in tried:
                continue
            cost, tokens, count = self._placed.get(m.pid, _NO_PLACEMENTS)
            others = max(0, m.reported_tokens - tokens)
            indexed = m.pid in index
            views.append(PipelineView(m.pid, m.ready and indexed, cost + others * per_token_s,
                                      m.max_model_len, m.capacity_blocks, count,
                                      m.snapshot_interval_blocks,
                                      index.num_blocks(m.pid) if indexed else 0,
                                      self.calibration.ratio(m.pid, now)))  # fmt: skip
        fetchable = busy = None
        if self.policy is RoutingPolicy.FETCH:
            fetchable = index.match(hashes, now, pending=False)
            busy = {p: t - now for p, t in self._links_free.items() if t > now}
        return index.match(hashes, now), views, fetchable, busy
