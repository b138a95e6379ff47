"""TensorRT-LLM PP executor loops: request broadcast chain, blocking forward, ring, retire."""

from __future__ import annotations

from dataclasses import replace

import pytest

from prefill_node.core.policy import trtllm_policy
from prefill_node.core.wave import ScheduledChunk
from prefill_node.sim.executor_loops import ExecutorLoops, LoopCosts, WaveHostWork
from prefill_node.sim.simulator import Simulator
from prefill_node.sim.trtllm_costs import (
    TRTLLM_PP_MEASURED,
    InvalidLoopCostError,
    TrtllmLoopCosts,
)
from prefill_node.sim.workloads import WorkloadKind, WorkloadSpec
from tests.test_sim import TOY, run

COSTS = TrtllmLoopCosts(
    send_s_per_token=1e-7,
    recv_s_per_token=2e-7,
    merge_s_per_token=3e-7,
    prepare_s_per_token=4e-7,
    retire_walks=2.0,
    walk_base_s_per_token=1e-8,
)
WORK = WaveHostWork(
    pass_walk_tokens=1000,
    batch_walk_tokens=400,
    first_chunk_tokens=500,
    pass_prompt_tokens=2000,
    batch_prompt_tokens=800,
    new_request_tokens=1000,
    chunk_prompt_tokens=600,
    retire_tokens=300,
)


def _loops(blocking: bool, stages: int = 3) -> ExecutorLoops:
    trt = replace(COSTS, blocking_request_send=blocking)
    return ExecutorLoops(stages, LoopCosts(1e-6, 2e-6, 1e-5, trt))


def test_new_prompts_are_pickled_down_the_ranks_before_each_rank_schedules():
    loops = _loops(blocking=False)
    # rank 0: pickle 1000 tokens (0.1 ms), merge them (0.3 ms), then its pass walks
    # 1000 matched + 2000 prompt tokens (1.02 ms); add_sequence 500 (1 ms), get_tokens 600
    assert loops.fetch_done_at(1000) == pytest.approx(4e-4)
    k, launch0 = loops.begin(4e-4, WORK)
    assert (k, launch0) == (0, pytest.approx(4e-4 + 1.02e-3 + 1.24e-3))
    # rank 1 unpickles 0.1 ms + one hop after rank 0 started pickling, re-pickles for rank 2
    # and merges (fetched at 0.71 ms), but the schedule only comes at 1.42 + 0.01 ms; then
    # can_schedule (0.408 ms), the replayed pass (1.02 ms) and its local work (1.24 ms)
    assert loops.launch_time(1, 0) == pytest.approx(1.43e-3 + 0.408e-3 + 1.02e-3 + 1.24e-3)
    assert loops.launch_time(2, 0) == pytest.approx(1.44e-3 + 2.668e-3)
    # host work charged: fetch (send + merge on rank 0; recv + send + merge on rank 1)
    assert loops.host_busy_s[0] == pytest.approx(4e-4 + 1.02e-3 + 1.24e-3)
    assert loops.host_busy_s[1] == pytest.approx(6e-4 + 2.668e-3)
    assert loops.host_busy_s[2] == pytest.approx(5e-4 + 2.668e-3)


def test_blocking_forward_waits_for_the_next_rank_to_reach_its_loop_top():
    free = _loops(blocking=False)
    block = _loops(blocking=True)
    for loops in (free, block):
        loops.begin(loops.fetch_done_at(1000), WORK)
    # wave 0 blocking: rank 1 sits at its top already, the send costs one hop more
    assert block.launch_time(0, 0) == pytest.approx(free.launch_time(0, 0) + 1e-5)
    # wave 1: rank 0's loop is back at its top at its launch of wave 0 (2.66 ms), but with
    # a blocking send its fetch returns only once rank 1 launched wave 0 (4.108 ms) + hop
    assert free.fetch_done_at(1000) == pytest.approx(2.66e-3 + 1e-4 + 3e-4)
    assert block.launch_time(1, 0) == pytest.approx(4.108e-3)
    assert block.fetch_done_at(1000) == pytest.approx(4.108e-3 + 1e-5 + 3e-4)
    assert block.fetch_done_at(0) == pytest.approx(2.67e-3)  # empty payload: eager send
    block.begin(block.fetch_done_at(1000), WORK)
    # wave 2 needs GPU 0 done with wave 0 (top of rank 0), then rank 1's top: GPU 1 too
    assert block.leader_free_at() is None
    block.gpu_done(0, 0, 5e-3)
    assert block.leader_free_at() == pytest.approx(max(block.launch_time(0, 1), 5e-3))
    assert block.fetch_done_at(1000) is None
    block.gpu_done(1, 0, 9e-3)
    top1 = max(block.launch_time(1, 1), 9e-3)
    assert block.fetch_done_at(1000) == pytest.approx(top1 + 1e-5 + 3e-4)


