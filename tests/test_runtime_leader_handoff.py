"""LeaderHandoffs over a real RequestTable: when a hand-off resolves, how it fails, what it
cancels, when deadlines fire (no processes)."""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future

import pytest

from prefill_node.engine.types import KVPullDestination, PrefillOptions, StageKVManifest
from prefill_node.errors import InvalidKVDestinationError, KVHandoffError
from prefill_node.kv_handoff.stage_handoff import HandoffOutcome
from prefill_node.runtime.leader_handoff import LeaderHandoffs
from prefill_node.runtime.leader_request import LeaderRequest, RequestTable

pytestmark = pytest.mark.timeout(30)


def manifest(stage: int) -> StageKVManifest:
    return StageKVManifest(stage, 2 * stage, 2 * stage + 2, (3, 4), 4, 7, 2, 8, "float32")


class Stages:
    """Two stages' report streams (stage 0 delivers in-process, stage 1 through a queue the
    receiver thread reads, as the reports plane does) and the leader's request table with
    the engine's side of it: records come (``add``), their logits arrive
    (``logits_ready``) and they go (``forget``: aborted)."""

    def __init__(self) -> None:
        self.table = RequestTable()
        self.stream: queue.SimpleQueue = queue.SimpleQueue()  # stage 1 -> the leader
        self.handoffs: LeaderHandoffs | None = None
        self.cancelled: list[str] = []
        self.settled: dict[str, tuple] = {}
        self.expired: list[str] = []
        self.done = threading.Event()

    def report(self, handoff: HandoffOutcome) -> None:
        if handoff.stage == 0:
            self.handoffs.deliver((handoff,))
        else:
            self.stream.put((handoff,))

    def receive(self, stage: int):
        assert stage == 1
        return self.stream.get()

    def settle(self, req: LeaderRequest, manifests, error) -> None:
        self.settled[req.request_id] = (manifests, error)
        self.done.set()

    def add(self, rid: str, ships: bool = True, deadline_s: float | None = None) -> None:
        dest = KVPullDestination() if ships else None
        options = PrefillOptions(rid, kv_destination=dest, deadline_s=deadline_s)
        assert self.table.add(LeaderRequest(rid, (1, 2), options, Future(), time.monotonic()))

    def logits_ready(self, rid: str) -> None:
        with self.table.cond:
            self.table.get(rid).logits_at = time.monotonic()
            self.table.logits_seen += 1
            self.table.cond.notify_all()

    def forget(self, rid: str) -> None:
        self.table.pop(rid)


@pytest.fixture
def stages():
    s = Stages()
    h = s.handoffs = LeaderHandoffs(
        2, s.table, 0.3, s.cancelled.extend, s.settle, s.expired.append, receive=s.receive
    )
    h.start()
    yield s, h
    h.stop()
    s.stream.put(None)  # the end of stage 1's stream: its receiver thread ends
    h._receivers[0].join(timeout=2)
    assert not h._receivers[0].is_alive()


def wait_for(pred, timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.002)
    assert pred()


def test_resolves_after_logits_and_every_stage_in_stage_order(stages):
    s, h = stages
    s.add("r")
    s.report(HandoffOutcome("r", 1, manifest(1)))
    s.report(HandoffOutcome("r", 1, None, "late duplicate"))  # a stage's second word is ignored
    time.sleep(0.02)
    assert "r" not in s.settled  # stage 0 missing, logits missing
    s.report(HandoffOutcome("r", 0, manifest(0)))
    time.sleep(0.02)
    assert "r" not in s.settled  # logits still missing
    s.logits_ready("r")
    wait_for(lambda: "r" in s.settled)
    assert s.settled["r"] == ((manifest(0), manifest(1)), None)
    assert s.cancelled == []


def test_rejected_destination_is_the_callers_fault_and_cancels_every_stage(stages):
    s, h = stages
    s.add("bad")
    s.report(HandoffOutcome("bad", 1, None, "InvalidTransferRequest: x", invalid_destination=True))
    wait_for(lambda: "bad" in s.settled)
    manifests, error = s.settled["bad"]
    assert manifests is None and isinstance(error, InvalidKVDestinationError)
    assert "stage 1" in str(error) and s.cancelled == ["bad"]
    h.late_output("bad")  # failed before its logits: cancelled again once they arrive
    h.late_output("bad")
    assert s.cancelled == ["bad", "bad"]


def test_unreachable_decode_and_missing_stage_fail_as_handoff_errors(stages):
    s, h = stages
    s.add("lost")
    s.logits_ready("lost")
    s.report(HandoffOutcome("lost", 0, None, "DecodeUnreachable: refused"))
    s.add("quiet")
    s.logits_ready("quiet")
    s.report(HandoffOutcome("quiet", 0, manifest(0)))
    wait_for(lambda: {"lost", "quiet"} <= set(s.settled))
    lost, quiet = s.settled["lost"][1], s.settled["quiet"][1]
    assert isinstance(lost, KVHandoffError) and "DecodeUnreachable" in str(lost)
    assert isinstance(quiet, KVHandoffError) and "stages [1]" in str(quiet)
    assert sorted(s.cancelled) == ["lost", "quiet"]


def test_deadline_fires_once_and_forget_stops_it(stages):
    s, h = stages
    s.add("d1", ships=False, deadline_s=time.monotonic() + 0.05)
    s.add("d2", ships=False, deadline_s=time.monotonic() + 0.05)
    s.forget("d2")
    wait_for(lambda: s.expired == ["d1"])
    time.sleep(0.1)
    assert s.expired == ["d1"] and s.cancelled == []  # d2 never shipped: nothing to cancel


def test_a_record_taken_out_is_neither_settled_nor_expired(stages):
    """An abort takes the record out of the table, and that is all it has to do: the
    hand-off thread ignores its outcomes and its deadline never fires."""
    s, h = stages
    s.add("gone", deadline_s=time.monotonic() + 0.05)
    s.logits_ready("gone")
    s.forget("gone")
    s.report(HandoffOutcome("gone", 0, manifest(0)))
    s.report(HandoffOutcome("gone", 1, manifest(1)))
    time.sleep(0.15)
    assert "gone" not in s.settled and s.expired == [] and s.cancelled == []


def test_outcomes_wake_the_hand_off_thread_without_any_polling():
    """Outcomes are pushed: a request whose logits are back resolves as soon as the last
    stage's outcome is delivered, and nothing asks the stages for anything meanwhile."""
    s = Stages()
    asked: list[int] = []

    def receive(stage: int):
        asked.append(stage)  # one blocking read per batch, not a poll
        return s.stream.get()

    h = s.handoffs = LeaderHandoffs(
        2, s.table, 10.0, s.cancelled.extend, s.settle, s.expired.append, receive=receive
    )
    h.start()
    try:
        s.add("r")
        s.logits_ready("r")
        s.report(HandoffOutcome("r", 0, manifest(0)))
        time.sleep(0.2)  # stage 1 silent: nothing resolves, and no one asks again
        assert "r" not in s.settled and asked == [1]
        t0 = time.monotonic()
        s.report(HandoffOutcome("r", 1, manifest(1)))
        wait_for(lambda: "r" in s.settled)
        assert time.monotonic() - t0 < 0.5 and s.settled["r"][1] is None
        assert asked == [1, 1]
    finally:
        h.stop()
        s.stream.put(None)
