"""A busy pipeline behind the router, against a real gRPC server: its GetLoad is slow (its load
asks every stage, behind admission rounds). GetServerInfo must not be (the router asks it
after every broken event stream, with a 1 s deadline), and PipelineLink keeps such a pipeline
as a candidate with its last load; one whose readiness goes NOT_SERVING leaves at once. The
soak found the router dropping busy pipelines, and their whole index with them, about once
every eight seconds under load."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from prefill_node.client.prefill_client import PrefillClient
from prefill_node.runtime.dist_env import free_local_port
from prefill_router.discovery import PipelineEndpoint
from prefill_router.pipeline_link import LinkConfig, PipelineLink
from tests.grpc_harness import ServerThread, wait_until
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


class Recorder:
    """The link's owner: accepts the pipeline and records readiness changes."""

    def __init__(self) -> None:
        self.changes: list[tuple[bool, str]] = []

    def link_identified(self, link, info):
        return None

    def link_ready(self, link, ready, reason):
        self.changes.append((ready, reason))

    def link_batch(self, link, sequence, events):
        return True

    def link_stream_lost(self, link, reason):
        pass


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


def test_a_slow_getload_keeps_a_ready_pipeline_and_its_last_load():
    engine = SlowLoadEngine()
    with ServerThread(engine) as srv:
        owner = Recorder()
        link = PipelineLink(
            PipelineEndpoint("p", srv.target), owner, LinkConfig(poll_s=0.05, rpc_timeout_s=0.3)
        )
        link.start()
        try:
            wait_until(lambda: link.ready and link.load is not None, 10, "the link ready")
            assert link.watching  # readiness pushed by the health Watch stream
            before = link.load
            engine.slow.set()
            wait_until(lambda: link.slow_loads >= 3, 10, "three slow GetLoad calls")
            assert link.ready and link.load is before
            assert owner.changes == [(True, "")]
            engine.slow.clear()
            engine.kill_stage()  # readiness NOT_SERVING: gone at once
            wait_until(lambda: not link.ready, 5, "the link not ready")
            assert owner.changes[-1] == (False, "NOT_SERVING")
        finally:
            link.stop()
    engine.shutdown()


def test_late_health_checks_are_tolerated_a_few_times_in_a_row(monkeypatch):
    """Readiness polled (Check): one or two health checks past the deadline (a loaded host)
    keep the pipeline; the third in a row drops it, as a hung pipeline must be."""
    from grpc_health.v1._async import HealthServicer

    late = threading.Event()
    check = HealthServicer.Check

    async def slow_check(self, request, context):
        if late.is_set():
            await asyncio.sleep(0.5)
        return await check(self, request, context)

    monkeypatch.setattr(HealthServicer, "Check", slow_check)
    engine = ToyEngine()
    with ServerThread(engine) as srv:
        owner = Recorder()
        config = LinkConfig(poll_s=0.2, rpc_timeout_s=0.3, slow_polls_before_unready=3,
                            watch=False)  # fmt: skip
        link = PipelineLink(PipelineEndpoint("p", srv.target), owner, config)
        link.start()
        try:
            wait_until(lambda: link.ready, 10, "the link ready")
            for _ in range(3):  # two late checks, then one on time: still a candidate
                late.set()
                wait_until(lambda: link._slow_polls == 2, 5, "two late health checks")
                late.clear()
                wait_until(lambda: link._slow_polls == 0, 5, "a health check on time")
            assert link.ready and owner.changes == [(True, "")]
            late.set()  # hung: the third late check in a row drops it
            wait_until(lambda: not link.ready, 5, "the link not ready")
            assert owner.changes[-1] == (False, "unreachable: DEADLINE_EXCEEDED")
        finally:
            late.clear()
            link.stop()
    engine.shutdown()


