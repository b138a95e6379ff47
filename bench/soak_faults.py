"""The soak's fault schedule and injectors. Each fault is recorded with when it started, the
component it took down, when the tier was whole again (``recovered_s``: every pipeline ready
in the router's view, the router serving) and whether its effect was verified and the tier
recovered in time (``survived``): a killed process was restarted, a pressure burst evicted
blocks and its prompts succeeded, a cut KV-event stream was resubscribed, a killed decode
worker had hand-offs in flight and its successor answers. ``windows`` are the spans the
outcome verdicts (soak_outcomes) explain failures by."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field

from soak_cluster import CLIENT_BACKOFF_S  # bench/ is on sys.path
from soak_outcomes import Window

RECOVER_TIMEOUT_S = 240.0
STOP_PAST_HEARTBEAT_S = 8.0  # a stage SIGSTOPped this long: past the 5 s heartbeat timeout
EFFECT_TIMEOUT_S = 60.0  # a fault's effect (a resubscription, a successor's answer) by then
PRESSURE_PROMPTS = 24
# a request failing this soon after recovery is the fault's: the clients reconnect within
# CLIENT_BACKOFF_S of the router listening again
WINDOW_GRACE_S = CLIENT_BACKOFF_S + 1.0

FULL = (
    "decode_kill",
    "pressure",
    "stage_kill",
    "kv_cut",
    "leader_kill",
    "stage_stop",
    "router_restart",
    "stage_kill+decode_kill",  # overlapping faults: two components at once
    "kv_cut+pressure",
    "decode_kill",
    "pressure",
)
FEW = ("decode_kill", "router_restart", "kv_cut", "pressure")


LAST_START = 0.8  # no fault starts in the last 20% of the load: the "after" window


INJECTORS = ("decode_kill", "stage_kill", "leader_kill", "stage_stop", "router_restart",
             "kv_cut", "pressure")  # fmt: skip


def fault_names(kind: str) -> tuple[str, ...]:
    """``all``, ``few``, ``none``, or a comma-separated list of faults (``a+b``: both at
    once); ValueError names an unknown one."""
    names = {"all": FULL, "few": FEW, "none": ()}.get(kind)
    if names is None:
        names = tuple(n for n in kind.split(",") if n)
        unknown = {part for n in names for part in n.split("+")} - set(INJECTORS)
        if unknown or not names:
            raise ValueError(f"unknown faults {sorted(unknown)}; known: {', '.join(INJECTORS)}")
    return names


def schedule(kind: str, duration_s: float) -> list[tuple[float, str]]:
    """(seconds after load starts, fault) spread over 10%..60% of the run; a fault whose
    turn comes after 80% (the ones before recovered slowly) is skipped. ``a+b`` injects
    both at once."""
    names = fault_names(kind)
    if not names:
        return []
    step = 0.5 / max(1, len(names) - 1)
    return [(duration_s * (0.1 + i * step), name) for i, name in enumerate(names)]


def netem_unavailable() -> str | None:
    """Why network faults (``tc netem`` in a network namespace) cannot run here; None when
    they can. Probed once with a throwaway namespace."""
    ns = f"wavepp-soak-probe-{os.getpid()}"
    inside = ["ip", "netns", "exec", ns]
    steps = (
        ["ip", "netns", "add", ns],
        [*inside, "ip", "link", "set", "lo", "up"],
        [*inside, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "5ms"],
    )
    try:
        for argv in steps:
            run = subprocess.run(argv, capture_output=True, text=True, timeout=10)
            if run.returncode:
                return f"`{' '.join(argv[-6:])}` failed: {run.stderr.strip()[:120]}"
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


@dataclass
class FaultRecord:
    name: str
    at_s: float
    target: str = ""
    component: str = ""  # what it took down: pipeline-N, decode-N, router ("" : nothing)
    recovered_s: float | None = None
    survived: bool = False
    effect: str = ""  # what was verified, or why not
    detail: str = ""
    overlapping: bool = False


@dataclass
class Faults:
    pipes: list
    router: object
    decoders: list
    supervisor: object
    cut: object
    tally: object
    workload: object = None
    residency: object = None  # address -> set of resident block hashes (soak_report)
    records: list = field(default_factory=list)
    skipped: list = field(default_factory=list)  # faults whose turn came too late
    restarts: list = field(default_factory=list)  # (t, pipeline, why)
    router_epoch: float = 0.0  # monotonic time since when the router counts for the tally
    router_kills: list = field(default_factory=list)  # monotonic times of router SIGKILLs
    network: str = "not scheduled"  # network faults: what ran, or why they were skipped
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

    def windows(self) -> list[Window]:
        """Each fault's span on its component, and each supervisor restart's on its
        pipeline (monotonic times)."""
        out = []
        for r in self.records:
            if r.component:
                end = r.at_s + (r.recovered_s or RECOVER_TIMEOUT_S) + WINDOW_GRACE_S
                out.append(Window(self.t0 + r.at_s, self.t0 + end, r.component, r.name))
        for r in self.restarts:
            start = r["t"] - r["stop_s"] - r["start_s"]
            end = r["t"] + RECOVER_TIMEOUT_S / 8  # ready within a few seconds of its start
            out.append(Window(self.t0 + start, self.t0 + end, r["pipeline"], "restart"))
        return out

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
            names = name.split("+")
            await asyncio.gather(*(self._inject(n, len(names) > 1) for n in names))

    async def _inject(self, name: str, overlapping: bool) -> None:
        rec = FaultRecord(name, time.monotonic() - self.t0, overlapping=overlapping)
        self.records.append(rec)
        self._n += 1
        try:
            await self._injectors()[name](rec)
        except Exception as exc:  # noqa: BLE001 - a failed injection is recorded, not fatal
            rec.survived = False
            rec.detail += f" injection failed: {exc!r}"
        if rec.name != "pressure":
            ok = await asyncio.to_thread(self.wait_router_ready)
            rec.survived = ok and rec.survived
        rec.recovered_s = time.monotonic() - self.t0 - rec.at_s

    def _injectors(self) -> dict:
        return {
            "decode_kill": self.decode_kill,
            "stage_kill": self.stage_kill,
            "leader_kill": self.leader_kill,
            "stage_stop": self.stage_stop,
            "router_restart": self.router_restart,
            "kv_cut": self.kv_cut,
            "pressure": self.pressure,
        }

    async def decode_kill(self, rec: FaultRecord) -> None:
        d = self.decoders[self._n % len(self.decoders)]
        rec.target = rec.component = d.name
        busy = await self._until(lambda: bool(d.open_ids))  # land mid-transfer
        ok_before = d.ok_rows
        in_flight = await asyncio.to_thread(d.kill)
        d.start()
        answered = await self._until(lambda: d.ok_rows > ok_before)
        rec.survived = busy and in_flight > 0 and answered
        rec.effect = (f"{in_flight} hand-offs in flight ended DECODER_KILLED; its successor "
                      f"{'answered' if answered else 'did not answer'}")  # fmt: skip

    async def _until(self, done, timeout_s: float = EFFECT_TIMEOUT_S) -> bool:
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.25)
        return True

    def _pipe(self, rec: FaultRecord):
        p = self.pipes[self._n % len(self.pipes)]
        rec.component = p.name
        return p

    def _stage(self, rec: FaultRecord):
        p = self._pipe(rec)
        pids = p.stage_pids()
        if not pids:
            raise RuntimeError(f"{p.name} has no stage process")
        rec.target = f"{p.name} stage pid {pids[-1]}"
        return p, pids[-1]

    async def _kill_until_restarted(self, rec: FaultRecord, p, pid: int) -> None:
        starts = p.starts
        os.kill(pid, signal.SIGKILL)
        restarted = await self._until(lambda: p.starts > starts, RECOVER_TIMEOUT_S)
        rec.survived = restarted
        rec.effect = f"supervisor restarts: {p.starts - starts}"

    async def stage_kill(self, rec: FaultRecord) -> None:
        await self._kill_until_restarted(rec, *self._stage(rec))

    async def leader_kill(self, rec: FaultRecord) -> None:
        """SIGKILL stage 0: the leader, with the gRPC front and the admission coordinator."""
        p = self._pipe(rec)
        if p.pid is None:
            raise RuntimeError(f"{p.name} has no leader process")
        rec.target = f"{p.name} leader pid {p.pid}"
        await self._kill_until_restarted(rec, p, p.pid)

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
        restarts = p.starts - starts
        rec.effect = f"stopped {STOP_PAST_HEARTBEAT_S:.0f}s; supervisor restarts: {restarts}"

    async def router_restart(self, rec: FaultRecord) -> None:
        rec.target = rec.component = "router"
        old = self.router.pid
        self.router_kills.append(time.monotonic())
        self.router.kill()
        self.router_epoch = time.monotonic()
        await asyncio.to_thread(self.router.restart)
        rec.survived = self.router.pid not in (None, old)
        rec.effect = f"router pid {old} -> {self.router.pid}"

    async def kv_cut(self, rec: FaultRecord) -> None:
        rec.target = "pipeline-0 connections"
        rec.component = self.pipes[0].name
        before = await asyncio.to_thread(self._resyncs)
        n = await asyncio.to_thread(self.cut.cut)
        resubscribed = await self._until(lambda: self._resyncs() > before, EFFECT_TIMEOUT_S)
        rec.survived = n > 0 and resubscribed
        rec.effect = (f"{n} connection ends reset; the router "
                      f"{'resubscribed' if resubscribed else 'did not resubscribe'} "
                      "(wavepp_router_resyncs_total)")  # fmt: skip

    def _resyncs(self) -> int:
        """The router's KV-event snapshots applied for pipeline 0 (through the cut)."""
        with contextlib.suppress(Exception):
            url = f"http://127.0.0.1:{self.router.metrics_port}/metrics"
            text = urllib.request.urlopen(url, timeout=5).read().decode()
            pid = re.escape(self.cut.address)
            m = re.search(rf'^wavepp_router_resyncs_total\{{pipeline="{pid}"\}} (\S+)$', text, re.M)
            return int(float(m.group(1))) if m else 0
        return -1

    async def pressure(self, rec: FaultRecord) -> None:
        """Every prompt of the burst must succeed, and some resident blocks be evicted."""
        rec.target = "every stage"
        before = await asyncio.to_thread(self._resident)
        t = time.monotonic()
        codes = await self.workload.pressure(PRESSURE_PROMPTS)
        took = time.monotonic() - t
        after = await asyncio.to_thread(self._resident)
        evicted = sum(len(before[a] - after.get(a, set())) for a in before)
        ok = sum(code == "OK" for code in codes)
        rec.survived = evicted > 0 and ok == len(codes)
        rec.effect = f"{ok}/{len(codes)} prompts OK in {took:.1f}s; {evicted} blocks evicted"

    def _resident(self) -> dict[str, set[int]]:
        out = {}
        for p in self.pipes:
            with contextlib.suppress(Exception):
                out[p.address] = self.residency(p.address)
        return out
