"""Sample records for stream tests: rows of the Criteo sample as ``recserve join`` writes them
(one impression per request of ``per_request`` rows), produced to a topic, with what was produced."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from features import stream
from features.schema import Schema
from features.transform import Table, transform
from stream.records import CORRECTION, Impression, SampleWriter, Versions
from stream.rows import RowTable
from stream.sample_batch import KIND_BIT

ROOT = Path(__file__).resolve().parents[3]
SAMPLE = ROOT / "data/criteo/deepctr_criteo_sample.csv"


def records(schema: Schema, rows: int, per_request: int = 50, prefix: str = "r", skip: int = 0,
            ts: float = 1.7e9, served=None, invert: bool = False,
            corrections: int = 0, delta_seq: int = 0) -> list[tuple[str, int, float, bytes]]:  # fmt: skip
    """(request id, item, label, sample record) of ``rows`` rows of the sample after ``skip``;
    ``served(labels)``: the scores served (default zeros); ``invert``: every label flipped (a broken
    upstream); ``corrections``: every such row that is a negative is also corrected, as the joiner
    does for a click after the first horizon (a positive of kind CORRECTION, 30 s late; its item
    there is ``item | KIND_BIT``, as a trained key's item word has it); ``delta_seq``: the delta
    that served them."""
    table = stream.read(SAMPLE, schema, limit=skip + rows)
    out = []
    for lo in range(skip, skip + rows, per_request):
        hi = min(lo + per_request, skip + rows)
        part = Table({k: v[lo:hi] for k, v in table.columns.items()}, hi - lo)
        batch = transform(part, schema)
        assert batch.labels is not None
        rid = f"{prefix}-{lo // per_request}"
        scores = np.zeros(hi - lo, np.float32) if served is None else served(batch.labels).astype(np.float32)
        imp = Impression(rid, ts + lo, Versions("v", delta_seq, "v"), scores, b"")
        writer = SampleWriter(imp, RowTable.of(batch))
        for item in range(hi - lo):
            label = float(batch.labels[item]) if not invert else 1.0 - float(batch.labels[item])
            out.append((rid, item, label, writer.encode(item, label)))
            if corrections and (lo + item) % corrections == 0 and label == 0.0:
                out.append((rid, item | KIND_BIT, 1.0, writer.encode(item, 1.0, CORRECTION, elapsed=30.0)))
    return out


def produce(
    bootstrap: str, topic: str, recs: list[tuple[str, int, float, bytes]], partitions: int = 2
) -> None:
    """Produce ``recs`` keyed by request id, request k to partition k % partitions; all acknowledged."""
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bootstrap, "acks": "all"})
    for rid, _, _, value in recs:
        p.produce(topic, value, rid.encode(), partition=int(rid.rpartition("-")[2]) % partitions)
    assert p.flush(30) == 0, "samples not acknowledged"


def key(k: bytes) -> tuple[str, int]:
    """A trained key (``stream.sample_batch``) as (request id, item)."""
    return k[4:].decode(), int.from_bytes(k[:4], "big")
