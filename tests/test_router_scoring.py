"""Scorer: each policy's choice and reason, exclusions, and cached tokens equal to the node's."""

from __future__ import annotations

import dataclasses

import pytest

from prefill_node.core.admission_messages import Admitted
from prefill_node.core.coordinator import AdmissionCoordinator, CoordinatorConfig
from prefill_node.core.cost_model import ChunkCostModel
from prefill_node.core.hashing import ExtraKeys, hash_block_tokens
from prefill_node.core.kv_event_aggregator import PipelineKVEventAggregator, StageEvents
from prefill_node.core.kv_events import AllBlocksCleared
from prefill_node.core.request import RequestSpec
from prefill_node.core.round_driver import run_round
from prefill_node.core.stage_admission import StageAdmission, StageConfig
from prefill_node.errors import InvalidRequestError
from prefill_router.index import GlobalPrefixIndex
from prefill_router.scoring import (
    CandidateScore,
    Exclusion,
    InvalidRoutingInputError,
    PipelineView,
    RouteReason,
    RoutingPolicy,
    Scorer,
    predicted_cached_tokens,
)
from prefill_router.transfer import TransferModel

BS = 16
LINEAR = ChunkCostModel(per_token_s=1.0, per_token_context_s=0.0)  # 1 "second" per token


def view(pid, queued=0.0, *, ready=True, max_len=4096, capacity=256, inflight=0, snap=None):
    return PipelineView(pid, ready, queued, max_len, capacity, inflight, snap)


def test_prefix_wins_while_the_saved_compute_outweighs_the_queue():
    scorer = Scorer(LINEAR, BS)
    d = scorer.choose(160, {"a": 8, "b": 0}, [view("b"), view("a", queued=100.0)])
    assert (d.pipeline, d.reason, d.cached_tokens) == ("a", RouteReason.PREFIX_HIT, 128)
    assert d.candidates == (
        CandidateScore("a", 128, 100.0, 32.0, 0, None),
        CandidateScore("b", 0, 0.0, 160.0, 0, None),
    )
    assert [c.score for c in d.candidates] == [132.0, 160.0]


def test_load_wins_when_the_queue_is_long_enough():
    scorer = Scorer(LINEAR, BS, affinity_slack=0.0)
    d = scorer.choose(160, {"a": 8}, [view("a", queued=129.0), view("b")])
    assert (d.pipeline, d.reason, d.cached_tokens) == ("b", RouteReason.LOAD, 0)


def test_score_ties_go_to_lower_load_then_to_the_smaller_pid():
    scorer = Scorer(LINEAR, BS, affinity_slack=0.0)
    d = scorer.choose(160, {"a": 8}, [view("a", queued=128.0), view("b")])  # 160 = 160
    assert (d.pipeline, d.reason) == ("b", RouteReason.LOAD)
    d = scorer.choose(
        160, {}, [view("b", inflight=1), view("c", inflight=3), view("a", 0, inflight=2)]
    )
    assert d.pipeline == "b"
    d = scorer.choose(160, {}, [view("c"), view("b"), view("a")])
    assert (d.pipeline, d.reason) == ("a", RouteReason.LOAD)


def test_within_the_affinity_slack_the_longer_prefix_wins_beyond_it_the_score():
    # a: 129 queued + 32 = 161; b: 160. Pure score picks b; the slack keeps the cache hit.
    views = [view("a", queued=129.0), view("b")]
    assert Scorer(LINEAR, BS).choose(160, {"a": 8}, views).pipeline == "a"
    assert Scorer(LINEAR, BS, affinity_slack=0.0).choose(160, {"a": 8}, views).pipeline == "b"
    # 209 > 1.3 * 160 (the default slack): the queue is clearly longer, load wins
    far = [view("a", queued=177.0), view("b")]
    assert Scorer(LINEAR, BS).choose(160, {"a": 8}, far).pipeline == "b"
    assert Scorer(LINEAR, BS, affinity_slack=0.1).choose(160, {"a": 8}, views).pipeline == "a"
    near = [view("a", queued=145.0), view("b")]  # 177: within 0.3, beyond 0.1
    assert Scorer(LINEAR, BS, affinity_slack=0.1).choose(160, {"a": 8}, near).pipeline == "b"
    with pytest.raises(InvalidRoutingInputError):
        Scorer(LINEAR, BS, affinity_slack=-0.1)


