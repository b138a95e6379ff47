"""The in-process LocalEngine and a real 2-stage multi-process pipeline, fed the same request
sequence (whole-prompt reuse, partial reuse, eviction pressure, an abort mid-flight), report
the same cached tokens, first tokens and per-stage KV manifests: one reuse rule, one cache.

Both run ``sync-admission`` (one chunk of a request in flight): an abort then stops the request
before its last chunk is scheduled, on either transport. Under ``wave`` every chunk of a
short prompt may already be in flight when the abort arrives; the stages then complete (and
cache) it before the leader's cleanup, and how far it got depends on timing."""

from __future__ import annotations

import random
import threading
import time

import pytest

from prefill_node.engine.types import PrefillOptions
from prefill_node.errors import RequestAbortedError
from prefill_node.model.config import ModelConfig
from prefill_node.model.weights import random_weights
from prefill_node.runtime.engine_config import EngineConfig
from prefill_node.runtime.local_engine import LocalEngine
from tests.grpc_harness import PIPELINE_HF, start_tiny_pipeline, wait_until

pytestmark = pytest.mark.timeout(180)

BLOCKS = (16, 14)  # uneven stages; block size 4
CHUNK = 8
DELAY_S = 0.15


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(PIPELINE_HF["vocab_size"]) for _ in range(n)]


def _local(policy: str = "sync-admission", num_blocks: tuple[int, ...] = BLOCKS) -> LocalEngine:
    model = ModelConfig.from_hf_config(PIPELINE_HF, name="tiny-grpc-pipeline")
    config = EngineConfig(
        stages=2,
        num_blocks=num_blocks,
        block_size=4,
        max_wave_tokens=CHUNK,
        policy=policy,
        debug_wave_delay_s=DELAY_S,
    )
    return LocalEngine.from_weights(model, random_weights(model, seed=11), config)


def _run(engine, prompt: list[int], rid: str):
    return engine.submit(prompt, PrefillOptions(rid)).result(60)


def _run_aborted(engine, prompt: list[int], rid: str) -> None:
    """Submit from a thread, abort once every stage holds the request's blocks."""
    errors: list[BaseException] = []

    def submit() -> None:
        try:
            _run(engine, prompt, rid)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=submit)
    t.start()
    wait_until(lambda: all(s.used_blocks for s in engine.load().stages), 20, "admitted")
    assert engine.abort(rid)
    t.join(60)
    assert len(errors) == 1 and isinstance(errors[0], RequestAbortedError), errors
    wait_until(lambda: not any(s.used_blocks for s in engine.load().stages), 20, "released")


def _sequence(engine) -> list[tuple]:
    p1 = _prompt(20, 1)  # 5 full blocks
    seq = [
        ("cold", p1),
        ("whole", p1),  # every block cached: the last one by copy
        ("abort", _prompt(32, 2)),  # 8 cold blocks, aborted part-way
        ("partial", p1[:12] + _prompt(9, 3)),
        ("big", _prompt(44, 4)),  # 11 blocks: evicts on the 14-block stage
        ("bigger", _prompt(40, 5)),
        ("evicted?", p1),
        ("whole-big", _prompt(40, 5)),
    ]
    out = []
    for i, (name, prompt) in enumerate(seq):
        rid = f"{name}-{i}"
        if name == "abort":
            _run_aborted(engine, prompt, rid)
            out.append((name, "aborted"))
            continue
        r = _run(engine, prompt, rid)
        out.append((name, r.cached_tokens, r.first_token_id, r.stage_manifests))
        time.sleep(0.05)
    return out


def test_local_engine_and_pipeline_agree_on_reuse_tokens_and_manifests() -> None:
    local = _local()
    try:
        expected = _sequence(local)
        local.check_integrity()
    finally:
        local.shutdown()
    pipeline = start_tiny_pipeline(
        stage_blocks=BLOCKS,
        max_wave_tokens=CHUNK,
        policy="sync-admission",
        debug_wave_delay_s=DELAY_S,
    )
    try:
        got = _sequence(pipeline)
        pipeline.debug_check_integrity()
    finally:
        pipeline.shutdown()
    assert [g[:2] for g in got] == [e[:2] for e in expected]  # cached tokens
    assert [g[2:3] for g in got] == [e[2:3] for e in expected]  # first tokens
    assert got == expected  # manifests: the same blocks on every stage
    cached = [e[1] for e in expected]
    assert cached[:2] == [0, 19] and cached[3] == 12


