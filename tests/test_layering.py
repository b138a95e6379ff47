"""The package layering docs/architecture.md states, checked on every module's imports."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports (at any depth: lazy imports count too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _modules(package: str, *, skip: tuple[str, ...] = ()) -> list[Path]:
    base = ROOT / package
    return [p for p in sorted(base.rglob("*.py")) if p.relative_to(base).parts[0] not in skip]


def _offenders(paths: list[Path], banned: tuple[str, ...]) -> dict[str, list[str]]:
    out = {}
    for path in paths:
        hits = sorted(
            m for m in _imports(path) if any(m == b or m.startswith(b + ".") for b in banned)
        )
        if hits:
            out[str(path.relative_to(ROOT))] = hits
    return out


def test_no_node_library_package_imports_the_router() -> None:
    """prefill_router builds on prefill_node, never the reverse; only the CLI, which
    composes every part, may import both."""
    assert _offenders(_modules("prefill_node", skip=("cli",)), ("prefill_router",)) == {}


def test_nothing_outside_the_server_imports_the_servicer() -> None:
    paths = [
        p
        for package in ("prefill_node", "prefill_router", "wavepp_gateway", "kv_transfer")
        for p in _modules(package, skip=("server",) if package == "prefill_node" else ())
    ]
    assert _offenders(paths, ("prefill_node.server.servicer",)) == {}


def test_sans_io_core_imports_no_torch_threads_or_sockets() -> None:
    banned = ("torch", "grpc", "socket", "threading", "asyncio", "prefill_node.runtime")
    assert _offenders(_modules("prefill_node/core"), banned) == {}


def test_kv_transfer_imports_nothing_from_the_node() -> None:
    assert _offenders(_modules("kv_transfer"), ("prefill_node", "prefill_router")) == {}
