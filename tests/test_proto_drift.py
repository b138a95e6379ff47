"""The committed stubs in wavepp_proto/ are exactly what scripts/gen_proto.py produces now."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def _stubs(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name.endswith(GENERATED_SUFFIXES)
    }


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "gen_proto.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    fresh = _stubs(tmp_path / "wavepp_proto")
    committed = _stubs(REPO_ROOT / "wavepp_proto")
    assert fresh, "protoc generated nothing: are there .proto files under proto/?"
    assert sorted(fresh) == sorted(committed), (
        "stub files differ from proto/ sources; run: .venv/bin/python scripts/gen_proto.py"
    )
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale stubs {stale}; run: .venv/bin/python scripts/gen_proto.py"


def test_every_proto_source_has_stubs() -> None:
    sources = sorted((REPO_ROOT / "proto").rglob("*.proto"))
    stubs = _stubs(REPO_ROOT / "wavepp_proto")
    for source in sources:
        stem = str(source.relative_to(REPO_ROOT / "proto").with_suffix(""))
        assert stem.removeprefix("wavepp_proto/") + "_pb2.py" in stubs, f"no stub for {source}"


def test_stubs_import_under_a_collision_free_name() -> None:
    from wavepp_proto.prefill.v1 import prefill_pb2, prefill_pb2_grpc

    service = prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"]
    assert service.full_name == "wavepp.prefill.v1.PrefillService"
    assert [m.name for m in service.methods] == [
        "Prefill",
        "PrefillStream",
        "Abort",
        "GetLoad",
        "SubscribeKvEvents",
        "GetServerInfo",
        "Score",
        "LeasePrefix",
    ]
    assert hasattr(prefill_pb2_grpc, "PrefillServiceStub")
