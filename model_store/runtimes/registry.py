"""The runtimes' registry: a runtime is one module of ``model_store.runtimes`` that calls
``register(DenseRuntime(...))``; ``discover`` imports them in module name order (a runtime that runs
another's export registers after it).
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from pathlib import Path

from model_store.runtimes.base import DenseRuntime

RUNTIMES: dict[str, DenseRuntime] = {}
"""Every registered runtime by name, in registration (module name) order."""
EXPORTS: dict[str, DenseRuntime] = {}
"""The runtimes that write a file of their own (``export`` not None): what a version ships."""


def register(runtime: DenseRuntime) -> DenseRuntime:
    """Add ``runtime`` to the registry (a name or a file registered twice is a ValueError; so is a
    runtime that both exports and runs another's export, or runs the export of one not registered
    before it, or in another file)."""
    if runtime.name in RUNTIMES:
        raise ValueError(f"dense runtime {runtime.name!r} registered twice")
    if (runtime.export is None) != bool(runtime.of):
        raise ValueError(
            f"dense runtime {runtime.name!r}: give either an exporter or the runtime it runs (of)"
        )
    if runtime.of:
        source = EXPORTS.get(runtime.of)
        if source is None or source.file != runtime.file:
            raise ValueError(
                f"dense runtime {runtime.name!r} runs {runtime.of!r}'s export: register that first, same file"
            )
        RUNTIMES[runtime.name] = runtime
        return runtime
    taken = {Path(r.file).suffix: r.name for r in EXPORTS.values()}
    if Path(runtime.file).suffix in taken:
        raise ValueError(
            f"dense runtime {runtime.name!r}: {runtime.file} has the suffix of {taken[Path(runtime.file).suffix]}'s"
        )
    RUNTIMES[runtime.name] = EXPORTS[runtime.name] = runtime
    return runtime


def preload() -> None:
    """Import every exporting runtime's modules now: a long-running process that exports (the
    streaming trainer's full versions) holds them from its start. Of the ~72 MB a process's first
    export adds (the DLRM of the Criteo schema), 21 MB are these modules; a second adds ~3 MB."""
    for runtime in EXPORTS.values():
        for module in runtime.modules:
            importlib.import_module(module)


def get(name: str) -> DenseRuntime:
    """The runtime registered as ``name``; a ValueError naming the known ones otherwise."""
    try:
        return RUNTIMES[name]
    except KeyError:
        raise ValueError(f"unknown dense runtime {name!r}; known runtimes: {', '.join(RUNTIMES)}") from None


def for_file(path: str | os.PathLike[str]) -> DenseRuntime:
    """The (CPU) runtime that writes files ending like ``path``; a ValueError naming the known
    suffixes otherwise."""
    suffix = Path(path).suffix
    for runtime in EXPORTS.values():
        if Path(runtime.file).suffix == suffix:
            return runtime
    known = ", ".join(Path(r.file).suffix for r in EXPORTS.values())
    raise ValueError(f"{path}: unknown dense model format {suffix!r}; expected one of {known}")


def discover(package: str) -> None:
    """Import every module of ``package`` (names starting with '_' excepted) in name order: each
    runtime there registers itself."""
    for module in pkgutil.iter_modules(importlib.import_module(package).__path__):
        if not module.name.startswith("_"):
            importlib.import_module(f"{package}.{module.name}")
