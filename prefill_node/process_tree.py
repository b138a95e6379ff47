"""ProcessTree: CPU time and resident memory of a process and its descendants (Linux /proc);
``terminate``: stop a child process the polite way, then the hard way.

Used by benchmarks and tests that hold a whole local system to a budget (an idle tier must
idle). A process that exits between two reads simply stops counting; its CPU time up to
then is lost, so measure windows in which the tree is stable.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import NamedTuple

_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


class ProcessSample(NamedTuple):
    pid: int
    name: str
    cpu_s: float
    rss_bytes: int


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            kids += [int(c) for c in (task / "children").read_text().split()]
    except OSError:  # gone
        pass
    return kids


def _sample(pid: int) -> ProcessSample | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        statm = Path(f"/proc/{pid}/statm").read_text().split()
    except OSError:
        return None
    name = stat[stat.index("(") + 1 : stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2 :].split()
    cpu_ticks = int(fields[11]) + int(fields[12])  # utime + stime (fields 14, 15 of stat)
    return ProcessSample(pid, name, cpu_ticks / _TICKS, int(statm[1]) * _PAGE)


class ProcessTree:
    """The processes rooted at ``roots`` (re-walked on every ``sample``: late children count)."""

    def __init__(self, *roots: int) -> None:
        self.roots = roots

    def pids(self) -> list[int]:
        seen: list[int] = []
        todo = list(self.roots)
        while todo:
            pid = todo.pop()
            if pid not in seen:
                seen.append(pid)
                todo += _children(pid)
        return seen

    def sample(self) -> list[ProcessSample]:
        return [s for s in map(_sample, self.pids()) if s is not None]

    def cpu_s(self) -> float:
        """User + system CPU seconds of every live process of the tree so far."""
        return sum(s.cpu_s for s in self.sample())


def terminate(proc: subprocess.Popen, timeout_s: float = 30.0) -> int:
    """SIGTERM ``proc`` (a server drains and exits), SIGKILL it after ``timeout_s``; its code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()
