"""DecodeEngine: many requests on one DecodeWorker thread (tiny random Llama, in-process).

Interleaved requests generate exactly what each generates alone on a plain DecodeWorker;
a pool too small for all of them at once makes later ones wait (and still answer the same);
cancelling frees the blocks; a failed KV load follows the policy; nothing stays allocated.
"""

from __future__ import annotations

import queue
import random

import pytest

from kv_transfer.vllm_decode.params import LoadReport
from prefill_node.decode.decode_engine import (
    DecodeEngine,
    DecodeJob,
    Finished,
    KVLoadFailurePolicy,
    Token,
)
from prefill_node.decode.decode_worker import DecodeWorker
from prefill_node.decode.worker_process import DecodeWorkerSpec
from prefill_node.errors import InvalidPromptError
from prefill_node.model.weights import random_weights
from tests.tiny_models import tiny_llama

CONFIG = tiny_llama("tiny-untied", tie_word_embeddings=False)
BLOCK = 4


def _prompts(n: int, length: int, seed: int = 3) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(CONFIG.vocab_size) for _ in range(length)) for _ in range(n)]


def _alone(prompts, max_tokens: int) -> list[list[int]]:
    """Each prompt on its own on a plain DecodeWorker (the reference)."""
    worker = DecodeWorker.from_weights(
        CONFIG, random_weights(CONFIG, 0), num_blocks=64, block_size=BLOCK
    )
    try:
        out = []
        for i, prompt in enumerate(prompts):
            first = worker.compute_prompt(f"r{i}", prompt)
            out.append(list(worker.generate(f"r{i}", first, max_tokens)))
            worker.release(f"r{i}")
        return out
    finally:
        worker.close()


def _engine(num_blocks: int, policy=KVLoadFailurePolicy.RECOMPUTE) -> DecodeEngine:
    spec = DecodeWorkerSpec(model_config=CONFIG, seed=0, num_blocks=num_blocks, block_size=BLOCK)
    engine = DecodeEngine(spec, policy)
    engine.start()
    return engine


class _Collector:
    def __init__(self) -> None:
        self.events: queue.SimpleQueue = queue.SimpleQueue()

    def job(self, request_id, prompt, max_tokens, **kw) -> DecodeJob:
        sink = lambda event: self.events.put((request_id, event))  # noqa: E731
        return DecodeJob(request_id, tuple(prompt), max_tokens, frozenset(), sink, **kw)

    def run(self, n: int) -> tuple[dict[str, list[int]], dict[str, Finished]]:
        tokens: dict[str, list[int]] = {}
        ends: dict[str, Finished] = {}
        while len(ends) < n:
            request_id, event = self.events.get(timeout=60)
            if isinstance(event, Token):
                assert request_id not in ends
                tokens.setdefault(request_id, []).append(event.token_id)
            else:
                ends[request_id] = event
        return tokens, ends


@pytest.mark.parametrize("num_blocks", [64, 7])
def test_interleaved_requests_generate_what_each_generates_alone(num_blocks):
    """64 blocks: all three run at once, one token each in turn. 7 blocks: each needs 5
    (13 prompt + 8 new tokens - 1 over blocks of 4), so they run one after another."""
    prompts = _prompts(3, 13)
    expected = _alone(prompts, 8)
    engine = _engine(num_blocks)
    try:
        c = _Collector()
        for i, prompt in enumerate(prompts):
            engine.submit(c.job(f"q{i}", prompt, 8))
        tokens, ends = c.run(3)
        assert [tokens[f"q{i}"] for i in range(3)] == expected
        assert {e.reason for e in ends.values()} == {"length"}
        assert all(e.load is None for e in ends.values())
        assert engine.stats() == 0  # every block back, after check_integrity
        assert engine.counters.prompt_tokens["local_compute"] == 39
        assert engine.load() == (0, 0, 0, num_blocks)
    finally:
        engine.stop()


def test_a_request_that_can_never_fit_is_refused_before_it_queues():
    engine = _engine(4)
    try:
        c = _Collector()
        with pytest.raises(InvalidPromptError, match="need 5 KV blocks"):
            engine.submit(c.job("big", _prompts(1, 13)[0], 8))
        assert engine.stats() == 0
    finally:
        engine.stop()


def test_cancel_mid_generation_stops_it_and_frees_every_block():
    engine = _engine(64)
    try:
        events: queue.SimpleQueue = queue.SimpleQueue()
        count = [0]

        def sink(event):
            events.put(event)
            count[0] += 1
            if count[0] == 3:
                engine.cancel("long")  # from the engine thread itself: queued, like any

        engine.submit(DecodeJob("long", _prompts(1, 9)[0], 200, frozenset(), sink))
        seen = []
        while not isinstance(event := events.get(timeout=60), Finished):
            seen.append(event)
        assert event.reason == "abort"
        assert 3 <= len(seen) < 200
        assert engine.stats() == 0
        assert engine.counters.finished["abort"] == 1
    finally:
        engine.stop()


@pytest.mark.parametrize("policy", list(KVLoadFailurePolicy))
def test_a_refused_kv_load_follows_the_failure_policy(policy):
    """A load refused before any READ (the prompt is not the stages'): ``recompute`` answers
    as if no load had been asked, ``fail`` ends the request with an error; both report the
    load as failed and hold no block afterwards."""
    prompt = _prompts(1, 10)[0]
    expected = _alone([prompt], 6)[0]
    engine = _engine(64, policy)
    try:
        c = _Collector()
        engine.submit(c.job("r", prompt, 6, manifests=(), refused="not the stages' prompt"))
        tokens, ends = c.run(1)
        assert ends["r"].load == LoadReport(0, 0, "not the stages' prompt")
        if policy is KVLoadFailurePolicy.RECOMPUTE:
            assert (tokens["r"], ends["r"].reason) == (expected, "length")
            assert engine.counters.kv_loads["failed_recomputed"] == 1
        else:
            assert ("r" not in tokens, ends["r"].reason) == (True, "error")
            assert "KV load failed" in ends["r"].error
            assert engine.counters.kv_loads["failed"] == 1
        assert engine.stats() == 0
    finally:
        engine.stop()
