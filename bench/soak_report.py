"""The soak's measurements and verdicts: a sampler over time (throughput, latency, blocks
used per stage, RSS and fds per process), the checks once load stops (leaks, integrity,
router index = residency, Prometheus = the client's tally, every outcome expected or
explained, availability, aborts), the flat JSON rows and the plot."""

from __future__ import annotations

import contextlib
import os
import re
import statistics
import time
import urllib.request

from soak_cluster import fd_count, rss_bytes  # bench/ is on sys.path
from soak_outcomes import Verdict, availability, breaches, reconcile, verdict
from soak_workload import WRITE_LOST

INVARIANTS = (
    "leaked_blocks",
    "leaked_leases",
    "leaked_transfers",
    "lost_requests",
    "hung_requests",
    "internal_errors",
    "unknown_errors",
    "unexplained_writes_lost",
    "integrity_failures",
    "double_ends",
    "index_mismatches",
    "counter_mismatches",
    "unexplained_pipeline_losses",
    "growing_processes",
    "faults_not_survived",
    "unexpected_outcomes",
    "availability_breaches",
    "aborts_without_effect",
)
TAKE_A_PIPELINE = ("stage_kill", "leader_kill", "stage_stop", "kv_cut")
WRITE_LOST_WINDOW_S = 5.0  # a stream write lost this soon after a router kill is the kill's
RSS_NOISE_BYTES = 16 * 2**20  # growth over the last half below this is noise
FD_NOISE = 4
# a shorter last half measures warm-up, not leaks: a process (re)started in the run fills
# its caches, and a router's index grows with every new prefix a pressure burst brings
MIN_GROWTH_WINDOW_S = 300.0


class Sampler:
    """One row per ``sample``: the window's OK throughput and latency quantiles, used blocks
    per stage (from the router's GetLoad), RSS and fds of every long-lived process."""

    def __init__(self, pipes, router, decoders) -> None:
        self.pipes, self.router, self.decoders = pipes, router, decoders
        self.t0 = time.monotonic()
        self.rows: list[dict] = []
        self.procs: dict[str, list[tuple[float, int, int]]] = {}  # "role@pid" -> (t, rss, fds)
        self._seen = 0
        self.max_overdue = 0
        self.loop_lag_s = 0.0  # how late the client's event loop ran its last 1 s sleep

    def _processes(self) -> dict[str, int]:
        out = {"client": os.getpid()}
        if self.router.pid:
            out["router"] = self.router.pid
        for p in self.pipes:
            if p.pid:
                out[f"{p.name}/stage0"] = p.pid
                for i, pid in enumerate(p.stage_pids(), 1):
                    out[f"{p.name}/stage{i}"] = pid
        for d in self.decoders:
            if d.pid:
                out[d.name] = d.pid
        return out

    def sample(self, tally) -> None:
        from prefill_node.client.prefill_client import PrefillClient

        now = time.monotonic()
        t = now - self.t0
        window = tally.rows[self._seen :]
        self._seen = len(tally.rows)
        dt = now - (self.t0 + self.rows[-1]["t"]) if self.rows else 1.0
        ok = [lat for _, _, code, lat, _ in window if code == "OK"]
        q = statistics.quantiles(ok, n=20, method="inclusive") if len(ok) >= 2 else [None] * 19
        row = {
            "row": "series",
            "t": round(t, 2),
            "ok_per_s": len(ok) / max(dt, 1e-3),
            "ended_per_s": len(window) / max(dt, 1e-3),
            "p50_s": q[9],
            "p95_s": q[18],
            "open": len(tally.open),
            "client_loop_lag_s": round(self.loop_lag_s, 3),
        }
        self.max_overdue = max(self.max_overdue, tally.overdue(now))
        with contextlib.suppress(Exception), PrefillClient(self.router.address) as c:
            for i, p in enumerate(c.load(timeout_s=2).pipelines):
                for s in p.stages:
                    row[f"used_blocks_p{i}s{s.stage}"] = s.used_blocks
        for role, pid in self._processes().items():
            rss, fds = rss_bytes(pid), fd_count(pid)
            if rss is not None and fds is not None:
                self.procs.setdefault(f"{role}@{pid}", []).append((t, rss, fds))
                row[f"rss_mb_{role}"] = round(rss / 2**20, 1)
        self.rows.append(row)

    def postfix(self, tally) -> str:
        r = self.rows[-1] if self.rows else {}
        bad = tally.outcomes["INTERNAL"] + tally.outcomes["UNKNOWN"]
        return f"ok/s {r.get('ok_per_s', 0):.0f} open {r.get('open', 0)} bad {bad}"


