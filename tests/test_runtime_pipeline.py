"""Real multi-process pipelines (gloo on loopback) against the single-process reference
(transformers for GLM-5, Qwen3-Next and Kimi Linear, whose MLA / linear attention the
reference does not implement)."""

from __future__ import annotations

import functools
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest
import torch
import transformers

from prefill_node.engine.types import PrefillOptions
from prefill_node.errors import RequestAbortedError, StageStateError, UnavailableError
from prefill_node.model.config import ModelConfig
from prefill_node.model.loader_hf import save_hf_checkpoint
from prefill_node.model.reference import reference_forward
from prefill_node.model.weights import random_weights
from prefill_node.runtime.dist_env import DistEnv, free_local_port
from prefill_node.runtime.pipeline_engine import PipelineEngine
from prefill_node.runtime.spec import ModelSource, PipelineSpec
from tests.tiny_models import (
    TINY_GLM5_HF,
    TINY_KIMI_HF,
    TINY_MINIMAX_M2_HF,
    TINY_QWEN3_NEXT_HF,
)

pytestmark = pytest.mark.timeout(120)

VOCAB = 89
HF_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}
SEED = 7
MODEL = ModelConfig.from_hf_config(HF_CONFIG, name="tiny-qwen3")
WEIGHTS = random_weights(MODEL, SEED)
MOE_HF_CONFIG = {**TINY_MINIMAX_M2_HF, "vocab_size": VOCAB}
MOE_MODEL = ModelConfig.from_hf_config(MOE_HF_CONFIG, name="tiny-minimax-m2")
MLA_HF_CONFIG = {**TINY_GLM5_HF, "vocab_size": VOCAB, "num_hidden_layers": 4}
MLA_MODEL = ModelConfig.from_hf_config(MLA_HF_CONFIG, name="tiny-glm_moe_dsa")
HYBRID_HF_CONFIG = {**TINY_QWEN3_NEXT_HF, "vocab_size": VOCAB}
HYBRID_MODEL = ModelConfig.from_hf_config(HYBRID_HF_CONFIG, name="tiny-qwen3_next")
KIMI_HF_CONFIG = {**TINY_KIMI_HF, "vocab_size": VOCAB}
KIMI_MODEL = ModelConfig.from_hf_config(KIMI_HF_CONFIG, name="tiny-kimi_linear")
FAMILIES = {
    "qwen3": (HF_CONFIG, MODEL, WEIGHTS),
    "minimax-m2": (MOE_HF_CONFIG, MOE_MODEL, random_weights(MOE_MODEL, SEED)),
    "glm-5": (MLA_HF_CONFIG, MLA_MODEL, random_weights(MLA_MODEL, SEED)),
    "qwen3-next": (HYBRID_HF_CONFIG, HYBRID_MODEL, random_weights(HYBRID_MODEL, SEED)),
    "kimi-linear": (KIMI_HF_CONFIG, KIMI_MODEL, random_weights(KIMI_MODEL, SEED)),
}


@functools.cache
def _transformers_model(family: str):
    _, model, weights = FAMILIES[family]
    with tempfile.TemporaryDirectory() as tmp:
        save_hf_checkpoint(tmp, model, weights)
        return transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()


def _expected(family: str, prompt: list[int]):
    """Last-token logits and, per layer, the cache planes a stage must hold: K and V, or
    (GLM-5) one plane of [latent | rotated key | indexer key] entries, or (a recurrent
    layer) its final state and conv tail."""
    _, model, weights = FAMILIES[family]
    if model.mla is None and model.recurrent is None:
        return reference_forward(model, weights, prompt)
    with torch.no_grad():
        out = _transformers_model(family)(torch.tensor([prompt]), use_cache=True)
    layers = out.past_key_values.layers
    if model.recurrent is not None:
        entries = [
            (c.recurrent_states[0][0], c.conv_states[0][0, :, 1:].T)
            if model.is_linear_layer(i)
            else (c.keys[0].transpose(0, 1), c.values[0].transpose(0, 1))
            if model.mla is None
            else (torch.cat((c.keys[0, 0], c.values[0, 0]), dim=-1),)  # Kimi: latent | key part
            for i, c in enumerate(layers)
        ]
        return out.logits[0, -1], entries
    entries = [
        (torch.cat((c.keys[0, 0], c.values[0, 0], c.indexer_keys[0]), dim=-1),) for c in layers
    ]
    return out.logits[0, -1], entries


