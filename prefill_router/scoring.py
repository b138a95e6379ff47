"""Routing policies: choose a pipeline for a prompt from the index's matches and their loads."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from operator import attrgetter

from prefill_node.core.cost_model import ChunkCostModel
from prefill_node.core.request import blocks_needed, max_reusable_blocks, reused_tokens
from prefill_node.errors import InvalidRequestError
from prefill_router.index import PipelineId
from prefill_router.transfer import TransferModel

# PREFIX's cache-affinity slack. Measured with bench/router.py (8 tenants, Zipf, 2 pipelines
# whose caches hold the tenants' prefixes only together): 0.1 kept 0.89x of prefix-only's
# cached tokens, 0.3 kept 0.94x; the queue term still moves tenants off an overloaded pipeline.
DEFAULT_AFFINITY_SLACK = 0.3


class InvalidRoutingInputError(InvalidRequestError):
    """A routing input is malformed: a non-positive length, a negative load, a bad match."""


class RoutingPolicy(Enum):
    """How ``Scorer`` picks among eligible pipelines."""

    PREFIX = "prefix"  # least queued + uncached-suffix seconds (default)
    ROUND_ROBIN = "round_robin"  # rotate over eligible pipelines
    LEAST_LOADED = "least_loaded"  # least queued seconds
    PREFIX_ONLY = "prefix_only"  # longest cached prefix, ties by load
    # PREFIX, where a pipeline may also fetch the prefix from another pipeline that holds it
    # (needs a ``TransferModel``: the router's prior, refitted from the fetches it sees)
    FETCH = "fetch"


class RouteReason(Enum):
    """Why a ``RoutingDecision`` chose its pipeline, or chose none."""

    PREFIX_HIT = "prefix_hit"  # chosen holds the longest prefix, and some candidate holds less
    FETCH = "fetch"  # chosen fetches (part of) the prefix from another pipeline first
    LOAD = "load"  # no prefix difference among candidates, or load outweighed it
    ONLY_CANDIDATE = "only_candidate"  # a single eligible pipeline
    ROUND_ROBIN = "round_robin"  # its turn in the rotation
    NO_CANDIDATE = "no_candidate"  # None: no candidate that could take the prompt is ready
    NEVER_FITS = "never_fits"  # None: the prompt is too big for every candidate, ready or not


class Exclusion(Enum):
    """Why a candidate could not be chosen."""

    NOT_READY = "not_ready"
    TOO_LONG = "too_long"  # prompt_tokens > max_model_len
    TOO_MANY_BLOCKS = "too_many_blocks"  # needs more blocks than the smallest stage holds


@dataclass(frozen=True, slots=True)
class PipelineView:
    """A candidate pipeline as the router last saw it (validated on construction).

    ``queued_cost_s``: cost-model seconds of work queued or in flight there;
    ``time_ratio``: how much longer than the cost model its answers take
    (``PredictionCalibration``; 1: as predicted); ``capacity_blocks``: total blocks of its
    smallest stage (a prompt needing more never fits); ``snapshot_interval_blocks``: set for
    models with recurrent-state layers, whose cached prefix is reusable only up to a
    multiple of it (``StageConfig``'s field).
    """

    pid: PipelineId
    ready: bool
    queued_cost_s: float
    max_model_len: int
    capacity_blocks: int
    inflight_requests: int = 0
    snapshot_interval_blocks: int | None = None
    resident_blocks: int = 0  # prefix blocks it holds (the index's count): a tie-breaker
    time_ratio: float = 1.0

    def __post_init__(self) -> None:
        snap = self.snapshot_interval_blocks
        if not (
            self.pid
            and math.isfinite(self.queued_cost_s)
            and self.queued_cost_s >= 0
            and math.isfinite(self.time_ratio)
            and self.time_ratio > 0
            and self.max_model_len >= 1
            and self.capacity_blocks >= 1
            and self.inflight_requests >= 0
            and self.resident_blocks >= 0
            and (snap is None or snap >= 1)
        ):
            raise InvalidRoutingInputError(f"invalid pipeline view: {self}")


@dataclass(frozen=True, slots=True)
class CandidateScore:
    """One candidate's numbers. ``queued_cost_s`` and ``prefill_cost_s`` are cost-model
    seconds; ``queued_s``, ``prefill_s`` and ``score`` are the same scaled by the pipeline's
    ``time_ratio``: predicted seconds on that pipeline. ``score`` (seconds until this
    prompt's prefill would finish there: queued work plus the uncached suffix) is what PREFIX
    minimises, and what the router's flow control checks deadlines against; every policy
    reports it. ``excluded`` says why the candidate could not be chosen (None: eligible).

    FETCH only: ``fetch_from`` names the pipeline this candidate would copy ``fetch_blocks``
    blocks of the prefix from (in ``fetch_s`` seconds, the transfer model's), after the
    ``cached_tokens`` it would then hold; None when it computes what it does not hold. The
    fetch runs while the queued work does (admission runs ahead of execution), so the
    suffix starts after whichever ends last."""

    pid: PipelineId
    cached_tokens: int
    queued_cost_s: float
    prefill_cost_s: float
    inflight_requests: int
    excluded: Exclusion | None
    resident_blocks: int = 0
    time_ratio: float = 1.0
    fetch_from: PipelineId | None = None
    fetch_blocks: int = 0
    fetch_s: float = 0.0

    @property
    def score(self) -> float:
        if self.fetch_s > self.queued_s:  # the suffix waits for the fetch, not the queue
            return self.fetch_s + self.prefill_s
        return self.time_ratio * (self.queued_cost_s + self.prefill_cost_s)

    @property
    def queued_s(self) -> float:
        return self.time_ratio * self.queued_cost_s

    @property
    def prefill_s(self) -> float:
        return self.time_ratio * self.prefill_cost_s

    @property
    def eligible(self) -> bool:
        return self.excluded is None


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    """The chosen pipeline (None: see ``reason``), the cached tokens predicted there (what
    the node will report: 0 when none; with a fetch, after it), and every candidate's
    numbers in pid order."""

    pipeline: PipelineId | None
    reason: RouteReason
    policy: RoutingPolicy
    prompt_tokens: int
    cached_tokens: int
    candidates: tuple[CandidateScore, ...]

    @property
    def routed(self) -> bool:
        return self.pipeline is not None

    @property
    def chosen(self) -> CandidateScore | None:
        return next((c for c in self.candidates if c.pid == self.pipeline), None)


def predicted_cached_tokens(
    prompt_tokens: int,
    block_size: int,
    matched_blocks: int,
    snapshot_interval_blocks: int | None = None,
) -> int:
    """Tokens the node will take from its cache, given ``matched_blocks`` leading blocks
    resident on every stage. The node's rule (``prefill_node.core.request``): every full
    block (at most the prompt minus its last token on stages with recurrent state, cut down
    to a snapshot boundary), and the last token always recomputed."""
    blocks = usable_blocks(prompt_tokens, block_size, matched_blocks, snapshot_interval_blocks)
    return reused_tokens(prompt_tokens, block_size, blocks)


def usable_blocks(
    prompt_tokens: int,
    block_size: int,
    matched_blocks: int,
    snapshot_interval_blocks: int | None = None,
) -> int:
    """The leading blocks of ``matched_blocks`` the node resumes from
    (``predicted_cached_tokens``' rule)."""
    recurrent = snapshot_interval_blocks is not None
    limit = max_reusable_blocks(prompt_tokens, block_size, needs_snapshot=recurrent)
    blocks = min(matched_blocks, limit)
    if snapshot_interval_blocks is not None:
        blocks -= blocks % snapshot_interval_blocks
    return blocks


class Scorer:
    """Chooses a pipeline per prompt under one ``RoutingPolicy`` (sans-IO).

    Eligible candidates are ready and fit (``prompt_tokens <= max_model_len`` and the
    prompt's blocks, partial last one included, within ``capacity_blocks``). Ties always
    go to lower load (queued seconds, then in-flight requests, then resident prefix blocks),
    then to the smaller pid.
    ROUND_ROBIN's rotation (by pid order, resuming after the last pipeline it chose) is
    the only state. Every prediction is scaled by its pipeline's ``time_ratio`` (the
    view's), so routing and the flow control's deadline check predict with one calibration.
    One cost model and block size serve every pipeline (homogeneous pipelines; the block
    size must be the one the prompt was hashed with).

    PREFIX prefers cache affinity within ``affinity_slack`` of the best score: the queue
    estimate is coarse (queued work is charged as if serial, while a pipeline overlaps its
    requests), so among candidates scoring at most ``(1 + affinity_slack) * best`` the one
    with the longest cached prefix wins. A burst sharing a new prefix (pending entries) thus
    stays on one pipeline until its queue is clearly longer than another's, instead of
    computing the prefix on every pipeline. 0 = pure score (ties to lower load).

    FETCH scores each candidate twice, computing what it lacks and fetching the prefix from
    the ready pipeline holding the most of it (its confirmed blocks, ``fetchable``: pending
    entries are blocks not computed yet) with ``transfer``, keeps the lower score of the two,
    and then picks as PREFIX does. So a request goes (a) to a pipeline holding its prefix,
    (b) to one without it that computes it, or (c) to one without it that fetches it,
    whichever the cost model, the queues and the transfer model say finishes first.
    """

    def __init__(
        self,
        cost_model: ChunkCostModel,
        block_size: int,
        policy: RoutingPolicy = RoutingPolicy.PREFIX,
        affinity_slack: float = DEFAULT_AFFINITY_SLACK,
        transfer: TransferModel | None = None,
    ) -> None:
        if block_size < 1:
            raise InvalidRoutingInputError(f"block_size must be >= 1, got {block_size}")
        if policy is RoutingPolicy.FETCH and transfer is None:
            raise InvalidRoutingInputError("the fetch policy needs a transfer model")
        self.transfer = transfer  # FETCH's; the router core refits it as fetches complete
        if not (math.isfinite(affinity_slack) and affinity_slack >= 0):
            raise InvalidRoutingInputError(f"affinity_slack must be >= 0, got {affinity_slack}")
        self.affinity_slack = affinity_slack
        self.cost_model = cost_model
        self.block_size = block_size
        self.policy = policy
        self._last_round_robin: PipelineId | None = None

    def choose(
        self,
        prompt_tokens: int,
        matched_blocks: Mapping[PipelineId, int],
        candidates: Sequence[PipelineView],
        fetchable: Mapping[PipelineId, int] | None = None,
        links_busy_s: Mapping[PipelineId, float] | None = None,
    ) -> RoutingDecision:
        """Pick a pipeline for a prompt of ``prompt_tokens`` tokens, given each pipeline's
        leading blocks held (``GlobalPrefixIndex.match``; a missing pid counts 0) and, for
        FETCH, those it could serve a fetch from (confirmed only) and how long each
        pipeline's links stay busy with fetches already placed (a missing pid: 0)."""
        scores = self.assess(prompt_tokens, matched_blocks, candidates, fetchable, links_busy_s)
        eligible = [s for s in scores if s.excluded is None]
        if not eligible:
            fits = any(s.excluded is Exclusion.NOT_READY for s in scores)
            reason = RouteReason.NO_CANDIDATE if fits or not scores else RouteReason.NEVER_FITS
            return RoutingDecision(None, reason, self.policy, prompt_tokens, 0, scores)
        chosen, reason = self._pick(eligible)
        return RoutingDecision(
            chosen.pid, reason, self.policy, prompt_tokens, chosen.cached_tokens, scores
        )

    def assess(
        self,
        prompt_tokens: int,
        matched_blocks: Mapping[PipelineId, int],
        candidates: Sequence[PipelineView],
        fetchable: Mapping[PipelineId, int] | None = None,
        links_busy_s: Mapping[PipelineId, float] | None = None,
    ) -> tuple[CandidateScore, ...]:
        """Every candidate's score for the prompt, in pid order, choosing nothing (no
        policy state moves): what ``choose`` picks from, and what a router's flow control
        predicts the prompt's time to its result from."""
        if prompt_tokens < 1:
            raise InvalidRoutingInputError(f"prompt_tokens must be >= 1, got {prompt_tokens}")
        full_blocks = prompt_tokens // self.block_size
        if matched_blocks and not (
            min(matched_blocks.values()) >= 0 and max(matched_blocks.values()) <= full_blocks
        ):
            pid, blocks = next((p, b) for p, b in matched_blocks.items()
                               if not 0 <= b <= full_blocks)  # fmt: skip
            raise InvalidRoutingInputError(
                f"{pid!r}: {blocks} matched blocks, a {prompt_tokens}-token prompt has "
                f"{full_blocks} full blocks"
            )
        views = sorted(candidates, key=_PID)
        if len({v.pid for v in views}) != len(views):
            raise InvalidRoutingInputError("candidate pipelines must have distinct pids")
        needed = blocks_needed(prompt_tokens, self.block_size)  # the same for every view
        get = matched_blocks.get
        scores = [self._score(prompt_tokens, needed, get(v.pid, 0), v) for v in views]
        if self.policy is RoutingPolicy.FETCH and fetchable and self.transfer is not None:
            busy = links_busy_s or {}
            scores = self._fetch_options(
                prompt_tokens, scores, views, fetchable, busy, self.transfer
            )
        return tuple(scores)

    def _fetch_options(
        self,
        prompt_tokens: int,
        scores: list[CandidateScore],
        views: list[PipelineView],
        fetchable: Mapping[PipelineId, int],
        busy: Mapping[PipelineId, float],
        transfer: TransferModel,
    ) -> list[CandidateScore]:
        """Each candidate's score with the prefix fetched from the ready pipeline holding
        the most of it (not itself; ties to the one whose links free first), where that
        scores better than computing. The fetch starts when both pipelines' links are free
        of the fetches already placed."""
        full = prompt_tokens // self.block_size
        sources = sorted(
            ((min(fetchable.get(v.pid, 0), full), v.pid) for v in views if v.ready),
            key=lambda s: (-s[0], busy.get(s[1], 0.0), s[1]),
        )[:2]
        if not sources or sources[0][0] == 0:
            return scores
        out = []
        for score, view in zip(scores, views, strict=True):
            blocks, source = next((b, p) for b, p in (*sources, (0, "")) if p != view.pid)
            snap = view.snapshot_interval_blocks
            after = usable_blocks(prompt_tokens, self.block_size, blocks, snap)
            have = -(-score.cached_tokens // self.block_size)  # the blocks it resumes from
            if after <= have:
                out.append(score)
                continue
            cached = reused_tokens(prompt_tokens, self.block_size, after)
            fetched = replace(
                score,
                cached_tokens=cached,
                prefill_cost_s=self.cost_model.chunk_cost(cached, prompt_tokens - cached),
                fetch_from=source,
                fetch_blocks=after - have,
                fetch_s=max(busy.get(source, 0.0), busy.get(view.pid, 0.0))
                + transfer.fetch_s(after - have),
            )
            out.append(fetched if fetched.score < score.score else score)
        return out

    def _score(
        self, prompt_tokens: int, needed: int, matched: int, view: PipelineView
    ) -> CandidateScore:
        """``needed``: the prompt's blocks (``blocks_needed``)."""
        cached = predicted_cached_tokens(
            prompt_tokens, self.block_size, matched, view.snapshot_interval_blocks
        )
        excluded = None  # a misfit first: it never goes away, readiness may
        if prompt_tokens > view.max_model_len:
            excluded = Exclusion.TOO_LONG
        elif needed > view.capacity_blocks:
            excluded = Exclusion.TOO_MANY_BLOCKS
        elif not view.ready:
            excluded = Exclusion.NOT_READY
        return CandidateScore(
            view.pid,
            cached,
            view.queued_cost_s,
            self.cost_model.chunk_cost(cached, prompt_tokens - cached),
            view.inflight_requests,
            excluded,
            view.resident_blocks,
            view.time_ratio,
        )

    def _pick(self, eligible: list[CandidateScore]) -> tuple[CandidateScore, RouteReason]:
        """``eligible`` is non-empty and in pid order."""
        policy = self.policy
        if policy is RoutingPolicy.ROUND_ROBIN:
            last = self._last_round_robin
            after = [s for s in eligible if last is None or s.pid > last]
            chosen = (after or eligible)[0]
            self._last_round_robin = chosen.pid
            reason = RouteReason.ONLY_CANDIDATE if len(eligible) == 1 else RouteReason.ROUND_ROBIN
            return chosen, reason
        if len(eligible) == 1:  # every other policy's minimum over one candidate
            return eligible[0], RouteReason.ONLY_CANDIDATE
        if policy in _PREFIX_LIKE and self.affinity_slack > 0:
            limit = min(s.score for s in eligible) * (1 + self.affinity_slack)
            near = [s for s in eligible if s.score <= limit]
            # a holder before a pipeline that would fetch the same prefix: copies fill caches
            chosen = min(
                near, key=lambda s: (-s.cached_tokens, s.fetch_from is not None, s.score, *_load(s))
            )
        elif policy in _PREFIX_LIKE:
            chosen = min(eligible, key=lambda s: (s.score, *_load(s)))
        elif policy is RoutingPolicy.PREFIX_ONLY:
            chosen = min(eligible, key=lambda s: (-s.cached_tokens, *_load(s)))
        else:
            chosen = min(eligible, key=_load)
        if chosen.fetch_from is not None:
            return chosen, RouteReason.FETCH
        most = max(s.cached_tokens for s in eligible)
        least = min(s.cached_tokens for s in eligible)
        if policy is not RoutingPolicy.LEAST_LOADED and chosen.cached_tokens == most > least:
            return chosen, RouteReason.PREFIX_HIT
        return chosen, RouteReason.LOAD


_PID = attrgetter("pid")
_PREFIX_LIKE = (RoutingPolicy.PREFIX, RoutingPolicy.FETCH)


def _load(s: CandidateScore) -> tuple[float, int, int, str]:
    """Tie order: less queued work (predicted seconds), fewer requests in flight, fewer
    resident prefix blocks (more room: idle pipelines share new prefixes out instead of one
    filling up), pid."""
    return (s.queued_s, s.inflight_requests, s.resident_blocks, s.pid)
