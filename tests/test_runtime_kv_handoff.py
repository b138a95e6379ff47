"""Prompt -> 2-stage multi-process PipelineEngine -> NIXL -> decode worker process -> tokens.

Every stage is its own process with its own NIXL agent (stage 0 inside the leader); the
decode worker is a third process with block size 8 against prefill's 4. Generated tokens
must equal monolithic greedy generation by the independent reference forward. The same
pipeline publishes its KV events to a sink, and enforces deadlines. After every test each
stage holds no blocks (none pinned for a hand-off either) and every integrity check passes.
"""

from __future__ import annotations

import random
import socket
import threading
import time

import pytest

from prefill_node.core.hashing import ExtraKeys, hash_block_tokens
from prefill_node.core.kv_events import BlockStored, KVEvent
from prefill_node.decode.worker_process import DecodeWorkerProcess, DecodeWorkerSpec
from prefill_node.engine.types import KVPullDestination, KVPushDestination, PrefillOptions
from prefill_node.errors import DeadlineExceededError, InvalidKVDestinationError, KVHandoffError
from prefill_node.kv_handoff.config import KVHandoffConfig
from prefill_node.model.config import ModelConfig
from prefill_node.model.reference import reference_forward
from prefill_node.model.weights import random_weights
from prefill_node.runtime.dist_env import DistEnv, free_local_port
from prefill_node.runtime.pipeline_engine import PipelineEngine
from prefill_node.runtime.spec import ModelSource, PipelineSpec
from tests.tiny_models import TINY_LLAMA_HF

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

HF_CONFIG = TINY_LLAMA_HF
CONFIG = ModelConfig.from_hf_config(HF_CONFIG, name="tiny-llama")
WEIGHTS = random_weights(CONFIG, seed=0)
BS = 4
SHIPPING = KVHandoffConfig(  # at-end hand-off; test_runtime_kv_stream.py covers streaming
    transfer_timeout_s=5.0, handshake_timeout_s=1.0, lease_ttl_s=5.0, stream=False
)
NEW_TOKENS = 32


def reference_greedy(prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    ids, out = list(prompt), []
    for _ in range(n):
        logits, _ = reference_forward(CONFIG, WEIGHTS, ids)
        out.append(int(logits.argmax()))
        ids.append(out[-1])
    return out


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(CONFIG.vocab_size) for _ in range(length)]


class EventSink:
    def __init__(self) -> None:
        self.events: list[KVEvent] = []
        self._lock = threading.Lock()

    def __call__(self, events) -> None:
        with self._lock:
            self.events.extend(events)

    def stored_hashes(self) -> set[int]:
        with self._lock:
            return {h for e in self.events if isinstance(e, BlockStored) for h in e.block_hashes}


@pytest.fixture(scope="module")
def decode():
    spec = DecodeWorkerSpec(model_config=CONFIG, seed=0, num_blocks=48, block_size=8, timeout_s=5)
    with DecodeWorkerProcess(spec) as worker:
        yield worker
        assert worker.stats().used_blocks == 0


@pytest.fixture(scope="module")
def sink() -> EventSink:
    return EventSink()


@pytest.fixture(scope="module")
def engine(sink):
    spec = PipelineSpec(
        model=ModelSource(config=HF_CONFIG, seed=0, name="tiny-llama"),
        layer_ranges=((0, 2), (2, 4)),
        stage_blocks=(40, 36),
        block_size=BS,
        max_wave_tokens=8,
        min_wave_tokens=4,
        dead_after_s=5.0,
    )
    env = DistEnv(0, 2, "127.0.0.1", free_local_port())
    engine = PipelineEngine.start(
        spec, env, startup_timeout_s=60, kv_handoff=SHIPPING, kv_events=sink
    )
    yield engine
    wait_idle(engine)
    engine.shutdown()


