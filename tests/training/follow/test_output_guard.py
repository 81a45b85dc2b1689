"""The output guard in a streaming trainer (mock Kafka cluster): samples whose labels an upstream
bug inverted make the served AUC fall; the guard trips, trains nothing more, and rewinds the
served rows to the last good delta as the next delta (what serving holds with every delta applied
is what it held then); good samples clear it and training resumes."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest

import model_store as ms
from model_store.guards import read_guards
from tests.helpers import wait_until
from tests.training.follow.helpers import NAME, rows_at, schema_of, stream_cfg
from tests.training.sources.samples import produce, records
from training.follow.guard import OutputGuardConfig
from training.follow.trainer import FollowTrainer

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.jit.load. is deprecated")
GUARD = OutputGuardConfig(window=100, band_windows=5, min_band_windows=3, warmup_windows=0)


def served(labels: np.ndarray) -> np.ndarray:
    """What a fair served model predicted for these labels (AUC about 0.8)."""
    rng = np.random.default_rng(int(labels.sum() * 1000 + len(labels)))
    return np.clip(0.15 + 0.35 * labels + rng.normal(0, 0.15, len(labels)), 0.01, 0.99)


def test_inverted_labels_trip_the_guard_which_rewinds_the_served_rows(kafka, new_topic, store):
    topic = new_topic("samples-output-guard")
    schema = schema_of(store)

    def batch(prefix: str, invert: bool = False, delta_seq: int = 1) -> list:
        return records(schema, 200, per_request=20, prefix=prefix, served=served, invert=invert,
                       delta_seq=delta_seq)  # fmt: skip

    produce(kafka.bootstrap, topic, [r for p in ("g0", "g1", "g2", "g3") for r in batch(p)])
    cfg = stream_cfg(store, f"kafka://{kafka.bootstrap}/{topic}", delta_interval_s=0.2, guard=GUARD)
    stop = threading.Event()
    with FollowTrainer(cfg) as trainer:
        thread = threading.Thread(target=trainer.run, args=(stop,), daemon=True)
        thread.start()
        try:
            r = wait_until(lambda: trainer.rewinder, 30, "the trainer up")
            wait_until(
                lambda: r.cuts.cut and r.cuts.cut[-1][1] >= 800, 60, "the good samples trained and cut"
            )
            assert not r.guard.tripped and len(r.guard.band) >= 3
            produce(kafka.bootstrap, topic, [r for p in ("b0", "b1") for r in batch(p, invert=True)])
            vdir = ms.version_dir(store, NAME, ms.current(store, NAME))
            # the rewind's own delta published (deltas of bad samples cut before the trip are
            # later than r.last.to too: reading the rows before the rewind's lands compares those)
            wait_until(lambda: r.rewinds == 1 and r.guard.served_from is not None
                       and r.guard.served_from in ms.list_deltas(vdir), 60, "the rewind cut")  # fmt: skip
            assert r.guard.tripped and "served AUC" in r.guard.reason and r.last.rows > 0
            wait_until(lambda: r.held >= 300, 30, "the rest of the bad samples read, not trained")
            good, now = rows_at(store, r.last.to), rows_at(store)
            assert good.keys() == now.keys()
            assert all(np.array_equal(good[k], now[k]) for k in good)
            assert r.last.to <= 1  # no later than the delta that served the good samples
            rewound = r.guard.served_from  # the rewind's delta (a delta of offsets alone may follow it)
            produce(
                kafka.bootstrap, topic, [r for p in ("h0", "h1") for r in batch(p, delta_seq=rewound - 1)]
            )
            wait_until(lambda: r.guard.seen >= 1600, 30, "the samples served before the rewind read")
            assert r.guard.tripped  # healthy, but served by the model that tripped
            produce(kafka.bootstrap, topic, [r for p in ("h2", "h3") for r in batch(p, delta_seq=rewound)])
            wait_until(lambda: r.guard.recoveries == 1, 60, "the guard cleared")
            trained = trainer.result.rows
            produce(kafka.bootstrap, topic, batch("h4", delta_seq=rewound))
            wait_until(lambda: trainer.result.rows > trained, 30, "training resumed")
        finally:
            stop.set()
            thread.join(60)
    events, bad = read_guards(store / NAME)
    assert [e.event for e in events] == ["trip", "rewind", "clear"] and not bad
    assert events[1].to == r.last.to and "served AUC" in events[0].reason
    shown = subprocess.run([sys.executable, "-m", "recserve", "versions", "--store", str(store), "--model", NAME],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert "guard  output rewind" in shown.stdout and f"back at delta {r.last.to}" in shown.stdout, (
        shown.stdout
    )
