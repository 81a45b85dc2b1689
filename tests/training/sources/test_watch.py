"""The watched directory: which files count, read once each from the ledger's row, a TICK after
every look, an unreadable file failed in the ledger and the next one read."""

from __future__ import annotations

from pathlib import Path

from features.schema import load_schema
from training import sources
from training.sources import TICK, Reading
from training.sources.ledger import Ledger
from training.sources.watch import WatchDir

ROOT = Path(__file__).resolve().parents[3]
SCHEMA = load_schema(ROOT / "data/schemas/criteo.yaml")
SAMPLE = ROOT / "data/criteo/deepctr_criteo_sample.csv"


def test_a_file_counts_once_complete(tmp_path) -> None:
    ledger = Ledger(tmp_path / ".ledger.json")
    w = WatchDir(tmp_path, ledger)
    growing = tmp_path / "a.csv"
    growing.write_text("label,I1\n0,1\n")
    assert w.ready() == [] and w.pending == 1  # first sighting
    with growing.open("a") as f:
        f.write("1,2\n")
    assert w.ready() == []  # still growing
    assert w.ready() == [growing]  # same size and mtime for two looks
    marked = tmp_path / "b.tsv"
    marked.write_text("x")
    (tmp_path / "b.tsv.done").write_text("")
    (tmp_path / ".c.csv").write_text("x")
    (tmp_path / "d.csv.part").write_text("x")
    (tmp_path / "notes.md").write_text("x")
    assert sorted(w.ready()) == [growing, marked]  # in any order, from one look
    ledger.fail("b.tsv", "never mind")
    assert w.ready() == [growing]  # done in the ledger: not offered again
    assert WatchDir(tmp_path, Ledger(tmp_path / ".ledger.json")).ready() == [marked]  # not committed yet
    ledger.commit()
    assert WatchDir(tmp_path, Ledger(tmp_path / ".ledger.json")).ready() == []  # the ledger persists


def test_files_are_read_once_from_the_ledgers_row_with_a_tick_after_every_look(tmp_path) -> None:
    lines = SAMPLE.read_text().splitlines(keepends=True)
    (tmp_path / "a.csv").write_text("".join(lines[:41]))  # header + 40 rows
    (tmp_path / "a.csv.done").write_text("")
    (tmp_path / "b.tsv").write_text("not\tcriteo\n")  # a marked file that cannot be read
    (tmp_path / "b.tsv.done").write_text("")
    ledger = Ledger(tmp_path / "ledger.json")
    ledger.advance("a.csv", 15)  # trained before a restart
    looks: list[float] = []
    reading = Reading(SCHEMA, poll_s=0.5, wait=looks.append)
    source = sources.open_source(str(tmp_path), reading, default="watch", ledger=ledger)
    assert not source.bounded
    chunks = source.chunks()
    assert next(chunks) is TICK
    first = next(chunks)
    assert (first.start.unit, first.start.row, first.table.num_rows, first.last) == ("a.csv", 15, 25, False)
    end = next(chunks)
    assert (end.start.unit, end.start.row, end.table.num_rows, end.last) == ("a.csv", 40, 0, True)
    ledger.advance("a.csv", 25)
    ledger.finish(end)
    assert next(chunks) is TICK and looks == [0.5]  # b.tsv failed, nothing else: waited, looked again
    assert ledger.done("b.tsv") and "cannot read it" in (ledger.error("b.tsv") or "")
    (tmp_path / "c.csv").write_text("".join(lines[:11]))
    (tmp_path / "c.csv.done").write_text("")
    assert next(chunks) is TICK and looks == [0.5, 0.5]  # the file came after that look
    assert next(chunks).start == sources.Position("c.csv", 0)  # and nothing assumed the end


def test_once_ends_after_the_files_there_now(tmp_path) -> None:
    (tmp_path / "a.csv").write_text("".join(SAMPLE.read_text().splitlines(keepends=True)[:6]))
    looks: list[float] = []
    source = sources.get("watch").open(str(tmp_path), Reading(SCHEMA, once=True, wait=looks.append),
                                       Ledger(tmp_path / "l.json"))  # fmt: skip
    got = [(c.start.unit, c.table.num_rows, c.last) for c in source.chunks() if c is not TICK]
    assert got == [("a.csv", 5, False), ("a.csv", 0, True)] and looks == [1.0]  # a second look: no marker
