"""The router's transfer model: a prior until enough fetches were seen, then the line
through them (least squares), recovering the fixed and per-block costs it was fed."""

from __future__ import annotations

import pytest

from prefill_router.transfer import InvalidTransferInputError, TransferFit, TransferModel


def test_fetch_time_is_fixed_plus_per_block_and_zero_for_nothing():
    m = TransferModel(fixed_s=0.002, per_block_s=0.0005)
    assert m.fetch_s(8) == pytest.approx(0.006)
    assert m.fetch_s(0) == 0.0
    link = TransferModel.for_link(stage_block_bytes=4e6, link_bytes_per_s=40e9, fixed_s=1e-3)
    assert link.per_block_s == pytest.approx(1e-4) and link.fixed_s == 1e-3


def test_the_fit_recovers_a_synthetic_link_and_keeps_the_prior_until_enough_samples():
    truth = TransferModel(fixed_s=0.003, per_block_s=0.0007)
    fit = TransferFit(TransferModel(0.0, 1.0), window=64, min_samples=4)
    sizes = [4, 9, 16, 30, 2, 64, 12]
    for i, n in enumerate(sizes):
        model = fit.observe(n, truth.fetch_s(n))
        if i < 3:
            assert model == fit.prior  # 3 samples < min_samples
    assert fit.num_samples == len(sizes)
    assert fit.model.fixed_s == pytest.approx(truth.fixed_s, rel=1e-9)
    assert fit.model.per_block_s == pytest.approx(truth.per_block_s, rel=1e-9)


def test_the_window_forgets_old_fetches():
    fit = TransferFit(TransferModel(0.0, 1.0), window=4, min_samples=2)
    for n in (1, 2, 3, 4):
        fit.observe(n, 10.0 * n)  # a slow link
    for n in (1, 2, 3, 4):
        fit.observe(n, 0.5 + 0.25 * n)  # it got faster; the old samples left the window
    assert (fit.model.fixed_s, fit.model.per_block_s) == pytest.approx((0.5, 0.25))


def test_one_size_or_a_negative_intercept_falls_back_to_a_per_block_line():
    fit = TransferFit(TransferModel(1.0, 1.0), min_samples=2)
    fit.observe(8, 0.8)
    fit.observe(8, 0.8)
    assert (fit.model.fixed_s, fit.model.per_block_s) == pytest.approx((0.0, 0.1))
    fit = TransferFit(TransferModel(1.0, 1.0), min_samples=2)
    fit.observe(1, 0.0)
    fit.observe(10, 2.0)  # the line through them crosses below zero at 0 blocks
    assert fit.model.fixed_s == 0.0 and fit.model.per_block_s == pytest.approx(20.0 / 101)


@pytest.mark.parametrize(
    "make",
    [
        lambda: TransferModel(-1.0, 0.1),
        lambda: TransferModel(0.0, float("nan")),
        lambda: TransferModel.for_link(1e6, 0.0, 0.0),
        lambda: TransferFit(TransferModel(0, 0), window=1),
        lambda: TransferFit(TransferModel(0, 0)).observe(0, 1.0),
        lambda: TransferFit(TransferModel(0, 0)).observe(3, -1.0),
    ],
)
def test_bad_terms_and_samples_are_refused(make):
    with pytest.raises(InvalidTransferInputError):
        make()
