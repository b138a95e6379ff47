"""FlowControl, the router's bounded cluster queue (sans-IO): exact admissions, waits,
rejections with their predictions and retry hints, priority first, tenants in turn."""

from __future__ import annotations

import pytest

from prefill_router.flow_control import FlowConfig, FlowControl, Verdict, Waiter


def waiter(rid: str, tenant: str = "t", priority: int = 0, cost_s: float = 1.0) -> Waiter:
    return Waiter(rid, priority, tenant, cost_s)


def test_admits_up_to_the_slots_of_the_ready_pipelines_then_queues_then_rejects():
    flow = FlowControl(FlowConfig(max_inflight_per_pipeline=2, max_queue=2))
    verdicts = [flow.offer(waiter(f"r{i}"), 0.5, None, 2).verdict for i in range(7)]
    assert verdicts == [Verdict.ADMIT] * 4 + [Verdict.WAIT] * 2 + [Verdict.QUEUE_FULL]
    assert (flow.inflight, flow.num_waiting) == (4, 2)
    # the full-queue rejection predicts its wait: the queue's cost over 2 pipelines
    full = flow.offer(waiter("r7"), 0.5, None, 2)
    assert full == (Verdict.QUEUE_FULL, 0.5 + 2.0 / 2, 1.5)
    flow.check_integrity()


def test_a_request_predicted_past_its_deadline_is_rejected_with_how_late_it_would_be():
    flow = FlowControl(FlowConfig(max_inflight_per_pipeline=1, max_queue=8))
    assert flow.offer(waiter("a"), 2.0, 1.0, 1) == (Verdict.DEADLINE, 2.0, 1.0)
    assert flow.offer(waiter("b"), 0.5, 1.0, 1).verdict is Verdict.ADMIT
    assert flow.offer(waiter("c", cost_s=3.0), 0.5, None, 1).verdict is Verdict.WAIT
    # waiting adds the cost queued ahead (3 s): 0.5 + 3 > 2
    assert flow.offer(waiter("d"), 0.5, 2.0, 1) == (Verdict.DEADLINE, 3.5, 1.5)
    # ... but not a lower priority's: "e" goes before "c"
    assert flow.offer(waiter("e", priority=1), 0.5, 2.0, 1).verdict is Verdict.WAIT
    assert (flow.inflight, flow.num_waiting) == (1, 2)
    flow.check_integrity()


def test_a_request_predicted_to_wait_past_the_wait_bound_is_rejected_deadline_or_not():
    flow = FlowControl(FlowConfig(max_inflight_per_pipeline=1, max_queue=8, max_wait_s=1.0))
    # free slot, but 1.5 s of work queued on the best pipeline (prediction 2.0, own cost 0.5)
    assert flow.offer(waiter("a", cost_s=0.5), 2.0, None, 1) == (Verdict.WAIT_LIMIT, 2.0, 0.5)
    assert flow.offer(waiter("b", cost_s=0.5), 1.4, None, 1).verdict is Verdict.ADMIT  # 0.9 s
    assert flow.offer(waiter("c", cost_s=0.8), 0.5, None, 1).verdict is Verdict.WAIT
    # waiting adds the cost queued ahead (0.8 s): 0.3 + 0.8 - 0.25 < 1, 0.5 + 0.8 - 0.25 > 1
    assert flow.offer(waiter("d", cost_s=0.25), 0.3, 60.0, 1).verdict is Verdict.WAIT
    late = flow.offer(waiter("e", cost_s=0.25), 0.5, 60.0, 1)
    assert late.verdict is Verdict.WAIT_LIMIT and late[1:] == pytest.approx((0.5 + 1.05, 0.3))
    # the deadline still rules first: a request late for it is told how late
    assert flow.offer(waiter("f", cost_s=0.25), 0.5, 1.0, 1).verdict is Verdict.DEADLINE
    assert (flow.inflight, flow.num_waiting) == (1, 2)
    flow.check_integrity()
    with pytest.raises(ValueError):
        FlowConfig(max_wait_s=-1.0)


def test_waiters_go_by_priority_then_tenant_by_tenant_in_arrival_order():
    flow = FlowControl(FlowConfig(max_inflight_per_pipeline=1, max_queue=16))
    assert flow.offer(waiter("busy"), 0.1, None, 1).verdict is Verdict.ADMIT
    queued = [waiter("a1", "A"), waiter("a2", "A"), waiter("a3", "A"), waiter("b1", "B"),
              waiter("c1", "C"), waiter("low", "B", priority=-1), waiter("hi", "C", priority=5),
              waiter("b2", "B")]  # fmt: skip
    for w in queued:
        assert flow.offer(w, 0.1, None, 1).verdict is Verdict.WAIT
    order = []
    while flow.num_waiting:
        (next_up,) = flow.release(1)
        order.append(next_up.request_id)
        flow.check_integrity()
    assert order == ["hi", "a1", "b1", "c1", "a2", "b2", "a3", "low"]
    assert flow.inflight == 1


