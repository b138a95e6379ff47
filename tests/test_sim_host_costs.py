"""Host costs charged symmetrically: what each policy pays, where, and exact small schedules."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest

from prefill_node.core.policy import trtllm_policy, wave_policy
from prefill_node.core.wave import ScheduledChunk
from prefill_node.sim.executor_loops import LoopCosts, WaveHostWork
from prefill_node.sim.presets import InvalidRequestError, get_preset
from prefill_node.sim.simulator import Simulator
from prefill_node.sim.stage_hosts import StageHosts
from prefill_node.sim.trtllm_costs import HOST_COST_CHARGES, TRTLLM_PP_MEASURED, TrtllmLoopCosts
from prefill_node.sim.workloads import WorkloadKind, WorkloadSpec
from tests.test_sim import TOY

COSTS = TrtllmLoopCosts(
    send_s_per_token=1e-7,
    recv_s_per_token=2e-7,
    merge_s_per_token=3e-7,
    prepare_s_per_token=4e-7,
    retire_walks=2.0,
    iteration_s=5e-4,
)


def _sim(policy, trtllm: TrtllmLoopCosts, n: int = 1, preset=TOY):
    spec = WorkloadSpec(WorkloadKind.SUFFIX, 4096, 1, n, 64, suffix_tokens=512)
    sim = Simulator(replace(preset, trtllm=trtllm), spec, policy)
    return sim, sim.run()


def test_stage_hosts_prepare_ahead_serially_and_retire_after_the_gpu():
    hosts = StageHosts(3, LoopCosts(1e-6, 0.0, 1e-5, COSTS))
    work = WaveHostWork(0, 0, 0, chunk_prompt_tokens=1000)
    hosts.plan(7, 0.0, work)  # 0.5 ms + 1000 x 0.4 us = 0.9 ms per stage, s hops later
    assert [hosts.ready_at(s, 7) for s in range(3)] == pytest.approx([9e-4, 9.1e-4, 9.2e-4])
    hosts.plan(8, 1e-4, work)  # each stage's host is still busy with wave 7
    assert [hosts.ready_at(s, 8) for s in range(3)] == pytest.approx([1.8e-3, 1.81e-3, 1.82e-3])
    hosts.retire(1, 5e-3, 1000)  # two walks of 1,000 tokens at 1 us after its GPU at 5 ms
    hosts.plan(9, 5e-3, work)
    assert hosts.ready_at(0, 9) == pytest.approx(5.9e-3)
    assert hosts.ready_at(1, 9) == pytest.approx(5e-3 + 2e-3 + 9e-4)
    assert hosts.host_busy_s[1] == pytest.approx(3 * 9e-4 + 2e-3)
    hosts.launched(0, 7)
    with pytest.raises(Exception, match="never planned"):
        hosts.ready_at(0, 7)


def test_wave_single_request_pays_admission_transport_and_stage_loop_work_exactly():
    sim, res = _sim(wave_policy(2), COSTS)
    chunk = [ScheduledChunk("req-0", 3584, 512)]
    t0, t1 = sim.roof.stage_time(0, chunk), sim.roof.stage_time(1, chunk)
    # the round: 3 phases of 1 ms, our core's 1 us per prompt token, and moving the request
    # to every stage and creating it there (send + recv + merge per token)
    round_s = 3e-3 + 1e-6 * 4096 + (1e-7 + 2e-7 + 3e-7) * 4096
    loop = 5e-4 + 4e-7 * 4096  # iteration + the whole prompt as a list, for its one chunk
    expected = round_s + loop + t0 + sim.roof.transfer_time(512) + t1
    assert res.p50_latency_s == pytest.approx(expected, rel=1e-9)
    assert res.loop_stall_s == pytest.approx(loop, rel=1e-9)  # stage 0 waited for its host
    retire = 2 * TOY.rounds.walk_s_per_token * 4096  # two walks of the prompt, 27 ns a token
    assert sim.hosts.host_busy_s == pytest.approx([loop + retire] * 2)


@pytest.mark.parametrize("field", ["prepare_s_per_token", "iteration_s", "retire_walks"])
def test_loop_costs_wave_keeps_slow_both_policies(field):
    """A cost HOST_COST_CHARGES lists for both loops lengthens both policies' runs."""
    base = replace(COSTS, **{field: 0.0})
    dear = replace(COSTS, **{field: getattr(COSTS, field) * 20})
    # walks of 1 us a token: the retire work outlasts the next request's admission round
    preset = replace(TOY, rounds=replace(TOY.rounds, walk_s_per_token=1e-6))
    for policy in (wave_policy(2), trtllm_policy(2)):
        cheap_run = _sim(policy, base, n=3, preset=preset)[1]
        dear_run = _sim(policy, dear, n=3, preset=preset)[1]
        assert dear_run.makespan_s > cheap_run.makespan_s, (field, policy.name)


