"""PredictionCalibration (sans-IO): a synthetic sequence of answers moves each pipeline's
measured / predicted ratio as an EWMA starting from the cluster's (which starts at 1),
bounded, drifting back to 1 without samples; the Scorer scales its predictions (routing and
the deadline check alike) by it."""

from __future__ import annotations

import pytest

from prefill_node.core.cost_model import ChunkCostModel
from prefill_router.calibration import CalibrationConfig, PredictionCalibration
from prefill_router.scoring import PipelineView, RouteReason, Scorer

HALF = CalibrationConfig(alpha=0.5, min_ratio=0.25, max_ratio=100.0, half_life_s=10.0)


def test_answers_move_the_ratio_as_an_ewma_starting_at_one():
    cal = PredictionCalibration(HALF)
    assert cal.ratio("a", 0.0) == 1.0 and cal.ratios(0.0) == {}
    assert cal.observe("a", 0.5, 1.5, 0.0) == 2.0  # sample 3: 0.5 * 1 + 0.5 * 3
    assert cal.observe("a", 1.0, 3.0, 0.0) == 2.5  # 0.5 * 2 + 0.5 * 3
    assert cal.observe("a", 2.0, 1.0, 0.0) == 1.5  # sample 0.5
    assert cal.cluster_ratio(0.0) == 1.5  # the same samples, from 1
    assert cal.ratio("b", 0.0) == 1.5  # no samples of its own: the cluster's
    assert cal.observe("b", 1.0, 7.0, 0.0) == 4.25  # from the cluster's 1.5
    assert cal.observe("a", 1.0, 1.5, 0.0) == 1.5  # per pipeline
    assert cal.ratios(0.0) == {"a": 1.5, "b": 4.25}
    assert cal.cluster_ratio(0.0) == 0.5 * (0.5 * 1.5 + 0.5 * 7.0) + 0.5 * 1.5
    assert cal.ratio("c", 0.0) == cal.cluster_ratio(0.0)


def test_samples_are_clamped_so_the_ratio_stays_within_its_bounds():
    cal = PredictionCalibration(HALF)
    assert cal.observe("a", 1e-6, 10.0, 0.0) == pytest.approx(50.5)  # sample 1e7 -> 100
    for _ in range(60):
        cal.observe("a", 1e-6, 10.0, 0.0)
    assert cal.ratio("a", 0.0) == pytest.approx(100.0)
    assert cal.ratio("a", 0.0) <= 100.0
    for _ in range(60):
        cal.observe("a", 10.0, 0.0, 0.0)  # sample 0 -> 0.25
    assert cal.ratio("a", 0.0) == pytest.approx(0.25)


def test_samples_that_say_nothing_leave_the_ratio_alone():
    cal = PredictionCalibration(HALF)
    assert cal.observe("a", 0.0, 1.0, 0.0) is None  # nothing predicted
    assert cal.observe("a", 1.0, -1.0, 0.0) is None
    assert cal.ratios(0.0) == {}
    off = PredictionCalibration(CalibrationConfig(alpha=0.0))
    assert off.observe("a", 1.0, 50.0, 0.0) is None
    assert off.ratio("a", 0.0) == 1.0


def test_without_samples_the_ratio_drifts_back_to_one_with_its_half_life():
    cal = PredictionCalibration(HALF)
    cal.observe("a", 1.0, 17.0, 100.0)  # 9
    assert cal.ratio("a", 100.0) == 9.0
    assert cal.ratio("a", 110.0) == pytest.approx(5.0)  # halfway back to 1
    assert cal.ratio("a", 120.0) == pytest.approx(3.0)
    assert cal.observe("a", 1.0, 9.0, 110.0) == pytest.approx(7.0)  # from 5, not from 9
    assert cal.cluster_ratio(120.0) == pytest.approx(1 + (7.0 - 1) / 2)  # the same samples
    cal.forget("a")
    assert cal.ratios(110.0) == {}
    assert cal.ratio("a", 110.0) == pytest.approx(7.0)  # its next instance: the cluster's


@pytest.mark.parametrize(
    "bad",
    [{"alpha": -0.1}, {"alpha": 1.5}, {"min_ratio": 0.0}, {"min_ratio": 2.0},
     {"max_ratio": 0.5}, {"max_ratio": float("inf")}, {"half_life_s": 0.0}],
)  # fmt: skip
def test_a_bad_config_is_refused(bad):
    with pytest.raises(ValueError):
        CalibrationConfig(**bad)


LINEAR = ChunkCostModel(per_token_s=1.0, per_token_context_s=0.0)


def test_the_scorer_predicts_with_each_pipelines_ratio():
    scorer = Scorer(LINEAR, 16, affinity_slack=0.0)
    a = PipelineView("a", True, 10.0, 4096, 256, time_ratio=3.0)
    b = PipelineView("b", True, 40.0, 4096, 256)
    d = scorer.choose(32, {}, [a, b])
    ca, cb = d.candidates
    assert (ca.queued_cost_s, ca.prefill_cost_s) == (10.0, 32.0)  # the cost model's seconds
    assert (ca.queued_s, ca.prefill_s, ca.score) == (30.0, 96.0, 126.0)  # scaled: a is slower
    assert cb.score == 72.0
    assert (d.pipeline, d.reason) == ("b", RouteReason.LOAD)  # uncalibrated, a would win
    assert scorer.assess(32, {}, [a, b]) == d.candidates  # admission predicts the same
    plain = scorer.choose(32, {}, [PipelineView("a", True, 10.0, 4096, 256), b])
    assert plain.pipeline == "a"