def test_the_suffix_cost_counts_attention_over_the_cached_prefix():
    model = ChunkCostModel(per_token_s=1.0, per_token_context_s=0.01)
    d = Scorer(model, BS).choose(160, {"a": 8}, [view("a"), view("b")])
    a, b = d.candidates
    assert a.prefill_cost_s == pytest.approx(32 * (1.0 + 0.01 * (128 + 16)))
    assert b.prefill_cost_s == pytest.approx(160 * (1.0 + 0.01 * 80))


def test_a_burst_after_record_pending_sticks_to_one_pipeline():
    """As the router accounts them: every routed request adds its predicted prefill
    seconds to its pipeline's queue. Without pending entries the burst spreads; with them
    it stays on one (each follower costs a queue plus one block, within the slack)."""
    extra = ExtraKeys("m")
    tokens = list(range(1000, 2024))  # 64 full blocks
    hashes = hash_block_tokens(tokens, BS, extra)
    for with_pending in (True, False):
        index, scorer = GlobalPrefixIndex(), Scorer(LINEAR, BS)
        inflight = {"a": 0, "b": 0, "c": 0}
        queued = dict.fromkeys(inflight, 0.0)
        for pid in inflight:
            index.add_pipeline(pid)
            index.apply(pid, 1, [AllBlocksCleared()])
        chosen = []
        for i in range(3):
            views = [view(pid, queued[pid], inflight=n) for pid, n in inflight.items()]
            d = scorer.choose(len(tokens), index.match(hashes, now=0.1 * i), views)
            chosen.append((d.pipeline, d.reason, d.cached_tokens))
            inflight[d.pipeline] += 1
            queued[d.pipeline] += next(
                c.prefill_cost_s for c in d.candidates if c.pid == d.pipeline
            )
            if with_pending:
                index.record_pending(d.pipeline, hashes, now=0.1 * i)
        if with_pending:
            hit = ("a", RouteReason.PREFIX_HIT, 1023)  # all 64 blocks, last token recomputed
            assert chosen == [("a", RouteReason.LOAD, 0), hit, hit]
        else:
            assert [c[0] for c in chosen] == ["a", "b", "c"]


def test_different_cache_salts_never_match_each_others_blocks():
    tokens = list(range(64))
    tenant1 = hash_block_tokens(tokens, BS, ExtraKeys("m", cache_salt="t1"))
    tenant2 = hash_block_tokens(tokens, BS, ExtraKeys("m", cache_salt="t2"))
    index = GlobalPrefixIndex()
    for pid in ("a", "b"):
        index.add_pipeline(pid)
        index.apply(pid, 1, [AllBlocksCleared()])
    index.record_pending("a", tenant1, now=0.0)
    assert index.match(tenant1, now=0.0) == {"a": 4, "b": 0}
    assert index.match(tenant2, now=0.0) == {"a": 0, "b": 0}
    scorer = Scorer(LINEAR, BS)
    d = scorer.choose(64, index.match(tenant2, 0.0), [view("a", 5.0), view("b", 1.0)])
    assert (d.pipeline, d.reason, d.cached_tokens) == ("b", RouteReason.LOAD, 0)