def slopes(sampler: Sampler, load_s: float) -> dict[str, dict]:
    """Per process that lived at least half the run: least-squares slope of RSS (bytes/s)
    and fds (1/s) over the last half of its samples, and whether that half grew beyond
    noise (RSS_NOISE_BYTES, FD_NOISE); ``growing`` is None (not judged) where that half
    is shorter than MIN_GROWTH_WINDOW_S."""
    out = {}
    for key, series in sampler.procs.items():
        if len(series) < 6 or series[-1][0] - series[0][0] < load_s / 2:
            continue
        half = series[len(series) // 2 :]
        ts = [s[0] for s in half]
        rss_slope = statistics.linear_regression(ts, [s[1] for s in half]).slope
        fd_slope = statistics.linear_regression(ts, [s[2] for s in half]).slope
        span = ts[-1] - ts[0]
        out[key] = {
            "rss_mb_per_min": rss_slope * 60 / 2**20,
            "fds_per_min": fd_slope * 60,
            "rss_mb_end": half[-1][1] / 2**20,
            "fds_end": half[-1][2],
            "growing": None
            if span < MIN_GROWTH_WINDOW_S
            else rss_slope * span > RSS_NOISE_BYTES or fd_slope * span > FD_NOISE,
        }
    return out


def _settled(report) -> bool:
    return (
        report.ok
        and report.inflight_requests == 0
        and not any(
            s.used_blocks or s.kv_held_blocks or s.kv_pushes or s.kv_leases for s in report.stages
        )
    )


def residency(address: str) -> set[int]:
    """Hashes of the blocks resident on every stage, from a fresh subscription's snapshot."""
    from prefill_node.client.prefill_client import PrefillClient

    with PrefillClient(address) as c:
        stream = c.subscribe_kv_events(timeout_s=30)
        batch = next(iter(stream))
        stream.cancel()
    held: set[int] = set()
    for ev in batch.events:
        kind = ev.WhichOneof("event")
        if kind == "stored":
            held.update(ev.stored.block_hashes)
        elif kind == "removed":
            held.difference_update(ev.removed.block_hashes)
        elif kind == "cleared":
            held.clear()
    return held


def final_checks(pipes, router, decode_finals, tally, faults, args) -> dict:
    """Wait (up to ``args.settle`` s) for the pipelines to let go of everything, then check."""
    from prefill_node.client.prefill_client import PrefillClient

    out: dict = {"settle_s": None, "stages": {}, "integrity": [], "index": {}}
    start = time.monotonic()
    reports = {}
    while True:
        reports = {}
        for p in pipes:
            with contextlib.suppress(Exception), PrefillClient(p.address) as c:
                reports[p.name] = c.check_integrity(timeout_s=30)
        if len(reports) == len(pipes) and all(map(_settled, reports.values())):
            out["settle_s"] = time.monotonic() - start
            break
        if time.monotonic() - start > args.settle:
            break
        time.sleep(1.0)
    leaked = {"blocks": 0, "leases": 0, "transfers": 0}
    for p in pipes:
        rep = reports.get(p.name)
        if rep is None:
            out["integrity"].append(f"{p.name}: no integrity report")
            continue
        if not rep.ok:
            out["integrity"].append(f"{p.name}: {rep.error}")
        for s in rep.stages:
            out["stages"][f"{p.name}/stage{s.stage}"] = {
                "used": s.used_blocks,
                "cached": s.cached_blocks,
                "kv_held": s.kv_held_blocks,
                "pushes": s.kv_pushes,
                "leases": s.kv_leases,
            }
            leaked["blocks"] += s.used_blocks
            leaked["leases"] += s.kv_leases
            leaked["transfers"] += s.kv_pushes
    for i, final in enumerate(decode_finals):
        if final is None:
            out["integrity"].append(f"decode-{i}: no final report")
            continue
        leaked["blocks"] += final["used_blocks"]
        leaked["transfers"] += final["receptions"]
        if final["integrity"]:
            out["integrity"].append(f"decode-{i}: {final['integrity']}")
    out["leaked"] = leaked
    out["index"] = index_check(pipes, router, faults)
    out["counters"] = counter_check(router, tally, faults)
    return out


def index_check(pipes, router, faults, timeout_s: float = 20.0) -> dict:
    """The router's indexed blocks per pipeline against each pipeline's own snapshot, until
    they agree (pending entries expire, resubscriptions land) or ``timeout_s``."""
    from prefill_node.client.prefill_client import PrefillClient

    routes = [faults.cut.address, *(p.address for p in pipes[1:])]
    deadline = time.monotonic() + timeout_s
    while True:
        result = {}
        with contextlib.suppress(Exception), PrefillClient(router.address) as c:
            indexed = {p.address: p.indexed_blocks for p in c.load(timeout_s=5).pipelines}
            for p, route in zip(pipes, routes, strict=True):
                result[p.name] = {"router": indexed.get(route),
                                  "pipeline": len(residency(p.address))}  # fmt: skip
        agree = len(result) == len(pipes) and all(
            r["router"] == r["pipeline"] for r in result.values()
        )
        if agree or time.monotonic() > deadline:
            result["mismatches"] = (
                0
                if agree
                else max(
                    1,
                    len(pipes)
                    - sum(
                        r["router"] == r["pipeline"] for r in result.values() if isinstance(r, dict)
                    ),
                )
            )
            return result
        time.sleep(1.0)


def counter_check(router, tally, faults) -> dict:
    """The current router process's wavepp_requests_total{outcome} against the outcomes the
    clients counted for the requests sent after it started (soak_outcomes.reconcile: every
    outcome equal, cancellations counted on both sides)."""
    text = ""
    with contextlib.suppress(Exception):
        url = f"http://127.0.0.1:{router.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
    server = {
        m.group(1): int(float(m.group(2)))
        for m in re.finditer(r'^wavepp_requests_total\{outcome="(\w+)"\} (\S+)$', text, re.M)
    }
    epoch = faults.router_epoch
    with tally._lock:
        mine = [(code, detail) for end, _, code, lat, detail in tally.rows if end - lat >= epoch]
    rec = reconcile({k: v for k, v in server.items() if v}, mine)
    lost = sum(
        float(m.group(1))
        for m in re.finditer(r"^wavepp_router_pipeline_lost_total\{[^}]*\} (\S+)$", text, re.M)
    )
    # a pipeline leaves the candidate set only when a fault takes it away (and once more
    # when it comes back restarted): any other loss is the router giving up on a live one
    since = faults.router_epoch - faults.t0
    takers = [r for r in faults.records if r.name in TAKE_A_PIPELINE and r.at_s >= since]
    restarts = [r for r in faults.restarts if r["t"] >= since]
    allowed = 2 * (len(takers) + len(restarts))
    return {
        "router": rec.router,
        "client": rec.client,
        "client_undetermined": rec.undetermined,
        "differences": {k: list(v) for k, v in rec.mismatches.items()},
        "mismatches": len(rec.mismatches) if server else 1,
        "router_pipeline_losses": int(lost),
        "losses_explained_by_faults": allowed,
        "unexplained_losses": max(0, int(lost) - allowed),
    }


def unexplained_writes_lost(tally, faults) -> int:
    """Streams that ended STREAM_WRITE_LOST (the client library's own INTERNAL when a write
    fails under it) other than within WRITE_LOST_WINDOW_S after a router kill."""
    return sum(
        1
        for end, _kind, code, _lat, _detail in tally.rows
        if code == WRITE_LOST
        and not any(0 <= end - k <= WRITE_LOST_WINDOW_S for k in faults.router_kills)
    )


def _phase(rows: list[dict], lo: float, hi: float) -> dict:
    if hi <= lo:
        return {"ok_per_s": None, "p50_s": None, "p95_s": None, "seconds": 0.0}
    sel = [r for r in rows if lo <= r["t"] < hi]
    ok = [r["ok_per_s"] for r in sel]
    p50 = [r["p50_s"] for r in sel if r["p50_s"] is not None]
    p95 = [r["p95_s"] for r in sel if r["p95_s"] is not None]
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return {"ok_per_s": med(ok), "p50_s": med(p50), "p95_s": med(p95), "seconds": hi - lo}


def summarise(args, tally, faults, sampler: Sampler, checks: dict) -> list[dict]:
    recs = faults.records
    first = min((r.at_s for r in recs), default=args.duration)
    last = max((r.at_s + (r.recovered_s or 0) for r in recs), default=args.duration)
    grow = slopes(sampler, args.duration)
    ended, windows = tally.ended_rows(), faults.windows()
    unexpected = breaches(ended, windows)
    avail = availability(ended, windows)
    summary = {
        "row": "summary",
        "duration_s": args.duration,
        "concurrency": args.concurrency,
        "pipelines": args.pipelines,
        "decoders": args.decoders,
        "requests": sum(tally.outcomes.values()) + len(tally.open),
        **{f"outcome_{k}": v for k, v in sorted(tally.outcomes.items())},
        "leaked_blocks": checks["leaked"]["blocks"],
        "leaked_leases": checks["leaked"]["leases"],
        "leaked_transfers": checks["leaked"]["transfers"],
        "lost_requests": len(tally.open),
        "hung_requests": tally.hung + len(tally.open),
        "internal_errors": tally.outcomes["INTERNAL"],
        "unknown_errors": tally.outcomes["UNKNOWN"],
        "stream_writes_lost": tally.outcomes[WRITE_LOST],
        "unexplained_writes_lost": unexplained_writes_lost(tally, faults),
        "integrity_failures": len(checks["integrity"]),
        "double_ends": tally.double_ends,
        "index_mismatches": checks["index"]["mismatches"],
        "counter_mismatches": checks["counters"]["mismatches"],
        "unexplained_pipeline_losses": checks["counters"]["unexplained_losses"],
        # the client (this process) keeps every request's row: its growth is not a leak
        "growing_processes": sum(
            bool(g["growing"]) for k, g in grow.items() if k != f"client@{os.getpid()}"
        ),
        "faults_injected": len(recs),
        "faults_skipped": faults.skipped,
        "faults_not_survived": sum(not r.survived for r in recs),
        "unexpected_outcomes": sum(unexpected.values()),
        "availability_breaches": avail.unexplained + (not avail.holds),
        "aborts_without_effect": len(tally.aborts_without_effect),
        "invariants": list(INVARIANTS),
        "unexpected": dict(unexpected.most_common(15)),
        # when the first ones happened (seconds from the start), to set beside the faults
        "unexpected_at": [
            {
                "kind": r.kind,
                "code": r.code,
                "start_s": round(r.start - faults.t0, 2),
                "end_s": round(r.end - faults.t0, 2),
            }
            for r in ended
            if verdict(r, windows) is Verdict.BREACH
        ][:10],  # fmt: skip
        "availability": {
            "judged": avail.judged,
            "ok": avail.ok,
            "ok_share": round(avail.ok_share, 4),
            "unexplained": avail.unexplained,
            "excluded_router_or_overlapping": avail.excluded,
            "unexplained_by": dict(avail.unexplained_codes),
            "explained_by": dict(avail.explained_codes),
        },
        "aborts": {
            "landed": tally.aborts_landed,
            "too_late": tally.aborts_too_late,
            "without_effect": tally.aborts_without_effect[:10],
        },
        "network_faults": faults.network,
        "settle_s": checks["settle_s"],
        "integrity": checks["integrity"],
        "index": checks["index"],
        "counters": checks["counters"],
        "stages_end": checks["stages"],
        "supervisor_restarts": faults.restarts,
        "by_kind": dict(sorted(tally.by_kind.items())),
        "failures": dict(tally.details.most_common(15)),
        "max_overdue_seen": sampler.max_overdue,
        "hung_by": dict(tally.hung_by),
        "worst_overrun_s": round(tally.worst_overrun_s, 2),
        "max_client_loop_lag_s": max((r["client_loop_lag_s"] for r in sampler.rows), default=0),
        "before": _phase(sampler.rows, 0, first),
        "during": _phase(sampler.rows, first, last),
        "after": _phase(sampler.rows, last, args.duration),
        "slopes": grow,
    }
    faults_rows = [{"row": "fault", **vars(r)} for r in recs]
    return [summary, *faults_rows, *sampler.rows]


def plot(sampler: Sampler, faults, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sampler.rows
    t = [r["t"] for r in rows]
    fig, ax = plt.subplots(4, 1, figsize=(11, 12), sharex=True)
    ax[0].plot(t, [r["ok_per_s"] for r in rows], label="OK / s")
    ax[0].plot(t, [r["ended_per_s"] for r in rows], label="ended / s", alpha=0.6)
    ax[1].plot(t, [r["p50_s"] for r in rows], label="p50")
    ax[1].plot(t, [r["p95_s"] for r in rows], label="p95")
    ax[1].set_yscale("log")
    for key in sorted({k for r in rows for k in r if k.startswith("used_blocks")}):
        ax[2].plot(t, [r.get(key) for r in rows], label=key.removeprefix("used_blocks_"))
    for key in sorted({k for r in rows for k in r if k.startswith("rss_mb")}):
        ax[3].plot(t, [r.get(key) for r in rows], label=key.removeprefix("rss_mb_"))
    titles = (
        "throughput (requests/s)",
        "latency of OK requests (s)",
        "used blocks per stage",
        "RSS per process (MiB)",
    )
    for a, title in zip(ax, titles, strict=True):
        a.set_title(title)
        a.legend(fontsize=7, ncol=4)
        for r in faults.records:
            a.axvline(r.at_s, color="red", alpha=0.3)
    for r in faults.records:
        ax[0].annotate(r.name, (r.at_s, 0), fontsize=7, rotation=90, color="red")
    ax[-1].set_xlabel("seconds since load started")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
