"""``recserve train``: train a model and export it to the model store (see training/train.py).

Also runnable under torchrun for multi-rank DDP: ``torchrun --nproc-per-node 2 -m training.cli ...``.

``recserve train --follow --watch DIR``: continuous training into the served version instead
(see training/follow.py): new files in DIR train the served embeddings (the served dense model is
frozen) and deltas are cut into the version every --delta-interval-s seconds. SIGTERM or Ctrl-C
cuts a final delta and exits 0.
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
    from training.config import config_from_args, follow_only_flags

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if getattr(args, "follow", False):
        return run_follow(args)
    try:
        stray = follow_only_flags(args)
        if stray:
            raise ValueError(f"{', '.join(stray)}: only with --follow")
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


def run_follow(args: argparse.Namespace) -> int:
    """``--follow``: train until SIGTERM/Ctrl-C, ``--max-seconds`` or (``--once``) the files
    present now are done; a final delta is cut on the way out. Prints a JSON summary."""
    import signal
    import threading

    from training.config import follow_config_from_args

    try:
        cfg = follow_config_from_args(args)
    except (TypeError, ValueError) as e:
        logging.getLogger("recserve.train").error("bad configuration: %s", e)
        return 2
    from serving.model_store import ModelStoreError
    from training.follow import follow

    stop = threading.Event()
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            handlers[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        result = follow(cfg, stop)
    except ModelStoreError as e:
        logging.getLogger("recserve.train").error("cannot follow: %s", e)
        return 1
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    summary = {
        "version": result.version,
        "deltas": [f"{v}/{seq}" for v, seq in result.deltas],
        "files": result.files,
        "rows": result.rows,
        "steps": result.steps,
        "reloads": result.reloads,
        "wall_s": round(result.seconds, 2),
    }
    print(json.dumps(summary))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="recserve train", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