def test_not_ready_and_misfit_candidates_are_excluded():
    scorer = Scorer(LINEAR, BS)
    views = [
        view("a", ready=False),
        view("b", max_len=100),
        view("c", capacity=6),  # 101 tokens need 7 blocks
        view("d", queued=1e6),
    ]
    d = scorer.choose(101, {"a": 6, "b": 6, "c": 6}, views)
    assert (d.pipeline, d.reason, d.cached_tokens) == ("d", RouteReason.ONLY_CANDIDATE, 0)
    assert [c.excluded for c in d.candidates] == [
        Exclusion.NOT_READY,
        Exclusion.TOO_LONG,
        Exclusion.TOO_MANY_BLOCKS,
        None,
    ]
    assert scorer.choose(96, {}, [view("c", capacity=6)]).pipeline == "c"  # exactly fits


def test_no_choice_says_whether_waiting_can_help():
    scorer = Scorer(LINEAR, BS)
    d = scorer.choose(101, {}, [view("a", ready=False), view("b", max_len=100)])
    assert (d.pipeline, d.reason, d.routed) == (None, RouteReason.NO_CANDIDATE, False)
    d = scorer.choose(101, {}, [view("a", ready=False, max_len=100), view("b", capacity=2)])
    assert (d.pipeline, d.reason, d.cached_tokens) == (None, RouteReason.NEVER_FITS, 0)
    assert scorer.choose(101, {}, []).reason is RouteReason.NO_CANDIDATE


def test_round_robin_rotates_over_eligible_candidates_in_pid_order():
    scorer = Scorer(LINEAR, BS, RoutingPolicy.ROUND_ROBIN)
    views = [view("c"), view("a"), view("b", queued=1e6)]
    picks = [scorer.choose(32, {"a": 2}, views).pipeline for _ in range(4)]
    assert picks == ["a", "b", "c", "a"]
    views = [view("a"), view("b", ready=False), view("c")]
    d = scorer.choose(32, {}, views)
    assert (d.pipeline, d.reason) == ("c", RouteReason.ROUND_ROBIN)
    assert scorer.choose(32, {}, [view("b")]).reason is RouteReason.ONLY_CANDIDATE
    assert scorer.choose(32, {}, views).pipeline == "c"  # resumes after b


def test_least_loaded_ignores_the_cache_and_prefix_only_ignores_the_load():
    views = [view("a", queued=10.0), view("b", queued=5.0, inflight=4), view("c", queued=5.0)]
    d = Scorer(LINEAR, BS, RoutingPolicy.LEAST_LOADED).choose(160, {"a": 9}, views)
    assert (d.pipeline, d.reason, d.cached_tokens) == ("c", RouteReason.LOAD, 0)
    only = Scorer(LINEAR, BS, RoutingPolicy.PREFIX_ONLY)
    d = only.choose(160, {"a": 9, "b": 2}, views)
    assert (d.pipeline, d.reason, d.cached_tokens) == ("a", RouteReason.PREFIX_HIT, 144)
    d = only.choose(160, {"a": 2, "b": 2, "c": 2}, views)
    assert (d.pipeline, d.reason) == ("c", RouteReason.LOAD)  # same match: lower load


def test_bad_input_raises_a_typed_error():
    scorer = Scorer(LINEAR, BS)
    bad_calls = [
        lambda: scorer.choose(0, {}, [view("a")]),
        lambda: scorer.choose(32, {"a": -1}, [view("a")]),
        lambda: scorer.choose(32, {"a": 3}, [view("a")]),  # 32 tokens hold 2 full blocks
        lambda: scorer.choose(32, {}, [view("a"), view("a")]),
        lambda: Scorer(LINEAR, 0),
        lambda: view("a", queued=-1.0),
        lambda: view("a", queued=float("nan")),
        lambda: view("a", capacity=0),
        lambda: view("", 0.0),
        lambda: view("a", snap=0),
    ]
    for call in bad_calls:
        with pytest.raises(InvalidRoutingInputError):
            call()
    assert issubclass(InvalidRoutingInputError, InvalidRequestError)


# ---- the node's own rule ------------------------------------------------------------

