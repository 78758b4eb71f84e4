"""The package's import rules, read from its source: every import statement of every module under encoder_service/
(at module level, inside functions, under TYPE_CHECKING alike: a lazy import is still an arrow), parsed with ast,
nothing imported. Data flows down: each part of the package imports only the parts below it that MAY_IMPORT names,
so the layering in docs/architecture.md stays true; and no two modules import each other, directly or round a
circle. Beside the package, one direction between tests and benchmarks: benchmarks/ may use tests/support/, nothing
under tests/ imports benchmarks/ (a benchmark's own tests live in benchmarks/tests/)."""

from __future__ import annotations

import ast
from pathlib import Path

import encoder_service

PACKAGE = Path(encoder_service.__file__).parent
TESTS = Path(__file__).resolve().parents[1]

# The parts of encoder_service (a subpackage, or a module at the top) and what each may import besides itself,
# from the top down: a part, or one module of a part ("models.configs"); "" is encoder_service/__init__.py
# (__version__, NUMERICS_VERSION). Two stacks share the bottom: the server (cli -> api -> core -> replicas and
# engine -> runtime -> models -> ops; replicas over cache) and the LLM side (integrations -> client), both over
# rowpath/ (what both ends move rows with), protocol/, ranges and errors.
MAY_IMPORT: dict[str, set[str]] = {
    "cli": {"api", "integrations", "settings", "testing", "errors"},
    # the LLM side: a client of the service, never its server; of models/ only the row-width rules
    "integrations": {"client", "rowpath", "protocol", "ranges", "errors", "settings", "models.configs",
                     "models.spec"},
    # transports: parse, call the core, answer; api/service.py builds the core from its parts
    "api": {"core", "replicas", "engine", "runtime", "preprocessing", "models", "cache", "protocol", "ranges",
            "errors", "settings", ""},
    # the flow: no transport, no client
    "core": {"replicas", "engine", "preprocessing", "models", "cache", "protocol", "ranges", "timeouts",
             "errors", "settings", ""},
    # what replicas share and how (Redis, the row path between them): what this process holds is cache/'s; a
    # replica fetches rows from another with the row path (rowpath/raw_http.py)
    "replicas": {"cache", "rowpath", "protocol", "ranges", "timeouts", "errors", "redis_url"},
    "engine": {"runtime", "models", "errors", "settings"},
    # the rows' host memory and the device row arena's CUDA IPC handle come from the row path
    "runtime": {"models", "ops", "rowpath", "errors", "settings"},
    "preprocessing": {"models", "errors", "settings"},
    # what an LLM server runs: the row path, protocol/, ranges and errors of the server's, nothing that serves
    "client": {"rowpath", "protocol", "ranges", "errors"},
    # what both ends move rows with: the raw HTTP reader, the host row pool, the CUDA IPC calls
    "rowpath": {"protocol", "ranges", "errors"},
    "settings": {"protocol", "errors", "redis_url"},
    "cache": {"errors", ""},
    "redis_url": set(),
    "protocol": {"ranges", "errors"},
    "models": {"ops", "errors"},
    "ranges": {"errors"},
    "timeouts": {"errors"},
    "ops": {"errors"},
    "testing": set(),
    "errors": set(),
    "": set(),
}


def module_name(path: Path, root: Path, package: str) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def modules(root: Path, package: str) -> dict[str, Path]:
    return {module_name(p, root, package): p for p in sorted(root.rglob("*.py"))}


def imports_of(root: Path, package: str) -> dict[str, set[str]]:
    """Each module of the package -> the modules of the package it imports, anywhere in its body. `from a
    import b` names the module a.b when there is one (a submodule), else a; relative imports are resolved."""
    known = modules(root, package)
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]  # where relative imports start
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                subs = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known]
                targets.update(subs if len(subs) == len(node.names) else [base, *subs])
        graph[name] = {t for t in targets if t in known and t != name}
    return graph


def part(module: str, package: str) -> str:
    """The part a module belongs to: encoder_service.core.flight -> core, encoder_service.errors -> errors."""
    return module.removeprefix(package).lstrip(".").split(".")[0]


def within(target: str, name: str) -> bool:
    """`target` is the module `name` or inside it (a package)."""
    return target == name or target.startswith(name + ".")


