"""The short soak: bench/soak.py for about 60 s (router, 2 pipelines of 2 stage processes,
2 decode workers, mixed load with push and pull hand-offs, a few faults), with the same
invariants as the long run: every request ends once with a status expected for its kind or
explained by a fault in flight, nothing hung, aborts of requests in flight take effect,
availability, every fault's effect verified, no block, lease or transfer left anywhere once
load stops, integrity true on every stage, the router's index equal to the pipelines'
residency and its counters equal to the client's tally.

Generous limits on startup (a loaded 2-core machine starts 7 processes slowly); none on the
invariants.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(900)


def test_short_soak_loses_nothing_and_leaks_nothing(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    run = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "soak.py"),
            "--duration",
            "60",
            "--concurrency",
            "24",
            "--decoders",
            "1",
            "--decode-concurrency",
            "3",
            "--faults",
            "few",
            "--json",
            str(out),
            "--settle",
            "60",
        ],
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert out.is_file(), (
        f"no result (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    )
    rows = json.loads(out.read_text())
    summary = rows[0]
    broken = {name: summary[name] for name in summary["invariants"] if summary[name]}
    assert not broken, f"broken invariants {broken}: {json.dumps(summary, indent=1)[:6000]}"
    assert run.returncode == 0, run.stderr[-3000:]
    # it really ran: load of every kind, hand-offs both ways, the faults injected
    kinds = {key.split(":")[0] for key, n in summary["by_kind"].items() if key.endswith(":OK")}
    assert {"tenant", "unique", "stream", "push", "pull"} <= kinds, summary["by_kind"]
    assert summary["outcome_OK"] > 200
    assert summary["outcome_CANCELLED"] > 0 and summary["outcome_DEADLINE_EXCEEDED"] > 0
    assert summary["by_kind"].get("hostile:INVALID_ARGUMENT", 0) > 0
    names = [r["name"] for r in rows if r["row"] == "fault"]
    assert {"decode_kill", "pressure", "kv_cut", "router_restart"} <= set(names), names
    assert summary["counters"]["router"]["ok"] > 0
    assert summary["aborts"]["landed"] > 0  # aborts reached requests in flight
    assert summary["availability"]["judged"] > 100
    assert all(r["survived"] and r["effect"] for r in rows if r["row"] == "fault")
    assert all(
        i["router"] == i["pipeline"] for k, i in summary["index"].items() if k != "mismatches"
    )
    assert [r for r in rows if r["row"] == "series"], "no time series"
