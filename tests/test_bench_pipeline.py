"""bench/pipeline.py's summary: paired wave/baseline ratios and per-cell efficiency."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import pipeline as bench  # noqa: E402


def _row(policy: str, run: int, tok_s: float, ceiling: float, source: int = 0) -> dict:
    return {
        "workload": "cold",
        "policy": policy,
        "concurrency": 8,
        "run": run,
        "source": source,
        "input_tok_s": tok_s,
        "computed_tok_s": tok_s,
        "p50_s": 1.0,
        "p95_s": 2.0,
        "busy_stage0": 0.9,
        "busy_stage1": 0.9,
        "cpu_stage0": 0.8,
        "cpu_stage1": 0.8,
        "ceiling_tok_s": ceiling,
    }


def test_wave_over_each_baseline_pairs_each_run_with_itself():
    # run 0 is a fast machine, run 1 and 2 slow ones; wave wins two runs of three against
    # trtllm and every run against sync-admission.
    per_run = [
        _row("wave", 0, 110.0, 200.0),
        _row("trtllm", 0, 100.0, 200.0),
        _row("sync-admission", 0, 55.0, 200.0),
        _row("wave", 1, 54.0, 100.0),
        _row("trtllm", 1, 60.0, 100.0),
        _row("sync-admission", 1, 27.0, 100.0),
        _row("wave", 2, 66.0, 100.0),
        _row("trtllm", 2, 60.0, 100.0),
        _row("sync-admission", 2, 33.0, 100.0),
    ]
    rows = {r["policy"]: r for r in bench.summarise(per_run)}
    wave, trt = rows["wave"], rows["trtllm"]
    assert wave["wave_over_trtllm"] == pytest.approx(1.1)  # median of 1.1, 0.9, 1.1
    assert trt["wave_over_trtllm"] == pytest.approx(1.1)
    assert wave["wave_over_trtllm_medians"] == pytest.approx(66.0 / 60.0)
    assert (wave["wave_ahead_of_trtllm_runs"], wave["paired_runs"]) == (2, 3)
    assert wave["wave_over_sync_admission"] == pytest.approx(2.0)
    assert wave["wave_ahead_of_sync_admission_runs"] == 3
    # efficiency: ratio of medians, and the median of each run's own ratio
    assert wave["efficiency"] == pytest.approx(66.0 / 100.0)
    assert wave["efficiency_per_run"] == pytest.approx(0.55)  # 0.55, 0.54, 0.66
    assert "| 1.10x | 2/3 | 2.00x | 3/3 |" in bench.markdown([wave])


def test_pooled_runs_pair_only_within_their_own_invocation():
    # two invocations both number their runs from 0: a run pairs only with its own source
    per_run = [
        _row("wave", 0, 120.0, 200.0, source=0),
        _row("trtllm", 0, 100.0, 200.0, source=0),
        _row("wave", 0, 50.0, 100.0, source=1),
        _row("trtllm", 0, 100.0, 100.0, source=1),
    ]
    wave = next(r for r in bench.summarise(per_run) if r["policy"] == "wave")
    assert wave["paired_runs"] == 2 and wave["wave_ahead_of_trtllm_runs"] == 1
    assert wave["wave_over_trtllm"] == pytest.approx((1.2 + 0.5) / 2)
    assert "wave_over_sync_admission" not in wave  # not run: no ratio, blank cells
    assert "| 0.85x | 1/2 | | |" in bench.markdown([wave])
