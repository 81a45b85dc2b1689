"""The Kafka source of samples (``kafka://BROKERS/TOPIC``) against the mock cluster: chunks per
partition at their offsets, from where the ledger says, a rank's share of the partitions, the
training batch equal to the one the rows' features make, and malformed records refused."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from features import stream
from features.schema import load_schema
from features.transform import Table, transform
from tests.training.sources.samples import ROOT, SAMPLE, key, produce, records
from training import sources
from training.sources import Reading
from training.sources.ledger import Ledger

SCHEMA = load_schema(ROOT / "data/schemas/criteo.yaml")


def _read(spec: str, ledger: Ledger, **kw) -> list[sources.KeyedChunk]:
    reading = Reading(SCHEMA, poll_s=0.2, once=True, **kw)
    chunks = sources.open_source(spec, reading, "kafka", ledger).chunks()
    return [c for c in chunks if isinstance(c, sources.KeyedChunk)]


def test_chunks_lie_at_their_offsets_and_resume_where_the_ledger_says(kafka, tmp_path):
    topic = kafka.create_topic("source-offsets", 2)
    kafka.create_topic(topic + ".dead", 1)
    recs = records(SCHEMA, 100, per_request=10)
    produce(kafka.bootstrap, topic, recs)
    spec = f"kafka://{kafka.bootstrap}/{topic}"
    ledger = Ledger(tmp_path / "ledger.json")
    chunks = _read(spec, ledger, batch_rows=16)
    assert all(c.rows <= 16 and c.stop.row == c.start.row + c.rows for c in chunks)
    for unit in (f"{topic}/0", f"{topic}/1"):
        mine = [c for c in chunks if c.start.unit == unit]
        assert [c.start.row for c in mine] == [0, *(c.stop.row for c in mine[:-1])]  # no gap, no overlap
    got = sorted(key(k) for c in chunks for k in c.keyed.keys.tolist())
    assert got == sorted((r[0], r[1]) for r in recs)
    # the rows read back make the batch their features make
    first = next(c for c in chunks if c.start == sources.Position(f"{topic}/0", 0))
    rows = np.array(
        [10 * int(rid.rpartition("-")[2]) + item for rid, item in map(key, first.keyed.keys.tolist())]
    )
    table = stream.read(SAMPLE, SCHEMA, limit=100)
    assert first.keyed.batch() == transform(
        Table({k: v[rows] for k, v in table.columns.items()}, len(rows)), SCHEMA
    )

    ledger.resume({f"{topic}/0": 30, f"{topic}/1": 50})
    again = _read(spec, ledger)
    assert {c.start.unit: c.start.row for c in again} == {f"{topic}/0": 30}  # partition 1 was read to its end


def test_a_rank_reads_its_share_of_the_partitions(kafka, tmp_path):
    topic = kafka.create_topic("source-ranks", 4)
    produce(kafka.bootstrap, topic, records(SCHEMA, 80, per_request=10), partitions=4)
    spec = f"kafka://{kafka.bootstrap}/{topic}"
    units = [{c.start.unit for c in _read(spec, Ledger(tmp_path / f"{r}.json"), part=(r, 2))} for r in (0, 1)]
    assert units == [{f"{topic}/0", f"{topic}/2"}, {f"{topic}/1", f"{topic}/3"}]


def test_the_source_lists_its_partitions_as_typed_parts_with_their_resume_positions(kafka, tmp_path):
    topic = kafka.create_topic("source-parts", 3)
    ledger = Ledger(tmp_path / "l.json")
    source = sources.open_source(f"kafka://{kafka.bootstrap}/{topic}", Reading(SCHEMA), "kafka", ledger)
    parts = source.list_parts()
    assert parts == [sources.Part(f"{topic}/{p}", p) for p in range(3)]
    assert sources.share(parts, 1, 2) == [parts[1]]  # what rank 1 of 2 reads (and ranks.Ranks.take)
    ledger.resume({f"{topic}/2": 7})
    assert [p.resume(ledger) for p in parts] == [
        sources.Position(f"{topic}/{p}", r) for p, r in ((0, 0), (1, 0), (2, 7))
    ]
    assert sources.get("kafka").keyed  # its chunks are keyed samples, whatever flag named it


def test_a_spec_without_a_topic_and_a_missing_topic_are_refused(kafka, tmp_path):
    with pytest.raises(ValueError, match="expected kafka://BROKERS/TOPIC"):
        _read("kafka://localhost:9092", Ledger(tmp_path / "l.json"))
    with pytest.raises(ValueError, match="a stream is read with a ledger"):
        sources.open_source(f"kafka://{kafka.bootstrap}/t", Reading(SCHEMA), "kafka")


def test_a_looks_chunks_join_into_one_batch_and_behind_counts_what_was_not_yielded(kafka, tmp_path):
    topic = kafka.create_topic("source-looks", 4)
    kafka.create_topic(topic + ".dead", 1)
    recs = records(SCHEMA, 120, per_request=10)
    produce(kafka.bootstrap, topic, recs, partitions=4)
    reading = Reading(SCHEMA, poll_s=0.2, once=True, batch_rows=50)
    source = sources.open_source(
        f"kafka://{kafka.bootstrap}/{topic}", reading, "kafka", Ledger(tmp_path / "l.json")
    )
    assert source.behind() is None  # nothing assigned yet
    looks: list[list[sources.Chunk]] = []
    seen = []  # at each look: (behind, rows yielded before it)
    for chunk in source.chunks():
        if chunk is sources.TICK:
            seen.append((source.behind(), sum(c.rows for look in looks for c in look)))
            looks.append([])
        else:
            looks[-1].append(chunk)
    assert seen[0] == (120, 0) and seen[-1] == (0, 120)
    assert all(behind == 120 - rows for behind, rows in seen)
    # the chunks of one look (several partitions) join into the batch their rows' features make
    look = max(looks, key=len)
    assert len(look) > 1 and sum(c.rows for c in look) <= 50
    joined = sources.Keyed.join([c.keyed for c in look])
    rows = np.array([10 * int(rid.rpartition("-")[2]) + item for rid, item in map(key, joined.keys.tolist())])
    table = stream.read(SAMPLE, SCHEMA, limit=120)
    assert joined.batch() == transform(
        Table({k: v[rows] for k, v in table.columns.items()}, len(rows)), SCHEMA
    )
    # the batch the reading thread built for the whole look (``to_batches``, every look of the consume at once)
    assert all(c.look is look[0].look for c in look) and look[0].look.batch == joined.batch()


def test_a_once_read_takes_a_last_short_look_without_waiting_to_fill_it(kafka, tmp_path):
    # 70 records at 64 a look: the last look holds 6, and a read with ``once`` knows no more are
    # its to take, so it ends at once instead of waiting fill_s (here a minute) for 58 more
    topic = kafka.create_topic("source-once-tail", 3)
    kafka.create_topic(topic + ".dead", 1)
    produce(kafka.bootstrap, topic, records(SCHEMA, 70, per_request=10), partitions=3)
    got: list[sources.KeyedChunk] = []
    reader = threading.Thread(
        target=lambda: got.extend(
            _read(
                f"kafka://{kafka.bootstrap}/{topic}", Ledger(tmp_path / "l.json"), batch_rows=64, fill_s=60.0
            )
        ),  # fmt: skip
        daemon=True,
    )
    reader.start()
    reader.join(timeout=30)
    assert not reader.is_alive(), "the read waited for records past the ends it started with"
    assert sum(c.rows for c in got) == 70


def test_records_the_broker_dropped_before_they_were_read_are_counted_skipped(kafka, tmp_path):
    """The mock cluster keeps about 5 MB a partition: 16,000 samples of ~470 bytes overflow it, so a
    reader from offset 0 finds the first ones gone and reads past them, counted, not silently."""
    topic = kafka.create_topic("source-retention", 1)
    kafka.create_topic(topic + ".dead", 1)
    recs = [r for p in range(80) for r in records(SCHEMA, 200, per_request=200, prefix=f"p{p}")]
    produce(kafka.bootstrap, topic, recs, partitions=1)
    source = sources.open_source(f"kafka://{kafka.bootstrap}/{topic}", Reading(SCHEMA, poll_s=0.2, once=True),
                                 "kafka", Ledger(tmp_path / "ledger.json"))  # fmt: skip
    rows = sum(c.rows for c in source.chunks() if isinstance(c, sources.KeyedChunk))
    assert source.skipped() > 0 and rows + source.skipped() == len(recs)
