"""``recserve train``: train a model and export it to the model store (see training/train.py).

Also runnable under torchrun for multi-rank DDP: ``torchrun --nproc-per-node 2 -m training.cli ...``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    from training.config import add_arguments as add_config_arguments

    add_config_arguments(p)
    p.add_argument("--log-level", default="INFO")


def run(args: argparse.Namespace) -> int:
    from training.config import config_from_args

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = config_from_args(args)
    except (TypeError, ValueError) as e:
        logging.getLogger("recserve.train").error("bad configuration: %s", e)
        return 2
    from training.train import train

    t0 = time.perf_counter()
    result = train(cfg)
    if result.evaluation is not None:  # rank 0
        summary = {
            "auc": round(result.auc, 5),
            "logloss": round(result.logloss, 5),
            "samples_per_s": round(result.samples_per_s, 1),
            "steps": result.steps,
            "version_dir": result.version_dir,
            "curve": result.curve,
            "wall_s": round(time.perf_counter() - t0, 2),
        }
        print(json.dumps(summary))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="recserve train", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
