"""DESIGN.md §4: dependencies point one way, router -> policies and backends, never back."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("router", "backends", "policies")
# Who may import whom (first-party packages only).
ALLOWED = {
    "router": {"router", "policies", "backends"},
    "backends": {"backends"},
    "policies": {"policies"},
}
# backends.sim runs inside Triton; only the launcher command may import it from the router.
SIM_IMPORTERS = {"router/cli_replica.py", "router/cli_replicas.py", "router/cli_up.py"}


def imports(path: Path) -> set[str]:
    """Every module a file imports, absolute names."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_one_way(path: Path) -> None:
    """No module imports a first-party package its layer may not depend on."""
    rel = path.relative_to(ROOT)
    layer = rel.parts[0]
    for name in imports(path):
        top = name.split(".")[0]
        if top in PACKAGES:
            assert top in ALLOWED[layer], f"{rel} imports {name}"
        if name.startswith("backends.sim") and layer == "router":
            assert rel.as_posix() in SIM_IMPORTERS, f"{rel} imports the stand-in engine {name}"


def test_walker_sees_a_violation(tmp_path: Path) -> None:
    """The walker reports imports inside functions too, so a lazy back-import cannot hide."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from router.app import create_app\n    import backends.sim\n")
    assert {"router.app", "backends.sim"} <= imports(bad)
