"""``recserve train``: train a model and export it to the model store (see training/train.py).

Also runnable under torchrun for multi-rank DDP:
``torchrun --nproc-per-node 2 -m recserve.commands.train ...``.

``recserve train --follow MODEL_DIR --watch DIR`` (or ``--stream kafka://BROKERS/TOPIC``, samples
from ``recserve join``): continuous training into the version the model
directory serves (its CURRENT; the same MODEL_DIR as ``recserve ps-serve``) instead (see
training/follow/trainer.py): new files in DIR train the served embeddings (the served dense model is
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
    """One flag per TrainConfig field (--arch, --batch-size, --no-export, ...), then the --follow
    mode's own flags (the FollowConfig fields TrainConfig does not have, --follow MODEL_DIR among
    them)."""

    from recserve import config
    from training.config import TrainConfig
    from training.follow.config import FollowConfig

    config.add_arguments(p, TrainConfig)
    g = p.add_argument_group(
        "continuous training (--follow MODEL_DIR)",
        "keep training the embeddings of the version MODEL_DIR serves (<store>/<model>, as for "
        "`recserve ps-serve`) on new files in --watch and cut deltas into it; the served dense "
        "model is loaded frozen so the deltas stay consistent with it. Uses --batch-size --lr "
        "--staleness --update-threads --capacity --eviction --max-memory-gb --threads and "
        "--delta-interval-s (default 2 here) too.",
    )
    config.add_arguments(g, FollowConfig, yaml_flag=False, skip=config.dests(TrainConfig))


def run_args(args: argparse.Namespace) -> int:
    from recserve import config
    from training.config import TrainConfig
    from training.follow.config import FollowConfig

    if getattr(args, "follow", None):
        return run_follow(args)
    try:
        stray = only_in(FollowConfig, TrainConfig, args)
        if stray:
            raise ValueError(f"{', '.join(stray)}: only with --follow")
        cfg = config.from_args(TrainConfig, args)
    except (TypeError, ValueError) as e:
        logging.getLogger("recserve.train").error("bad configuration: %s", e)
        return 2
    from model_store import IncompatibleVersion
    from training.ranks import DeviceError
    from training.train import train

    t0 = time.perf_counter()
    try:
        result = train(cfg)
    except IncompatibleVersion as e:  # --publish: the gate refused the version; it stays exported
        logging.getLogger("recserve.train").error(
            "exported, not published: %s. `recserve publish --allow-schema-change VERSION` publishes "
            "it for a new stack",
            e,
        )
        return 1
    except DeviceError as e:
        logging.getLogger("recserve.train").error("cannot train here: %s", e)
        return 2
    except Exception as e:
        if not out_of_room(e):
            raise
        logging.getLogger("recserve.train").error("training stopped: %s", e)
        return 1
    if result.evaluation is not None:  # rank 0
        summary = {
            "auc": round(result.auc, 5),
            "logloss": round(result.logloss, 5),
            "samples_per_s": round(result.samples_per_s, 1),
            "steps": result.steps,
            "version_dir": result.version_dir,
            "curve": result.curve,
            "wall_s": round(time.perf_counter() - t0, 2),
            **result.ps,  # ps_rows, evictions, expired, grows (summed over the shards)
        }
        print(json.dumps(summary))
    return 0


def out_of_room(e: BaseException | None) -> bool:
    """Whether a PS shard (in-process or over gRPC, possibly behind the worker's background
    updates) refused rows for lack of room: RESOURCE_EXHAUSTED anywhere in the cause chain."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if getattr(e, "grpc_status", None) == "RESOURCE_EXHAUSTED":
            return True
        e = e.__cause__ or e.__context__
    return False


def only_in(cls: type, other: type, args: argparse.Namespace) -> list[str]:
    """The flags the user typed that ``cls`` has and ``other`` does not."""
    from recserve import config

    theirs = set(config.given(other, args))
    return [f for f in config.given(cls, args) if f not in theirs]


def run_follow(args: argparse.Namespace) -> int:
    """``--follow``: train until SIGTERM/Ctrl-C, ``--max-seconds`` or (``--once``) the files
    present now are done; a final delta is cut on the way out. Prints a JSON summary."""
    import signal
    import threading

    from recserve import config
    from training.config import TrainConfig
    from training.follow.config import FollowConfig

    try:
        ignored = only_in(TrainConfig, FollowConfig, args)
        if ignored:
            raise ValueError(f"{', '.join(ignored)} do not apply to --follow")
        cfg = config.from_args(FollowConfig, args)
    except (TypeError, ValueError) as e:
        logging.getLogger("recserve.train").error("bad configuration: %s", e)
        return 2
    from dataclasses import asdict

    from model_store import ModelStoreError
    from serving import memory
    from serving.rpc.metrics import MetricsPortError
    from training.follow.trainer import follow

    stop = threading.Event()
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            handlers[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        with memory.trimming():  # its steps' and versions' freed memory, back to the system
            result = follow(cfg, stop)
    except (ModelStoreError, MetricsPortError) as e:
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
        "duplicates": result.duplicates,
        "refused": result.refused,
        "progressive": [asdict(s) for s in result.progressive],
        "progressive_total": result.progressive_total and asdict(result.progressive_total),
        "steps": result.steps,
        "reloads": result.reloads,
        "full_versions": result.full_versions,
        "refused_versions": result.refused_versions,
        "wall_s": round(result.seconds, 2),
        "samples_per_s": round(result.rows / result.train_seconds) if result.train_seconds else 0,
        "max_lag_samples": result.max_lag_samples,
        "skipped_records": result.skipped_records,
    }
    print(json.dumps(summary))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m recserve.commands.train ...`` (what torchrun runs on every rank)."""
    parser = argparse.ArgumentParser(prog="recserve train", description=__doc__)
    add_arguments(parser)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return run_args(args)


if __name__ == "__main__":
    sys.exit(main())