def test_a_pipeline_back_after_a_long_outage_is_seen_within_the_retry_cap():
    """gRPC's reconnect backoff grows towards 120 s while a server is gone; the soak saw a
    restarted pipeline idle for 45 s before the router noticed it. The link's channels cap
    that backoff at ``retry_s``."""
    from prefill_node.server.server import ServerConfig

    port = free_local_port()
    config = ServerConfig(host="127.0.0.1", port=port, health_poll_s=0.05)
    engine = ToyEngine()
    owner = Recorder()
    link_config = LinkConfig(poll_s=0.1, rpc_timeout_s=0.3, retry_s=1.0)
    link = PipelineLink(PipelineEndpoint("p", f"127.0.0.1:{port}"), owner, link_config)
    try:
        with ServerThread(engine, config):
            link.start()
            wait_until(lambda: link.ready, 10, "the link ready")
        wait_until(lambda: not link.ready, 5, "the link not ready")
        time.sleep(10)  # refused for 10 s: gRPC alone would wait ~6 s more after it is back
        with ServerThread(engine, config):
            t0 = time.monotonic()
            wait_until(lambda: link.ready, 10, "the link ready again")
            assert time.monotonic() - t0 < 2.5
    finally:
        link.stop()
        engine.shutdown()


def test_a_hung_pipeline_under_watch_leaves_after_late_probes_and_comes_back(monkeypatch):
    """Under Watch a hung pipeline keeps its stream open and pushes nothing: a late GetLoad
    is followed by a health Check, and the third late one in a row drops it. Answering
    again, it is back (a new Watch reports SERVING)."""
    from grpc_health.v1._async import HealthServicer

    hung = threading.Event()
    check = HealthServicer.Check

    async def slow_check(self, request, context):
        if hung.is_set():
            await asyncio.sleep(0.5)
        return await check(self, request, context)

    monkeypatch.setattr(HealthServicer, "Check", slow_check)
    engine = SlowLoadEngine()
    engine.load_delay_s = 0.5
    with ServerThread(engine) as srv:
        owner = Recorder()
        config = LinkConfig(poll_s=0.1, rpc_timeout_s=0.3, slow_polls_before_unready=3)
        link = PipelineLink(PipelineEndpoint("p", srv.target), owner, config)
        link.start()
        try:
            wait_until(lambda: link.ready and link.watching, 10, "the link ready, watching")
            engine.slow.set()  # busy: GetLoad late, Check on time: stays
            wait_until(lambda: link.slow_loads >= 3, 10, "three slow GetLoad calls")
            assert link.ready and owner.changes == [(True, "")]
            hung.set()  # hung: GetLoad and Check late
            wait_until(lambda: not link.ready, 10, "the hung link not ready")
            assert owner.changes[-1] == (False, "unreachable: DEADLINE_EXCEEDED")
            hung.clear()
            engine.slow.clear()
            wait_until(lambda: link.ready and link.watching, 10, "the link ready again")
            assert owner.changes[-1] == (True, "")
        finally:
            hung.clear()
            link.stop()
    engine.shutdown()


def test_without_health_watch_readiness_is_polled(monkeypatch):
    """A health service without Watch (UNIMPLEMENTED): the link polls Check instead, and a
    NOT_SERVING pipeline still leaves within a poll."""
    import grpc
    from grpc_health.v1._async import HealthServicer

    async def no_watch(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no Watch here")

    monkeypatch.setattr(HealthServicer, "Watch", no_watch)
    engine = ToyEngine()
    with ServerThread(engine) as srv:
        owner = Recorder()
        link = PipelineLink(PipelineEndpoint("p", srv.target), owner, LinkConfig(poll_s=0.1))
        link.start()
        try:
            wait_until(lambda: link.ready, 10, "the link ready")
            assert not link.watching
            engine.kill_stage()
            wait_until(lambda: not link.ready, 5, "the link not ready")
            assert owner.changes == [(True, ""), (False, "NOT_SERVING")]
        finally:
            link.stop()
    engine.shutdown()


@pytest.mark.asyncio
async def test_a_link_on_a_running_loop_runs_there_without_threads():
    """Started on a running event loop (the router's serving loop), a link adds no thread:
    readiness, load and events are tasks of that loop; ``aclose`` ends them."""
    engine = ToyEngine()
    with ServerThread(engine) as srv:
        before = {t.ident for t in threading.enumerate()}
        owner = Recorder()
        link = PipelineLink(PipelineEndpoint("p", srv.target), owner, LinkConfig(poll_s=0.05))
        link.start()
        try:
            for _ in range(500):
                if link.ready and link.load is not None:
                    break
                await asyncio.sleep(0.01)
            assert link.ready and link.watching and link.load is not None
            assert [t.name for t in threading.enumerate() if t.ident not in before] == []
            assert all(not t.done() for t in link._tasks)
        finally:
            await link.aclose()
        assert link._tasks == [] and link._clients == {}
    engine.shutdown()
