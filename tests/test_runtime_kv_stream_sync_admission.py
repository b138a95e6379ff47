"""Streamed push hand-off under the sync-admission policy (one pipeline per process: see
test_runtime_kv_handoff_sync_admission.py): many-chunk prompts, decode block size 8 vs prefill's 4,
push streamed and pull unchanged, tokens equal monolithic greedy, nothing leaks."""

from __future__ import annotations

import pytest

from prefill_node.decode.worker_process import DecodeWorkerProcess, DecodeWorkerSpec
from prefill_node.engine.types import KVPullDestination, PrefillOptions
from prefill_node.runtime.dist_env import DistEnv, free_local_port
from prefill_node.runtime.pipeline_engine import PipelineEngine
from tests.test_runtime_kv_handoff import CONFIG, NEW_TOKENS, prompt_of, reference_greedy, wait_idle
from tests.test_runtime_kv_stream import (
    STREAM,
    assert_streamed,
    parts_of,
    pipeline_spec,
    stream_round_trip,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_sync_admission_pipeline_streams_push_and_pulls_unchanged():
    spec = DecodeWorkerSpec(model_config=CONFIG, seed=0, num_blocks=64, block_size=8, timeout_s=5)
    with DecodeWorkerProcess(spec) as decode:
        env = DistEnv(0, 2, "127.0.0.1", free_local_port())
        engine = PipelineEngine.start(
            pipeline_spec("sync-admission"), env, startup_timeout_s=60, kv_handoff=STREAM
        )
        try:
            prompt = prompt_of(59, seed=31)  # 8 chunks, one at a time in the pipeline
            tokens, logits_at = stream_round_trip(engine, decode, "lock-stream", prompt)
            assert tokens == reference_greedy(prompt)
            parts = parts_of(decode, "lock-stream")
            assert_streamed(parts, len(prompt))
            assert min(p.at for p in parts) < logits_at
            options = PrefillOptions("lock-stream-pull", kv_destination=KVPullDestination())
            result = engine.submit(prompt, options).result(60)
            decode.pull("lock-stream-pull", prompt, result.stage_manifests)
            pulled = list(decode.generate("lock-stream-pull", result.first_token_id, NEW_TOKENS))
            assert pulled == reference_greedy(prompt)
            wait_idle(engine)
            assert decode.stats().used_blocks == 0
        finally:
            engine.shutdown()