def _burst(engine, salt: str | None = None) -> list[tuple]:
    """Three prompts sharing a new 24-token prefix, submitted together: the first computes
    it, the others are promised it and run behind its chunk (docs/wavepp.md, "Prefixes being
    computed"); with ``salt`` (a fresh cache identity) each runs alone and cold instead."""
    shared = _prompt(24, 7)
    prompts = [shared + _prompt(3 + i, 20 + i) for i in range(3)]
    if salt is not None:
        results = [
            engine.submit(p, PrefillOptions(f"cold-{i}", cache_salt=f"{salt}-{i}")).result(60)
            for i, p in enumerate(prompts)
        ]
    else:
        futures = [engine.submit(p, PrefillOptions(f"burst-{i}")) for i, p in enumerate(prompts)]
        results = [f.result(60) for f in futures]
    return [(r.cached_tokens, r.first_token_id, r.top_logprobs, r.stage_manifests) for r in results]


def _same_top(a: tuple[tuple[int, float], ...], b: tuple[tuple[int, float], ...]) -> bool:
    """The same top tokens with log-probabilities within fp32's 1e-4."""
    return [t for t, _ in a] == [t for t, _ in b] and all(
        abs(x - y) <= 1e-4 for (_, x), (_, y) in zip(a, b, strict=True)
    )


def test_a_burst_sharing_a_prefix_being_computed_matches_cold_runs_on_both_engines() -> None:
    """The promised prefix's KV is the producer's, read by the waiters on every stage: their
    first tokens and top tokens equal each prompt's cold run, the prefix counts as cached,
    and both engines agree block for block."""
    local = _local("wave")
    try:
        expected = _burst(local)
        cold = _burst(local, salt="cold")
        local.check_integrity()
    finally:
        local.shutdown()
    assert [e[0] for e in expected] == [0, 24, 24] and [c[0] for c in cold] == [0, 0, 0]
    assert [e[1] for e in expected] == [c[1] for c in cold]
    assert all(_same_top(e[2], c[2]) for e, c in zip(expected, cold, strict=True))
    pipeline = start_tiny_pipeline(
        stage_blocks=BLOCKS, max_wave_tokens=CHUNK, debug_wave_delay_s=DELAY_S
    )
    try:
        got = _burst(pipeline)
        pipeline.debug_check_integrity()
    finally:
        pipeline.shutdown()
    assert [g[:2] + g[3:] for g in got] == [e[:2] + e[3:] for e in expected]
    assert all(_same_top(g[2], e[2]) for g, e in zip(got, expected, strict=True))


def test_a_waiter_whose_producer_is_aborted_computes_the_prefix_and_reports_it() -> None:
    """a computes a 40-token prefix one chunk at a time (``sync-admission``: one chunk of a
    request in flight); b is promised it; a is aborted before its chunk ending the prefix
    was scheduled, so b starts at its lease instead: it computes the rest of the prefix
    itself, answers as its cold run does and reports only its lease as cached."""
    engine = _local(num_blocks=(64, 64))
    try:
        shared = _prompt(40, 8)
        fa = engine.submit(shared + _prompt(8, 30), PrefillOptions("a"))
        wait_until(lambda: engine.load().inflight_requests == 1, 20, "a admitted")
        b = shared + _prompt(3, 31)
        fb = engine.submit(b, PrefillOptions("b"))
        load = engine.load
        wait_until(lambda: load().inflight_requests == 2 and not load().queue_depth, 20, "b")
        assert engine.abort("a")
        got = fb.result(60)
        with pytest.raises(RequestAbortedError):
            fa.result(60)
        cold = engine.submit(b, PrefillOptions("b-cold", cache_salt="cold")).result(60)
        engine.check_integrity()
    finally:
        engine.shutdown()
    # its lease: what a had computed on every stage when b was admitted, not the promise
    assert got.cached_tokens < len(shared) and cold.cached_tokens == 0
    assert got.computed_tokens == len(b) - got.cached_tokens
    assert got.first_token_id == cold.first_token_id
    assert _same_top(got.top_logprobs, cold.top_logprobs)