def test_a_withdrawn_waiter_leaves_the_queue_and_its_cost():
    flow = FlowControl(FlowConfig(max_inflight_per_pipeline=1, max_queue=4))
    flow.offer(waiter("busy"), 0.1, None, 1)
    gone, stays = waiter("gone", "A", cost_s=5.0), waiter("stays", "B")
    flow.offer(gone, 0.1, None, 1)
    flow.offer(stays, 0.1, None, 1)
    assert flow.withdraw(gone) and not flow.withdraw(gone)
    flow.check_integrity()
    # only "stays" (1 s) is ahead now
    assert flow.offer(waiter("x"), 0.25, 0.5, 1) == (Verdict.DEADLINE, 1.25, 0.75)
    assert [w.request_id for w in flow.release(1)] == ["stays"]
    assert flow.num_waiting == 0


def test_more_ready_pipelines_drain_the_queue_and_none_ready_lets_everything_through():
    flow = FlowControl(FlowConfig(max_inflight_per_pipeline=1, max_queue=4))
    flow.offer(waiter("busy"), 0.1, None, 1)
    for rid in ("w1", "w2", "w3"):
        flow.offer(waiter(rid), 0.1, None, 1)
    assert [w.request_id for w in flow.drain(2)] == ["w1"]
    # no pipeline ready: nothing waits blind (the router answers UNAVAILABLE at once)
    assert [w.request_id for w in flow.drain(0)] == ["w2", "w3"]
    assert (flow.inflight, flow.num_waiting) == (4, 0)
    flow.check_integrity()


def test_no_bound_admits_everything_and_only_the_deadline_turns_requests_away():
    flow = FlowControl(FlowConfig(max_inflight_per_pipeline=0, max_queue=0))
    assert all(flow.offer(waiter(str(i)), 0.1, None, 1).verdict is Verdict.ADMIT
               for i in range(100))  # fmt: skip
    assert flow.offer(waiter("late"), 0.2, 0.1, 1).verdict is Verdict.DEADLINE


def test_release_without_a_slot_is_a_bug_and_bad_config_is_refused():
    with pytest.raises(RuntimeError):
        FlowControl(FlowConfig()).release(1)
    with pytest.raises(ValueError):
        FlowConfig(max_queue=-1)


def _busy_and_quiet_tenants(cost: float) -> FlowControl:
    """One slot, held; tenant A has 40 requests waiting, tenants q0..q7 one each."""
    flow = FlowControl(FlowConfig(max_inflight_per_pipeline=1, max_queue=1024))
    assert flow.offer(waiter("busy", "x", cost_s=cost), cost, None, 1).verdict is Verdict.ADMIT
    for i in range(40):
        assert flow.offer(waiter(f"a{i}", "A", cost_s=cost), cost, None, 1).verdict is Verdict.WAIT
    for j in range(8):
        assert flow.offer(waiter(f"q{j}", f"q{j}", cost_s=cost), cost, None, 1).verdict is (
            Verdict.WAIT
        )
    return flow


def _admitted_after(flow: FlowControl, mine: Waiter, cost: float) -> float:
    """Seconds until ``mine`` gets the slot when each admitted request holds it ``cost`` s
    and every tenant but A sends its next request as one is served (clients in a loop)."""
    t, n = 0.0, 0
    while True:
        t += cost
        (admitted,) = flow.release(1)
        flow.check_integrity()
        if admitted is mine:
            return t
        if admitted.tenant != "A":
            n += 1
            again = waiter(f"{admitted.tenant}-{n}", admitted.tenant, cost_s=cost)
            flow.offer(again, cost, None, 1)


def test_the_wait_is_predicted_by_tenant_turns_not_by_the_queue_total():
    # The 30-minute soak (one tenant sending over half of the tenant traffic) turned no
    # tenant request away while the slowest answers took 20-30 s: each offer predicted the
    # queue's total, a few seconds. 18 then ended DEADLINE_EXCEEDED at their 30 s deadline
    # (no answer before), the ten listed with their deadline inside a burst of long prompts.
    # Tenants take turns: A's 41st request waits 40 rounds of A and the 8 others, however
    # few of theirs wait now.
    cost = 0.1
    flow = _busy_and_quiet_tenants(cost)
    offer = flow.offer(waiter("a-late", "A", cost_s=cost), cost, 10.0, 1)
    assert offer.verdict is Verdict.DEADLINE  # at once, not at its deadline
    assert offer.predicted_s == pytest.approx(cost + 40 * cost + 41 * 8 * cost)
    mine = waiter("a-new", "A", cost_s=cost)
    predicted = flow.offer(mine, cost, None, 1).predicted_s
    waited = _admitted_after(flow, mine, cost)
    assert waited == pytest.approx(40 * 9 * cost + cost)  # 36.1 s, where 4.9 s was predicted
    assert waited <= predicted <= waited + 8 * cost + 1e-9  # at most one turn of the others
    # a quiet tenant's request goes after one request of each tenant, not after A's backlog
    flow = _busy_and_quiet_tenants(cost)
    quiet = waiter("q9-0", "q9", cost_s=cost)
    assert flow.offer(quiet, cost, 2.0, 1) == (Verdict.WAIT, pytest.approx(10 * cost), 0.0)
    assert _admitted_after(flow, quiet, cost) == pytest.approx(10 * cost)
