"""SIGKILL of a stage process under a real gRPC server over the real 2-stage PipelineEngine:
readiness and liveness go NOT_SERVING (a pipeline with a dead stage cannot recover, so the
kubelet must restart it; the soak found it stuck live forever), in-flight calls fail
UNAVAILABLE naming the dead stage, and the server itself keeps answering until it is
restarted (GetServerInfo, GetLoad, fast UNAVAILABLE refusals).

Its own pipeline (it is destroyed); 30 ms per wave keeps the calls in flight when the stage
dies (see PipelineSpec.debug_wave_delay_s).
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefill_node.client.prefill_client import SERVICE_NAME, PrefillClient
from tests.grpc_harness import (
    ServerThread,
    pipeline_server_config,
    start_tiny_pipeline,
    wait_mid_flight,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def engine():
    eng = start_tiny_pipeline(max_wave_tokens=8, min_wave_tokens=8, debug_wave_delay_s=0.03)
    yield eng
    eng.shutdown()


def test_killing_a_stage_fails_calls_unavailable_and_readiness_not_serving(engine):
    prompts = [[(5 * i + k) % 64 for i in range(120)] for k in range(4)]
    with (
        ServerThread(engine, pipeline_server_config()) as srv,
        PrefillClient(srv.target) as client,
        grpc.insecure_channel(srv.target) as channel,
        ThreadPoolExecutor(4) as pool,
    ):
        health = health_pb2_grpc.HealthStub(channel)
        status = lambda s: health.Check(health_pb2.HealthCheckRequest(service=s)).status
        assert (status(""), status(SERVICE_NAME)) == (SERVING, SERVING)
        pending = [
            pool.submit(client.prefill, p, request_id=f"k{i}") for i, p in enumerate(prompts)
        ]
        wait_mid_flight(engine, sum(map(len, prompts)))
        os.kill(engine.stage_pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        for call in pending:
            with pytest.raises(grpc.RpcError) as err:
                call.result(10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            # the first detector wins (the launcher's poll, or a gloo error on either plane);
            # either way the message names the dead stage and its exit code
            details = err.value.details()
            assert details.startswith("pipeline unavailable: stage 1 "), details
            assert "code -9" in details, details
        assert time.monotonic() - t0 < 5
        wait_until(lambda: status(SERVICE_NAME) == NOT_SERVING, 5, "readiness NOT_SERVING")
        wait_until(lambda: status("") == NOT_SERVING, 5, "liveness NOT_SERVING")
        # the server process answers until it is restarted: info and load; prefills refused
        assert client.server_info().num_stages == 2
        assert [s.stage for s in client.load().stages] == [0, 1]  # last figures seen
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            client.prefill([1, 2, 3])
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        details = err.value.details()
        assert details.startswith("the pipeline is not ready (") and "stage " in details, details
        assert details.endswith("retry later")
        assert time.monotonic() - t0 < 1
