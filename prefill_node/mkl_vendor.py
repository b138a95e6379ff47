"""MKL's CPU-vendor check, answered "Intel" on AMD CPUs (torch-free; read before torch loads).

torch's CPU wheel links MKL, and MKL picks its kernels by CPU vendor as well as by CPU
features: on an AMD EPYC with AVX-512 it runs slower kernels. torch's fused CPU attention
calls those GEMMs in fp32 and in bf16, so attention-heavy prefill runs slower
(``bench/forward.py --mkl-shim on|off`` measures it). Linear layers avoid MKL already: fp32
and bf16 go to oneDNN (``model/tensor_ops.linear``). The long-known
remedy is a two-function library, preloaded, that answers MKL's internal vendor query with
"Intel"; MKL then dispatches on the CPU's real features.

``shim_path`` builds that library once with the system C compiler into
``$WAVEPP_CACHE_DIR/native`` (``~/.cache/wavepp/native``); ``preload_env`` adds it to a
child process's ``LD_PRELOAD`` (the launcher's stage processes); ``reexec_with_shim``
restarts the current process with it (the ``wavepp`` command does this first thing, before
torch is imported). Only on Linux x86-64 with an AMD CPU; nothing happens elsewhere, when no
compiler is found (one log line says so), or with ``WAVEPP_MKL_VENDOR_SHIM=0``. MKL builds
that do not have these symbols ignore the library.
"""

from __future__ import annotations

import logging
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SHIM_ENV = "WAVEPP_MKL_VENDOR_SHIM"  # "0": never preload
_REEXEC_MARK = "WAVEPP_MKL_VENDOR_REEXEC"  # set in the restarted process: never loop
_SOURCE = (
    "int mkl_serv_intel_cpu_true(void) { return 1; }\nint mkl_serv_intel_cpu(void) { return 1; }\n"
)
_NAME = "libwavepp_mkl_vendor.so"


def applies() -> bool:
    """True on Linux x86-64 with an AMD CPU, unless ``WAVEPP_MKL_VENDOR_SHIM=0``."""
    if os.environ.get(SHIM_ENV, "1") == "0":
        return False
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return "AuthenticAMD" in line
    except OSError:
        return False
    return False


def _cache_dir() -> Path:
    root = os.environ.get("WAVEPP_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "wavepp"
    return base / "native"


def shim_path() -> Path | None:
    """The built library (building it on first use), or None where it does not apply or
    cannot be built."""
    if not applies():
        return None
    target = _cache_dir() / _NAME
    if target.is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src = Path(tmp) / "mkl_vendor.c"
            src.write_text(_SOURCE)
            out = Path(tmp) / _NAME
            cc = os.environ.get("CC", "cc")
            subprocess.run(
                [cc, "-O2", "-shared", "-fPIC", "-o", str(out), str(src)],
                check=True,
                capture_output=True,
                timeout=60,
            )
            os.replace(out, target)  # atomic: concurrent builders agree
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning(
            "MKL runs its slower non-Intel kernels on this AMD CPU: no C compiler to build "
            "the vendor shim (%s); install one (e.g. gcc) or set %s=0 to silence this",
            exc,
            SHIM_ENV,
        )
        return None
    return target


def preload_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the shim in ``LD_PRELOAD`` (first), where it applies; else unchanged."""
    path = shim_path()
    if path is None:
        return env
    current = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    if str(path) not in current:
        env["LD_PRELOAD"] = ":".join([str(path), *current])
    return env


def without_shim(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the shim turned off (``WAVEPP_MKL_VENDOR_SHIM=0``) and out of
    ``LD_PRELOAD`` (for a comparison run without it)."""
    env[SHIM_ENV] = "0"
    kept = [p for p in env.get("LD_PRELOAD", "").split(":") if p and Path(p).name != _NAME]
    env["LD_PRELOAD"] = ":".join(kept)
    return env


def reexec_with_shim() -> None:
    """Restart this process with the shim preloaded, if it applies and is not loaded yet.
    Call before torch is imported; returns normally when nothing needs doing."""
    if os.environ.get(_REEXEC_MARK) or not applies():
        return
    env = preload_env(dict(os.environ))
    if env.get("LD_PRELOAD") == os.environ.get("LD_PRELOAD"):
        return  # already preloaded, or no shim
    env[_REEXEC_MARK] = "1"
    argv = list(getattr(sys, "orig_argv", [])) or [sys.executable, *sys.argv]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv[1:]], env)
