"""The ``recserve`` command: one subcommand per process role.

Each role registers itself in ``ROLES`` as ``name -> (module, help)``. The module provides
``add_arguments(parser)`` and ``run(args) -> int`` (or ``add_<name>_arguments`` / ``run_<name>``
when one module serves several subcommands); it is imported only when its subcommand (or
``--help``) needs it, so ``recserve ps`` does not pay for importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

ROLES: dict[str, tuple[str, str]] = {
    "transform": ("features.cli", "read a data file, transform it and write compact batches"),
    "synth": ("features.synth", "write Criteo-shaped synthetic click logs of any size (TSV or Parquet)"),
    "ps": ("serving.ps.server", "serve one embedding parameter-server shard over gRPC"),
    "worker": ("serving.worker.server", "serve the embedding worker (route, pool, update) over gRPC"),
    "train": ("training.cli", "train a model (PS-backed embeddings, DDP dense) and export it"),
    "up": ("serving.stack_cli", "start the local serving stack (PS shards, worker, TorchServe) for a model"),
    "down": ("serving.stack_cli", "stop exactly the processes a previous `recserve up` started"),
    "score": ("serving.stack_cli", "send scoring requests from a data file to an endpoint and print scores"),
    "controller": (
        "serving.controller",
        "keep TorchServe's dense model on the model store's CURRENT version",
    ),
    "versions": ("serving.releases_cli", "list a model's versions (and optionally keep only the newest N)"),
    "publish": (
        "serving.releases_cli",
        "validate a version and make it the served one (atomic CURRENT switch)",
    ),
    "rollback": ("serving.releases_cli", "re-publish the previously published version"),
}


def _hook(module, kind: str, name: str):
    """``run_<name>`` / ``add_<name>_arguments`` if the module has them, else ``run`` / ``add_arguments``."""
    specific = getattr(module, f"run_{name}" if kind == "run" else f"add_{name}_arguments", None)
    return specific or getattr(module, "run" if kind == "run" else "add_arguments")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recserve", description="Train and serve recommendation models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in ROLES.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if only is None or only == name:
            _hook(importlib.import_module(module), "add", name)(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in argv if a in ROLES), None)
    parser = build_parser(only=chosen)
    args = parser.parse_args(argv)
    module = importlib.import_module(ROLES[args.command][0])
    return int(_hook(module, "run", args.command)(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
