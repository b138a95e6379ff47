"""Regenerate the committed Python stubs of proto/ into wavepp_proto/ with grpc_tools.protoc.

Run from anywhere: ``.venv/bin/python scripts/gen_proto.py`` (``--out DIR`` writes elsewhere;
tests/test_proto_drift.py uses that to compare a fresh generation with the committed files).
The stubs depend on the exact grpcio-tools version pinned in pyproject.toml.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "proto"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_sources() -> list[Path]:
    """Every .proto file under proto/, sorted (paths relative to proto/)."""
    return sorted(p.relative_to(PROTO_ROOT) for p in PROTO_ROOT.rglob("*.proto"))


def generated_files(root: Path) -> list[Path]:
    """The generated stub files under ``root`` (relative paths), sorted."""
    found = [p for p in root.rglob("*") if p.is_file() and p.name.endswith(GENERATED_SUFFIXES)]
    return sorted(p.relative_to(root) for p in found)


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on every source; returns the generated files relative to ``out_dir``."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p) for p in proto_sources()),
    ]
    code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}; see its message above")
    return generated_files(out_dir / "wavepp_proto")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO_ROOT,
        help="output root; stubs land in OUT/wavepp_proto/... (default: the repository root)",
    )
    args = parser.parse_args(argv)
    files = generate(args.out)
    print(f"generated {len(files)} files under {args.out / 'wavepp_proto'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
