"""ProcessTree: CPU time and resident memory of a process and its descendants (Linux /proc);
``terminate``: stop a child process the polite way, then the hard way; ``LineReader``: a
child's stdout line by line with a timeout.

Used by benchmarks and tests that hold a whole local system to a budget (an idle tier must
idle). A process that exits between two reads simply stops counting; its CPU time up to
then is lost, so measure windows in which the tree is stable.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
from pathlib import Path
from typing import IO, NamedTuple

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


class LineReader:
    """Lines of a child's text stream, each wait bounded.

    A thread reads the stream and queues its lines. Waiting with ``select`` on the pipe and
    then calling ``readline`` is wrong: ``readline`` pulls a whole buffer from the pipe, so
    lines that arrived together (a log line and the answer right after it) sit in Python's
    buffer while ``select`` waits for the pipe, which stays empty.
    """

    def __init__(self, stream: IO[str], name: str = "child-stdout") -> None:
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._pump, args=(stream,), name=name, daemon=True)
        self._thread.start()

    def _pump(self, stream: IO[str]) -> None:
        try:
            for line in stream:
                self._lines.put(line)
        except (OSError, ValueError):  # closed under us
            pass
        finally:
            self._lines.put(None)

    def next_line(self, timeout_s: float) -> str | None:
        """The next line (with its newline); None once the stream has ended. Raises
        ``TimeoutError`` when no line arrives within ``timeout_s``."""
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"no line in {timeout_s:g} s") from None
        if line is None:
            self._lines.put(None)  # every later call sees the end too
        return line
