"""LineReader: a child's stdout line by line, every wait bounded (real child processes)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from prefill_node.process_tree import LineReader, terminate

# Two lines in one write, then silence: the second line reaches the reader's side in the same
# read as the first, and no more bytes come after it.
TWO_THEN_SLEEP = (
    "import sys, time; sys.stdout.write('log\\n{\"ready\": 1}\\n'); sys.stdout.flush(); "
    "time.sleep(60)"
)


def _child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_lines_written_together_are_all_delivered_while_the_child_stays_silent():
    child = _child(TWO_THEN_SLEEP)
    try:
        lines = LineReader(child.stdout)
        assert lines.next_line(20) == "log\n"
        started = time.monotonic()
        assert lines.next_line(20) == '{"ready": 1}\n'
        assert time.monotonic() - started < 5  # already read, not waiting on the pipe
        with pytest.raises(TimeoutError):
            lines.next_line(0.2)
    finally:
        terminate(child, timeout_s=5)


def test_the_end_of_the_stream_is_none_on_every_later_call():
    child = _child("print('only')")
    lines = LineReader(child.stdout)
    assert lines.next_line(20) == "only\n"
    assert lines.next_line(20) is None
    assert lines.next_line(0.1) is None
    assert child.wait(20) == 0
