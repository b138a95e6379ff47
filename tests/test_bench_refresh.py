"""bench/refresh.py's wiring: every figure names a real benchmark writing to its results file,
and ``stamp`` gives every row its provenance without overwriting a benchmark's own."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import refresh  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def test_every_figure_runs_an_existing_benchmark_into_its_own_file(tmp_path: Path) -> None:
    names = [f.name for f in refresh.FIGURES]
    assert len(names) == len(set(names))
    for figure in refresh.FIGURES:
        for smoke in (False, True):
            argv = figure.argv(tmp_path, smoke)
            assert argv[0] in (refresh.PY, refresh.WAVEPP)
            if argv[0] == refresh.PY:
                assert (REPO / argv[1]).is_file(), argv
            assert argv[argv.index("--json") + 1] == str(tmp_path / f"{figure.name}.json")
    inside = refresh.FIGURES[0].argv(REPO / "bench" / "results", False)
    assert "bench/results/pipeline.json" in inside  # relative to the repository's root


def test_stamp_adds_provenance_and_the_load_around_the_run(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text(json.dumps([{"a": 1}, {"a": 2, "commit": "abc123"}]))
    assert refresh.stamp(path, ["wavepp", "sim", "--json", "x.json"], 0.5, 1.5) == 2
    first, second = json.loads(path.read_text())
    assert first["command"] == "wavepp sim --json x.json" and first["commit"]
    assert (first["load_1m_before"], first["load_1m_after"]) == (0.5, 1.5)
    assert first["cpu_model"] not in ("", "unknown")  # the processor this ran on (Linux)
    assert second["commit"] == "abc123"  # the benchmark's own stamp stays
    path.write_text(json.dumps({"table": []}))
    refresh.stamp(path, ["x"], 0.0, 0.0)
    assert json.loads(path.read_text())["command"] == "x"


def test_list_prints_every_command_and_runs_nothing(capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(sys, "argv", ["refresh.py", "--list", "--out", str(tmp_path)])
    assert refresh.main() == 0
    out = capsys.readouterr().out
    assert all(f"# {f.name}:" in out for f in refresh.FIGURES)
    assert not list(tmp_path.iterdir())
