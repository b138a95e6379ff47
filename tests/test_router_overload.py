"""Overload control at the router, end to end over real gRPC with a real `wavepp serve`
pipeline: with one slot and a queue of one, a second request waits and is served, a third is
rejected at once with RESOURCE_EXHAUSTED and a retry-after-ms hint, and a waiter whose
deadline passes leaves the queue; a request predicted (the router's own cost model, set
high here so the trigger is deterministic) to finish after its deadline is rejected at once,
while one without a deadline is served; a request predicted to wait past the router's
`--max-wait` is rejected at once, deadline or not; and the prediction, calibrated by the
answers of a pipeline slowed down on purpose (every wave sleeps), rejects a too-short
deadline at once that the bare cost model (optimistic by orders of magnitude here) admits."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from prefill_node.client.prefill_client import PrefillClient
from prefill_node.core.cost_model import ChunkCostModel
from prefill_node.model.loader_hf import save_hf_checkpoint
from prefill_node.model.weights import random_weights
from prefill_node.server.server import ServerConfig
from prefill_node.wire.status import RETRY_AFTER_KEY
from prefill_router.calibration import CalibrationConfig
from prefill_router.discovery import StaticDiscovery
from prefill_router.flow_control import FlowConfig
from prefill_router.router_engine import RouterConfig, RouterEngine
from tests.grpc_harness import ServerThread, wait_until
from tests.router_harness import MODEL, serve, stop

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

LONG = [(7 * i + 3) % 64 for i in range(240)]  # 15 waves of 0.1 s per stage: seconds
LONG2 = [(11 * i + 5) % 64 for i in range(240)]  # not cached after LONG
SHORT = [(3 * i + 1) % 64 for i in range(40)]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("model")
    save_hf_checkpoint(model_dir, MODEL, random_weights(MODEL, seed=7))
    proc, port = serve(model_dir, wave_delay_s=0.1)
    try:
        with PrefillClient(f"127.0.0.1:{port}") as client:
            wait_until(client.is_ready, 60, "pipeline ready")
        yield f"127.0.0.1:{port}"
    finally:
        stop(proc)


def routed(address: str, config: RouterConfig):
    engine = RouterEngine(StaticDiscovery([address]), config)
    engine.start()
    server = ServerThread(engine, ServerConfig(host="127.0.0.1", port=0, blocking_submit=False))
    return engine, server


def retry_after_ms(err: grpc.RpcError) -> int:
    return int(dict(err.trailing_metadata())[RETRY_AFTER_KEY])


def test_a_full_queue_rejects_at_once_with_a_retry_hint_and_waiters_are_served(pipeline):
    # the bare cost model's predictions: the waiters' deadlines are tested, not calibration
    off = CalibrationConfig(alpha=0.0)
    engine, server = routed(pipeline, RouterConfig(flow=FlowConfig(1, 1), calibration=off))
    try:
        with server as srv, PrefillClient(srv.target) as client, ThreadPoolExecutor(2) as pool:
            wait_until(client.is_ready, 30, "the router SERVING")
            m = engine.metrics
            first = pool.submit(client.prefill, LONG, request_id="first")
            wait_until(lambda: m.admission["admit"] == 1, 30, "the first admitted")
            second = pool.submit(client.prefill, SHORT, request_id="second")
            wait_until(lambda: m.waiting == 1, 30, "the second waiting")
            with pytest.raises(grpc.RpcError) as err:
                client.prefill(SHORT, request_id="third")
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "queue is full" in err.value.details()
            assert retry_after_ms(err.value) >= 1
            # a waiter whose deadline passes (the first holds the slot for seconds) leaves
            with pytest.raises(grpc.RpcError) as late:
                client.prefill(SHORT, request_id="late", timeout_s=0.3)
            assert late.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # queue still full
            assert first.result(60).result.request_id == "first"
            assert second.result(60).result.request_id == "second"
            assert m.queue_wait_s > 0
            assert dict(m.admission) == {"admit": 1, "wait": 1, "queue_full": 2, "dequeued": 1}
            # now a waiter that runs out of time while waiting is withdrawn
            first = pool.submit(client.prefill, LONG2, request_id="first-again")
            wait_until(lambda: m.admission["admit"] == 2, 30, "admitted again")
            with pytest.raises(grpc.RpcError) as late:
                client.prefill(SHORT, request_id="late", timeout_s=0.3)
            assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            wait_until(lambda: m.admission["withdrawn"] == 1, 10, "the late waiter withdrawn")
            assert m.waiting == 0
            assert first.result(60).result.request_id == "first-again"
            assert engine._flow.inflight == 0
            engine._flow.check_integrity()
    finally:
        engine.shutdown()


def test_a_request_predicted_past_its_deadline_is_rejected_at_once(pipeline):
    # one second per prompt token: a 40-token prompt is predicted to take 40 s
    slow = ChunkCostModel(per_token_s=1.0, per_token_context_s=0.0)
    engine, server = routed(pipeline, RouterConfig(cost_model=slow))
    try:
        with server as srv, PrefillClient(srv.target) as client:
            wait_until(client.is_ready, 30, "the router SERVING")
            fresh = [(13 * i + 7) % 64 for i in range(40)]  # nothing of it cached anywhere
            with pytest.raises(grpc.RpcError) as err:
                client.prefill(fresh, request_id="hurried", timeout_s=20)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "past its deadline" in err.value.details()
            assert 19_000 <= retry_after_ms(err.value) <= 21_000  # about 40 s - 20 s
            result = client.prefill(fresh, request_id="patient").result  # no deadline
            assert result.request_id == "patient"
            assert dict(engine.metrics.admission) == {"deadline": 1, "admit": 1}
    finally:
        engine.shutdown()


def test_a_request_predicted_to_wait_past_max_wait_is_rejected_at_once_deadline_or_not(pipeline):
    # one second per prompt token: LONG in flight puts 240 s of predicted work on the only
    # pipeline, so a request with no deadline behind it is predicted to wait far past 5 s
    slow = ChunkCostModel(per_token_s=1.0, per_token_context_s=0.0)
    config = RouterConfig(cost_model=slow, flow=FlowConfig(max_wait_s=5.0))
    engine, server = routed(pipeline, config)
    try:
        with server as srv, PrefillClient(srv.target) as client, ThreadPoolExecutor(1) as pool:
            wait_until(client.is_ready, 30, "the router SERVING")
            busy = pool.submit(client.prefill, LONG, request_id="busy", cache_salt="wait")
            wait_until(lambda: engine.metrics.admission["admit"] == 1, 30, "busy admitted")
            with pytest.raises(grpc.RpcError) as err:
                client.prefill(SHORT, request_id="behind", cache_salt="wait")
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-wait of 5s" in err.value.details()
            assert retry_after_ms(err.value) >= 100_000  # most of LONG's 240 s, less 5 s
            assert busy.result(60).result.request_id == "busy"
            # nothing queued once the router's view of the pipeline has caught up (its
            # next poll): the same request goes on
            wait_until(
                lambda: client.score(SHORT, cache_salt="wait").queued_s < 5.0,
                30,
                "queue seen empty",
            )
            assert client.prefill(SHORT, request_id="after", cache_salt="wait").result
            assert dict(engine.metrics.admission) == {"admit": 2, "wait_limit": 1}
            engine._flow.check_integrity()
    finally:
        engine.shutdown()


def _ratio_gauge(engine: RouterEngine) -> dict[str, float]:
    families = engine.metrics.collector().collect()
    family = next(f for f in families if f.name == "wavepp_router_prediction_ratio")
    return {s.labels["pipeline"]: s.value for s in family.samples}


@pytest.mark.parametrize("alpha", [0.5, 0.0])
def test_answers_calibrate_the_prediction_so_a_too_short_deadline_is_rejected_at_once(
    pipeline, alpha
):
    # The default cost model predicts a 40-token prompt in about 1e-4 s; each wave sleeps
    # 0.1 s on each stage, so its answer takes >= 0.3 s (3 chunks): every sample is over
    # 1,000 (>= 0.3 s / 2e-4 s even with a stale load doubling the prediction), so after 3
    # answers (alpha 0.5) the ratio is over 875 and a fresh 400-token prompt (about 8e-4 s
    # uncalibrated) is predicted to take over 0.7 s: past a 0.2 s deadline. Uncalibrated
    # (alpha 0) the same request is admitted and misses its deadline on the pipeline.
    engine, server = routed(pipeline, RouterConfig(calibration=CalibrationConfig(alpha=alpha)))
    try:
        with server as srv, PrefillClient(srv.target) as client:
            wait_until(client.is_ready, 30, "the router SERVING")
            for i in range(3):
                prompt = [(17 * j + 5 * i + 2) % 64 for j in range(40)]
                client.prefill(prompt, request_id=f"warm-{i}", cache_salt=f"s{i}")
            ratios = _ratio_gauge(engine)
            assert set(ratios) == ({pipeline} if alpha else set())
            assert ratios == pytest.approx(engine.prediction_ratios(), rel=1e-3)  # drifts
            long = [(19 * j + 3) % 64 for j in range(400)]
            with pytest.raises(grpc.RpcError) as err:
                client.prefill(long, request_id="hurried", cache_salt="fresh", timeout_s=0.2)
            if alpha:
                assert ratios[pipeline] > 875
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "past its deadline" in err.value.details()
                assert retry_after_ms(err.value) >= 500
                assert dict(engine.metrics.admission) == {"admit": 3, "deadline": 1}
            else:
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                assert dict(engine.metrics.admission) == {"admit": 4}
    finally:
        engine.shutdown()
