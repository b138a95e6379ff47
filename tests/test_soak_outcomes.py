"""The soak's outcome classes: a stream whose client library lost a request write under it
(grpc.aio's own INTERNAL "Internal error from Core") is counted apart from a server's
INTERNAL, and is allowed only right after a router kill."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
soak_workload = pytest.importorskip("soak_workload")
soak_report = pytest.importorskip("soak_report")


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def test_lost_write_is_its_own_outcome_and_a_server_internal_is_not() -> None:
    lost = _error(grpc.StatusCode.INTERNAL, soak_workload.WRITE_LOST_DETAILS)
    assert soak_workload._code(lost) == soak_workload.WRITE_LOST
    server = _error(grpc.StatusCode.INTERNAL, "internal error in request r1 (KeyError)")
    assert soak_workload._code(server) == "INTERNAL"
    assert soak_workload._code(_error(grpc.StatusCode.UNAVAILABLE, "x")) == "UNAVAILABLE"


def test_lost_writes_are_explained_only_right_after_a_router_kill() -> None:
    kill = time.monotonic()
    window = soak_report.WRITE_LOST_WINDOW_S
    lost = soak_workload.WRITE_LOST
    tally = SimpleNamespace(
        rows=[
            (kill + 0.01, "stream", lost, 0.1),  # at the kill: explained
            (kill + window + 1, "stream", lost, 0.1),  # too late
            (kill - 1, "stream", lost, 0.1),  # before it
            (kill + 0.01, "stream", "UNAVAILABLE", 0.1),  # another outcome: not counted
        ]
    )
    assert soak_report.unexplained_writes_lost(tally, SimpleNamespace(router_kills=[kill])) == 2
    assert soak_report.unexplained_writes_lost(tally, SimpleNamespace(router_kills=[])) == 3