B = 4
PRIMED = list(range(30))  # 7 full blocks and a partial one
PROBES = {
    "same prompt": PRIMED,
    "full blocks only": PRIMED[:28],  # its last block is recomputed
    "exactly one block": PRIMED[:4],
    "shared prefix then new": PRIMED[:20] + [99, 98, 97],
    "shorter than a block": PRIMED[:3],
    "new prompt": [7] * 13,
}


@pytest.mark.parametrize("snap", [None, 3])
@pytest.mark.parametrize("probe", PROBES)
def test_predicted_cached_tokens_equal_what_the_node_admits(probe, snap):
    """Prime a real 2-stage pipeline, feed its KV events to the index, then compare the
    router's prediction with the node's ``Admitted.cached_len`` for the same prompt."""
    extra = ExtraKeys("tiny")
    configs = [StageConfig(0, 32, B, enable_kv_events=True)]
    configs.append(StageConfig(1, 32, B, snapshot_interval_blocks=snap, enable_kv_events=True))
    stages = [StageAdmission(c) for c in configs]
    coord = AdmissionCoordinator(CoordinatorConfig(B, (32, 32)))
    run_round(coord, stages, [RequestSpec("prime", tuple(PRIMED), extra)])
    for st in stages:
        st.materialise("prime", 0, len(PRIMED))
        st.complete("prime")
    agg = PipelineKVEventAggregator(2)
    feed = agg.ingest_many(StageEvents(s, st.drain_events()) for s, st in enumerate(stages))
    index = GlobalPrefixIndex()
    index.add_pipeline("p")
    index.apply("p", 1, [AllBlocksCleared(), *feed])
    tokens = PROBES[probe]
    matched = index.match(hash_block_tokens(tokens, B, extra), now=0.0)
    d = Scorer(LINEAR, B).choose(len(tokens), matched, [view("p", snap=snap)])
    (admitted,) = run_round(coord, stages, [RequestSpec("probe", tuple(tokens), extra)])
    assert isinstance(admitted, Admitted)
    assert d.cached_tokens == admitted.cached_len
    assert d.cached_tokens == predicted_cached_tokens(len(tokens), B, matched["p"], snap)


def test_predicted_cached_tokens_exact_values():
    assert predicted_cached_tokens(32, 16, 2) == 31  # every block; the last token recomputed
    assert predicted_cached_tokens(32, 16, 1) == 16
    # with recurrent state (snapshots) never the block holding the last token
    assert predicted_cached_tokens(32, 16, 2, snapshot_interval_blocks=1) == 16
    assert predicted_cached_tokens(33, 16, 2) == 32
    assert predicted_cached_tokens(33, 16, 1) == 16
    assert predicted_cached_tokens(1, 16, 0) == 0
    assert predicted_cached_tokens(100, 4, 24, snapshot_interval_blocks=5) == 80


def test_views_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        view("a").queued_cost_s = 1.0  # type: ignore[misc]


def test_idle_pipelines_share_new_prefixes_out_by_resident_blocks():
    """Equal load, nothing cached for this prompt: the pipeline holding fewer prefix blocks
    takes it (two tenants' cold prompts land on two pipelines, not both on the first)."""
    views = [
        PipelineView("a", True, 0.0, 4096, 256, 0, None, resident_blocks=30),
        PipelineView("b", True, 0.0, 4096, 256, 0, None, resident_blocks=0),
    ]
    d = Scorer(LINEAR, BS).choose(160, {}, views)
    assert (d.pipeline, d.reason) == ("b", RouteReason.LOAD)
    with pytest.raises(InvalidRoutingInputError):
        PipelineView("c", True, 0.0, 4096, 256, 0, None, resident_blocks=-1)


# ---- FETCH: a pipeline may copy the prefix from another pipeline that holds it ------------


def test_fetch_needs_a_transfer_model():
    with pytest.raises(InvalidRoutingInputError, match="transfer model"):
        Scorer(LINEAR, BS, RoutingPolicy.FETCH)


