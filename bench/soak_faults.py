"""The soak's fault schedule and injectors. Each fault is recorded with when it started, when
the tier was whole again (``recovered_s``: every pipeline ready in the router's view, the
router serving) and whether that happened in time (``survived``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from dataclasses import dataclass, field

RECOVER_TIMEOUT_S = 240.0
STOP_PAST_HEARTBEAT_S = 8.0  # a stage SIGSTOPped this long: past the 5 s heartbeat timeout

FULL = (
    "decode_kill",
    "pressure",
    "stage_kill",
    "kv_cut",
    "stage_stop",
    "router_restart",
    "decode_kill",
    "pressure",
)
FEW = ("decode_kill", "router_restart", "kv_cut", "pressure")


LAST_START = 0.8  # no fault starts in the last 20% of the load: the "after" window


def schedule(kind: str, duration_s: float) -> list[tuple[float, str]]:
    """(seconds after load starts, fault) spread over 10%..60% of the run; a fault whose
    turn comes after 80% (the ones before recovered slowly) is skipped."""
    names = {"all": FULL, "few": FEW, "none": ()}[kind]
    if not names:
        return []
    step = 0.5 / max(1, len(names) - 1)
    return [(duration_s * (0.1 + i * step), name) for i, name in enumerate(names)]


@dataclass
class FaultRecord:
    name: str
    at_s: float
    target: str = ""
    recovered_s: float | None = None
    survived: bool = False
    detail: str = ""


@dataclass
class Faults:
    pipes: list
    router: object
    decoders: list
    supervisor: object
    cut: object
    tally: object
    workload: object = None
    records: list = field(default_factory=list)
    skipped: list = field(default_factory=list)  # faults whose turn came too late
    restarts: list = field(default_factory=list)  # (t, pipeline, why)
    router_epoch: float = 0.0  # monotonic time since when the router counts for the tally
    router_kills: list = field(default_factory=list)  # monotonic times of router SIGKILLs
    t0: float = field(default_factory=time.monotonic)
    _n: int = 0

    def note_restart(self, name: str, why: str, stop_s: float, start_s: float) -> None:
        t = time.monotonic() - self.t0
        self.restarts.append(
            {
                "t": round(t, 1),
                "pipeline": name,
                "why": why,
                "stop_s": round(stop_s, 1),
                "start_s": round(start_s, 1),
            }
        )

    # -- waiting for the tier to be whole -----------------------------------------------------
    def tier_ready(self) -> bool:
        from prefill_node.client.prefill_client import PrefillClient

        with contextlib.suppress(Exception), PrefillClient(self.router.address) as c:
            loads = c.load(timeout_s=5).pipelines
            return len(loads) == len(self.pipes) and all(p.ready for p in loads) and c.is_ready()
        return False

    def wait_router_ready(self, timeout_s: float = RECOVER_TIMEOUT_S) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.tier_ready():
                return True
            time.sleep(0.25)
        return False

    # -- the schedule ----------------------------------------------------------------------------
    async def run(self, plan: list[tuple[float, str]], end: float) -> None:
        self.t0 = time.monotonic()
        last_start = self.t0 + LAST_START * (end - self.t0)
        for at_s, name in plan:
            await asyncio.sleep(max(0.0, self.t0 + at_s - time.monotonic()))
            if time.monotonic() >= last_start:
                self.skipped.append(name)
                continue
            rec = FaultRecord(name, time.monotonic() - self.t0)
            self.records.append(rec)
            self._n += 1
            try:
                await self._injectors()[name](rec)
            except Exception as exc:  # noqa: BLE001 - a failed injection is recorded, not fatal
                rec.detail += f" injection failed: {exc!r}"
            if rec.name not in ("pressure",):
                ok = await asyncio.to_thread(self.wait_router_ready)
                rec.survived = ok and rec.survived is not False
            rec.recovered_s = time.monotonic() - self.t0 - rec.at_s

    def _injectors(self) -> dict:
        return {
            "decode_kill": self.decode_kill,
            "stage_kill": self.stage_kill,
            "stage_stop": self.stage_stop,
            "router_restart": self.router_restart,
            "kv_cut": self.kv_cut,
            "pressure": self.pressure,
        }

    async def decode_kill(self, rec: FaultRecord) -> None:
        d = self.decoders[self._n % len(self.decoders)]
        rec.target = d.name
        await asyncio.sleep(0.05)  # it always has hand-offs in flight; land mid-transfer
        d.kill()
        d.start()
        rec.survived = True

    def _stage(self, rec: FaultRecord):
        p = self.pipes[self._n % len(self.pipes)]
        pids = p.stage_pids()
        if not pids:
            raise RuntimeError(f"{p.name} has no stage process")
        rec.target = f"{p.name} stage pid {pids[-1]}"
        return p, pids[-1]

    async def stage_kill(self, rec: FaultRecord) -> None:
        p, pid = self._stage(rec)
        starts = p.starts
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + RECOVER_TIMEOUT_S
        while p.starts == starts and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        rec.survived = p.starts > starts
        rec.detail = f"supervisor restarts: {p.starts - starts}"

    async def stage_stop(self, rec: FaultRecord) -> None:
        p, pid = self._stage(rec)
        starts = p.starts
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(STOP_PAST_HEARTBEAT_S)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + RECOVER_TIMEOUT_S
        while time.monotonic() < deadline:
            if p.starts > starts or await asyncio.to_thread(self.tier_ready):
                break
            await asyncio.sleep(0.5)
        rec.survived = True
        rec.detail = f"supervisor restarts: {p.starts - starts}"

    async def router_restart(self, rec: FaultRecord) -> None:
        rec.target = "router"
        self.router_kills.append(time.monotonic())
        self.router.kill()
        self.router_epoch = time.monotonic()
        await asyncio.to_thread(self.router.restart)
        rec.survived = True

    async def kv_cut(self, rec: FaultRecord) -> None:
        rec.target = "pipeline-0 connections"
        n = await asyncio.to_thread(self.cut.cut)
        rec.detail = f"{n} connection ends reset"
        rec.survived = True

    async def pressure(self, rec: FaultRecord) -> None:
        rec.target = "every stage"
        n = 24
        t = time.monotonic()
        await self.workload.pressure(n)
        rec.detail = f"{n} prompts of ~{1000} tokens in {time.monotonic() - t:.1f}s"
        rec.survived = True
