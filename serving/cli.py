"""The ``recserve`` command: one subcommand per process role.

Each role registers itself in ``ROLES`` as ``name -> (module, help)``. The module provides
``add_arguments(parser)`` and ``run(args) -> int``; it is imported only when its subcommand (or
``--help``) needs it, so ``recserve ps`` does not pay for importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

ROLES: dict[str, tuple[str, str]] = {
    "transform": ("features.cli", "read a data file, transform it and write compact batches"),
    "ps": ("serving.ps.server", "serve one embedding parameter-server shard over gRPC"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recserve", description="Train and serve recommendation models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in ROLES.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if only is None or only == name:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in argv if a in ROLES), None)
    parser = build_parser(only=chosen)
    args = parser.parse_args(argv)
    module = importlib.import_module(ROLES[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