def test_fetch_sends_the_prompt_to_an_idle_pipeline_that_copies_the_prefix():
    # a holds 8 of the 10 blocks and has 100 s queued; b is idle. Computing on b: 160;
    # staying on a: 100 + 32 = 132; copying the 8 blocks to b (2 + 8 x 0.5 = 6 s, while b's
    # empty queue waits for nothing) and computing the 32-token suffix there: 6 + 32 = 38.
    scorer = Scorer(LINEAR, BS, RoutingPolicy.FETCH, affinity_slack=0.0,
                    transfer=TransferModel(fixed_s=2.0, per_block_s=0.5))  # fmt: skip
    views = [view("a", queued=100.0), view("b")]
    d = scorer.choose(160, {"a": 8}, views, fetchable={"a": 8})
    assert (d.pipeline, d.reason, d.cached_tokens) == ("b", RouteReason.FETCH, 128)
    b = d.chosen
    assert (b.fetch_from, b.fetch_blocks, b.fetch_s, b.prefill_cost_s) == ("a", 8, 6.0, 32.0)
    assert b.score == 38.0
    # a's own option stays its cache hit (it cannot fetch from itself, nobody holds more)
    assert d.candidates[0].fetch_from is None and d.candidates[0].score == 132.0
    # the copy overlaps b's queue: with 20 s queued there the copy costs nothing extra
    d = scorer.choose(160, {"a": 8}, [view("a", queued=100.0), view("b", queued=20.0)],
                      fetchable={"a": 8})  # fmt: skip
    assert d.chosen.score == 20.0 + 32.0 and d.chosen.fetch_from == "a"


def test_fetch_copies_only_what_the_target_lacks_and_only_when_it_pays():
    fast = Scorer(LINEAR, BS, RoutingPolicy.FETCH, affinity_slack=0.0,
                  transfer=TransferModel(0.0, 1.0))  # fmt: skip
    views = [view("a", queued=100.0), view("b", queued=30.0)]
    d = fast.choose(160, {"a": 8, "b": 3}, views, fetchable={"a": 8, "b": 3})
    assert (d.pipeline, d.chosen.fetch_blocks, d.cached_tokens) == ("b", 5, 128)
    slow = Scorer(LINEAR, BS, RoutingPolicy.FETCH, affinity_slack=0.0,
                  transfer=TransferModel(0.0, 200.0))  # fmt: skip
    d = slow.choose(160, {"a": 8, "b": 3}, views, fetchable={"a": 8, "b": 3})
    assert (d.pipeline, d.reason, d.chosen.fetch_from) == ("a", RouteReason.PREFIX_HIT, None)
    assert all(c.fetch_from is None for c in d.candidates)  # computing beat copying everywhere


def test_fetch_reads_only_confirmed_blocks_of_ready_pipelines():
    scorer = Scorer(LINEAR, BS, RoutingPolicy.FETCH, affinity_slack=0.0,
                    transfer=TransferModel(0.0, 0.1))  # fmt: skip
    views = [view("a", queued=100.0), view("b")]
    # a's 8 blocks are pending only (routed there, not computed yet): nothing to copy
    d = scorer.choose(160, {"a": 8}, views, fetchable={"a": 0})
    assert all(c.fetch_from is None for c in d.candidates)
    # a holds them but is not ready (restarting): nothing to copy either
    d = scorer.choose(160, {"a": 8}, [view("a", ready=False), view("b")], fetchable={"a": 8})
    assert (d.pipeline, d.chosen.fetch_from) == ("b", None)
    # PREFIX never fetches, whatever it is told
    d = Scorer(LINEAR, BS, affinity_slack=0.0).choose(160, {"a": 8}, views, fetchable={"a": 8})
    assert (d.pipeline, d.chosen.fetch_from) == ("a", None)  # 132 against b computing: 160