def test_scheduler_walk_base_is_charged_to_trtllm_only():
    """The capacity scheduler's per-iteration prefix walk is the exemption WavePP's escrow
    buys: wave's timeline does not depend on it at all."""
    dear = replace(COSTS, walk_base_s_per_token=1e-6)
    wave = [_sim(wave_policy(2), c, n=3)[1] for c in (COSTS, dear)]
    lock = [_sim(trtllm_policy(2), c, n=3)[1] for c in (COSTS, dear)]
    assert wave[0] == wave[1]
    assert lock[1].makespan_s > lock[0].makespan_s


def test_transport_is_on_wave_rounds_and_on_trtllm_loops():
    """Request transport and creation cost both policies, on different timelines."""
    for policy in (wave_policy(2), trtllm_policy(2)):
        free = _sim(policy, replace(COSTS, send_s_per_token=0.0, recv_s_per_token=0.0))[1]
        paid = _sim(policy, COSTS)[1]
        assert paid.p50_latency_s > free.p50_latency_s, policy.name
    wave_gap = (
        _sim(wave_policy(2), COSTS)[1].p50_latency_s
        - (
            _sim(wave_policy(2), replace(COSTS, send_s_per_token=0.0, recv_s_per_token=0.0))[1]
        ).p50_latency_s
    )
    assert wave_gap == pytest.approx((1e-7 + 2e-7) * 4096, rel=1e-9)  # once, on the round


def test_host_time_scale_multiplies_every_host_cost_of_both_policies():
    scaled = replace(TOY, host_time_scale=2.0, trtllm=COSTS).host_scaled()
    assert scaled.host_time_scale == 1.0
    assert scaled.rounds.host_s_per_token == pytest.approx(2 * TOY.rounds.host_s_per_token)
    assert scaled.rounds.walk_s_per_token == pytest.approx(2 * TOY.rounds.walk_s_per_token)
    assert scaled.rounds.phase_latency_s == TOY.rounds.phase_latency_s  # messages, not host
    assert scaled.trtllm == replace(
        COSTS.scaled(2.0), blocking_request_send=COSTS.blocking_request_send
    )
    assert scaled.trtllm.iteration_s == pytest.approx(1e-3)
    for policy in (wave_policy(2), trtllm_policy(2)):
        one = _sim(policy, COSTS)[1]
        two = _sim(policy, COSTS, preset=replace(TOY, host_time_scale=2.0))[1]
        assert two.p50_latency_s > one.p50_latency_s, policy.name
    with pytest.raises(InvalidRequestError, match="host_time_scale"):
        replace(TOY, host_time_scale=0.0)


def test_every_host_cost_is_listed_once_with_a_timeline_for_each_policy():
    assert len(HOST_COST_CHARGES) == len({c for c, _, _ in HOST_COST_CHARGES})
    exempt = [w for _, _, w in HOST_COST_CHARGES if w.startswith("EXEMPT")]
    assert len(exempt) == 2 and all(": " in w for w in exempt)  # each names its mechanism
    for f in fields(TrtllmLoopCosts):  # every cost the executor model has is placed
        if f.type == "float":
            assert any(f.name in c for c, _, _ in HOST_COST_CHARGES), f.name


def test_gpu_presets_share_one_set_of_measured_host_constants():
    glm, mini, kimi = (get_preset(n) for n in ("glm5-pp4", "minimax-pp4", "kimi-pp8"))
    assert glm.trtllm == mini.trtllm == kimi.trtllm == TRTLLM_PP_MEASURED
    assert glm.host_time_scale == mini.host_time_scale == kimi.host_time_scale
    for field in ("host_s_per_token", "host_s_per_cached_token", "walk_s_per_token"):
        assert getattr(glm.rounds, field) == getattr(mini.rounds, field)
        assert getattr(glm.rounds, field) == getattr(kimi.rounds, field)
