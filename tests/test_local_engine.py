"""LocalEngine on tiny random models: equals one full forward, prefix reuse, typed errors."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefill_node.engine.types import PrefillOptions
from prefill_node.errors import (
    InvalidPromptError,
    InvalidRequestError,
    NeverFitsError,
    RequestAbortedError,
    UnavailableError,
)
from prefill_node.model.partition import LayerRange
from prefill_node.model.reference import reference_forward
from prefill_node.model.weights import random_weights
from prefill_node.runtime.engine_config import EngineConfig
from prefill_node.runtime.local_engine import LocalEngine
from prefill_node.runtime.messages import RequestOptions, WaveChunk, WaveHeader
from tests.tiny_models import tiny_llama

CONFIG = tiny_llama("tiny-llama")
WEIGHTS = random_weights(CONFIG, seed=0)
OPTS = PrefillOptions()


@pytest.fixture
def make_engine():
    """Engine factory; every engine it built must pass check_integrity at teardown, idle."""
    built: list[LocalEngine] = []

    def make(stages: int = 2, num_blocks: int | tuple[int, ...] = 32, **kw) -> LocalEngine:
        kw.setdefault("block_size", 4)
        kw.setdefault("max_wave_tokens", 5)
        config = EngineConfig(stages=stages, num_blocks=num_blocks, **kw)
        engine = LocalEngine.from_weights(CONFIG, WEIGHTS, config)
        built.append(engine)
        return engine

    yield make
    for engine in built:
        engine.check_integrity()
        assert all(stage.used_blocks == 0 for stage in engine.load().stages)
        engine.shutdown()


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(CONFIG.vocab_size) for _ in range(n)]


def assert_matches_reference(engine: LocalEngine, ids: list[int], logits: torch.Tensor) -> None:
    ref_logits, _ = reference_forward(CONFIG, WEIGHTS, ids)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("stages", "chunk"), [(1, 64), (2, 3), (3, 5), (4, 7)])
def test_logits_and_kv_equal_one_full_forward(make_engine, stages: int, chunk: int) -> None:
    engine = make_engine(stages, max_wave_tokens=chunk)
    ids = prompt(23, seed=stages)
    out = engine.prefill(ids, OPTS)
    ref_logits, ref_kv = reference_forward(CONFIG, WEIGHTS, ids)
    torch.testing.assert_close(out.logits, ref_logits, atol=1e-4, rtol=1e-4)
    r = out.result
    assert (r.prompt_tokens, r.cached_tokens, r.computed_tokens) == (23, 0, 23)
    assert r.first_token_id == int(ref_logits.argmax())
    manifests = r.stage_manifests
    assert [m.stage for m in manifests] == list(range(stages))
    assert manifests[0].layer_start == 0 and manifests[-1].layer_end == CONFIG.num_layers
    for stage, m in zip(engine.stages, manifests, strict=True):
        assert len(m.block_ids) == 6 and m.num_tokens == 23 and m.dtype == "float32"
        for layer in range(m.layer_start, m.layer_end):  # the manifest points at the real KV
            k, v = stage.kv.read(layer, m.block_ids, 23)
            torch.testing.assert_close(k, ref_kv[layer][0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v, ref_kv[layer][1], atol=1e-5, rtol=1e-5)


def test_shared_prefix_reuses_full_blocks_only(make_engine) -> None:
    engine = make_engine(3)
    a = prompt(22, seed=1)
    b = a[:13] + prompt(9, seed=2)
    assert engine.prefill(a, OPTS).result.cached_tokens == 0
    out = engine.prefill(b, OPTS)
    assert (out.result.cached_tokens, out.result.computed_tokens) == (12, 10)  # 3 full blocks
    assert_matches_reference(engine, b, out.logits)
    again = engine.prefill(a, OPTS)
    assert again.result.cached_tokens == 20  # a's 5 full blocks
    assert_matches_reference(engine, a, again.logits)


def test_fully_cached_prompt_copies_last_block_and_computes_one_token(make_engine) -> None:
    engine = make_engine(2)
    ids = prompt(16, seed=3)
    engine.prefill(ids, OPTS)
    out = engine.prefill(ids, OPTS)
    assert (out.result.cached_tokens, out.result.computed_tokens) == (15, 1)
    assert_matches_reference(engine, ids, out.logits)
    third = engine.prefill(ids, OPTS)  # the shared block was never written: still reusable
    assert third.result.cached_tokens == 15
    assert_matches_reference(engine, ids, third.logits)


def test_fully_cached_prompt_without_room_for_the_copy_recomputes_last_block(make_engine) -> None:
    engine = make_engine(2, num_blocks=4)  # exactly the prompt's 4 blocks: no spare for a copy
    ids = prompt(16, seed=4)
    engine.prefill(ids, OPTS)
    out = engine.prefill(ids, OPTS)
    assert (out.result.cached_tokens, out.result.computed_tokens) == (12, 4)
    assert_matches_reference(engine, ids, out.logits)


def test_reusable_prefix_is_the_minimum_over_stages(make_engine) -> None:
    engine = make_engine(2, num_blocks=(32, 6))
    a, c = prompt(20, seed=5), prompt(20, seed=6)
    engine.prefill(a, OPTS)
    # c needs 5 blocks on stage 1 (6 blocks): the spare one, then a's chain tail-first.
    engine.prefill(c, OPTS)
    assert engine.stages[0].pool.index.longest_prefix(engine_hashes(engine, a)) == 5
    assert engine.stages[1].pool.index.longest_prefix(engine_hashes(engine, a)) == 1
    out = engine.prefill(a, OPTS)
    assert (out.result.cached_tokens, out.result.computed_tokens) == (4, 16)
    assert_matches_reference(engine, a, out.logits)


def engine_hashes(engine: LocalEngine, ids: list[int]):
    from prefill_node.core.hashing import ExtraKeys, hash_block_tokens

    return hash_block_tokens(ids, engine.config.block_size, ExtraKeys(engine.model_id))


def test_cache_salt_isolates_reuse(make_engine) -> None:
    engine = make_engine(2)
    ids = prompt(12, seed=7)
    salted = PrefillOptions(cache_salt="tenant-a")
    assert engine.prefill(ids, salted).result.cached_tokens == 0
    assert engine.prefill(ids, PrefillOptions(cache_salt="tenant-b")).result.cached_tokens == 0
    assert engine.prefill(ids, OPTS).result.cached_tokens == 0
    assert engine.prefill(ids, salted).result.cached_tokens == 11


def test_bad_inputs_raise_typed_errors_synchronously(make_engine) -> None:
    engine = make_engine(2, num_blocks=(32, 4), max_model_len=40)
    cases = [
        ([], InvalidPromptError, "empty"),
        ([1, 64], InvalidPromptError, "token id 64 at position 1"),
        ([-1], InvalidPromptError, "token id -1"),
        ([1, "x"], InvalidPromptError, "integers"),
        ([1.5], InvalidPromptError, "integers"),
        (list(range(41)), InvalidPromptError, "max_model_len=40"),
        (list(range(17)), NeverFitsError, "needs 5 blocks .* stage 1 has only 4"),
    ]
    for ids, error, message in cases:
        with pytest.raises(error, match=message):
            engine.submit(ids, OPTS)
    with pytest.raises(InvalidRequestError, match="top_logprobs"):
        engine.submit([1, 2], PrefillOptions(top_logprobs=21))
    assert engine.submit(list(range(16)), OPTS).result().computed_tokens == 16  # still serving


def test_engine_protocol_results_load_health_shutdown(make_engine) -> None:
    engine = make_engine(2)
    ids = prompt(10, seed=8)
    future = engine.submit(ids, PrefillOptions(request_id="req-1", top_logprobs=3))
    r = future.result(30)  # submit only queues: the leader's waves compute it
    assert r.request_id == "req-1" and len(r.top_logprobs) == 3
    assert r.top_logprobs[0][0] == r.first_token_id
    logprobs = [lp for _, lp in r.top_logprobs]
    assert logprobs == sorted(logprobs, reverse=True) and all(lp < 0 for lp in logprobs)
    assert float(torch.tensor(logprobs).exp().sum()) <= 1.0 + 1e-6
    assert r.timings.total_s >= r.timings.compute_s > 0
    assert engine.vocab_size == 64 and engine.max_model_len == 256
    load = engine.load()
    assert load.queue_depth == 0 and load.inflight_requests == 0
    assert [(s.cached_blocks, s.used_blocks) for s in load.stages] == [(2, 0), (2, 0)]
    assert engine.health().ready and not engine.abort("req-1")
    engine.shutdown()
    assert not engine.health().live
    with pytest.raises(UnavailableError):
        engine.submit(ids, OPTS).result()


def test_concurrent_requests_share_waves_and_match_reference(make_engine) -> None:
    """Requests submitted together are admitted by the same rounds and packed into shared
    waves (fewer waves than requests); each answer still equals its own full forward."""
    engine = make_engine(2, max_wave_tokens=16, debug_wave_delay_s=0.05)
    prompts = [prompt(3 + i % 4, seed=40 + i) for i in range(12)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda ids: engine.prefill(ids, OPTS), prompts))
    for ids, out in zip(prompts, outs, strict=True):
        assert out.result.computed_tokens == len(ids)
        assert_matches_reference(engine, ids, out.logits)
    stats = engine.stage_stats()
    assert [s.tokens for s in stats] == [sum(map(len, prompts))] * 2
    assert all(s.waves < len(prompts) for s in stats), [s.waves for s in stats]


def test_options_travel_once_and_leave_every_stage_with_their_request(make_engine) -> None:
    """A request's options reach the stages with its first chunk only: the last stage still
    answers with its top-k several chunks later, and no stage keeps them once the request
    finished, or was aborted between its chunks."""
    engine = make_engine(2, max_wave_tokens=8, debug_wave_delay_s=0.05)
    out = engine.submit(prompt(30, seed=12), PrefillOptions("long", top_logprobs=4)).result()
    assert len(out.top_logprobs) == 4
    assert all(s.waves >= 4 for s in engine.stage_stats())  # 30 tokens in chunks of <= 8
    assert [s.options_held for s in engine.stages] == [0, 0]
    fut = engine.submit(prompt(40, seed=13), PrefillOptions("cut", top_logprobs=2))
    deadline = time.monotonic() + 10
    while engine.stages[1].options_held == 0:  # its first chunk reached the last stage
        assert time.monotonic() < deadline, "the first chunk never reached stage 1"
        time.sleep(0.005)
    assert engine.abort("cut")
    with pytest.raises(RequestAbortedError):
        fut.result(timeout=10)
    while any(s.admission.num_reservations for s in engine.stages):
        assert time.monotonic() < deadline, "the aborted request stayed on a stage"
        time.sleep(0.005)
    assert [s.options_held for s in engine.stages] == [0, 0]


def test_passed_deadline_fails_the_request_and_frees_its_blocks(make_engine) -> None:
    engine = make_engine(2)
    late = PrefillOptions(deadline_s=time.monotonic() - 1.0)
    with pytest.raises(RequestAbortedError, match="deadline"):
        engine.submit(prompt(9, seed=9), late).result()
    assert engine.prefill(prompt(9, seed=9), OPTS).result.cached_tokens == 0


def admit_alone(engine: LocalEngine, request_id: str, ids: list[int]) -> int:
    """Reserve ``request_id`` on every stage of the idle ``engine`` through one admission
    round of a coordinator of its own (the core's messages, without the leader's waves);
    its cached tokens."""
    from prefill_node.core.admission_messages import Admitted
    from prefill_node.core.coordinator import AdmissionCoordinator, CoordinatorConfig
    from prefill_node.core.hashing import ExtraKeys
    from prefill_node.core.request import RequestSpec
    from prefill_node.core.round_driver import run_round

    coordinator = AdmissionCoordinator(
        CoordinatorConfig(engine.config.block_size, engine.config.stage_num_blocks)
    )
    spec = RequestSpec(request_id, tuple(ids), ExtraKeys(engine.model_id))
    (outcome,) = run_round(coordinator, [s.admission for s in engine.stages], [spec])
    assert isinstance(outcome, Admitted)
    return outcome.cached_len


def test_stage_refuses_a_chunk_that_does_not_continue_its_kv(make_engine) -> None:
    engine = make_engine(1)
    stage = engine.stages[0]
    ids = prompt(8, seed=10)
    assert admit_alone(engine, "r", ids) == 0
    step = stage.run_wave(WaveHeader(0, (WaveChunk("r", 4, 4, is_last=True),)), None)
    assert [rid for rid, _ in step.failed] == ["r"] and not step.outputs
    assert "wrong_position" in step.failed[0][1]
    assert stage.admission.reservation("r") is None  # the refusal dropped it on the stage


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    stages=st.integers(1, 3),
    # the longest prompt (30-token stem + 3-token tail) needs 9 blocks of 4: every cache fits it
    blocks=st.lists(st.integers(9, 20), min_size=3, max_size=3),
    requests=st.lists(
        st.tuples(st.integers(0, 2), st.integers(1, 30), st.integers(0, 3)), min_size=1, max_size=6
    ),
)
def test_random_request_streams_match_reference(make_engine, stages, blocks, requests) -> None:
    """Prompts from 3 shared stems with random cut points and tails, on uneven caches."""
    engine = make_engine(stages, num_blocks=tuple(blocks[:stages]))
    stems = [prompt(30, seed=100 + s) for s in range(3)]
    for stem, cut, tail in requests:
        ids = stems[stem][:cut] + prompt(tail, seed=cut * 7 + tail)
        out = engine.prefill(ids, OPTS)
        assert out.result.cached_tokens + out.result.computed_tokens == len(ids)
        assert out.result.cached_tokens <= len(ids) - 1
        assert_matches_reference(engine, ids, out.logits)
        engine.check_integrity()


def test_a_round_between_complete_and_logits_leaves_the_waves_options(
    make_engine, monkeypatch
) -> None:
    """The WAVE thread's sweep of options (on every admission round) may land after
    ``complete`` released a finished request's reservation and before its logits: the wave
    still answers with the top-k its first chunk brought (here the sweep is forced there)."""
    engine = make_engine(1, num_blocks=8)
    stage = engine.stages[0]
    ids = prompt(10, seed=12)
    assert admit_alone(engine, "req", ids) == 0
    complete = stage._complete

    def complete_then_a_round(*args):
        done = complete(*args)
        with stage._lock:  # what ``admit`` does on the WAVE thread
            stage._sweep_options()
        assert stage.options_held == 0  # the finished request's entry is gone ...
        return done

    monkeypatch.setattr(stage, "_complete", complete_then_a_round)
    chunk = WaveChunk("req", 0, len(ids), is_last=True, options=RequestOptions(5))
    step = stage.run_wave(WaveHeader(0, (chunk,)), None)
    assert not step.failed and len(step.outputs[0].top_logprobs) == 5  # ... not the wave's


def test_stage_materialises_on_escrowed_blocks(make_engine) -> None:
    """Admission escrows victims for the suffix; executing the chunk makes them its blocks."""
    engine = make_engine(1, num_blocks=8)
    stage = engine.stages[0]
    ids = prompt(10, seed=11)
    assert admit_alone(engine, "req", ids) == 0
    victims = stage.admission.reservation("req").escrow.victims()
    assert len(victims) == 3 and stage.pool.stats().in_use == 0
    chunk = WaveChunk("req", 0, len(ids), is_last=True, options=RequestOptions(1))
    step = stage.run_wave(WaveHeader(0, (chunk,)), None)
    assert not step.failed and [o.request_id for o in step.outputs] == ["req"]
    assert_matches_reference(engine, ids, step.outputs[0].logits)
    ((rid, manifest),) = step.manifests
    assert rid == "req" and manifest.block_ids == tuple(b.block_id for b in victims)
    assert engine.prefill(ids, OPTS).result.cached_tokens == 8  # its 2 full blocks were cached


def test_min_wave_tokens_reaches_the_spec_and_bad_values_name_the_option() -> None:
    layers = (LayerRange(0, CONFIG.num_layers),)
    config = EngineConfig(stages=1, block_size=4, max_wave_tokens=16)
    assert config.pipeline_spec(layers).min_wave_tokens == 8  # default: M/2
    config = EngineConfig(stages=1, block_size=4, max_wave_tokens=16, min_wave_tokens=4)
    assert config.pipeline_spec(layers).min_wave_tokens == 4
    for bad in (0, 6, 20):  # below one block, not whole blocks, above the wave budget
        with pytest.raises(InvalidRequestError, match="--min-wave-tokens"):
            EngineConfig(block_size=4, max_wave_tokens=16, min_wave_tokens=bad)
