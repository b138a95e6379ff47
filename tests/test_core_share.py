"""Core sharing between a local pipeline's stage processes (runtime/core_share.py): the
thread split, the board across real processes, and a real pipeline that lends its cores."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prefill_node.client.prefill_client import PrefillClient
from prefill_node.engine.types import PrefillOptions
from prefill_node.errors import InvalidRequestError
from prefill_node.model.loader_hf import save_hf_checkpoint
from prefill_node.model.reference import reference_forward
from prefill_node.model.weights import random_weights
from prefill_node.runtime.core_share import HOST_SLOTS, CoreBoard, CoreShare, share_threads
from prefill_node.runtime.dist_env import DistEnv, free_local_port
from prefill_node.runtime.engine_config import EngineConfig
from prefill_node.runtime.local_engine import LocalEngine
from prefill_node.runtime.pipeline_engine import PipelineEngine
from prefill_node.runtime.spec import ModelSource, PipelineSpec
from tests.router_harness import spawn, stop
from tests.tiny_models import TINY_LLAMA_HF, tiny_llama

HF = TINY_LLAMA_HF
SEED = 11


@pytest.mark.parametrize(
    ("rank", "busy", "budget", "base", "threads"),
    [
        (0, [True, False], 2, 1, 2),  # alone: the idle stage's core too
        (1, [False, False], 2, 1, 2),  # not yet marked: about to compute, still alone
        (0, [True, True], 2, 1, 1),  # both compute: one core each
        (0, [True, False, False, False], 4, 1, 4),
        (2, [True, False, True, False], 4, 1, 2),
        (0, [True, True, True, False], 4, 1, 2),  # one spare core: the lowest rank's
        (1, [True, True, True, False], 4, 1, 1),
        (0, [True, False, False, False], 2, 1, 2),  # 4 stages on 2 cores: never more
        (1, [True, True, False, False], 2, 1, 1),
        (0, [True, False], 4, 2, 4),  # two threads each, lent whole
    ],
)
def test_share_threads(rank, busy, budget, base, threads) -> None:
    assert share_threads(rank, busy, budget, base) == threads


@given(
    st.lists(st.booleans(), min_size=1, max_size=8),
    st.integers(1, 16),
    st.integers(1, 3),
)
def test_shares_never_exceed_the_budget(busy, budget, base) -> None:
    working = [r for r, b in enumerate(busy) if b] or [0]
    marked = [b or r == working[0] for r, b in enumerate(busy)]
    shares = [share_threads(r, marked, budget, base) for r in working]
    assert all(s >= base for s in shares)
    assert sum(shares) <= max(budget, base * len(working))
    if budget >= base * len(working):
        assert sum(shares) == budget  # every idle thread is lent


def test_share_threads_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="slot 2 outside"):
        share_threads(2, [True, False], 2)
    with pytest.raises(ValueError, match="must be >= 1"):
        share_threads(0, [True], 0)


def test_board_is_shared_with_a_child_process() -> None:
    board = CoreBoard.create(3)
    try:
        assert board.busy() == [False, False, False]
        code = (
            "import sys; from prefill_node.runtime.core_share import CoreBoard; "
            "b, slot = CoreBoard.attach(sys.argv[1]); assert slot == 2, slot; "
            "assert b.busy() == [True, False, False], b.busy(); b.set_busy(slot, True)"
        )
        board.set_busy(0, True)
        subprocess.run(
            [sys.executable, "-c", code, board.seat(2)], pass_fds=(board.fd,), check=True
        )
        assert board.busy() == [True, False, True]
    finally:
        board.close()


def test_pipelines_on_a_host_board_claim_their_own_slots_and_lend_across(tmp_path) -> None:
    """Two pipelines joining one host board get disjoint slots; a stage of one computing
    alone takes the other's idle cores, and gives them back when that one computes."""
    path = tmp_path / "cores"
    first, second = CoreBoard.host(path, 2), CoreBoard.host(path, 1)
    calls: list[int] = []
    try:
        assert first.slots == (0, 1) and second.slots == (2,)
        me = CoreShare(first, first.slots[0], budget=3, set_threads=calls.append)
        me.computing(True)
        me.adjust()  # every other slot idle: all three cores
        second.set_busy(second.slots[0], True)  # the other pipeline computes
        me.adjust()
        assert calls == [3, 2]
        assert first.busy()[:3] == [True, False, True]
    finally:
        first.close()
    again = CoreBoard.host(path, 2)  # a closed pipeline's slots are free again
    try:
        assert again.slots == (0, 1) and again.busy()[:2] == [False, False]
    finally:
        again.close()
        second.close()


