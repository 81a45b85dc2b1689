"""The dependency direction of DESIGN.md, enforced: an AST walk over every source module."""

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
    # the benchmarks run on product code, never on tests' helpers
    "loadtest": {
        "features",
        "model_store",
        "stream",
        "serving",
        "training",
        "handlers",
        "recserve",
        "loadtest",
    },
}
PROJECT = {
    "features",
    "model_store",
    "stream",
    "serving",
    "training",
    "handlers",
    "recserve",
    "loadtest",
    "tests",
}


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
