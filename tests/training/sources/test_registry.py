"""The data-source registry: a spec's scheme picks the kind, an unknown one is refused by name, an
unbounded source is refused by epochs, and files name where every chunk lies."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from features import stream
from features.schema import load_schema
from training import data, sources
from training.config import TrainConfig
from training.follow.config import FollowConfig
from training.sources import Reading

ROOT = Path(__file__).resolve().parents[3]
SCHEMA = load_schema(ROOT / "data/schemas/criteo.yaml")
SAMPLE = ROOT / "data/criteo/deepctr_criteo_sample.csv"


def test_the_scheme_picks_the_kind() -> None:
    assert {"files", "watch", "kafka"} <= set(sources.KINDS)
    assert sources.parse("logs/*.tsv", default="files") == (sources.get("files"), "logs/*.tsv")
    assert sources.parse("watch://incoming/", default="files") == (sources.get("watch"), "incoming/")
    with pytest.raises(ValueError, match="unknown data source 'nope'; known sources: .*files"):
        sources.parse("nope://broker/topic", default="files")
    with pytest.raises(ValueError, match="'files' registered twice"):
        sources.register(sources.get("files"))
    for config in (
        lambda: TrainConfig(data="nope://b/t"),
        lambda: FollowConfig(follow="m", watch="nope://b/t"),
    ):
        with pytest.raises(ValueError, match="unknown data source 'nope'"):  # at start, as a bad setting
            config()


def test_files_name_the_file_and_row_of_every_chunk(tmp_path) -> None:
    lines = SAMPLE.read_text().splitlines(keepends=True)
    for name, rows in (("a.csv", lines[:31]), ("b.csv", lines[:1] + lines[31:81])):
        (tmp_path / name).write_text("".join(rows))
    options = stream.ReadOptions(block_size=1024)  # several chunks per file
    source = sources.open_source(str(tmp_path / "*.csv"), Reading(SCHEMA, options), default="files")
    chunks = list(source.chunks())
    assert source.bounded and len(chunks) > 2
    for unit, total in ((str(tmp_path / "a.csv"), 30), (str(tmp_path / "b.csv"), 50)):
        mine = [c for c in chunks if c.start.unit == unit]
        assert [c.start.row for c in mine] == [0, *(c.stop.row for c in mine[:-1])]  # contiguous
        assert mine[-1].stop.row == total
    whole = stream.read(tmp_path / "*.csv", SCHEMA)
    np.testing.assert_array_equal(
        np.concatenate([c.table.columns["C1"] for c in chunks]), whole.columns["C1"]
    )


def test_chunks_are_one_kind_per_class_and_keyedness_is_the_kinds() -> None:
    assert not sources.get("files").keyed and not sources.get("watch").keyed and sources.get("kafka").keyed
    assert isinstance(sources.TICK, sources.TableChunk) and sources.TICK.rows == 0
    chunk = sources.TableChunk(stream.read(SAMPLE, SCHEMA, limit=5), sources.Position("a.csv", 10), last=True)
    assert (chunk.rows, chunk.stop) == (5, sources.Position("a.csv", 15))
    assert not hasattr(chunk, "keyed") and not hasattr(sources.KeyedChunk, "table")
    parts = [sources.Part(f"t/{p}", p) for p in range(5)]
    assert [sources.share(parts, r, 2) for r in (0, 1)] == [parts[0::2], parts[1::2]]
    assert sources.open_source(str(SAMPLE), Reading(SCHEMA), default="files").list_parts() == []


def test_epochs_refuse_an_unbounded_source(tmp_path) -> None:
    endless = sources.SourceKind("endless", lambda where, reading, ledger: _Endless())
    sources.register(endless)
    try:
        split = data.Split("endless://", SCHEMA, stream.ReadOptions())
        with pytest.raises(
            ValueError, match="endless://: endless is an unbounded source and cannot be read in epochs"
        ):
            split.scan()
    finally:
        del sources.KINDS["endless"]


class _Endless:
    bounded = False

    def chunks(self):
        while True:
            yield sources.TICK
