"""WaveScheduler (sans-IO): progress, ring, chunks in flight, completion and deferred abort."""

from __future__ import annotations

import pytest

from prefill_node.core.planner import PlannerMode, WavePlanner
from prefill_node.core.policy import Policy, sync_admission_policy, wave_policy
from prefill_node.core.wave_scheduler import WaveDone, WaveScheduler
from prefill_node.errors import InvariantError


def _scheduler(policy: Policy) -> WaveScheduler:
    cfg = policy.planner_config(
        max_wave_tokens=16, min_wave_tokens=8, block_size=4, max_wave_requests=8
    )
    return WaveScheduler(policy, WavePlanner(cfg))


def _spans(wave) -> list[tuple[str, int, int]]:
    return [(c.request_id, c.start, c.end) for c in wave.chunks]


def test_waves_cover_the_uncached_suffix_once_and_the_last_chunk_finishes() -> None:
    s = _scheduler(sync_admission_policy(1))
    s.admit("a", 8, 30)
    covered = []
    while (wave := s.next_wave()) is not None:
        covered += _spans(wave)
        last = [s.is_last(c) for c in wave.chunks]
        done = s.wave_done(wave.wave_id)
        progress = WaveDone(computed=(("a", wave.chunks[0].end),))
        assert done == (WaveDone(finished=("a",)) if any(last) else progress)
    assert covered == [("a", 8, 24), ("a", 24, 30)]
    assert s.idle and "a" not in s


def test_the_ring_bounds_waves_in_flight() -> None:
    s = _scheduler(wave_policy(1, PlannerMode.FIXED))  # ring 2
    s.admit("a", 0, 100)
    first, second = s.next_wave(), s.next_wave()
    assert first is not None and second is not None
    assert s.ring_full and s.next_wave() is None
    assert s.wave_done(first.wave_id) == WaveDone(computed=(("a", 16),))
    assert s.next_wave() is not None
    assert s.waves_in_flight == 2 and s.remaining_tokens == 100 - 48


def test_without_pipelined_chunks_a_request_waits_for_its_chunk() -> None:
    s = _scheduler(sync_admission_policy(2))  # ring 2, one chunk per request in flight
    s.admit("a", 0, 40)
    s.admit("b", 0, 8)
    w1 = s.next_wave()
    assert _spans(w1) == [("a", 0, 16)]
    w2 = s.next_wave()
    assert _spans(w2) == [("b", 0, 8)]  # a is skipped while its chunk is in flight
    assert s.next_wave() is None
    assert s.wave_done(w2.wave_id).finished == ("b",)
    assert s.next_wave() is None  # a still in flight
    s.wave_done(w1.wave_id)
    assert _spans(s.next_wave()) == [("a", 16, 32)]


def test_abort_with_chunks_in_flight_is_dropped_only_when_they_return() -> None:
    s = _scheduler(wave_policy(1, PlannerMode.FIXED))
    s.admit("a", 0, 100)
    w1, w2 = s.next_wave(), s.next_wave()
    assert s.abort("a") is False  # two chunks still computing
    assert s.wave_done(w1.wave_id) == WaveDone()  # aborted: its progress counts no more
    assert s.next_wave() is None  # aborted: nothing more scheduled
    assert s.wave_done(w2.wave_id) == WaveDone(dropped=("a",))
    assert s.idle
    assert s.abort("never-admitted") is True


def test_a_failed_request_is_dropped_not_finished() -> None:
    s = _scheduler(wave_policy(1, PlannerMode.FIXED))
    s.admit("a", 0, 12)
    s.admit("b", 0, 4)
    wave = s.next_wave()
    assert _spans(wave) == [("a", 0, 12), ("b", 0, 4)]
    assert s.wave_done(wave.wave_id, failed={"a"}) == WaveDone(("b",), ("a",))


def test_a_returned_earlier_chunk_reports_how_far_its_request_computed() -> None:
    s = _scheduler(wave_policy(2, PlannerMode.FIXED))  # pipelined chunks: ring 4
    s.admit("a", 8, 40)
    w1, w2 = s.next_wave(), s.next_wave()
    assert _spans(w1) == [("a", 8, 24)] and _spans(w2) == [("a", 24, 40)]
    assert s.wave_done(w1.wave_id) == WaveDone(computed=(("a", 24),))
    assert s.wave_done(w2.wave_id) == WaveDone(finished=("a",))
    s.admit("c", 0, 40)
    w3 = s.next_wave()
    assert s.wave_done(w3.wave_id, failed={"c"}) == WaveDone(dropped=("c",))  # no progress


def test_a_cut_ends_a_chunk_where_waiting_requests_can_start() -> None:
    s = _scheduler(wave_policy(1, PlannerMode.FIXED))  # ring 2, budget 16
    s.admit("a", 0, 40)
    s.cut("a", 20)
    s.cut("a", 0)  # already scheduled, or past the end: ignored
    s.cut("a", 40)
    s.cut("nobody", 8)
    w1, w2 = s.next_wave(), s.next_wave()
    assert _spans(w1) == [("a", 0, 16)] and _spans(w2) == [("a", 16, 20)]
    s.wave_done(w1.wave_id)
    assert _spans(s.next_wave()) == [("a", 20, 36)]  # the cut is used up


def test_bad_admissions_are_bugs() -> None:
    s = _scheduler(wave_policy(1, PlannerMode.MPU))
    s.admit("a", 0, 4)
    with pytest.raises(InvariantError, match="twice"):
        s.admit("a", 0, 4)
    with pytest.raises(InvariantError, match="cached 4 of 4"):
        s.admit("b", 4, 4)
