"""RouterCore: the sans-IO routing core the router's server and the cluster simulator share."""

from __future__ import annotations

import pytest

from prefill_node.core.cost_model import ChunkCostModel
from prefill_node.core.hashing import ExtraKeys, hash_block_tokens
from prefill_node.core.kv_events import AllBlocksCleared, BlockStored
from prefill_node.errors import UnavailableError
from prefill_router.router_core import PipelineMember, RouterCore
from prefill_router.scoring import RouteReason, RoutingPolicy

BLOCK = 16
COST = ChunkCostModel(per_token_s=1e-3, per_token_context_s=0.0)
PROMPT = list(range(100, 100 + 4 * BLOCK))  # 4 full blocks


def core_with(*pids: str, policy: RoutingPolicy = RoutingPolicy.PREFIX) -> RouterCore:
    core = RouterCore(COST, policy, pending_ttl_s=10.0)
    core.start_scoring("m", BLOCK)
    for pid in pids:
        core.index.add_pipeline(pid)
        core.index.apply(pid, 1, [AllBlocksCleared()])
    return core


def store(core: RouterCore, pid: str, tokens: list[int], salt: str | None = None) -> None:
    hashes = core.hashes(tokens, salt)
    seq = 2 + core.index.num_blocks(pid)
    core.index.apply(pid, seq, [BlockStored(tuple(hashes), None, tuple(tokens), BLOCK)])


def members(*pids: str, **kw) -> list[PipelineMember]:
    return [PipelineMember(pid, True, 4096, **kw) for pid in pids]


def test_hashes_are_the_nodes_per_salt_and_need_an_identity() -> None:
    fresh = RouterCore(COST)
    with pytest.raises(UnavailableError, match="no pipeline has connected"):
        fresh.hashes(PROMPT, None)
    core = core_with()
    assert core.hashes(PROMPT, "t1") == hash_block_tokens(PROMPT, BLOCK, ExtraKeys("m", "t1"))
    assert core.hashes(PROMPT, "t1") != core.hashes(PROMPT, "t2")
    assert len(core.hashes(PROMPT + [1, 2, 3], None)) == 4  # full blocks only


def test_route_places_on_the_prefix_holder_and_counts_it_until_finish() -> None:
    core = core_with("a", "b")
    store(core, "b", PROMPT[: 3 * BLOCK])
    hashes = core.hashes(PROMPT, None)
    decision, placement = core.route(len(PROMPT), hashes, members("a", "b"), now=0.0)
    assert placement is not None and placement.pid == "b" and decision.pipeline == "b"
    assert decision.reason is RouteReason.PREFIX_HIT
    assert (placement.cached_tokens, placement.computed_tokens) == (3 * BLOCK, BLOCK)
    assert placement.cost_s == pytest.approx(BLOCK * 1e-3)
    assert core.placed_requests("b") == 1 and core.placed_by_pipeline() == {"b": 1}
    # the prompt's 4th block is pending on b now: a second prompt sees all 4 there
    assert core.index.match(hashes, 1.0) == {"a": 0, "b": 4}
    # and b's queue holds the first one's cost
    scores = {s.pid: s for s in core.assess(len(PROMPT), hashes, members("a", "b"), 1.0)}
    assert scores["b"].queued_cost_s == pytest.approx(BLOCK * 1e-3)
    assert scores["b"].inflight_requests == 1 and scores["a"].queued_cost_s == 0.0
    core.finish(placement)
    core.finish(placement)  # idempotent
    assert core.placed_requests("b") == 0 and core.placed_by_pipeline() == {}
    scores = {s.pid: s for s in core.assess(len(PROMPT), hashes, members("a", "b"), 1.0)}
    assert scores["b"].queued_cost_s == 0.0


def test_decide_records_nothing_and_route_can_skip_pending() -> None:
    core = core_with("a")
    hashes = core.hashes(PROMPT, None)
    decision = core.decide(len(PROMPT), hashes, members("a"), 0.0)
    assert decision.pipeline == "a" and core.placed_requests("a") == 0
    assert core.index.num_pending() == 0
    _, placement = core.route(len(PROMPT), hashes, members("a"), 0.0, record_pending=False)
    assert placement is not None and core.index.num_pending() == 0
    assert core.placed_requests("a") == 1


def test_tried_unready_and_too_long_prompts_get_no_placement() -> None:
    core = core_with("a", "b")
    hashes = core.hashes(PROMPT, None)
    _, placement = core.route(len(PROMPT), hashes, members("a", "b"), 0.0, tried=("a",))
    assert placement is not None and placement.pid == "b"
    decision, none = core.route(len(PROMPT), hashes, members("a", "b"), 0.0, tried=("a", "b"))
    assert none is None and decision.reason is RouteReason.NO_CANDIDATE
    unready = [PipelineMember("a", False, 4096), PipelineMember("b", False, 4096)]
    decision, none = core.route(len(PROMPT), hashes, unready, 0.0)
    assert none is None and decision.reason is RouteReason.NO_CANDIDATE
    short = [PipelineMember("a", True, BLOCK), PipelineMember("b", True, BLOCK)]
    decision, none = core.route(len(PROMPT), hashes, short, 0.0)
    assert none is None and decision.reason is RouteReason.NEVER_FITS
    assert core.placed_by_pipeline() == {"b": 1}  # only the one placement counts


def test_reported_load_beyond_own_placements_counts_as_queued_work() -> None:
    core = core_with("a", "b")
    hashes = core.hashes(PROMPT, None)
    _, placement = core.route(len(PROMPT), hashes, members("a", "b"), 0.0)
    assert placement is not None and placement.pid == "a"  # a tie goes by pid
    # a reports 64 tokens in flight (ours) + 1,000 from elsewhere; b reports its own 2,000
    views = [PipelineMember("a", True, 4096, reported_tokens=1064),
             PipelineMember("b", True, 4096, reported_tokens=2000)]  # fmt: skip
    scores = {s.pid: s for s in core.assess(len(PROMPT), hashes, views, 0.0)}
    assert scores["a"].queued_cost_s == pytest.approx(placement.cost_s + 1000 * 1e-3)
    assert scores["b"].queued_cost_s == pytest.approx(2000 * 1e-3)
    assert core.decide(len(PROMPT), hashes, views, 0.0).pipeline == "a"


def test_observe_calibrates_and_forget_drops_index_and_ratio_not_placements() -> None:
    core = core_with("a")
    hashes = core.hashes(PROMPT, None)
    _, placement = core.route(len(PROMPT), hashes, members("a"), 0.0)
    assert placement is not None
    core.observe(placement, placement.predicted_cost_s * 3, 1.0)
    ratio = core.calibration.ratio("a", 1.0)
    assert ratio > 1.0
    score = core.assess(len(PROMPT), hashes, members("a"), 1.0)[0]
    assert score.time_ratio == ratio and score.score == pytest.approx(
        ratio * (score.queued_cost_s + score.prefill_cost_s)
    )
    core.forget("a")
    assert "a" not in core.index and core.calibration.ratios(1.0) == {}  # back to the cluster's
    assert core.placed_requests("a") == 1  # still running there until it finishes
    decision, none = core.route(len(PROMPT), hashes, members("a"), 1.0)
    assert none is None and decision.reason is RouteReason.NO_CANDIDATE  # not indexed: not ready
    core.finish(placement)
    assert core.placed_by_pipeline() == {}
