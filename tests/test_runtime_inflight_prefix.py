"""A real 2-stage pipeline given a burst of prompts that share a prefix nobody has cached
yet: the prefix is computed once (the first request), the others wait for it and reuse it,
under both policies, with results still equal to the reference."""

from __future__ import annotations

import random

import pytest

from prefill_node.engine.types import PrefillOptions
from tests.test_runtime_pipeline import VOCAB, _check_against_reference, _spec, start  # noqa: F401

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("policy", ["wave", "lockstep"])
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