def test_ring_and_retirement_gate_the_top_of_iteration_p():
    loops = _loops(blocking=False)
    done = {}
    for k in range(3):
        loops.begin(loops.fetch_done_at(1000), WORK)
        for s in range(3):
            done[s, k] = loops.launch_time(s, k) + 1e-3 * (s + 1)
            if k < 2:
                loops.gpu_done(s, k, done[s, k])
    for s in range(3):
        loops.gpu_done(s, 2, done[s, 2])
    # rank 0 at wave 3 waits for the last rank's sample state of wave 0 (sent after it
    # launched wave 1), one hop on, then retires wave 0: two walks of its 300 tokens
    ring = max(done[2, 0], loops.launch_time(2, 1)) + 1e-5
    expect = max(loops.launch_time(0, 2), done[0, 1], ring) + 2 * 1e-6 * 300
    assert loops.leader_free_at() == pytest.approx(expect)
    assert loops.fetch_done_at(0) == pytest.approx(expect)


def test_loop_costs_reject_negative_values():
    with pytest.raises(InvalidLoopCostError, match="recv_s_per_token"):
        TrtllmLoopCosts(recv_s_per_token=-1.0)


def _single(trtllm: TrtllmLoopCosts):
    preset = replace(TOY, trtllm=trtllm)
    spec = WorkloadSpec(WorkloadKind.SUFFIX, 4096, 1, 1, 64, suffix_tokens=512)
    sim = Simulator(preset, spec, trtllm_policy(2))
    return sim.run(), sim.roof, preset


def test_single_request_pays_broadcast_conversions_and_replay_exactly():
    t = TRTLLM_PP_MEASURED
    res, roof, p = _single(t)
    walk, add, hop, n = p.rounds.walk_s_per_token, p.rounds.host_s_per_token, 1e-5, 4096
    pass_walk = walk * 3584 + t.walk_base_s_per_token * n
    fetch0 = t.send_s_per_token * n + hop + t.merge_s_per_token * n  # blocking, rank 1 idle
    launch0 = fetch0 + pass_walk + (add + t.prepare_s_per_token) * n
    fetch1 = t.send_s_per_token * n + hop + (t.recv_s_per_token + t.merge_s_per_token) * n
    launch1 = max(fetch1, fetch0 + pass_walk + hop) + 2 * pass_walk
    launch1 += (add + t.prepare_s_per_token) * n
    chunk = [ScheduledChunk("req-0", 3584, 512)]
    arrive1 = launch0 + roof.stage_time(0, chunk) + roof.transfer_time(512)
    expected = max(launch1, arrive1) + roof.stage_time(1, chunk)
    assert res.p50_latency_s == pytest.approx(expected, rel=1e-9)
    assert _single(t)[0] == res  # deterministic


def test_prompt_costs_slow_trtllm_and_runs_stay_deterministic():
    measured = replace(TOY, trtllm=TRTLLM_PP_MEASURED)
    base = run(WorkloadKind.SUFFIX, 8, trtllm_policy(2))
    lock = run(WorkloadKind.SUFFIX, 8, trtllm_policy(2), preset=measured)
    assert lock.throughput_tok_s < base.throughput_tok_s
    assert lock.completed == base.completed == 24
    assert run(WorkloadKind.SUFFIX, 8, trtllm_policy(2), preset=measured) == lock


def test_mixed_workload_with_every_cost_completes_with_integrity():
    measured = replace(TOY, trtllm=TRTLLM_PP_MEASURED)
    res = run(WorkloadKind.MIXED, 4, trtllm_policy(2), preset=measured, n=12, check=True)
    assert (res.completed, res.rejected) == (12, 0)


def test_an_idle_loop_fetches_each_lone_request_when_it_arrives():
    # c=1: every request reaches an idle rank 0, whose loop top is long past; its fetch
    # (pickling, the blocking forward, merging) starts at the arrival, so each of the
    # three requests waits exactly as long as the first.
    preset = replace(TOY, trtllm=TRTLLM_PP_MEASURED)
    spec = WorkloadSpec(WorkloadKind.SUFFIX, 4096, 1, 3, 64, suffix_tokens=512)
    sim = Simulator(preset, spec, trtllm_policy(2))
    sim.run()
    first, *rest = [r.latency for r in sim.records]
    assert rest == [pytest.approx(first, rel=1e-9)] * 2
    assert first == pytest.approx(_single(TRTLLM_PP_MEASURED)[0].p50_latency_s, rel=1e-9)
