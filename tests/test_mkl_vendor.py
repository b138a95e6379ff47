"""The MKL vendor shim: built once, preloaded into child processes, a restart that happens
once, a switch that turns it off, and torch's results unchanged with it loaded."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from prefill_node import mkl_vendor

needs_amd = pytest.mark.skipif(
    not mkl_vendor.applies() or shutil.which(os.environ.get("CC", "cc")) is None,
    reason="not an AMD x86-64 Linux CPU, or no C compiler",
)

SCRIPT = """
import os, sys
from prefill_node.mkl_vendor import reexec_with_shim
print("start", flush=True)
reexec_with_shim()
print("preload", os.environ.get("LD_PRELOAD", ""))
"""


def test_the_switch_turns_it_off(monkeypatch) -> None:
    monkeypatch.setenv(mkl_vendor.SHIM_ENV, "0")
    assert not mkl_vendor.applies() and mkl_vendor.shim_path() is None
    assert mkl_vendor.preload_env({"LD_PRELOAD": "x.so"}) == {"LD_PRELOAD": "x.so"}


@needs_amd
def test_built_once_and_put_first_in_ld_preload(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("WAVEPP_CACHE_DIR", str(tmp_path))
    path = mkl_vendor.shim_path()
    assert path is not None and path.is_file() and path.parent == tmp_path / "native"
    mtime = path.stat().st_mtime_ns
    env = mkl_vendor.preload_env({"LD_PRELOAD": "other.so"})
    assert env["LD_PRELOAD"] == f"{path}:other.so"
    assert mkl_vendor.preload_env(env)["LD_PRELOAD"] == f"{path}:other.so"  # not twice
    assert mkl_vendor.shim_path().stat().st_mtime_ns == mtime  # not rebuilt
    off = mkl_vendor.without_shim(dict(env))
    assert off["LD_PRELOAD"] == "other.so" and off[mkl_vendor.SHIM_ENV] == "0"


@needs_amd
def test_the_process_restarts_once_with_the_shim(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["WAVEPP_CACHE_DIR"] = str(tmp_path)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines.count("start") == 2  # once before the restart, once after
    assert lines[-1] == f"preload {tmp_path / 'native' / mkl_vendor._NAME}"


@needs_amd
def test_torch_computes_the_same_with_the_shim(tmp_path) -> None:
    code = (
        "import torch; torch.manual_seed(0); a = torch.randn(300, 200); b = torch.randn(200, 100);"
        " torch.save(a @ b, __import__('sys').argv[1])"
    )
    results = []
    for preload in (False, True):
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        if preload:
            env["WAVEPP_CACHE_DIR"] = str(tmp_path)
            env = mkl_vendor.preload_env(env)
        target = tmp_path / f"{preload}.pt"
        subprocess.run([sys.executable, "-c", code, str(target)], env=env, check=True, timeout=120)
        import torch

        results.append(torch.load(target))
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-4)