def _spec(layer_ranges, stage_blocks, policy: str, hf_config=HF_CONFIG, **kw) -> PipelineSpec:
    name = ModelConfig.from_hf_config(hf_config).family.value
    return PipelineSpec(
        model=ModelSource(config=hf_config, seed=SEED, name=f"tiny-{name}"),
        layer_ranges=layer_ranges,
        stage_blocks=stage_blocks,
        block_size=4,
        policy=policy,
        max_wave_tokens=kw.pop("max_wave_tokens", 32),
        min_wave_tokens=8,
        capture_kv=True,
        dead_after_s=3.0,
        **kw,
    )


@pytest.fixture
def start() -> Iterator:
    engines: list[PipelineEngine] = []

    def _start(spec: PipelineSpec) -> PipelineEngine:
        env = DistEnv(0, spec.num_stages, "127.0.0.1", free_local_port())
        engines.append(PipelineEngine.start(spec, env, startup_timeout_s=60))
        return engines[-1]

    yield _start
    for engine in engines:
        engine.shutdown()


def _workload(rng: random.Random, n: int) -> list[list[int]]:
    """Prompts sharing a few prefixes (reuse) plus cold ones, 5..70 tokens."""
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randrange(8, 40))] for _ in range(3)]
    prompts = []
    for _ in range(n):
        head = rng.choice(prefixes)[: rng.randrange(0, 40)] if rng.random() < 0.7 else []
        prompts.append(head + [rng.randrange(VOCAB) for _ in range(rng.randrange(5, 30))])
    return prompts


