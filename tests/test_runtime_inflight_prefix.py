"""A real 2-stage pipeline given a burst of prompts that share a prefix nobody has cached
yet: the prefix is computed once (the first request), the others wait for it and reuse it -
from the moment the producer's chunks holding it have passed every stage - under both
policies, with results still equal to the reference."""

from __future__ import annotations

import random

import pytest

from prefill_node.engine.types import PrefillOptions
from tests.test_runtime_pipeline import VOCAB, _check_against_reference, _spec, start  # noqa: F401

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("policy", ["wave", "sync-admission"])
def test_a_burst_sharing_a_new_prefix_computes_it_once(start, policy) -> None:  # noqa: F811
    engine = start(_spec(((0, 2), (2, 4)), (64, 64), policy))
    rng = random.Random(5)
    system = [rng.randrange(VOCAB) for _ in range(40)]  # 10 blocks of 4
    prompts = [system + [rng.randrange(VOCAB) for _ in range(3)] for _ in range(4)]
    futures = [engine.submit(p, PrefillOptions(top_logprobs=VOCAB)) for p in prompts]
    results = [f.result(timeout=60) for f in futures]
    assert sorted(r.cached_tokens for r in results) == [0, 40, 40, 40]
    assert sum(r.computed_tokens for r in results) == 40 + 4 * 3
    _check_against_reference(engine, prompts, results)
    engine.debug_check_integrity()
    assert [s.pool.in_use for s in engine.stage_stats()] == [0, 0]


@pytest.mark.parametrize("policy", ["wave", "sync-admission"])
def test_a_waiter_starts_when_the_shared_chunks_passed_not_when_the_producer_ends(
    start,  # noqa: F811
    policy,
) -> None:
    """Every stage publishes a chunk's full blocks as it passes, so a request waiting for the
    prefix is admitted while the producer still has chunks to run, and reuses exactly it."""
    engine = start(_spec(((0, 2), (2, 4)), (64, 64), policy, debug_wave_delay_s=0.1))
    rng = random.Random(6)
    system = [rng.randrange(VOCAB) for _ in range(16)]  # 4 blocks: the producer's first chunks
    prompts = [system + [rng.randrange(VOCAB) for _ in range(n)] for n in (60, 3)]
    futures = [engine.submit(p, PrefillOptions(top_logprobs=VOCAB)) for p in prompts]
    producer, waiter = (f.result(timeout=60) for f in futures)
    assert (producer.cached_tokens, waiter.cached_tokens) == (0, 16)
    assert producer.computed_tokens + waiter.computed_tokens == 76 + 3
    # admitted at least one delayed wave before the producer's last chunk came back
    assert waiter.timings.queue_s + 0.1 < producer.timings.total_s
    _check_against_reference(engine, prompts, [producer, waiter])
    engine.debug_check_integrity()
    assert [s.pool.in_use for s in engine.stage_stats()] == [0, 0]
