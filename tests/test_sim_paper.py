"""The paper-reproduction table: cited figures, both policies, within the stated tolerance."""

from __future__ import annotations

import json

import pytest

from prefill_node.cli.main import main
from prefill_node.sim.paper import PAPER_FIGURES, TOLERANCE, format_table
from prefill_node.sim.presets import get_preset


def test_cited_figures_are_the_papers_four_absolute_numbers():
    assert [(f.preset, f.wave_tok_s, f.lockstep_tok_s) for f in PAPER_FIGURES] == [
        ("glm5-pp4", 1_213_000, 416_000),
        ("minimax-pp4", 1_113_000, 551_000),
    ]
    assert [round(f.ratio, 2) for f in PAPER_FIGURES] == [2.92, 2.02]  # the paper: 2.91, 2.02
    for f in PAPER_FIGURES:
        assert (f.kind.value, f.input_len, f.concurrency) == ("suffix4k", 131_072, 128)
        assert get_preset(f.preset).num_stages == 4


def test_reproduction_stays_within_its_stated_tolerance(tmp_path, capsys):
    out = tmp_path / "paper.json"
    assert main(["sim", "--reproduce-paper", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["preset"] for r in rows] == [f.preset for f in PAPER_FIGURES]
    for r in rows:
        for key in ("wave", "lockstep"):
            err = r[f"sim_{key}_tok_s"] / r[f"paper_{key}_tok_s"] - 1
            assert r[f"{key}_err"] == pytest.approx(err)
            assert abs(err) <= TOLERANCE, (r["preset"], key, err)
        assert r["sim_ratio"] == pytest.approx(r["sim_wave_tok_s"] / r["sim_lockstep_tok_s"])
        assert r["paper_ratio"] == pytest.approx(r["paper_wave_tok_s"] / r["paper_lockstep_tok_s"])
        assert r["within_tolerance"] is True
    text = capsys.readouterr().out
    assert text.strip() == format_table(rows).strip()
    assert "within 20% of the paper: yes" in text


def test_fit_bisects_each_constant_to_its_target():
    from prefill_node.sim.paper import _bisect, fit_presets

    assert _bisect(lambda x: x * x - 2.0, 0.25, 4.0, 40) == pytest.approx(2**0.5, rel=1e-9)
    fitted = fit_presets(requests=8, steps=2)  # a smoke run: tiny runs, two steps
    assert set(fitted) == {"host_time_scale", "glm5-pp4.flops_efficiency"}
    assert 0.25 <= fitted["host_time_scale"] <= 4.0
    assert 0.05 <= fitted["glm5-pp4.flops_efficiency"] <= 1.0
