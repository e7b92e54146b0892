"""DESIGN.md §4 and docs/architecture.md: imports point one way, and only the ledger knows Redis.

Packages: ``router`` may import ``policies`` and ``backends``; those two never import ``router``,
and ``policies`` imports nothing from ``backends``. Inside ``router``, each folder is a layer
that may import only the layers listed for it:

    router/ledger   →  (nothing else in router)      everything that knows Redis
    router/*.py     →  ledger                        shared: settings, fleet, dispatch, ...
    router/eval     →  ledger, shared
    router/http     →  ledger, shared, eval
    router/cli      →  anything

Only ``router/ledger`` imports the Redis client or spells a ``kvl:`` key, and only it imports
``router.ledger.schema`` (the key names and scripts). ``backends.sim`` runs inside Triton; only
the commands that launch stand-in replicas import it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("router", "backends", "policies")
ALLOWED = {
    "router": {"router", "policies", "backends"},
    "backends": {"backends"},
    "policies": {"policies"},
}
LAYERS = {
    "ledger": {"ledger"},
    "shared": {"ledger", "shared"},
    "eval": {"ledger", "shared", "eval"},
    "http": {"ledger", "shared", "eval", "http"},
    "cli": {"ledger", "shared", "eval", "http", "cli"},
}
SIM_IMPORTERS = {
    "router/cli/replica.py",
    "router/cli/replicas.py",
    "router/cli/up.py",
    "router/cli/local.py",
}


def imports(tree: ast.AST) -> set[str]:
    """Every module a file imports, absolute names (inside functions too)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def strings(tree: ast.AST) -> list[str]:
    """String constants that are not docstrings (docs may name keys; code may not)."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        if id(node) not in docstrings
    ]


def layer(module: str) -> str:
    """The router layer a module (dotted name, or a path's parts joined by dots) belongs to."""
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in LAYERS:
        return parts[1]
    return "shared"


def violations(rel: Path, source: str) -> list[str]:
    """What is wrong with the imports and strings of the file at ``rel`` (relative to ROOT)."""
    tree = ast.parse(source, str(rel))
    package = rel.parts[0]
    module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
    found: list[str] = []
    for name in sorted(imports(tree)):
        top = name.split(".")[0]
        if top in PACKAGES and top not in ALLOWED[package]:
            found.append(f"{rel} imports {name}: {package} may not import {top}")
        if name.startswith("backends.sim") and package == "router":
            if rel.as_posix() not in SIM_IMPORTERS:
                found.append(f"{rel} imports the stand-in engine {name}")
        if package != "router":
            continue
        mine = layer(module)
        if top == "router" and "." in name and layer(name) not in LAYERS[mine]:
            found.append(f"{rel} ({mine}) imports {name} ({layer(name)})")
        if mine != "ledger" and (top == "redis" or name.startswith("router.ledger.schema")):
            found.append(f"{rel} imports {name}: only router/ledger talks to Redis")
    if package == "router" and layer(module) != "ledger":
        found.extend(f"{rel} spells a Redis key {s!r}" for s in strings(tree) if "kvl:" in s)
    return found


def sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_one_way(path: Path) -> None:
    """No module imports what its package or layer may not depend on, or names a Redis key."""
    assert violations(path.relative_to(ROOT), path.read_text()) == []


@pytest.mark.parametrize(
    ("rel", "source", "complaint"),
    [
        ("router/ledger/core.py", "from router.http.app import create_app\n", "(ledger)"),
        ("router/ledger/core.py", "def f():\n    import router.dispatch\n", "(ledger)"),
        ("router/eval/runs.py", "from router.http import context\n", "(eval)"),
        ("router/dispatch.py", "from router.eval.runs import Runs\n", "(shared)"),
        ("router/http/app.py", "from router.cli.local import RedisServer\n", "(http)"),
        ("router/http/app.py", "import redis.asyncio\n", "only router/ledger"),
        ("router/eval/runs.py", "from router.ledger.schema import cache_key\n", "only"),
        ("router/eval/runs.py", "KEY = 'kvl:runs'\n", "spells a Redis key"),
        ("router/fleet.py", "from backends.sim.engine import Engine\n", "stand-in engine"),
        ("policies/base.py", "from backends.base import Chunk\n", "may not import backends"),
        ("backends/triton.py", "from router.settings import Settings\n", "may not import"),
    ],
)
def test_a_wrong_import_is_reported(rel: str, source: str, complaint: str) -> None:
    """Each rule catches the import or key it forbids, also inside a function."""
    found = violations(Path(rel), source)
    assert any(complaint in v for v in found), found


def test_allowed_imports_pass() -> None:
    """The rules permit what the layering permits: http using eval, eval using the ledger."""
    assert violations(Path("router/http/app.py"), "from router.eval.runs import Runs\n") == []
    assert violations(Path("router/eval/runs.py"), "from router.ledger import Ledger\n") == []
    doc = '"""Keys like ``kvl:lineage`` may be named in docs."""\n'
    assert violations(Path("router/monitor.py"), doc) == []


def module_name(rel: Path) -> str:
    return ".".join(rel.with_suffix("").parts).removesuffix(".__init__")


def project_imports(rel: Path, source: str, modules: set[str]) -> set[str]:
    """The project modules a file imports (under TYPE_CHECKING and inside functions too):
    each imported name resolved to the deepest module it names, relative imports included.
    ``from package import module`` depends on that module, not on the package's __init__."""
    tree = ast.parse(source, str(rel))
    here = module_name(rel).split(".")
    package = here if rel.name == "__init__.py" else here[:-1]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                names.add(full if full in modules else base)
    found: set[str] = set()
    for name in names:
        parts = name.split(".")
        while parts and ".".join(parts) not in modules:
            parts.pop()
        if parts:
            found.add(".".join(parts))
    found.discard(module_name(rel))
    return found


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def project_graph(files: dict[Path, str]) -> dict[str, set[str]]:
    modules = {module_name(rel) for rel in files}
    return {module_name(rel): project_imports(rel, src, modules) for rel, src in files.items()}


def test_no_import_cycle() -> None:
    """No two project modules import each other, directly or through others, not even for
    type checking only: a circle makes the import order matter and hides a missing layer."""
    files = {path.relative_to(ROOT): path.read_text() for path in sources()}
    assert import_cycles(project_graph(files)) == []


def test_an_import_cycle_is_reported() -> None:
    """A circle through a TYPE_CHECKING import, or a relative one, is found."""
    files = {
        Path("backends/a.py"): "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from backends.b import B\n",
        Path("backends/b.py"): "from .a import A\n",
        Path("backends/c.py"): "from backends import a\n",
    }
    assert import_cycles(project_graph(files)) == [["backends.a", "backends.b"]]
