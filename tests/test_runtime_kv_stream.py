"""Streamed push hand-off (issue 20) on a 2-stage multi-process PipelineEngine (wave policy).

Prompts span many chunks (max 8 tokens a wave, block size 4); the decode worker process uses
block size 8. Each stage WRITEs a chunk's final blocks while the request still runs, and its
last chunk's first layer (a group of its two) during that chunk's forward; decode logs every
"part" notification. Checks: generation equals monolithic greedy; decode saw parts of a
request before its logits reached the leader (ordering on the one monotonic clock of this
host); an abort or a dead decode mid-stream leaks no block on either side, decode is told
the attempt failed, and a retry (new transfer id) is exact.
"""

from __future__ import annotations

import time

import pytest

from kv_transfer.receiver import PartReceived
from prefill_node.decode.worker_process import DecodeWorkerProcess, DecodeWorkerSpec
from prefill_node.engine.types import KVPullDestination, PrefillOptions
from prefill_node.errors import KVHandoffError, RequestAbortedError
from prefill_node.kv_handoff.config import KVHandoffConfig
from prefill_node.runtime.dist_env import DistEnv, free_local_port
from prefill_node.runtime.pipeline_engine import PipelineEngine
from prefill_node.runtime.spec import ModelSource, PipelineSpec
from tests.test_runtime_kv_handoff import (
    BS,
    CONFIG,
    HF_CONFIG,
    NEW_TOKENS,
    prompt_of,
    reference_greedy,
    wait_idle,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

# debug_post_before_push: the final push waits until every range handed over before it is
# posted. Without it, a range (usually the last chunk's first layer group: this tiny model's
# last layer runs in microseconds) that the hand-off thread had not posted yet when the push
# came rides the push instead, and a loaded machine makes that happen: streaming is then
# not observable, which these tests must require.
STREAM = KVHandoffConfig(
    transfer_timeout_s=5.0,
    handshake_timeout_s=1.0,
    lease_ttl_s=5.0,
    stream=True,
    debug_post_before_push=True,
)
DELAY_S = 0.03  # per wave and stage: a many-chunk prompt runs long enough to abort mid-stream


def pipeline_spec(policy: str = "wave") -> PipelineSpec:
    return PipelineSpec(
        model=ModelSource(config=HF_CONFIG, seed=0, name="tiny-llama"),
        layer_ranges=((0, 2), (2, 4)),
        stage_blocks=(64, 64),
        block_size=BS,
        policy=policy,
        max_wave_tokens=8,
        min_wave_tokens=4,
        dead_after_s=5.0,
        debug_wave_delay_s=DELAY_S,
    )


@pytest.fixture(scope="module")
def decode():
    spec = DecodeWorkerSpec(model_config=CONFIG, seed=0, num_blocks=64, block_size=8, timeout_s=5)
    with DecodeWorkerProcess(spec) as worker:
        yield worker
        assert worker.stats().used_blocks == 0


@pytest.fixture(scope="module")
def engine():
    env = DistEnv(0, 2, "127.0.0.1", free_local_port())
    engine = PipelineEngine.start(pipeline_spec(), env, startup_timeout_s=60, kv_handoff=STREAM)
    yield engine
    wait_idle(engine)
    engine.shutdown()


def parts_of(decode, request_id: str) -> list[PartReceived]:
    """Each "part" decode received for the request (stage, end token, time, layers)."""
    log, _ = decode.kv_log()
    return [p for p in log if p.request_id == request_id]


def stream_round_trip(engine, decode, request_id: str, prompt: list[int]):
    dest = decode.expect_push(request_id, prompt)
    submitted = time.monotonic()  # <= the engine's t_submit: logits_at below is a lower bound
    result = engine.submit(prompt, PrefillOptions(request_id, kv_destination=dest)).result(60)
    assert [m.pushed for m in result.stage_manifests] == [True, True]
    logits_at = submitted + result.timings.total_s - result.timings.handoff_s
    tokens = list(decode.generate(request_id, result.first_token_id, NEW_TOKENS))
    return tokens, logits_at


def assert_streamed(parts, num_tokens: int) -> None:
    """Both stages streamed all-layer ranges ending on a prefill block boundary, never the
    last block, then the last chunk's first layer group (layer 0 of 2) up to the prompt's
    end; the final push carries the rest (the last group), with the "done" notification."""
    assert {p.stage for p in parts} == {0, 1}
    for stage, (lo, hi) in ((0, (0, 2)), (1, (2, 4))):
        mine = [p for p in parts if p.stage == stage]
        # two ranges in flight at once may land in either order: decode logs arrivals
        ends = sorted(p.end_token for p in mine if (p.layer_start, p.layer_end) == (lo, hi))
        assert ends and len(set(ends)) == len(ends) and all(end % BS == 0 for end in ends)
        assert max(ends) <= (num_tokens - 1) // BS * BS
        groups = [(p.layer_start, p.layer_end, p.end_token) for p in mine if p.layer_end < hi]
        assert groups == [(lo, lo + 1, num_tokens)]


def test_streamed_push_equals_monolithic_greedy_and_parts_precede_the_logits(engine, decode):
    prompt = prompt_of(61, seed=21)  # 8 chunks of <= 8 tokens; the last block is partial
    tokens, logits_at = stream_round_trip(engine, decode, "stream-1", prompt)
    assert tokens == reference_greedy(prompt)
    parts = parts_of(decode, "stream-1")
    assert_streamed(parts, len(prompt))
    assert min(p.at for p in parts) < logits_at  # decode had KV before the prefill ended
    wait_idle(engine)
    longer = prompt[:48] + prompt_of(29, seed=22)  # 12 cached blocks per stage, streamed too
    tokens, _ = stream_round_trip(engine, decode, "stream-2", longer)
    assert tokens == reference_greedy(longer)
    assert_streamed(parts_of(decode, "stream-2"), len(longer))
    assert decode.stats().used_blocks == 0
    wait_idle(engine)


def test_pull_is_unchanged_on_a_streaming_engine(engine, decode):
    prompt = prompt_of(43, seed=23)
    options = PrefillOptions("stream-pull", kv_destination=KVPullDestination())
    result = engine.submit(prompt, options).result(60)
    assert all(m.lease_id and not m.pushed for m in result.stage_manifests)
    decode.pull("stream-pull", prompt, result.stage_manifests)
    tokens = list(decode.generate("stream-pull", result.first_token_id, NEW_TOKENS))
    assert tokens == reference_greedy(prompt)
    assert parts_of(decode, "stream-pull") == []
    wait_idle(engine)


def wait_for_parts(decode, request_id: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not parts_of(decode, request_id):
        assert time.monotonic() < deadline, "no streamed part reached decode"
        time.sleep(0.01)


def test_abort_mid_stream_fails_decode_attempt_and_a_retry_is_exact(engine, decode):
    prompt = prompt_of(120, seed=24)  # 15 chunks
    dest = decode.expect_push("stream-abort", prompt)
    future = engine.submit(prompt, PrefillOptions("stream-abort", kv_destination=dest))
    wait_for_parts(decode, "stream-abort")
    assert not future.done()  # mid-stream: the prefill is still running
    assert engine.abort("stream-abort")
    with pytest.raises(RequestAbortedError):
        future.result(10)
    # decode hears "fail" from the stages (not its own 5 s timeout): the attempt is invalid
    with pytest.raises(KVHandoffError, match="TransferFailed"):
        list(decode.generate("stream-abort", 0, 1))
    wait_idle(engine)  # every stage: no block in use, none held by the hand-off
    assert decode.stats().used_blocks == 0
    tokens, _ = stream_round_trip(engine, decode, "stream-abort", prompt)  # new transfer id
    assert tokens == reference_greedy(prompt)
    wait_idle(engine)


def test_decode_killed_mid_stream_fails_cleanly_and_the_pipeline_keeps_serving(engine, decode):
    spec = DecodeWorkerSpec(model_config=CONFIG, seed=0, num_blocks=32, block_size=8, timeout_s=5)
    doomed = DecodeWorkerProcess(spec)
    try:
        prompt = prompt_of(120, seed=25)
        dest = doomed.expect_push("stream-dead", prompt)
        future = engine.submit(prompt, PrefillOptions("stream-dead", kv_destination=dest))
        wait_for_parts(doomed, "stream-dead")
        doomed.process.kill()
        doomed.process.join(10)
        with pytest.raises(KVHandoffError):
            future.result(60)
    finally:
        doomed.stop()
    wait_idle(engine, timeout_s=15.0)
    prompt = prompt_of(37, seed=26)
    tokens, _ = stream_round_trip(engine, decode, "after-dead", prompt)
    assert tokens == reference_greedy(prompt)
    wait_idle(engine)
