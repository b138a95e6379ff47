"""bench/peer_vllm.py's pure parts: the cases' prompts and the paired ours/vLLM ratios."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import peer_vllm_cases as cases  # noqa: E402
import peer_vllm_report as report  # noqa: E402


def _row(system: str, run: int, input_tok_s: float, computed_tok_s: float, case="cold") -> dict:
    return {"kind": "run", "system": system, "dtype": "float32", "case": case, "run": run,
            "input_tok_s": input_tok_s, "computed_tok_s": computed_tok_s,
            "cached_share": 1 - computed_tok_s / input_tok_s, "wall_s": 1.0}  # fmt: skip


def test_ratios_pair_each_run_with_the_same_runs_peer():
    # run 0 on a fast machine, runs 1 and 2 on slow ones: paired ratios 1.2, 0.9, 1.1
    per_run = [
        _row("wavepp-pipeline", 0, 1200.0, 600.0),
        _row("vllm-eager", 0, 1000.0, 400.0),
        _row("wavepp-pipeline", 1, 450.0, 450.0),
        _row("vllm-eager", 1, 500.0, 500.0),
        _row("wavepp-pipeline", 2, 550.0, 550.0),
        _row("vllm-eager", 2, 500.0, 500.0),
        _row("vllm-compiled", 0, 2400.0, 2400.0),  # only run 0: one pair
    ]
    rows = report.summarise(per_run)
    med = {r["system"]: r for r in rows if r["kind"] == "median"}
    assert med["wavepp-pipeline"]["input_tok_s"] == 550.0
    assert med["vllm-eager"]["runs"] == 3
    ratio = {r["peer"]: r for r in rows if r["kind"] == "ratio"}
    eager = ratio["vllm-eager"]
    assert eager["system"] == "wavepp-pipeline"
    assert eager["input_tok_s"] == pytest.approx(1.1)  # median of 1.2, 0.9, 1.1
    assert eager["computed_tok_s"] == pytest.approx(1.1)  # median of 1.5, 0.9, 1.1
    assert (eager["ahead_runs"], eager["paired_runs"]) == (2, 3)
    compiled = ratio["vllm-compiled"]
    assert (compiled["input_tok_s"], compiled["paired_runs"]) == (0.5, 1)
    # no ratio row of a peer over anything, and every row names system, dtype, case, run
    assert {r["system"] for r in ratio.values()} == {"wavepp-pipeline"}
    assert all({"system", "dtype", "case", "run"} <= r.keys() for r in rows)
    assert compiled["headline"] and not eager["headline"]  # vLLM's default configuration
    assert "| float32 | cold | 550 | 2,400 | 500 | 0.50x | 1.10x |" in report.table(rows)


def test_summary_keeps_the_order_the_cases_ran_in():
    per_run = [_row("vllm-eager", 0, 10.0, 10.0, case) for case in ("long", "cold", "b")]
    assert [r["case"] for r in report.summarise(per_run)] == ["long", "cold", "b"]


def test_first_token_agreement_is_in_every_row_and_required():
    per_run = [
        {**_row("vllm-compiled", 0, 1.0, 1.0), "first_tokens": [5, 6, 7, 8]},
        {**_row("vllm-eager", 0, 1.0, 1.0), "first_tokens": [5, 6, 7, 9]},
        {**_row("wavepp-pipeline", 0, 1.0, 1.0), "first_tokens": [5, 6, 0, 8]},
        {**_row("wavepp-pipeline", 1, 1.0, 1.0), "first_tokens": [5, 6, 7, 8]},  # no reference
    ]
    problems = report.first_token_agreement(per_run)
    compiled, eager, ours, alone = per_run
    assert (compiled["first_token_agreement"], compiled["agreement_vllm_eager"]) == (1.0, 0.75)
    assert eager["first_token_agreement"] == 0.75  # against the headline peer, compiled
    assert (ours["agreement_vllm_compiled"], ours["agreement_vllm_eager"]) == (0.75, 0.5)
    assert ours["first_token_agreement"] == 0.75
    assert alone["first_token_agreement"] is None and alone["agreement_vllm_eager"] is None
    assert len(problems) == 4  # three rows below 90%, one with nothing to compare with
    assert "no vLLM row" in problems[-1] and "75% < 90%" in problems[0]
    ratio = {r["peer"]: r for r in report.summarise(per_run) if r["kind"] == "ratio"}
    assert ratio["vllm-eager"]["first_token_agreement"] == 0.5
    assert not ratio["vllm-compiled"]["agreement_ok"]
    agreeing = [{**r, "first_tokens": [5, 6, 7, 8]} for r in per_run[:3]]
    assert report.first_token_agreement(agreeing) == []


@pytest.mark.parametrize(
    ("dtype", "agreement", "ties"), [("bfloat16", 0.5, 1), ("float32", 0.25, 0)]
)
def test_a_different_first_token_agrees_only_as_a_near_tie_in_that_dtype(dtype, agreement, ties):
    ours = [[[5, -0.1], [6, -3.0]],  # the same token
            [[7, -1.00], [8, -1.10]],  # 7 vs 8, 0.06 / 0.10 nats apart: a bf16 near-tie
            [[3, -0.5], [4, -2.0]],  # 3 vs 4, 1.5 nats apart on both sides: different
            [[9, -0.2], [1, -4.0]]]  # fmt: skip # 9 vs 10, each outside the other's top 2
    theirs = [[[5, -0.1], [6, -3.0]], [[8, -1.02], [7, -1.08]], [[4, -0.5], [3, -2.0]],
              [[10, -0.2], [2, -4.0]]]  # fmt: skip
    per_run = [
        {**_row("vllm-compiled", 0, 1.0, 1.0), "dtype": dtype, "first_top": theirs,
         "first_tokens": [t[0][0] for t in theirs]},
        {**_row("wavepp-pipeline", 0, 1.0, 1.0), "dtype": dtype, "first_top": ours,
         "first_tokens": [t[0][0] for t in ours]},
    ]  # fmt: skip
    problems = report.first_token_agreement(per_run)
    assert per_run[1]["first_token_agreement"] == agreement
    assert per_run[1]["first_token_near_ties"] == ties
    assert len(problems) == 1 and "wavepp-pipeline" in problems[0]  # below 90%
    # a row without the logprobs (an older driver) falls back to equal tokens only
    del per_run[0]["first_top"]
    report.first_token_agreement(per_run)
    assert (per_run[1]["first_token_agreement"], per_run[1]["first_token_near_ties"]) == (0.25, 0)


def test_cases_draw_the_same_prompts_per_run_and_new_ones_per_run():
    cold, first, cached, long = cases.make_cases(**cases.DEFAULT)
    assert first.prefix_tokens == cached.prefix_tokens == 1152  # 90% of 1280, 9 x 128
    seed, prompts = cached.draw(run=0, vocab=49152)
    assert (seed, prompts) == cached.draw(run=0, vocab=49152)
    assert prompts != cached.draw(run=1, vocab=49152)[1]
    assert len(prompts) == cached.prompts and len(seed) == 1
    assert all(len(p) == 1280 and p[:1152] == seed[0][:1152] for p in prompts)
    assert len({tuple(p[1152:]) for p in [*prompts, *seed]}) == cached.prompts + 1
    assert first.draw(0, 49152)[0] == []  # first sight: nothing seeded
    cold_prompts = cold.draw(0, 49152)[1]
    assert len({p[0] for p in cold_prompts}) > 1
    ids = [t for p in cold_prompts for t in p]
    assert min(ids) >= cases.FIRST_ID and max(ids) < 49152
    # computed tokens if no cached block is computed twice
    assert cold.computed_tokens == 4 * 1024
    assert first.computed_tokens == 1152 + 4 * 128
    assert cached.computed_tokens == 8 * 128
    assert long.computed_tokens == long.input_tokens == 4096


def test_shared_prefix_is_the_longest_aligned_share():
    assert cases.shared_prefix(1280) == 1152
    assert cases.shared_prefix(1024) == 896  # 921.6 rounds down to 7 blocks of 128
    assert cases.shared_prefix(100) == 0


def test_wait_quiet_waits_while_a_process_keeps_a_core_busy():
    import subprocess
    import time

    import quiet

    spin_s = 0.8
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import time\nt = time.time() + {spin_s}\nwhile time.time() < t: pass",
        ]
    )
    try:
        time.sleep(0.1)  # the child is spinning
        assert quiet.busy_cores(0.2) > quiet.QUIET_CORES
        waited = quiet.wait_quiet(max_s=5.0)
        assert waited >= spin_s - 0.1 - 0.25  # it waited for the child, one window late at most
        assert child.poll() is not None  # the child had stopped when the wait ended
    finally:
        child.kill()
        child.wait()


def test_stage_occupancy_pairs_each_setting_with_the_same_runs_default_pipeline():
    import stage_occupancy

    def row(setting, run, tok_s):
        return {"kind": "run", "setting": setting, "case": "cold", "run": run,
                "wall_s": 1.0, "computed_tokens": 100, "computed_tok_s": tok_s,
                "stage0_busy": 0.9, "stage0_cpu": 0.8, "stage0_waves": 4,
                "stage0_wide": 0.1}  # fmt: skip

    per_run = [row("default", 0, 1200.0), row("pinned", 0, 1000.0),
               row("default", 1, 900.0), row("pinned", 1, 1000.0),
               row("default", 2, 1050.0), row("pinned", 2, 1000.0),
               row("drain-bound", 2, 700.0)]  # fmt: skip
    summary = stage_occupancy.summarise(per_run)
    ratios = {r["setting"]: r for r in summary if r["kind"] == "ratio"}
    assert ratios["pinned"]["computed_tok_s"] == pytest.approx(1.05)  # median of 1.2, 0.9, 1.05
    assert ratios["drain-bound"]["computed_tok_s"] == pytest.approx(1.5)  # its one paired run
    assert ratios["drain-bound"]["runs"] == 1 and "pinned-drain-bound" not in ratios  # no rows
    medians = {r["setting"]: r for r in summary if r["kind"] == "median"}
    assert medians["default"]["computed_tok_s"] == 1050.0
    table = stage_occupancy.table(summary, 1)
    assert "| cold | default | 1,050 |" in table and "| 1.05x |" in table
