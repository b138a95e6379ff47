"""The soak's outcome classes: a stream whose client library lost a request write under it
(grpc.aio's own INTERNAL "Internal error from Core") is counted apart from a server's
INTERNAL, and is allowed only right after a router kill."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
soak_workload = pytest.importorskip("soak_workload")
soak_report = pytest.importorskip("soak_report")


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def test_lost_write_is_its_own_outcome_and_a_server_internal_is_not() -> None:
    lost = _error(grpc.StatusCode.INTERNAL, soak_workload.WRITE_LOST_DETAILS)
    assert soak_workload._code(lost) == soak_workload.WRITE_LOST
    server = _error(grpc.StatusCode.INTERNAL, "internal error in request r1 (KeyError)")
    assert soak_workload._code(server) == "INTERNAL"
    assert soak_workload._code(_error(grpc.StatusCode.UNAVAILABLE, "x")) == "UNAVAILABLE"


def test_lost_writes_are_explained_only_right_after_a_router_kill() -> None:
    kill = time.monotonic()
    window = soak_report.WRITE_LOST_WINDOW_S
    lost = soak_workload.WRITE_LOST
    tally = SimpleNamespace(
        rows=[
            (kill + 0.01, "stream", lost, 0.1, ""),  # at the kill: explained
            (kill + window + 1, "stream", lost, 0.1, ""),  # too late
            (kill - 1, "stream", lost, 0.1, ""),  # before it
            (kill + 0.01, "stream", "UNAVAILABLE", 0.1, ""),  # another outcome: not counted
        ]
    )
    assert soak_report.unexplained_writes_lost(tally, SimpleNamespace(router_kills=[kill])) == 2
    assert soak_report.unexplained_writes_lost(tally, SimpleNamespace(router_kills=[])) == 3


soak_outcomes = pytest.importorskip("soak_outcomes")
Ended, Window, Verdict = soak_outcomes.Ended, soak_outcomes.Window, soak_outcomes.Verdict


def test_an_outcome_is_expected_for_its_kind_explained_by_a_fault_or_a_breach() -> None:
    fault = [Window(10.0, 20.0, "pipeline-0", "stage_kill")]
    verdict = soak_outcomes.verdict
    assert verdict(Ended(0, 1, "tenant", "OK"), fault) is Verdict.OK
    assert verdict(Ended(0, 1, "deadline", "DEADLINE_EXCEEDED"), []) is Verdict.EXPECTED
    assert verdict(Ended(0, 1, "hostile", "INVALID_ARGUMENT"), []) is Verdict.EXPECTED
    assert verdict(Ended(0, 1, "cancel", "CANCELLED"), []) is Verdict.EXPECTED
    assert verdict(Ended(0, 1, "tenant", "RESOURCE_EXHAUSTED"), []) is Verdict.EXPECTED  # shed
    # a fault explains what it causes, only for requests in flight during it
    assert verdict(Ended(15, 16, "tenant", "UNAVAILABLE"), fault) is Verdict.EXPLAINED
    assert verdict(Ended(5, 11, "pull", "KV_KVHandoffError"), fault) is Verdict.EXPLAINED
    assert verdict(Ended(0, 1, "tenant", "UNAVAILABLE"), fault) is Verdict.BREACH
    assert verdict(Ended(0, 1, "pull", "KV_KVHandoffError"), []) is Verdict.BREACH
    assert verdict(Ended(0, 1, "tenant", "CANCELLED"), []) is Verdict.BREACH  # nobody cancelled
    # never expected, fault or not
    for code in ("STREAM_MISSING", "CLIENT_KeyError", "INTERNAL", "UNKNOWN"):
        assert verdict(Ended(15, 16, "stream", code), fault) is Verdict.BREACH, code
    rows = [Ended(15, 16, "stream", "STREAM_MISSING"), Ended(0, 1, "tenant", "UNAVAILABLE"),
            Ended(15, 16, "tenant", "UNAVAILABLE")]  # fmt: skip
    assert soak_outcomes.breaches(rows, fault) == {"stream:STREAM_MISSING": 1,
                                                   "tenant:UNAVAILABLE": 1}  # fmt: skip


def test_availability_counts_well_formed_requests_outside_router_and_overlapping_faults() -> None:
    windows = [
        Window(10.0, 20.0, "pipeline-0", "stage_kill"),
        Window(30.0, 40.0, "router", "router_restart"),
        Window(50.0, 60.0, "pipeline-1", "stage_kill"),
        Window(50.0, 60.0, "decode-0", "decode_kill"),
    ]
    ok = [Ended(t / 3, t / 3 + 1, "tenant", "OK") for t in range(300)]  # 3 per second
    rows = [
        *ok,
        Ended(15, 16, "tenant", "UNAVAILABLE"),  # explained by pipeline-0's fault
        Ended(35, 36, "tenant", "UNAVAILABLE"),  # the router's: excluded
        Ended(55, 56, "push", "UNAVAILABLE"),  # two components at once: excluded
        Ended(70, 71, "deadline", "DEADLINE_EXCEEDED"),  # not in the population
        Ended(70, 71, "cancel", "CANCELLED"),
    ]
    a = soak_outcomes.availability(rows, windows)
    excluded = sum(1 for r in ok if any(w.overlaps(r) for w in windows[1:]))
    assert (a.unexplained, a.excluded) == (0, excluded + 2)
    assert (a.judged, a.ok) == (300 - excluded + 1, 300 - excluded)
    assert a.ok_share >= 0.99 and a.holds  # the one failure is explained
    a = soak_outcomes.availability([*rows, Ended(80, 81, "unique", "UNAVAILABLE")], windows)
    assert a.unexplained == 1 and not a.holds  # nothing explains it
    few_ok = [*ok[:50], *(Ended(t, t + 1, "tenant", "UNAVAILABLE") for t in (11, 12, 13, 14))]
    a = soak_outcomes.availability(few_ok, windows[:1])
    assert a.unexplained == 0 and a.ok_share < 0.99 and not a.holds  # explained, but too many


def test_counters_must_equal_and_cancellations_count_on_both_sides() -> None:
    reconcile = soak_outcomes.reconcile
    ended = [("OK", "")] * 10 + [("INVALID_ARGUMENT", "bad")] * 3 + [("CANCELLED", "")] * 2
    ended += [("UNAVAILABLE", "failed to connect to all addresses")]  # never reached it
    ended += [("RESOURCE_EXHAUSTED", "Received message larger than max (1 vs. 2)")]
    ended += [("KV_KVHandoffError", "x"), ("DECODER_KILLED", "")]  # router ok; undetermined
    exact = reconcile({"ok": 11, "invalid_argument": 3, "cancelled": 3}, ended)
    assert (exact.client, exact.undetermined) == ({"ok": 11, "invalid_argument": 3}, 3)
    assert exact.mismatches == {}
    # a cancel that raced its answer: the router counted it ok
    assert reconcile({"ok": 12, "invalid_argument": 3, "cancelled": 2}, ended).mismatches == {}
    # the router counted more than were sent, or fewer OK than the clients saw
    assert "ok+cancelled" in reconcile({"ok": 11, "invalid_argument": 3, "cancelled": 4},
                                       ended).mismatches  # fmt: skip
    assert "ok+cancelled" in reconcile({"ok": 10, "invalid_argument": 3}, ended).mismatches
    assert reconcile({"ok": 11, "invalid_argument": 2}, ended).mismatches == {
        "invalid_argument": (2, 3)
    }
    assert reconcile({"ok": 11, "invalid_argument": 3, "unavailable": 1},
                     ended).mismatches == {"unavailable": (1, 0)}  # fmt: skip


def test_growth_is_judged_only_over_a_long_enough_window() -> None:
    """20 MiB over the last half of a 30-minute run is a leak; flat is not; the same 20 MiB
    over the last half of a 60 s run (a restarted process warming up) is not judged."""
    mib = 2**20
    sampler = soak_report.Sampler(None, None, None)

    def series(seconds: float, grow_mib: float) -> list[tuple[float, int, int]]:
        n = 60
        return [(seconds * i / (n - 1), int(300 * mib + 2 * grow_mib * mib * max(0, i - n // 2)
                 / n), 40) for i in range(n)]  # fmt: skip

    sampler.procs = {
        "router@1": series(1800, 20),
        "stage@2": series(1800, 0),
        "decode@3": series(60, 20),
    }
    long_run = soak_report.slopes(sampler, 1800)
    assert long_run["router@1"]["growing"] is True
    assert long_run["stage@2"]["growing"] is False
    short = soak_report.slopes(sampler, 60)["decode@3"]
    assert short["growing"] is None and short["rss_mb_per_min"] > 16
