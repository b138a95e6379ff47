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


def _local() -> LocalEngine:
    model = ModelConfig.from_hf_config(PIPELINE_HF, name="tiny-grpc-pipeline")
    config = EngineConfig(
        stages=2,
        num_blocks=BLOCKS,
        block_size=4,
        max_wave_tokens=CHUNK,
        policy="sync-admission",
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