def test_a_crashed_pipelines_slots_are_claimed_again_and_reset(tmp_path) -> None:
    """A pipeline killed mid-wave leaves its flags busy; the kernel drops its slot locks
    with the process, so the next claim gets those slots, reset to idle."""
    path = tmp_path / "cores"
    code = (
        "import sys, time; from prefill_node.runtime.core_share import CoreBoard; "
        "b = CoreBoard.host(sys.argv[1], 2); [b.set_busy(s, True) for s in b.slots]; "
        "print(b.slots, flush=True); time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE,
                             text=True)  # fmt: skip
    try:
        assert child.stdout.readline().strip() == "(0, 1)"
        held = CoreBoard.host(path, 1)
        assert held.slots == (2,) and held.busy()[:2] == [True, True]  # the child's
    finally:
        child.kill()
        child.wait()
    try:
        after = CoreBoard.host(path, 2)
        assert after.slots == (0, 1) and after.busy()[:2] == [False, False]
        after.close()
    finally:
        held.close()


def test_a_full_host_board_says_how_many_slots_are_free(tmp_path) -> None:
    path = tmp_path / "cores"
    boards = [CoreBoard.host(path, 16) for _ in range(HOST_SLOTS // 16 - 1)]
    try:
        with pytest.raises(InvalidRequestError, match="17 stages need 17 free slots, 16 of"):
            CoreBoard.host(path, 17)
        last = CoreBoard.host(path, 16)  # the failed claim left nothing held
        last.close()
    finally:
        for board in boards:
            board.close()


def test_a_core_board_needs_core_sharing() -> None:
    with pytest.raises(InvalidRequestError, match="drop --no-core-share"):
        EngineConfig(core_share=False, core_board=Path("/dev/shm/x"))


def test_core_share_switches_threads_at_layer_boundaries() -> None:
    board = CoreBoard.create(2)
    calls: list[int] = []
    try:
        me = CoreShare(board, 0, budget=2, set_threads=calls.append)
        me.computing(True)
        me.adjust()  # neighbour idle: two threads
        board.set_busy(1, True)
        me.adjust()  # neighbour busy: back to one
        me.adjust()
        board.set_busy(1, False)
        me.adjust()
        me.computing(False)  # wave over: one thread, marked idle
        assert calls == [2, 1, 2, 1]
        assert (me.layers, me.wide_layers) == (4, 2)
        assert board.busy() == [False, False]
    finally:
        board.close()


def _spec() -> PipelineSpec:
    return PipelineSpec(
        model=ModelSource(config=HF, seed=SEED, name="tiny-llama"),
        layer_ranges=((0, 2), (2, 4)),
        stage_blocks=(64, 64),
        block_size=4,
        max_wave_tokens=8,
        min_wave_tokens=8,
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("core_share", [True, False])
def test_a_lone_prompt_borrows_the_idle_stage_core(core_share: bool) -> None:
    """One prompt in 8-token chunks: its first chunk runs on stage 0 while stage 1 idles, its
    last on stage 1 while stage 0 idles (a stage marks itself idle before it sends the
    wave on), so both stages run layers wide - and the logits still match the
    single-process reference. With one allowed core there is nothing to lend (the budget is
    the process's allowed cores), so there the test requires that nothing was lent."""
    spec = _spec()
    env = DistEnv(0, spec.num_stages, "127.0.0.1", free_local_port())
    engine = PipelineEngine.start(spec, env, startup_timeout_s=60, core_share=core_share)
    try:
        rng = random.Random(3)
        prompt = [rng.randrange(HF["vocab_size"]) for _ in range(40)]
        result = engine.submit(prompt, PrefillOptions(top_logprobs=5)).result(timeout=60)
        model = tiny_llama()
        logits, _ = reference_forward(model, random_weights(model, SEED), prompt)
        want = torch.log_softmax(logits.float(), dim=-1)
        for token, logprob in result.top_logprobs:
            assert abs(logprob - want[token].item()) < 1e-4
        wide = [s.wide_layers for s in engine.stage_stats()]
        assert [s.wide_layers for s in engine.load().stages] == wide  # GetLoad, /metrics
        if core_share and len(os.sched_getaffinity(0)) >= 2:
            assert all(w > 0 for w in wide), wide
        else:
            assert wide == [0, 0]
        engine.debug_check_integrity()
    finally:
        engine.shutdown()


def _wide_layers(metrics_port: int) -> int:
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    found = re.search(r'^wavepp_stage_wide_layers_total\{stage="0"\} (\S+)$', text, re.M)
    assert found is not None, text
    return int(float(found.group(1)))


@pytest.mark.timeout(180)
def test_one_stage_pipelines_on_a_host_board_lend_each_other_their_cores(tmp_path) -> None:
    """Two one-stage `wavepp serve` processes started with the same --core-board: a prompt
    sent to one runs its layers on the other's idle core too (two threads on two allowed
    cores), the other ran nothing wide; a one-stage pipeline without the board has no one
    to borrow from. The answers equal the single-process reference either way."""
    model = tiny_llama("tiny-cores", max_position_embeddings=256)
    model_dir = tmp_path / "model"
    save_hf_checkpoint(model_dir, model, random_weights(model, seed=SEED))
    rng = random.Random(5)
    prompt = [rng.randrange(model.vocab_size) for _ in range(48)]
    logits, _ = reference_forward(model, random_weights(model, SEED), prompt)
    want = torch.log_softmax(logits.float(), dim=-1)

    def start(*extra: str):
        return spawn(
            ["serve", "--model", str(model_dir), "--stages", "1", "--num-blocks", "64",
             "--block-size", "4", "--max-chunk-tokens", "8", "--host", "127.0.0.1", "--port",
             "0", "--metrics-host", "127.0.0.1", "--metrics-port", "0", "--threads", "1",
             "--log-level", "WARNING", "--no-kv-shipping", *extra],
            "wavepp serve:",
        )  # fmt: skip

    board = ("--core-board", str(tmp_path / "cores"))
    procs = [start(*board), start(*board), start()]
    try:
        (_, busy_port, busy_metrics), (_, _, idle_metrics), (_, _, alone_metrics) = procs
        with PrefillClient(f"127.0.0.1:{busy_port}") as client:
            result = client.prefill(prompt, top_logprobs=5).result
        assert result.top_logprobs
        for token, logprob in result.top_logprobs:
            assert abs(logprob - want[token].item()) < 1e-4
        lent = len(os.sched_getaffinity(0)) >= 2  # one allowed core: nothing to lend
        assert (_wide_layers(busy_metrics) > 0) == lent
        assert _wide_layers(idle_metrics) == 0
        with PrefillClient(f"127.0.0.1:{procs[2][1]}") as client:
            client.prefill(prompt)
        assert _wide_layers(alone_metrics) == 0  # no board: no neighbour to borrow from
    finally:
        for proc, _, _ in procs:
            stop(proc)


def test_a_core_board_in_one_process_takes_one_stage(tmp_path) -> None:
    """Every stage in one process would share its torch threads: refused, naming the fix,
    and the failed start leaves no slot claimed."""
    model = tiny_llama()
    config = EngineConfig(stages=2, block_size=4, max_wave_tokens=8, num_blocks=16,
                          core_board=tmp_path / "cores")  # fmt: skip
    with pytest.raises(InvalidRequestError, match="needs --stages 1"):
        LocalEngine.from_weights(model, random_weights(model, SEED), config)
    board = CoreBoard.host(tmp_path / "cores", HOST_SLOTS)
    board.close()
