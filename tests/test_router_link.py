"""A busy pipeline behind the router, against a real gRPC server: its GetLoad is slow (its load
asks every stage, behind admission rounds). GetServerInfo must not be (the router asks it
after every broken event stream, with a 1 s deadline), and PipelineLink keeps such a pipeline
as a candidate with its last load; one whose readiness goes NOT_SERVING leaves at once. The
soak found the router dropping busy pipelines, and their whole index with them, about once
every eight seconds under load."""

from __future__ import annotations

import threading
import time

import pytest

from prefill_node.server.client import PrefillClient
from tests.grpc_harness import ServerThread
from tests.grpc_toy_engine import ToyEngine

pytestmark = pytest.mark.timeout(60)


class SlowLoadEngine(ToyEngine):
    """GetLoad takes ``load_delay_s`` once ``slow`` is set (as a busy pipeline's does)."""

    def __init__(self) -> None:
        super().__init__()
        self.slow = threading.Event()
        self.load_delay_s = 1.0

    def load(self):
        if self.slow.is_set():
            time.sleep(self.load_delay_s)
        return super().load()


def test_server_info_does_not_wait_for_a_slow_load():
    engine = SlowLoadEngine()
    with ServerThread(engine) as srv, PrefillClient(srv.target) as client:
        first = client.server_info()
        engine.slow.set()
        t0 = time.monotonic()
        for _ in range(5):
            assert client.server_info(timeout_s=0.5) == first
        assert time.monotonic() - t0 < 1.0
    engine.shutdown()