def broken_rules(graph: dict[str, set[str]], package: str, may_import: dict[str, set[str]]) -> list[str]:
    """'a imports b (x may import only ...)' for every import of another part that the table does not allow."""
    broken = []
    for importer, targets in sorted(graph.items()):
        src = part(importer, package)
        rules = may_import[src]
        for target in sorted(targets):
            if (part(target, package) == src
                    or any(target == package if not rule else within(target, f"{package}.{rule}") for rule in rules)):
                continue
            named = ", ".join(sorted(rule or package for rule in rules)) or "nothing of the package"
            broken.append(f"{importer} imports {target} ({src or package} may import only {named})")
    return broken


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected components of more than one module (Tarjan's). A module's import
    of its own package (a name from the package's __init__) is no arrow here: Python ran that __init__ before
    the module itself, so it loads nothing and cannot close a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(n for n in graph.get(node, ()) if not node.startswith(n + ".")):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def imports_of_benchmarks(root: Path) -> list[str]:
    """'file:line imports benchmarks...' for every import of the benchmarks package in a file under `root`, lazy
    ones too (relative imports stay inside their own package)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            found += [f"{path.relative_to(root)}:{node.lineno} imports {name}" for name in names
                      if within(name, "benchmarks")]
    return found


GRAPH = imports_of(PACKAGE, "encoder_service")


def test_every_part_has_a_row():
    parts = {part(m, "encoder_service") for m in GRAPH}
    assert parts == set(MAY_IMPORT), "place a new part of the package in MAY_IMPORT (and docs/architecture.md)"


def test_the_rules_have_no_circle():
    assert circles(MAY_IMPORT) == []


def test_imports_follow_the_layering():
    assert broken_rules(GRAPH, "encoder_service", MAY_IMPORT) == []


def test_no_import_circles():
    assert circles(GRAPH) == []


def test_tests_never_import_the_benchmarks():
    assert imports_of_benchmarks(TESTS) == [], "move what both use to tests/support/, or the test to benchmarks/tests/"


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


RULES = {"api": {"core", "errors"}, "core": {"errors"}, "errors": set(), "": set()}
CLEAN = {
    "__init__.py": "",
    "errors.py": "class Error(Exception): ...\n",
    "core/__init__.py": "from .encoder import Encoder\n",
    "core/encoder.py": "from pkg.errors import Error\nfrom . import flight\n\nclass Encoder: ...\n",
    "core/flight.py": "from ..errors import Error\n",
    "api/__init__.py": "",
    "api/http.py": "from pkg.core import Encoder\nfrom pkg import errors\n",
}


def test_a_clean_fake_tree_passes(tmp_path):
    graph = imports_of(write_tree(tmp_path, CLEAN), "pkg")
    assert graph["pkg.api.http"] == {"pkg.core", "pkg.errors"}  # `from pkg import errors`: the module
    assert graph["pkg.core.flight"] == {"pkg.errors"}  # `from ..errors`: resolved
    assert broken_rules(graph, "pkg", RULES) == [] and circles(graph) == []


def test_a_lazy_import_reaching_back_up_fails(tmp_path):
    tree = CLEAN | {"core/flight.py": "def fill():\n    if True:\n        from pkg.api import http\n"}
    graph = imports_of(write_tree(tmp_path, tree), "pkg")
    assert broken_rules(graph, "pkg", RULES) == [
        "pkg.core.flight imports pkg.api.http (core may import only errors)"]
    # and it closes a circle through core's __init__: api.http -> core -> core.encoder -> core.flight -> api.http
    assert circles(graph) == [["pkg.api.http", "pkg.core", "pkg.core.encoder", "pkg.core.flight"]]


def test_a_circle_inside_one_part_fails(tmp_path):
    tree = CLEAN | {"core/flight.py": "import pkg.core.encoder\n"}
    graph = imports_of(write_tree(tmp_path, tree), "pkg")
    assert broken_rules(graph, "pkg", RULES) == []  # one part: the rules allow it
    assert circles(graph) == [["pkg.core.encoder", "pkg.core.flight"]]


def test_a_name_from_the_own_package_closes_no_circle(tmp_path):
    tree = CLEAN | {"core/flight.py": "from pkg.core import Encoder\n"}  # core's __init__ ran before flight
    assert circles(imports_of(write_tree(tmp_path, tree), "pkg")) == []


def test_an_import_of_the_benchmarks_anywhere_in_a_test_fails(tmp_path):
    write_tree(tmp_path, {
        "test_a.py": "import benchmarks_of_ours\nfrom .benchmarks import x\n",  # another name; a relative import
        "support/b.py": "def f():\n    from benchmarks.common import report\n",
        "unit/test_c.py": "import os, benchmarks.transfer_bench\n",
    })
    assert imports_of_benchmarks(tmp_path / "pkg") == [
        "support/b.py:2 imports benchmarks.common", "unit/test_c.py:1 imports benchmarks.transfer_bench"]
