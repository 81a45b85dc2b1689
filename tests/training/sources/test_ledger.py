"""The ledger of a followed source (training/sources/ledger.py): rows consumed per unit, kept apart
until ``commit`` (which the trainer calls after a delta's _SUCCESS), then written atomically in the
first follow ledgers' format; a published delta's positions win over the file; where it lives."""

from __future__ import annotations

import json

import pytest

from features.transform import Table
from training.follow.config import FollowConfig
from training.sources import Position, TableChunk
from training.sources.ledger import Ledger, ledger_path


def _chunk(unit: str, last: bool) -> TableChunk:
    return TableChunk(Table({}, 0), Position(unit, 0), last=last)


def test_a_new_ledger_has_consumed_nothing(tmp_path):
    ledger = Ledger(tmp_path / "ledger.json")
    assert (ledger.row("a.csv"), ledger.done("a.csv"), ledger.error("a.csv"), ledger.positions()) == (
        0,
        False,
        None,
        {},
    )


def test_progress_reaches_the_file_only_at_a_commit_in_the_first_ledgers_format(tmp_path):
    path = tmp_path / "state" / "ledger.json"  # its directory is made at the first commit
    ledger = Ledger(path)
    ledger.advance("a.csv", 100)
    ledger.advance("a.csv", 50)
    ledger.finish(_chunk("a.csv", last=True))
    ledger.advance("b.csv", 7)
    ledger.finish(_chunk("b.csv", last=False))  # more of b.csv to come
    assert ledger.positions() == {"a.csv": 150, "b.csv": 7} and ledger.done("a.csv")
    assert not path.exists()  # no delta published yet: a restart reads them again

    ledger.commit()

    assert json.loads(path.read_text()) == {
        "files": {"a.csv": {"rows": 150, "done": True}, "b.csv": {"rows": 7, "done": False}}
    }
    assert [p.name for p in path.parent.iterdir()] == ["ledger.json"]  # replaced atomically: no temp left
    again = Ledger(path)
    assert again.positions() == {"a.csv": 150, "b.csv": 7} and again.done("a.csv") and not again.done("b.csv")


def test_progress_after_a_commit_adds_to_the_committed_rows(tmp_path):
    ledger = Ledger(tmp_path / "ledger.json")
    ledger.advance("t/0", 10)
    ledger.commit()
    ledger.advance("t/0", 5)
    assert ledger.row("t/0") == 15 and Ledger(ledger.path).row("t/0") == 10
    ledger.commit()
    assert Ledger(ledger.path).row("t/0") == 15


def test_a_commit_of_what_was_taken_leaves_the_progress_since_apart(tmp_path):
    # a delta written on its own thread holds the progress taken at its cut; training went on
    path = tmp_path / "ledger.json"
    ledger = Ledger(path)
    ledger.advance("a.csv", 100)
    ledger.advance("b.csv", 5)
    taken = ledger.take()
    ledger.advance("a.csv", 30)  # trained after the cut: the next delta's
    ledger.advance("c.csv", 9)
    ledger.commit(taken)
    assert json.loads(path.read_text())["files"] == {
        "a.csv": {"rows": 100, "done": False},
        "b.csv": {"rows": 5, "done": False},
    }
    assert ledger.positions() == {"a.csv": 130, "b.csv": 5, "c.csv": 9}
    assert Ledger(path).positions() == {"a.csv": 100, "b.csv": 5}  # a restart: the published delta's
    ledger.commit()
    assert Ledger(path).positions() == {"a.csv": 130, "b.csv": 5, "c.csv": 9}


def test_a_commit_of_nothing_writes_nothing(tmp_path):
    ledger = Ledger(tmp_path / "ledger.json")
    ledger.commit()
    assert not ledger.path.exists()


def test_a_standby_taking_over_drops_what_was_not_committed(tmp_path):
    ledger = Ledger(tmp_path / "ledger.json")
    ledger.advance("t/0", 10)
    ledger.commit()
    ledger.advance("t/0", 5)
    ledger.advance("t/1", 3)
    predecessor = Ledger(ledger.path)  # the trainer that held the lock goes on, and commits
    predecessor.advance("t/1", 20)
    predecessor.commit()

    ledger.reload()

    assert ledger.positions() == {"t/0": 10, "t/1": 20}
    ledger.commit()  # nothing of its own left to write over the predecessor's
    assert Ledger(ledger.path).positions() == {"t/0": 10, "t/1": 20}


def test_a_published_deltas_positions_win_over_the_file_and_the_progress(tmp_path):
    """A crash between a delta's _SUCCESS and the ledger's commit leaves the file behind the delta;
    the delta's record says where the stream resumes."""
    ledger = Ledger(tmp_path / "ledger.json")
    ledger.advance("t/0", 10)
    ledger.fail("t/1", "unreadable")
    ledger.commit()
    ledger.advance("t/0", 99)  # read past the delta, never published

    ledger.resume({"t/0": 40, "t/2": 8})

    assert ledger.positions() == {"t/0": 40, "t/1": 0, "t/2": 8}
    assert not ledger.done("t/0") and ledger.done("t/1") and ledger.error("t/1") == "unreadable"
    ledger.advance("t/0", 2)
    assert ledger.row("t/0") == 42


def test_a_failed_unit_is_done_with_why_and_kept(tmp_path):
    ledger = Ledger(tmp_path / "ledger.json")
    ledger.advance("bad.csv", 3)
    ledger.fail("bad.csv", "row 4: not a number")
    ledger.commit()
    again = Ledger(ledger.path)
    assert (
        again.done("bad.csv")
        and again.error("bad.csv") == "row 4: not a number"
        and again.row("bad.csv") == 3
    )


@pytest.mark.parametrize("text", ["{", "[]", '{"units": {}}'])
def test_an_unreadable_ledger_is_refused_naming_it_and_the_way_out(tmp_path, text):
    path = tmp_path / "ledger.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"ledger.json: unreadable follow ledger .*move it away"):
        Ledger(path)


def test_the_ledger_lies_in_the_watched_directory_the_model_directory_or_where_state_says(tmp_path):
    model = str(tmp_path / "store" / "criteo")
    watched = FollowConfig(follow=model, watch=str(tmp_path / "incoming"))
    assert watched.ledger == tmp_path / "incoming" / ".recserve-follow-criteo.json"
    streamed = FollowConfig(follow=model, stream="kafka://h:1/samples")
    assert streamed.ledger == tmp_path / "store" / "criteo" / ".recserve-follow-criteo.json"
    placed = FollowConfig(follow=model, stream="kafka://h:1/samples", state=str(tmp_path / "s" / "l.json"))
    assert placed.ledger == tmp_path / "s" / "l.json"


def test_with_ranks_each_has_a_ledger_of_its_own(tmp_path):
    path = tmp_path / ".recserve-follow-criteo.json"
    assert ledger_path(path) == ledger_path(path, rank=0, world=1) == path
    assert [ledger_path(path, rank, world=2).name for rank in (0, 1)] == [
        ".recserve-follow-criteo-rank0.json",
        ".recserve-follow-criteo-rank1.json",
    ]
