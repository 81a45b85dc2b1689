"""The layout of DESIGN.md, enforced by AST walks over the source modules: the dependency
direction, no import circle inside serving/scoring, serving/stack and training, small modules, and
package faces (``__init__.py``) that only name."""

import ast
from pathlib import Path

from tests.helpers import ROOT

# package -> the project packages it may import (recserve.v1 is the generated proto contract)
ALLOWED = {
    "features": {"features"},
    "model_store": {"features", "model_store"},
    "stream": {"features", "model_store", "stream"},
    "serving": {"features", "model_store", "stream", "serving", "recserve.v1"},
    "training": {"features", "model_store", "stream", "serving", "training", "recserve.v1"},
    "handlers": {"features", "model_store", "stream", "serving", "handlers"},
}
# the benchmarks run on product code, never on tests' helpers
ALLOWED["loadtest"] = {*ALLOWED, "loadtest", "recserve"}
PROJECT = {*ALLOWED, "recserve", "tests"}


def imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name


def allowed(module: str, ok: set[str]) -> bool:
    return any(module == a or module.startswith(a + ".") for a in ok)


def test_nothing_imports_upwards():
    bad = []
    for package, ok in ALLOWED.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            for line, module in imports(path):
                if module.split(".")[0] in PROJECT and not allowed(module, ok):
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not bad, "imports against the dependency direction:\n" + "\n".join(bad)


def test_the_walk_sees_a_violation(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import os\nfrom training.train import train\n")
    assert [m for _, m in imports(probe)] == ["os", "training.train"]
    assert not allowed("training.train", ALLOWED["serving"])


def test_source_modules_stay_small():
    big = []
    for package in [*(p for p in ALLOWED if p != "loadtest"), "recserve"]:
        for path in (ROOT / package).rglob("*.py"):
            if "v1" in path.parts:  # generated
                continue
            n = len(path.read_text().splitlines())
            if n > 450:
                big.append(f"{path.relative_to(ROOT)}: {n} lines")
    assert not big, big


# --- import circles ------------------------------------------------------------------------------
# Folders whose modules import no circle among themselves, type-only (`if TYPE_CHECKING:`) and
# function-local imports included: a circle there is a module that cannot be read on its own.
CIRCLE_FREE = ("serving/scoring", "serving/stack", "training")


def module_of(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str, root: Path) -> bool:
    base = root.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, root: Path):
    """The modules an import statement names: ``from pkg import mod`` is ``pkg.mod`` where that is
    a module, else ``pkg`` (a name its face offers)."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = node.module or ""
    if node.level:  # relative: from the module's package upwards
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, base] if base else package)
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        yield sub if is_module(sub, root) else base


def import_graph(root: Path, folders) -> dict[str, dict[str, int]]:
    """module -> {module it imports: the line}, among the modules under ``folders``."""
    paths = {module_of(p, root): p for folder in folders for p in sorted((root / folder).rglob("*.py"))}
    graph: dict[str, dict[str, int]] = {}
    for module, path in paths.items():
        edges = graph.setdefault(module, {})
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for target in targets(node, module, path.name == "__init__.py", root):
                    if target in paths and target != module:
                        edges.setdefault(target, node.lineno)
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str]:
    """One import circle of ``graph`` as ``module:line`` steps back to where it began ([]: none)."""
    seen: dict[str, bool] = {}  # module -> still on the path being walked
    path: list[str] = []

    def walk(module: str) -> list[str]:
        seen[module] = True
        path.append(module)
        for nxt in sorted(graph[module]):
            if seen.get(nxt):
                loop = [*path[path.index(nxt) :], nxt]
                return [f"{a}:{graph[a][b]}" for a, b in zip(loop, loop[1:], strict=False)] + [nxt]
            if nxt not in seen and (found := walk(nxt)):
                return found
        path.pop()
        seen[module] = False
        return []

    for module in sorted(graph):
        if module not in seen and (found := walk(module)):
            return found
    return []


def test_no_import_circles():
    cycle = find_cycle(import_graph(ROOT, CIRCLE_FREE))
    assert not cycle, "an import circle (module:line of the import -> ...): " + " -> ".join(cycle)


def test_the_cycle_finder_sees_a_circle(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("import os\n\ndef f():\n    from pkg.c import C\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n"
    )
    graph = import_graph(tmp_path, ["pkg"])
    assert graph["pkg.a"] == {"pkg.b": 1}
    assert find_cycle(graph) == ["pkg.a:1", "pkg.b:4", "pkg.c:3", "pkg.a"]
    (pkg / "c.py").write_text("from pkg import a_name_of_the_face\n")  # the face: pkg, not pkg.a
    assert find_cycle(import_graph(tmp_path, ["pkg"])) == []


# --- package faces -------------------------------------------------------------------------------
FACES = ("features", "model_store", "stream", "serving", "training", "handlers", "recserve")
FACE_LINES = 40
"""A package's ``__init__.py`` over this many lines is a face: imports, re-exports, ``__all__`` and
a docstring, no code of its own."""


def code_in(path: Path) -> list[str]:
    """The definitions and assignments (other than ``__all__``) of a module, as ``line: what``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.append(f"{node.lineno}: {type(node).__name__} {node.name}")
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            names = [t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                     if isinstance(t, ast.Name)]  # fmt: skip
            if names != ["__all__"]:
                found.append(f"{node.lineno}: {ast.unparse(node).splitlines()[0][:60]}")
    return found


def test_package_faces_only_name():
    bad = []
    for package in FACES:
        for path in sorted((ROOT / package).rglob("__init__.py")):
            if path.relative_to(ROOT).parts[:2] == ("recserve", "v1"):  # generated
                continue
            lines = len(path.read_text().splitlines())
            if lines > FACE_LINES and (code := code_in(path)):
                bad.append(f"{path.relative_to(ROOT)} ({lines} lines): " + "; ".join(code))
    why = f"package faces over {FACE_LINES} lines that define code (move it to a named module)"
    assert not bad, why + ":\n" + "\n".join(bad)


def test_the_face_check_sees_code(tmp_path):
    face = tmp_path / "__init__.py"
    face.write_text('"""Doc."""\nfrom a import b\n\n__all__ = ["b"]\n__all__ += ["c"]\n')
    assert code_in(face) == []
    face.write_text("from a import b\n\nX: int = 1\n\n\ndef f():\n    y = 2\n")
    assert code_in(face) == ["3: X: int = 1", "6: FunctionDef f", "7: y = 2"]


def test_training_keeps_its_roles_in_packages():
    """training/'s top holds at most 26 modules: a role's modules live in its package (follow/,
    planning/, sources/), not beside the rest under a name prefix."""
    top = sorted(p.name for p in (ROOT / "training").glob("*.py"))
    assert len(top) <= 26, f"{len(top)} modules at training/'s top: {top}"
