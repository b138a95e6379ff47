"""The gateway's remote-vs-local rule and decode pick (sans-IO): exact choices and reasons."""

from __future__ import annotations

import pytest

from prefill_node.engine.types import ScoreReport
from wavepp_gateway.config import DecisionRule, GatewayConfig, InvalidGatewayConfigError
from wavepp_gateway.config import PrefillMode as Mode
from wavepp_gateway.decision import DecodeView, Reason, decide, pick_decode

RULE = DecisionRule(local_max_tokens=64, max_tier_queue_s=1.0, request_tokens=100)


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
    # ... even when the tier's queue is long: the budget caps decode's prefill in flight
    d = decide(Mode.AUTO, RULE, 40, DecodeView("d0", prefilling_tokens=30), tier(queued_s=1.5))
    assert (d.remote, d.reason) == (True, Reason.DECODE_BUSY)
    # a long suffix on a busy tier goes local only while decode has nothing pending
    busy = tier(queued_s=1.5)
    assert decide(Mode.AUTO, RULE, 500, DecodeView("d0", prefilling_tokens=1), busy).remote
    assert decide(Mode.AUTO, RULE, 500, DecodeView("d0"), busy).reason is Reason.TIER_BUSY


def test_no_tier_answer_or_no_ready_pipeline_is_local():
    assert decide(Mode.AUTO, RULE, 500, DecodeView("d0"), None).reason is Reason.TIER_UNAVAILABLE
    none_ready = tier(pipeline="")
    d = decide(Mode.AUTO, RULE, 500, DecodeView("d0"), none_ready)
    assert (d.remote, d.reason) == (False, Reason.TIER_UNAVAILABLE)


def test_a_busy_tier_goes_local_only_while_decode_has_nothing_waiting():
    busy = tier(queued_s=1.5)
    d = decide(Mode.AUTO, RULE, 500, DecodeView("d0", running=3), busy)
    assert (d.remote, d.reason) == (False, Reason.TIER_BUSY)
    assert decide(Mode.AUTO, RULE, 500, DecodeView("d0", waiting=1), busy).remote
    assert decide(Mode.AUTO, RULE, 500, DecodeView("d0"), tier(queued_s=1.0)).remote


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
    with pytest.raises(InvalidGatewayConfigError, match="--router"):
        GatewayConfig("m", 512, mode=Mode.REMOTE)
    with pytest.raises(InvalidGatewayConfigError):
        GatewayConfig("m", 512, decode_poll_s=0)
