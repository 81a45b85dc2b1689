"""``make bench-trainer``: how fast the streaming trainer replays a topic of samples (samples/s).

    python -m loadtest.bench_trainer [--requests 500] [--partitions 16] [--store DIR] [--quick]

Fills a samples topic on the mock broker with ``--requests`` requests of 200 Criteo items as
``recserve join`` writes them (keyed by request id), then replays it with the product's trainer
(``training.follow.trainer.FollowTrainer``, ``--follow --stream --once``, in this process), once per
setting, each on a fresh copy of the model store: the baseline (``recserve train --follow``'s
batch of 128 and the version's sparse learning rate) and ``--batch-size`` with ``--lr``. A step's
cost is mostly fixed (the dense network's forward and backward), so larger batches train more
samples a second; a sample's share of its batch's mean gradient shrinks with the batch, so the
learning rate grows with it (the linear scaling rule) to learn as fast per sample: the progressive
AUC of each run shows whether it does. Timed from the first sample read to the last delta
written (``FollowResult.train_seconds``); ``max_lag_samples``: the most samples the trainer was
behind the topic's end at a look. Writes loadtest/results/trainer.json.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from pathlib import Path

import numpy as np

from loadtest import mockbroker
from loadtest.common import (
    CRITEO_SCHEMA,
    CRITEO_TEST,
    given_or_trained,
    parse,
    parser,
    print_table,
    write_results,
)

ROWS = 200
TOPIC = "samples"
TARGET = 8_000  # 25 rps x 200 items = 5,000 samples/s, with headroom on a loaded 2-core VM
BASELINE_BATCH = 128
VERSION_LR = 0.005  # the sparse learning rate loadtest.common.train_version trains with


def records(requests: int, seed: int = 0) -> list[tuple[str, bytes]]:
    """(request id, sample record) of ``requests`` requests of ``ROWS`` Criteo test rows each
    (ten distinct requests' rows, cycled), labelled as the data says."""
    from features import stream
    from features.schema import load_schema
    from features.transform import Table, transform
    from stream.records import Impression, SampleWriter, Versions
    from stream.rows import RowTable

    schema = load_schema(CRITEO_SCHEMA)
    table = stream.read(str(CRITEO_TEST), schema, limit=10 * ROWS)
    batches = [transform(Table({k: v[lo : lo + ROWS] for k, v in table.columns.items()}, ROWS), schema)
               for lo in range(0, table.num_rows - ROWS + 1, ROWS)]  # fmt: skip
    rng = np.random.default_rng(seed)
    out = []
    for i in range(requests):
        batch = batches[i % len(batches)]
        assert batch.labels is not None
        imp = Impression(f"req-{seed}-{i}", 1.7e9 + 0.04 * i, Versions("v1", 0, "v1"),
                         rng.random(ROWS, dtype=np.float32), b"")  # fmt: skip
        writer = SampleWriter(imp, RowTable.of(batch))
        out += [(imp.request_id, writer.encode(item, float(batch.labels[item]))) for item in range(ROWS)]
    return out


def replay(store: Path, bootstrap: str, batch_size: int, lr: float | None, work: Path) -> dict:
    """One trainer over the whole topic, on a copy of ``store``; its figures."""
    from training.follow.config import FollowConfig
    from training.follow.trainer import FollowTrainer

    copy = Path(tempfile.mkdtemp(dir=work))
    shutil.copytree(store, copy, dirs_exist_ok=True)
    cfg = FollowConfig(follow=str(copy / "criteo"), stream=f"kafka://{bootstrap}/{TOPIC}", once=True,
                       batch_size=batch_size, lr=lr, delta_interval_s=2.0, poll_s=0.5)  # fmt: skip
    with FollowTrainer(cfg) as trainer:
        r = trainer.run(threading.Event())
    shutil.rmtree(copy)
    auc = r.progressive_total.auc if r.progressive_total is not None else None
    return {"batch_size": batch_size, "lr": lr or "version's", "samples": r.rows, "steps": r.steps,
            "deltas": len(r.deltas), "seconds": round(r.train_seconds, 2),
            "train_samples_per_s": round(r.rows / max(r.train_seconds, 1e-9)),
            "max_lag_samples": r.max_lag_samples, "progressive_auc": auc}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from loadtest.stream_users import produce

    p = parser(__doc__)
    p.add_argument("--requests", type=int, default=500, help="requests of 200 samples (default: 500)")
    p.add_argument("--partitions", type=int, default=16,
                   help="partitions of the topic (default: 16; the mock keeps about 5 MB a partition)")  # fmt: skip
    p.add_argument("--batch-size", type=int, default=1024, help="the batch set against 128 (default: 1024)")
    p.add_argument("--lr", type=float, default=None,
                   help=f"its sparse learning rate (default: {VERSION_LR:g} x batch / {BASELINE_BATCH})")  # fmt: skip
    p.add_argument("--store", help="existing model store (default: train one into a temp dir)")
    args = parse(p, argv, {"requests": 20, "partitions": 4})
    with tempfile.TemporaryDirectory() as tmp, mockbroker.running() as broker:
        work = Path(tmp)
        store = given_or_trained(args.store, work)
        broker.create_topic(TOPIC, args.partitions)
        broker.create_topic(TOPIC + ".dead", 1)
        produce(broker.bootstrap, TOPIC, records(args.requests))
        lr = args.lr or VERSION_LR * args.batch_size / BASELINE_BATCH
        runs = [replay(store, broker.bootstrap, BASELINE_BATCH, None, work),
                replay(store, broker.bootstrap, args.batch_size, lr, work)]  # fmt: skip
    expected = args.requests * ROWS
    print_table(f"streaming trainer replaying {expected} samples ({args.partitions} partitions)", runs,
                ["batch_size", "lr", "samples", "steps", "deltas", "seconds", "train_samples_per_s",
                 "max_lag_samples", "progressive_auc"])  # fmt: skip
    result = {"samples": expected, "requests": args.requests, "items": ROWS, "partitions": args.partitions,
              "baseline": runs[0], "trainer": runs[1], "train_samples_per_s": runs[1]["train_samples_per_s"],
              "max_lag_samples": runs[1]["max_lag_samples"], "target_samples_per_s": TARGET}  # fmt: skip
    write_results("trainer", result, args.results_dir)
    return 0 if all(r["samples"] == expected for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
