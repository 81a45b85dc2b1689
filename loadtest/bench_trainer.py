"""``make bench-trainer``: the streaming step against the offline step, on the same samples.

    python -m loadtest.bench_trainer [--requests 300] [--partitions 16] [--rounds 2] [--store DIR] [--quick]

``--requests`` requests of 200 Criteo training rows (the 8,000-row split's 40 requests, cycled)
are laid out twice, in the same order: as the samples ``recserve join`` writes (keyed by request
id) on a topic of the mock broker, and as the rows themselves in a TSV file. At batch 128 (the
version's sparse learning rate) and at 1,024 (the linear scaling rule: 8x the rate), in turns
(offline, streaming, streaming, offline, ... over ``--rounds``), each run on a fresh copy of the
same trained version, in this process, with the same torch threads:

- **offline**: ``recserve train --follow --watch DIR --once`` over the file: the offline step
  (rows read and transformed beside it, ``TrainCtx.steps``) on the version's in-process tables;
- **streaming**: ``recserve train --follow --stream kafka://... --once`` over the topic: consumes
  decoded on the reading thread, dedupe, progressive validation and the output guard in the step.

Each trains the same samples into the same version with the frozen dense network, so their models
should be the same: ``*_auc`` is each run's AUC on the Criteo test split (never trained on) after
it. Samples/s is timed by the trainer, from the first sample read to the last delta written
(``FollowResult.train_seconds``); the median over the rounds is reported. For reference,
``recserve_train_samples_per_s``: ``recserve train`` (from scratch, the dense network trained too)
over the same file at the same batch, its own epoch-loop rate; ``broker_consume_samples_per_s``:
a bare consumer reading the topic (what the broker delivers at most here); ``broker_cpu_s``: the
mock broker's CPU seconds during each run.

Writes loadtest/results/trainer.json: per batch size ``offline_samples_per_s``,
``streaming_samples_per_s``, ``ratio`` (streaming / offline), ``offline_auc``, ``streaming_auc``,
``streaming_progressive_auc``.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from loadtest import mockbroker
from loadtest.common import (
    CRITEO_SCHEMA,
    CRITEO_TEST,
    CRITEO_TRAIN,
    given_or_trained,
    parse,
    parser,
    print_table,
    write_results,
)

ROWS = 200
TOPIC = "samples"
BATCHES = (128, 1024)
VERSION_LR = 0.005  # the sparse learning rate loadtest.common.train_version trains with
THREADS = 1  # torch intra-op threads of every run (the reading thread and the broker need the rest)
TARGET_RATIO, TARGET_AUC = 0.9, 0.005


def records(requests: int, seed: int = 0) -> list[tuple[str, bytes]]:
    """(request id, sample record) of ``requests`` requests of ``ROWS`` Criteo training rows each
    (request i holds rows 200 * (i % 40) onwards), labelled as the data says."""
    from features import stream
    from features.schema import load_schema
    from features.transform import Table, transform
    from stream.records import Impression, SampleWriter, Versions
    from stream.rows import RowTable

    schema = load_schema(CRITEO_SCHEMA)
    table = stream.read(str(CRITEO_TRAIN), schema)
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


def rows_file(requests: int, path: Path) -> Path:
    """The rows of ``records(requests)`` in the same order, as the TSV lines they came from."""
    lines = CRITEO_TRAIN.read_text().splitlines(keepends=True)
    n = len(lines) // ROWS
    path.write_text("".join("".join(lines[(i % n) * ROWS : (i % n + 1) * ROWS]) for i in range(requests)))
    return path


def test_auc(trainer) -> float:
    """The AUC on the Criteo test split of what ``trainer`` holds now (its version, as trained)."""
    from features import stream
    from features.transform import transform
    from training.evaluate import auc, sigmoid

    lv = trainer.loaded
    batch = transform(stream.read(str(CRITEO_TEST), lv.schema), lv.schema)
    assert batch.labels is not None
    return round(auc(batch.labels, sigmoid(lv.ctx.predict(batch).logits)), 5)


def follow_run(store: Path, source: dict, batch_size: int, lr: float | None, work: Path) -> dict:
    """One follower over ``source`` (``watch=`` or ``stream=``) on a copy of ``store``; its figures."""
    from training.follow.config import FollowConfig
    from training.follow.trainer import FollowTrainer

    copy = Path(tempfile.mkdtemp(dir=work))
    shutil.copytree(store, copy, dirs_exist_ok=True)
    cfg = FollowConfig(follow=str(copy / "criteo"), once=True, batch_size=batch_size, lr=lr, delta_interval_s=2.0,
                       poll_s=0.5, threads=THREADS, state=str(copy / "follow-state.json"), **source)  # fmt: skip
    with FollowTrainer(cfg) as trainer:
        r = trainer.run(threading.Event())
        held_out = test_auc(trainer)
    shutil.rmtree(copy)
    prog = r.progressive_total.auc if r.progressive_total is not None else None
    return {"samples": r.rows, "steps": r.steps, "samples_per_s": round(r.rows / max(r.train_seconds, 1e-9)),
            "auc": held_out, "progressive_auc": prog, "max_lag_samples": r.max_lag_samples}  # fmt: skip


def recserve_train(rows: Path, batch_size: int, lr: float, work: Path) -> int:
    """``recserve train`` over ``rows`` (from scratch, in-process tables, no export): samples/s."""
    from training.config import TrainConfig, train_table
    from training.train import train

    table = train_table()
    cfg = TrainConfig(store=str(work / "scratch"), model="criteo", data=str(rows), test=str(CRITEO_TEST), epochs=1,
                      batch_size=batch_size, table=replace(table, optimizer=replace(table.optimizer, lr=lr)),
                      inprocess_ps=True, export=False, progress=False, threads=THREADS)  # fmt: skip
    return round(train(cfg).samples_per_s)


def consume_ceiling(bootstrap: str, partitions: int, expected: int) -> int:
    """Samples/s a bare consumer reads the topic at (no decode, no step): what the broker here
    delivers at most."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench-trainer-ceiling", "enable.auto.commit": False})  # fmt: skip
    c.assign([TopicPartition(TOPIC, p, 0) for p in range(partitions)])
    n, t0, deadline = 0, None, time.monotonic() + 60
    while n < expected and time.monotonic() < deadline:
        got = c.consume(min(1024, expected - n), 0.5)  # not a full 1,024 at the end: no wait out
        t0 = t0 if t0 is not None or not got else time.perf_counter()
        n += len(got)
    c.close()
    return round(n / (time.perf_counter() - t0)) if t0 is not None and n >= expected else 0


