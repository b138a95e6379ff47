"""Every benchmark script imports and explains itself: ``bench/X.py --help`` exits 0 with a
usage line. Benchmarks are not run by the suite, so without this a renamed helper they import
(bench/ modules import each other as scripts) breaks a benchmark silently until the next
figure run. One process: each script runs as ``__main__`` with ``--help`` on ``sys.argv``."""

from __future__ import annotations

import contextlib
import io
import runpy
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if 'if __name__ == "__main__"' in p.read_text())


def test_the_scripts_are_found() -> None:
    names = {p.name for p in SCRIPTS}
    assert {"peer_vllm.py", "router.py", "kv_shipping.py", "forward.py"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_help_runs(script: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    monkeypatch.syspath_prepend(str(BENCH))
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(script), run_name="__main__")
    assert exit_info.value.code in (0, None), out.getvalue()
    assert "usage:" in out.getvalue()
