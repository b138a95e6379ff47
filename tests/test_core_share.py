"""Core sharing between a local pipeline's stage processes (runtime/core_share.py): the
thread split, the board across real processes, and a real pipeline that lends its cores."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prefill_node.engine.types import PrefillOptions
from prefill_node.model.reference import reference_forward
from prefill_node.model.weights import random_weights
from prefill_node.runtime.core_share import CoreBoard, CoreShare, share_threads
from prefill_node.runtime.dist_env import DistEnv, free_local_port
from prefill_node.runtime.pipeline_engine import PipelineEngine
from prefill_node.runtime.spec import ModelSource, PipelineSpec
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
    with pytest.raises(ValueError, match="rank 2 outside"):
        share_threads(2, [True, False], 2)
    with pytest.raises(ValueError, match="must be >= 1"):
        share_threads(0, [True], 0)


def test_board_is_shared_with_a_child_process() -> None:
    board = CoreBoard.create(3)
    try:
        assert board.busy() == [False, False, False]
        code = (
            "import sys; from prefill_node.runtime.core_share import CoreBoard; "
            "b = CoreBoard.attach(int(sys.argv[1]), 3); "
            "assert b.busy() == [True, False, False], b.busy(); b.set_busy(2, True); b.close()"
        )
        board.set_busy(0, True)
        subprocess.run(
            [sys.executable, "-c", code, str(board.fd)], pass_fds=(board.fd,), check=True
        )
        assert board.busy() == [True, False, True]
    finally:
        board.close()


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