def cpu_s(pid: int) -> float:
    """CPU seconds process ``pid`` has used (user + system)."""
    f = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def measure(args, store: Path, broker, rows: Path, work: Path) -> dict:
    """Per batch size, the rounds of both runs in turns; the medians and the ratio."""
    import torch

    torch.set_num_threads(THREADS)
    out: dict = {}
    for b in BATCHES:
        lr = VERSION_LR * b / BATCHES[0]
        runs: dict[str, list[dict]] = {"offline": [], "streaming": []}
        for r in range(args.rounds):
            for arm in ("offline", "streaming") if r % 2 == 0 else ("streaming", "offline"):
                source = {"watch": str(rows.parent)} if arm == "offline" else {"stream": f"kafka://{broker.bootstrap}/{TOPIC}"}  # fmt: skip
                before = cpu_s(broker.proc.pid)
                run = follow_run(store, source, b, lr, work)
                runs[arm].append(run | {"broker_cpu_s": round(cpu_s(broker.proc.pid) - before, 2)})
                print(f"  batch {b} round {r + 1} {arm}: {runs[arm][-1]}", flush=True)
        off, st = runs["offline"], runs["streaming"]
        rate = {a: statistics.median(x["samples_per_s"] for x in runs[a]) for a in runs}
        out[str(b)] = {"lr": lr, "offline_samples_per_s": rate["offline"], "streaming_samples_per_s": rate["streaming"],
                       "ratio": round(rate["streaming"] / rate["offline"], 3), "offline_auc": off[-1]["auc"],
                       "streaming_auc": st[-1]["auc"], "streaming_progressive_auc": st[-1]["progressive_auc"],
                       "samples": {"offline": off[-1]["samples"], "streaming": st[-1]["samples"]},
                       "rounds": runs, "recserve_train_samples_per_s": recserve_train(rows, b, lr, work)}  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    from loadtest.stream_users import produce

    p = parser(__doc__)
    p.add_argument("--requests", type=int, default=300, help="requests of 200 samples (default: 300)")
    p.add_argument("--partitions", type=int, default=16,
                   help="partitions of the topic (default: 16; the mock keeps about 5 MB a partition)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=2, help="runs of each arm per batch size, in turns (default: 2)")  # fmt: skip
    p.add_argument("--store", help="existing model store (default: train one into a temp dir)")
    args = parse(p, argv, {"requests": 20, "partitions": 4, "rounds": 1})
    with tempfile.TemporaryDirectory() as tmp, mockbroker.running() as broker:
        work = Path(tmp)
        store = given_or_trained(args.store, work)
        (work / "rows").mkdir()
        rows = rows_file(args.requests, work / "rows" / "samples.tsv")
        broker.create_topic(TOPIC, args.partitions)
        broker.create_topic(TOPIC + ".dead", 1)
        produce(broker.bootstrap, TOPIC, records(args.requests))
        ceiling = consume_ceiling(broker.bootstrap, args.partitions, args.requests * ROWS)
        batches = measure(args, store, broker, rows, work)
    expected = args.requests * ROWS
    table = [{"batch": b, **{k: v for k, v in r.items() if k not in ("rounds", "samples")}} for b, r in batches.items()]  # fmt: skip
    print(f"a bare consumer reads the topic at {ceiling} samples/s (the broker's ceiling here)")
    print_table(f"offline and streaming steps on the same {expected} samples (threads {THREADS}, "
                f"{args.partitions} partitions, median of {args.rounds})", table,
                ["batch", "lr", "offline_samples_per_s", "streaming_samples_per_s", "ratio", "offline_auc",
                 "streaming_auc", "streaming_progressive_auc", "recserve_train_samples_per_s"])  # fmt: skip
    met = {f"streaming >= {TARGET_RATIO}x offline, AUC within {TARGET_AUC} (batch {b})":
           r["ratio"] >= TARGET_RATIO and abs(r["streaming_auc"] - r["offline_auc"]) <= TARGET_AUC
           for b, r in batches.items()}  # fmt: skip
    result = {"samples": expected, "requests": args.requests, "items": ROWS, "partitions": args.partitions,
              "threads": THREADS, "rounds": args.rounds, "batches": batches, "targets_met": met,
              "broker_consume_samples_per_s": ceiling,
              "conditions": "one process, the mock broker in another on the same cores"}  # fmt: skip
    write_results("trainer", result, args.results_dir)
    every = all(r["samples"]["offline"] == r["samples"]["streaming"] == expected for r in batches.values())
    return 0 if every else 1


if __name__ == "__main__":
    raise SystemExit(main())
