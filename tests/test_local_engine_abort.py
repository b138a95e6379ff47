"""LocalEngine.abort: a running request is dropped from the schedule (its stages release it
once its chunks in flight are back), a queued one never starts; both fail with
RequestAbortedError at once and leave no block held."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from prefill_node.engine.types import PrefillOptions
from prefill_node.errors import RequestAbortedError
from tests.grpc_harness import stage_used_blocks, tiny_local_engine, wait_until

LONG = list(range(1, 61))  # 15 blocks of 4, in waves of at most 16 tokens


def _run(engine, prompt, request_id):
    return engine.submit(prompt, PrefillOptions(request_id=request_id)).result()


def test_abort_stops_a_running_request_and_frees_its_blocks():
    engine = tiny_local_engine(stage_delay_s=0.1)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_run, engine, LONG, "victim")
        # admitted: reserved on every stage AND the leader's verdict applied (the stages
        # reserve during the round, before the leader knows; an abort then is "before")
        wait_until(
            lambda: stage_used_blocks(engine) == [15, 15] and engine.load().inflight_requests == 1,
            what="admission",
        )
        assert engine.abort("victim") is True
        with pytest.raises(RequestAbortedError, match="'victim' was aborted after"):
            pending.result(10)
    wait_until(lambda: stage_used_blocks(engine) == [0, 0], 10, "the stages released it")
    assert engine.abort("victim") is False
    assert _run(engine, [1, 2, 3], "after").prompt_tokens == 3
    engine.check_integrity()
    engine.shutdown()


def test_abort_drops_a_queued_request_before_it_starts():
    # 16 blocks: LONG holds 15, so the second request waits for capacity (the escrow
    # headroom keeps a quarter of a stage free while another request holds a reservation)
    engine = tiny_local_engine(num_blocks=16, stage_delay_s=0.1)
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(_run, engine, LONG, "first")
        wait_until(lambda: engine.load().inflight_requests == 1, what="first running")
        queued = pool.submit(_run, engine, [5, 6, 7, 8, 9], "queued")
        wait_until(lambda: engine.load().queue_depth == 1, what="second queued")
        assert engine.abort("queued") is True
        with pytest.raises(RequestAbortedError, match="'queued' was aborted before it started"):
            queued.result(10)
        assert running.result(10).computed_tokens == 60
    assert engine.load().queue_depth == 0
    # the aborted prompt never ran: nothing of it was cached
    assert _run(engine, [5, 6, 7, 8, 9], "again").cached_tokens == 0
    engine.check_integrity()
    engine.shutdown()