def wait_idle(engine: PipelineEngine, timeout_s: float = 5.0) -> None:
    """Every stage's blocks unpinned (bounded: leases and cancels end asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine.stage_stats()
        busy = [(s.pool.in_use, s.kv_held_blocks) for s in stats]
        if busy == [(0, 0), (0, 0)] or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert busy == [(0, 0), (0, 0)]
    engine.debug_check_integrity()  # admission state and each stage's hand-off


def push_round_trip(engine, decode, request_id: str, prompt: list[int]) -> list[int]:
    dest = decode.expect_push(request_id, prompt)
    result = engine.submit(prompt, PrefillOptions(request_id, kv_destination=dest)).result(30)
    assert [m.pushed for m in result.stage_manifests] == [True, True]
    assert [(m.layer_start, m.layer_end) for m in result.stage_manifests] == [(0, 2), (2, 4)]
    assert len({m.agent_name for m in result.stage_manifests}) == 2  # one agent per stage
    assert not any(rid == request_id for rid, *_ in decode.kv_log()[0])  # nothing streamed
    return list(decode.generate(request_id, result.first_token_id, NEW_TOKENS))


def test_push_generation_equals_monolithic_greedy(engine, decode):
    prompt = prompt_of(13, seed=1)
    assert push_round_trip(engine, decode, "push-1", prompt) == reference_greedy(prompt)
    wait_idle(engine)
    longer = prompt + prompt_of(6, seed=2)  # reuses 3 cached blocks per stage, ships them too
    assert push_round_trip(engine, decode, "push-2", longer) == reference_greedy(longer)
    assert decode.stats().used_blocks == 0
    wait_idle(engine)


def test_pull_generation_equals_monolithic_greedy_and_leases_end(engine, decode):
    prompt = prompt_of(17, seed=3)
    options = PrefillOptions("pull-1", kv_destination=KVPullDestination())
    result = engine.submit(prompt, options).result(30)
    manifests = result.stage_manifests
    assert all(m.lease_id and m.agent_name and m.regions for m in manifests)
    assert [s.pool.in_use for s in engine.stage_stats()] == [5, 5]  # leased until released
    decode.pull("pull-1", prompt, manifests)
    assert list(decode.generate("pull-1", result.first_token_id, NEW_TOKENS)) == (
        reference_greedy(prompt)
    )
    wait_idle(engine)  # decode's release unpinned every stage's lease


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_decode_fails_cleanly_and_pipeline_keeps_serving(engine, decode):
    prompt = prompt_of(9, seed=4)
    dest = KVPushDestination(
        agent_name="nobody", metadata_endpoint=f"127.0.0.1:{_closed_port()}", block_ids=(0, 1, 2)
    )
    started = time.monotonic()
    future = engine.submit(prompt, PrefillOptions("lost", kv_destination=dest))
    with pytest.raises(KVHandoffError, match="DecodeUnreachable"):
        future.result(30)
    assert time.monotonic() - started < 4
    wait_idle(engine)
    outside = KVPushDestination(
        agent_name="far", metadata_endpoint="10.1.2.3:7", block_ids=(0, 1, 2)
    )
    with pytest.raises(InvalidKVDestinationError, match="allow-list"):
        engine.submit(prompt, PrefillOptions("outside", kv_destination=outside)).result(30)
    wait_idle(engine)
    assert push_round_trip(engine, decode, "after-loss", prompt) == reference_greedy(prompt)
    wait_idle(engine)


def test_kv_events_carry_the_prompts_chained_hashes(engine, sink):
    prompt = prompt_of(22, seed=8)  # 5 full blocks
    engine.submit(prompt, PrefillOptions("events-1")).result(30)
    model_id = f"{CONFIG.name}|float32"
    expected = set(hash_block_tokens(prompt, BS, ExtraKeys(model_id=model_id)))
    assert len(expected) == 5
    deadline = time.monotonic() + 5  # the stages' batches ride that request's waves
    while not expected <= sink.stored_hashes() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert expected <= sink.stored_hashes()
    wait_idle(engine)


def test_deadline_aborts_and_frees_every_stage(engine):
    prompt = prompt_of(10, seed=6)
    past = PrefillOptions("late", deadline_s=time.monotonic() - 1)
    with pytest.raises(DeadlineExceededError):
        engine.submit(prompt, past).result(5)
    with socket.socket() as silent:  # accepts, never answers: the hand-off hangs
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        dest = KVPushDestination(
            agent_name="mute",
            metadata_endpoint=f"127.0.0.1:{silent.getsockname()[1]}",
            block_ids=(0, 1, 2),
        )
        options = PrefillOptions("slow", deadline_s=time.monotonic() + 0.3, kv_destination=dest)
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError, match="deadline"):
            engine.submit(prompt, options).result(10)
        assert 0.25 < time.monotonic() - started < 2.0
        wait_idle(engine)
    assert engine.submit(prompt, PrefillOptions("after-deadline")).result(30).prompt_tokens == 10
    wait_idle(engine)


def test_reused_request_id_supersedes_a_live_lease(engine, decode):
    """A retry with the same id while the first answer's lease is live: the stages revoke
    the old lease, run the new request, and nothing leaks."""
    prompt = prompt_of(12, seed=10)
    options = PrefillOptions("again", kv_destination=KVPullDestination())
    first = engine.submit(prompt, options).result(30)
    assert [s.kv_held_blocks for s in engine.stage_stats()] == [3, 3]
    second = engine.submit(prompt, options).result(30)
    assert second.cached_tokens == 11  # every block reused, the last one by copy
    assert {m.lease_id for m in second.stage_manifests}.isdisjoint(
        m.lease_id for m in first.stage_manifests
    )
    decode.pull("again", prompt, second.stage_manifests)
    tokens = list(decode.generate("again", second.first_token_id, NEW_TOKENS))
    assert tokens == reference_greedy(prompt)
    wait_idle(engine)


def test_abort_after_the_answer_revokes_leases_decode_never_pulled(engine):
    """A pull-mode answer whose decode never came (its caller gave up): Abort revokes the
    leases on every stage at once, well before their TTL, and only once."""
    prompt = prompt_of(14, seed=11)
    options = PrefillOptions("unpulled", kv_destination=KVPullDestination())
    engine.submit(prompt, options).result(30)
    assert [s.kv_held_blocks for s in engine.stage_stats()] == [4, 4]
    started = time.monotonic()
    assert engine.abort("unpulled")
    wait_idle(engine, timeout_s=SHIPPING.lease_ttl_s / 2)
    assert time.monotonic() - started < SHIPPING.lease_ttl_s / 2  # revoked, not expired
    assert not engine.abort("unpulled")  # nothing left to revoke
    assert not engine.abort("never-seen")
