"""A quiet machine before each measurement: benchmarks that run several systems back to back
wait until the cores are idle, so no measurement pays for the one before it.

A system that just answered can keep a core busy for a while (vLLM's CPU engine: about one
core for about a second after each ``generate``); without the wait that lands on whichever
system a benchmark measures next.
"""

from __future__ import annotations

import os
import time

QUIET_CORES = 0.15  # "quiet": fewer busy cores than this over one window
QUIET_WINDOW_S = 0.2
QUIET_MAX_S = 10.0


def busy_cores(window_s: float) -> float:
    """Cores the whole machine kept busy over the next ``window_s`` (/proc/stat: user, nice,
    system, irq and softirq time of all cores)."""

    def ticks() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        return v[0] + v[1] + v[2] + v[5] + v[6], sum(v)

    (b0, t0), _, (b1, t1) = ticks(), time.sleep(window_s), ticks()
    return (os.cpu_count() or 1) * (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0


def wait_quiet(max_s: float = QUIET_MAX_S) -> float:
    """Wait until the machine is quiet (fewer than QUIET_CORES busy cores over one
    QUIET_WINDOW_S window), at most ``max_s``; returns the time waited."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < max_s and busy_cores(QUIET_WINDOW_S) > QUIET_CORES:
        pass
    return time.perf_counter() - t0
