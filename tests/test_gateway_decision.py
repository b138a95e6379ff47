"""The gateway's remote-vs-local rule and decode pick (sans-IO): exact choices and reasons."""

from __future__ import annotations

import pytest

from prefill_node.engine.types import ScoreReport
from wavepp_gateway.config import DecisionRule, GatewayConfig, InvalidGatewayConfigError
from wavepp_gateway.config import PrefillMode as Mode
from wavepp_gateway.decision import DecodeView, FirstTokenModel, Reason, pick_decode
from wavepp_gateway.decision import decide as _decide

RULE = DecisionRule(
    local_max_tokens=64, max_tier_queue_s=0.1, decode_prefill_rate=1000.0, request_tokens=100
)


def decide(mode, rule, prompt, decode, report, first_token=None):
    return _decide(mode, rule, prompt, decode, report, first_token or FirstTokenModel(rule))


def tier(cached: int = 0, queued_s: float = 0.0, pipeline: str = "p0") -> ScoreReport:
    return ScoreReport(pipeline, "load", 0, cached, queued_s, 0.01, 1 if pipeline else 0)


def test_a_long_uncached_prompt_goes_to_the_tier():
    d = decide(Mode.AUTO, RULE, 500, DecodeView("d0"), tier())
    assert (d.remote, d.reason, d.label) == (True, Reason.LONG_SUFFIX, "remote")


def test_a_short_prompt_is_computed_on_decode():
    d = decide(Mode.AUTO, RULE, 64, DecodeView("d0"), tier())
    assert (d.remote, d.reason) == (False, Reason.SHORT_SUFFIX)
    assert decide(Mode.AUTO, RULE, 65, DecodeView("d0"), tier()).remote


def test_a_prefix_held_by_decode_makes_a_long_prompt_local():
    held = DecodeView("d0", cached_tokens=450)  # 50 tokens left to compute there
    d = decide(Mode.AUTO, RULE, 500, held, tier(cached=480))
    assert (d.remote, d.reason) == (False, Reason.SHORT_SUFFIX)
    assert decide(Mode.AUTO, RULE, 500, DecodeView("d0", cached_tokens=400), tier()).remote


def test_decode_prefill_budget_counts_prompts_it_is_still_computing():
    # 40 tokens on their own fit the 64-token budget; on top of 30 pending they do not
    d = decide(Mode.AUTO, RULE, 40, DecodeView("d0", prefilling_tokens=24), tier())
    assert (d.remote, d.reason) == (False, Reason.SHORT_SUFFIX)  # 24 + 40 = 64: in budget
    d = decide(Mode.AUTO, RULE, 40, DecodeView("d0", prefilling_tokens=30), tier())
    assert (d.remote, d.reason) == (True, Reason.DECODE_BUSY)
    # a tier queued no more than max_tier_queue_s counts as idle: over the budget is remote
    # even where decode is predicted faster (the budget is the idle crossover)
    fast = DecisionRule(local_max_tokens=64, max_tier_queue_s=0.1, decode_prefill_rate=1e6)
    for queued in (0.0, 0.1):
        d = decide(Mode.AUTO, fast, 500, DecodeView("d0"), tier(queued_s=queued))
        assert (d.remote, d.reason) == (True, Reason.LONG_SUFFIX) and d.local_s < d.remote_s
    assert decide(Mode.AUTO, fast, 500, DecodeView("d0"), tier(queued_s=0.11)).reason is (
        Reason.TIER_BUSY)  # fmt: skip


def test_no_tier_answer_or_no_ready_pipeline_is_local():
    assert decide(Mode.AUTO, RULE, 500, DecodeView("d0"), None).reason is Reason.TIER_UNAVAILABLE
    none_ready = tier(pipeline="")
    d = decide(Mode.AUTO, RULE, 500, DecodeView("d0"), none_ready)
    assert (d.remote, d.reason) == (False, Reason.TIER_UNAVAILABLE)


def test_over_budget_a_queued_tier_loses_to_decode_only_when_decode_answers_first():
    # prior rate 1000 tokens/s: 500 tokens take 0.5 s on decode; the tier: queue + 0.01 s
    d = decide(Mode.AUTO, RULE, 500, DecodeView("d0", running=3), tier(queued_s=0.6))
    assert (d.remote, d.reason) == (False, Reason.TIER_BUSY)
    assert (d.local_s, d.remote_s) == pytest.approx((0.5, 0.61))
    assert decide(Mode.AUTO, RULE, 500, DecodeView("d0"), tier(queued_s=0.4)).remote
    # what decode is still computing counts: 200 pending tokens put it at 0.7 s
    d = decide(Mode.AUTO, RULE, 500, DecodeView("d0", prefilling_tokens=200), tier(queued_s=0.6))
    assert (d.remote, d.reason, d.local_s) == (True, Reason.LONG_SUFFIX, pytest.approx(0.7))
    # a short suffix over the budget because of pending work: decode_busy unless faster there
    d = decide(Mode.AUTO, RULE, 40, DecodeView("d0", prefilling_tokens=30), tier(queued_s=1.5))
    assert (d.remote, d.reason) == (False, Reason.TIER_BUSY)  # 0.07 s against 1.51 s
    d = decide(Mode.AUTO, RULE, 40, DecodeView("d0", prefilling_tokens=3000), tier(queued_s=1.5))
    assert (d.remote, d.reason) == (True, Reason.DECODE_BUSY)  # 3.04 s against 1.51 s


