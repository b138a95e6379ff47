"""Where a benchmark row comes from: commit, date, command line and the machine's load.

Every figure the README quotes must say which code produced it, when, with what command and
beside what else; a benchmark adds ``provenance()`` to each row it writes (flat keys).
"""

from __future__ import annotations

import datetime
import os
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    return done.stdout.strip() if done.returncode == 0 else ""


def provenance(command: list[str] | None = None) -> dict[str, object]:
    """``commit`` (with ``+dirty`` when the work tree differs from it outside bench/results/,
    which the benchmark being stamped may itself have just rewritten), ``date_utc``,
    ``command`` (as typed, relative to the repo; or ``command`` for a row another program
    wrote, as bench/refresh.py stamps them), ``cpus`` this process may use, ``cpu_model`` (the
    processor the kernel reports, with its family and model numbers: figures from two CPUs
    do not compare) and ``load_1m``, the 1-minute load average when the row was taken."""
    commit = _git("rev-parse", "--short=12", "HEAD") or "unknown"
    if _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results"):
        commit += "+dirty"
    return {
        "commit": commit,
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": shlex.join(command or [Path(sys.executable).name, *sys.argv]),
        "cpus": len(os.sched_getaffinity(0)),
        "cpu_model": cpu_model(),
        "load_1m": round(os.getloadavg()[0], 2),
    }


def cpu_model() -> str:
    """The first ``model name`` in /proc/cpuinfo, with the x86 family and model numbers when
    the name alone does not tell two generations apart (a VM's guest may say just "AMD
    EPYC"; a VM's host CPU can change between boots): e.g. "AMD EPYC (family 25, model
    17)". "unknown" where the file or the name is missing."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model") and key not in fields:
                    fields[key] = value.strip()
                if not line.strip():  # the first processor's block is enough
                    break
    except OSError:
        pass
    name = fields.get("model name")
    if name is None:
        return "unknown"
    if "cpu family" in fields and "model" in fields:
        return f"{name} (family {fields['cpu family']}, model {fields['model']})"
    return name
