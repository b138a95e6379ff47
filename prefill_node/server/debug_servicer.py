"""The DebugService servicer: a pipeline's invariants checked on demand (``--debug-service``).

A soak test or an operator asks, once load has stopped, whether every stage's cache passes
``check_integrity()`` and what each stage still holds (used blocks, KV WRITEs, pull leases).
Only engines that can check their stages serve it (``IntegrityCheckable``: the multi-process
pipeline). A stage that does not answer fails the call with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol, runtime_checkable

import grpc

from prefill_node.errors import InvariantError, WaveppError
from wavepp_proto.prefill.v1 import debug_pb2, debug_pb2_grpc


@runtime_checkable
class IntegrityCheckable(Protocol):
    """An engine whose stages can be checked and counted (``PipelineEngine``)."""

    def debug_check_integrity(self) -> None: ...

    def stage_stats(self, timeout_s: float = 30.0) -> list[Any]: ...

    def load(self) -> Any: ...


def integrity_report(engine: IntegrityCheckable) -> debug_pb2.IntegrityReport:
    """Check every stage, then count what each holds (blocking: run it off the event loop)."""
    report = debug_pb2.IntegrityReport(ok=True)
    try:
        engine.debug_check_integrity()
    except InvariantError as exc:
        report.ok, report.error = False, str(exc)
    for s in engine.stage_stats():
        load = s.load()  # the occupancy GetLoad reports: escrowed blocks count as used
        report.stages.add(
            stage=s.stage,
            used_blocks=load.used_blocks,
            cached_blocks=load.cached_blocks,
            free_blocks=load.free_blocks,
            kv_held_blocks=s.kv_held_blocks,
            kv_pushes=s.kv_pushes,
            kv_leases=s.kv_leases,
        )
    report.inflight_requests = engine.load().inflight_requests
    return report


class DebugServicer(debug_pb2_grpc.DebugServiceServicer):
    def __init__(self, engine: IntegrityCheckable) -> None:
        self._engine = engine

    async def CheckIntegrity(  # noqa: N802 - gRPC method name
        self, request: debug_pb2.CheckIntegrityRequest, context: grpc.aio.ServicerContext
    ) -> debug_pb2.IntegrityReport:
        try:
            return await asyncio.to_thread(integrity_report, self._engine)
        except (WaveppError, TimeoutError) as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"stages did not answer: {exc}")
            raise  # unreachable: abort raises