def _check_against_reference(engine: PipelineEngine, prompts, results, family="qwen3") -> None:
    for prompt, res in zip(prompts, results, strict=True):
        logits, kv = _expected(family, prompt)
        ref = torch.log_softmax(logits.float(), dim=-1)
        got = torch.full((VOCAB,), float("nan"))
        for token, logprob in res.top_logprobs:
            got[token] = logprob
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
        assert res.first_token_id == int(ref.argmax())
        assert res.cached_tokens + res.computed_tokens == len(prompt)
        whole = res.cached_tokens == len(prompt) - 1 and len(prompt) % 4 == 0  # last by copy
        assert (res.cached_tokens % 4 == 0 or whole) and res.computed_tokens >= 1
        dumps = engine.debug_dump_kv(res.request_id)
        assert [d.stage for d in dumps] == list(range(engine.spec.num_stages))
        for d in dumps:
            for i, (k, v) in enumerate(zip(d.k, d.v, strict=True)):
                planes = kv[d.layer_start + i]
                torch.testing.assert_close(k, planes[0], atol=1e-4, rtol=0)
                if len(planes) == 2:
                    torch.testing.assert_close(v, planes[1], atol=1e-4, rtol=0)
                else:
                    assert v.numel() == 0  # an MLA cache has one plane, captured as k
        manifests = res.stage_manifests
        assert [(m.stage, m.layer_start, m.layer_end) for m in manifests] == [
            (s, a, b) for s, (a, b) in enumerate(engine.spec.layer_ranges)
        ]
        assert all(
            m.num_tokens == len(prompt) and len(m.block_ids) == -(-len(prompt) // 4)
            for m in manifests
        )


CASES = [
    pytest.param("qwen3", ((0, 2), (2, 4)), (48, 40), id="P2"),
    pytest.param("qwen3", ((0, 1), (1, 3), (3, 4)), (64, 30, 45), id="P3-uneven"),
    pytest.param("minimax-m2", ((0, 2), (2, 4)), (48, 40), id="P2-minimax-m2-moe"),
    pytest.param("glm-5", ((0, 2), (2, 4)), (48, 40), id="P2-glm-5-mla-dsa"),
    pytest.param("qwen3-next", ((0, 2), (2, 4)), (48, 40), id="P2-qwen3-next-hybrid"),
    pytest.param("kimi-linear", ((0, 2), (2, 4)), (48, 40), id="P2-kimi-linear-kda-mla"),
]


@pytest.mark.parametrize("policy", ["wave", "sync-admission"])
@pytest.mark.parametrize(("family", "layer_ranges", "stage_blocks"), CASES)
def test_pipeline_matches_reference_under_reuse_and_eviction(
    start, family, layer_ranges, stage_blocks, policy
) -> None:
    engine = start(_spec(layer_ranges, stage_blocks, policy, hf_config=FAMILIES[family][0]))
    rng = random.Random(hash((layer_ranges, policy)) & 0xFFFF)
    prompts = _workload(rng, 24)
    # two bursts: the second reuses (and evicts) what the first cached
    results = []
    for burst in (prompts[:12], prompts[12:]):
        futures = [engine.submit(p, PrefillOptions(top_logprobs=VOCAB)) for p in burst]
        results += [f.result(timeout=60) for f in futures]
    assert sum(r.cached_tokens for r in results) > 0, "the workload should reuse prefixes"
    _check_against_reference(engine, prompts, results, family)
    engine.debug_check_integrity()
    stats = engine.stage_stats()
    assert [s.pool.in_use for s in stats] == [0] * len(stats)  # drained: nothing pinned
    assert sum(stats[0].pool.total for _ in stats) > 0
    assert engine.health().ready


def test_drain_bound_reaches_the_planner_and_keeps_results_exact(start) -> None:
    """``wave_overhead_tokens`` (``wavepp serve --wave-overhead-tokens``) reaches the leader's
    planner: a lone 64-token prompt on an idle pipeline (M = 32, b_min = 8) runs in waves of
    at most sqrt(64 x 4) = 16 tokens, not MPU's two waves of 32, and its logits and every
    stage's KV still equal the reference's."""
    engine = start(_spec(((0, 2), (2, 4)), (48, 40), "wave", wave_overhead_tokens=4))
    prompt = [random.Random(5).randrange(VOCAB) for _ in range(64)]
    result = engine.submit(prompt, PrefillOptions(top_logprobs=VOCAB)).result(timeout=60)
    _check_against_reference(engine, [prompt], [result])
    for stage in engine.stage_stats():
        assert stage.tokens == 64 and stage.waves >= 4, stage
    engine.debug_check_integrity()


# ---- trtllm: rank 0 decides alone, the other stages follow (docs/wavepp.md) ----------


@pytest.mark.parametrize(
    ("layer_ranges", "stage_blocks"),
    [
        pytest.param(((0, 2), (2, 4)), (200, 200), id="P2"),
        pytest.param(((0, 1), (1, 3), (3, 4)), (200, 200, 200), id="P3"),
    ],
)
def test_trtllm_pipeline_matches_reference_under_reuse(start, layer_ranges, stage_blocks) -> None:
    """Caches large enough that no stage evicts: every stage holds what rank 0 reuses, so
    every request runs, and its logits and every stage's KV equal the reference's."""
    engine = start(_spec(layer_ranges, stage_blocks, "trtllm"))
    prompts = _workload(random.Random(11), 24)
    results = []
    for burst in (prompts[:12], prompts[12:]):  # the second burst reuses the first's blocks
        futures = [engine.submit(p, PrefillOptions(top_logprobs=VOCAB)) for p in burst]
        results += [f.result(timeout=60) for f in futures]
    assert sum(r.cached_tokens for r in results) > 0, "the workload should reuse prefixes"
    _check_against_reference(engine, prompts, results)
    engine.debug_check_integrity()
    assert [s.pool.in_use for s in engine.stage_stats()] == [0] * len(stage_blocks)


@pytest.mark.parametrize("policy", ["trtllm", "sync-admission"])
def test_stage_that_evicted_rank0s_prefix_fails_it_under_trtllm_only(start, policy) -> None:
    """Stage 1 is small: B evicts A's blocks there while stage 0 still holds them. Asked for
    A again, rank 0 alone decides to reuse all of A (``trtllm``); stage 1 cannot follow and
    the request fails with the mismatch, instead of computing on a cache it does not have.
    ``sync-admission`` negotiates the common prefix and serves A exactly."""
    engine = start(_spec(((0, 2), (2, 4)), (200, 12), policy))
    rng = random.Random(5)
    a, b = ([rng.randrange(VOCAB) for _ in range(40)] for _ in range(2))
    for prompt in (a, b):
        engine.submit(prompt, PrefillOptions()).result(timeout=30)
    again = engine.submit(a, PrefillOptions(top_logprobs=VOCAB))
    if policy == "trtllm":
        with pytest.raises(StageStateError, match="stage 1 .*cannot_follow.*prefix_missing"):
            again.result(timeout=30)
    else:
        res = again.result(timeout=30)
        # stage 1 kept A's first 2 blocks (B took the 2 free ones and evicted 8, tail first):
        # the negotiated prefix, where rank 0 alone would have reused 39 tokens
        assert res.cached_tokens == 8
        _check_against_reference(engine, [a], [res])
    # the pipeline keeps serving; stage 1 dropped what it held for the failed request
    c = [rng.randrange(VOCAB) for _ in range(20)]
    res = engine.submit(c, PrefillOptions(top_logprobs=VOCAB)).result(timeout=30)
    _check_against_reference(engine, [c], [res])
    engine.debug_check_integrity()


def test_abort_in_flight_frees_blocks_on_every_stage(start) -> None:
    engine = start(_spec(((0, 2), (2, 3), (3, 4)), (80, 80, 80), "wave", max_wave_tokens=8))
    rng = random.Random(1)
    long_prompt = [rng.randrange(VOCAB) for _ in range(200)]
    fut = engine.submit(long_prompt, PrefillOptions(request_id="victim"))
    deadline = time.monotonic() + 30
    while engine.load().inflight_tokens in (0, len(long_prompt)):  # wait until it runs
        assert time.monotonic() < deadline and not fut.done()
        time.sleep(0.01)
    assert engine.abort("victim") and not engine.abort("victim")
    with pytest.raises(RequestAbortedError):
        fut.result(timeout=5)
    # the pipeline keeps serving, and the victim's blocks are free on every stage; the full
    # blocks of the chunks it finished before the abort stay cached (their KV is complete)
    ok = engine.submit(long_prompt[:30], PrefillOptions(top_logprobs=VOCAB)).result(timeout=30)
    assert ok.cached_tokens % 4 == 0 and ok.cached_tokens + ok.computed_tokens == 30
    _check_against_reference(engine, [long_prompt[:30]], [ok])
    deadline = time.monotonic() + 10
    while any(s.pool.in_use for s in engine.stage_stats()):
        assert time.monotonic() < deadline, engine.stage_stats()
        time.sleep(0.05)
    engine.debug_check_integrity()
    assert engine.load().inflight_requests == 0


def test_killing_a_stage_fails_in_flight_requests_within_seconds(start) -> None:
    # every stage sleeps 50 ms per wave: each 150-token request needs about 19 waves, so none
    # can have finished when the kill lands (on a loaded machine one sometimes had)
    spec = _spec(((0, 1), (1, 2), (2, 4)), (80, 80, 80), "wave", max_wave_tokens=8,
                 debug_wave_delay_s=0.05)  # fmt: skip
    engine = start(spec)
    rng = random.Random(2)
    futures = [
        engine.submit([rng.randrange(VOCAB) for _ in range(150)], PrefillOptions())
        for _ in range(4)
    ]
    os.kill(engine.stage_pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    for fut in futures:
        with pytest.raises(UnavailableError, match="stage"):
            fut.result(timeout=10)
    assert time.monotonic() - t0 < 5
    health = engine.health()
    assert not health.live and not health.ready and "stage" in health.detail
    with pytest.raises(UnavailableError):
        engine.submit([1, 2, 3], PrefillOptions()).result(timeout=1)
    t0 = time.monotonic()
    engine.shutdown()
    assert time.monotonic() - t0 < 15


def test_torchrun_env_launch_leader_plus_wavepp_stage_process(tmp_path, monkeypatch) -> None:
    """The Kubernetes path: the leader from RANK=0 env, the other stage via `wavepp stage`."""
    from prefill_node.runtime.engine_config import EngineConfig
    from prefill_node.runtime.factory import start_pipeline_engine

    save_hf_checkpoint(tmp_path, MODEL, WEIGHTS)
    env = DistEnv(0, 2, "127.0.0.1", free_local_port())
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    stage = subprocess.Popen(
        [sys.executable, "-m", "prefill_node.cli.main", "stage", "--connect-timeout", "60"],
        env={**os.environ, **env.with_rank(1).to_env()},
    )
    try:
        for key, value in env.to_env().items():
            monkeypatch.setenv(key, value)
        config = EngineConfig(
            model_dir=tmp_path,
            stages=2,
            policy="sync-admission",
            num_blocks=(64, 32),
            block_size=4,
            max_wave_tokens=16,
            stage_wait_s=60,
        )
        engine = start_pipeline_engine(config)
        assert engine.stage_pids == {}  # nothing launched locally
        prompt = list(range(1, 40))
        res = engine.submit(prompt, PrefillOptions(top_logprobs=3)).result(timeout=30)
        logits, _ = reference_forward(MODEL, WEIGHTS, prompt)
        assert res.first_token_id == int(logits.argmax()) and len(res.top_logprobs) == 3
        engine.debug_check_integrity()
        engine.shutdown()
        assert stage.wait(timeout=20) == 0
    finally:
        if stage.poll() is None:
            stage.kill()
            stage.wait()