def test_first_token_predictions_learn_from_what_the_streams_took():
    model = FirstTokenModel(RULE, alpha=0.5)
    view, busy = DecodeView("d0"), tier(queued_s=0.6)
    assert model.rate("d0") == 1000.0 and model.handoff_s == 0.0  # the priors
    assert decide(Mode.AUTO, RULE, 500, view, busy, model).reason is Reason.TIER_BUSY
    model.observe_local("d0", 500, 1.0)  # decode turned out to take 1 s for 500 tokens
    assert model.rate("d0") == 500.0 and model.rate("d1") == 1000.0  # per instance
    d = decide(Mode.AUTO, RULE, 500, view, busy, model)
    assert (d.remote, d.local_s) == (True, pytest.approx(1.0))
    model.observe_local("d0", 1000, 1.0)  # a faster sample moves it half way
    assert model.rate("d0") == 750.0
    # the tier answered 0.5 s later than the router's own estimate: the hand-off says so
    model.observe_remote(busy, 0.61 + 0.5)
    assert model.handoff_s == pytest.approx(0.5)
    d = decide(Mode.AUTO, RULE, 500, view, tier(queued_s=0.2), model)
    assert (d.remote, d.remote_s) == (False, pytest.approx(0.71))  # 0.667 s on decode
    model.observe_local("d0", 0, 1.0)  # nothing computed there: no sample
    assert model.rate("d0") == 750.0


@pytest.mark.parametrize("mode", [Mode.REMOTE, Mode.LOCAL])
def test_forced_modes_ignore_the_inputs(mode):
    for prompt, report in ((1, None), (10_000, tier())):
        d = decide(mode, RULE, prompt, DecodeView("d0"), report)
        assert (d.remote, d.reason) == (mode is Mode.REMOTE, Reason.POLICY)


def test_describe_names_every_input():
    d = decide(Mode.AUTO, RULE, 500, DecodeView("d0", 16, 2, 1, 0.5), tier(cached=32))
    line = d.describe()
    for part in ("prefill=remote", "reason=long_suffix", "prompt=500", "decode=d0",
                 "decode_cached=16", "running=2", "waiting=1", "prefilling=0", "kv=0.50", "tier=p0",
                 "cached=32"):  # fmt: skip
        assert part in line


def test_pick_prefers_less_load_then_a_cached_prefix_then_the_id():
    idle, busy = DecodeView("b", running=0), DecodeView("a", running=2)
    assert pick_decode([busy, idle], RULE).instance == "b"
    assert pick_decode([DecodeView("b"), DecodeView("a")], RULE).instance == "a"  # tie: id
    warm = DecodeView("c", cached_tokens=150, running=1)  # 100 load - 150 cached < 0
    assert pick_decode([idle, warm], RULE).instance == "c"
    waiting = DecodeView("d", cached_tokens=150, waiting=1)  # a waiting request weighs 200
    assert pick_decode([idle, waiting], RULE).instance == "b"
    assert pick_decode([idle, busy], RULE, exclude=("b",)).instance == "a"
    assert pick_decode([idle], RULE, exclude=("b",)) is None
    computing = DecodeView("e", prefilling_tokens=101)  # outweighs one running request
    assert pick_decode([computing, DecodeView("f", running=1)], RULE).instance == "f"
    assert pick_decode([], RULE) is None


def test_config_is_validated_once():
    with pytest.raises(InvalidGatewayConfigError):
        DecisionRule(local_max_tokens=-1)
    with pytest.raises(InvalidGatewayConfigError, match="decode_prefill_rate"):
        DecisionRule(decode_prefill_rate=0)
    with pytest.raises(InvalidGatewayConfigError):
        DecisionRule(max_tier_queue_s=-1)
    with pytest.raises(InvalidGatewayConfigError, match="--router"):
        GatewayConfig("m", 512, mode=Mode.REMOTE)
    with pytest.raises(InvalidGatewayConfigError):
        GatewayConfig("m", 512, decode_poll_s=0)
