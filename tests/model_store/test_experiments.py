"""The experiment record (``model_store.experiments``): its round trip, every refusal by name, a bad
record never replacing a good one, the changes and their history, and the assignment of units."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, replace

import numpy as np
import pytest
import xxhash

import model_store as ms
from model_store import experiments as ex
from model_store.experiments import CONTROL, Arm, Experiment, ExperimentError
from tests.helpers import ROOT
from tests.model_store.helpers import write_version


@pytest.fixture
def store(tmp_path):
    """Model m with version 1 published and versions 2, 3 beside it (same schema)."""
    versions = [write_version(tmp_path) for _ in range(3)]
    ms.publish(tmp_path, "m", versions[0])
    return tmp_path


def record(*arms: Arm, **fields) -> Experiment:
    return Experiment("e", "salt", list(arms), **fields)


GOOD = record(
    Arm(CONTROL, "1", 0.8), Arm("A", "2", 0.1), Arm("B", "3", 0.1, offset=0.1), Arm("S", "2", 0.0, True)
)


def test_the_record_round_trips_and_names_its_format(store):
    assert ex.read_experiment(store, "m") is None
    assert ex.write_experiment(store, "m", GOOD) == GOOD
    assert ex.read_experiment(store, "m") == GOOD
    raw = json.loads((ms.model_dir(store, "m") / ex.NAME).read_text())
    assert raw["format"] == ex.FORMAT and raw["arms"][1] == {"name": "A", "version": "2", "share": 0.1,
                                                             "shadow": False, "offset": 0.0}  # fmt: skip


BAD = [
    (replace(GOOD, arms=[Arm(CONTROL, "1", 0.8), Arm("A", "2", 0.1)]), "add up to 0.9"),
    (replace(GOOD, arms=[Arm(CONTROL, "1", 1.1), Arm("A", "2", -0.1)]), "share 1.1 is outside"),
    (replace(GOOD, arms=[Arm(CONTROL, "1", 1.0), Arm("S", "2", 0.2, True)]), "shadow arm 'S' has share 0.2"),
    (replace(GOOD, arms=[Arm(CONTROL, "1", 0.8), Arm("A", "2", 0.1), Arm("A", "3", 0.1)]), r"named twice: \['A'\]"),
    (replace(GOOD, arms=[Arm("A", "1", 0.9), Arm("B", "2", 0.1)]), "no 'control' arm"),
    (replace(GOOD, arms=[Arm(CONTROL, "1", 0.8), Arm("A", "2", 0.1), Arm("B", "3", 0.1, offset=0.05)]),
     "arm 'B' offset 0.05: its slice overlaps"),
    (replace(GOOD, state="paused"), "state 'paused'"),
    (replace(GOOD, salt=""), "salt '' must not be empty"),
    (replace(GOOD, arms=[Arm(CONTROL, "1", 0.9), Arm("A", "9", 0.1)]), "arm 'A' version '9' cannot be served.*does not exist"),
]  # fmt: skip


@pytest.mark.parametrize("bad,why", BAD, ids=[why.split(" ")[0] + str(i) for i, (_, why) in enumerate(BAD)])
def test_a_bad_record_is_refused_by_name_and_never_replaces_the_good_one(store, bad, why):
    ex.write_experiment(store, "m", GOOD)
    before = (ms.model_dir(store, "m") / ex.NAME).read_bytes()
    with pytest.raises(ExperimentError, match=why):
        ex.write_experiment(store, "m", bad)
    assert (ms.model_dir(store, "m") / ex.NAME).read_bytes() == before
    (ms.model_dir(store, "m") / ex.NAME).write_text(json.dumps(asdict(bad)))  # written by someone else
    with pytest.raises(ExperimentError, match=why):
        ex.read_experiment(store, "m")


def test_an_arm_the_store_cannot_serve_beside_control_is_refused_naming_it(store):
    incomplete = write_version(store, complete=False)
    other = write_version(store, fingerprint="another schema")
    for version, why in ((incomplete, "_SUCCESS"), (other, "feature schema")):
        bad = record(Arm(CONTROL, "1", 0.9), Arm("A", version, 0.1))
        with pytest.raises(ExperimentError, match=f"arm 'A' version '{version}' .*beside control.*{why}"):
            ex.write_experiment(store, "m", bad)
    assert ex.read_experiment(store, "m") is None
    # an ended experiment's versions may go (retention): it still reads
    ended = record(Arm(CONTROL, "1", 0.9), Arm("A", "99", 0.1), state=ex.STOPPED, ended=1.0)
    assert ex.read_experiment(store, "m") is None and ex.write_experiment(store, "m", ended) == ended


@pytest.mark.parametrize(
    "text,why",
    [
        ("{not json", "not an experiment record"),
        (b"\xff\xfe", "not an experiment record"),
        ('{"format": "recserve-experiment/0"}', "format 'recserve-experiment/0'"),
        (json.dumps({**asdict(GOOD), "extra": 1}), r"unknown field\(s\) \['extra'\]"),
        (json.dumps({**asdict(GOOD), "arms": [{"name": "control", "version": "1"}]}), "no 'share' field"),
        (json.dumps({**asdict(GOOD), "arms": "control"}), "'arms' is 'control'"),
    ],
)
def test_a_malformed_file_gives_the_typed_error(store, text, why):
    path = ms.model_dir(store, "m") / ex.NAME
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ExperimentError, match=why) as e:
        ex.read_experiment(store, "m")
    assert isinstance(e.value, ms.ModelStoreError) and str(path) in str(e.value)
    with pytest.raises(ExperimentError, match="cannot stop until it reads"):
        ex.stop(store, "m")
    assert path.read_bytes() == (text if isinstance(text, bytes) else text.encode())


def test_start_lays_control_out_as_current_with_the_share_left(store):
    exp = ex.start(store, "m", "fresh", [("2", 0.1), ("3", 0.2)], shadows=["2"], unit_key="user_id")
    assert [(a.name, a.version, a.share, a.shadow, a.offset) for a in exp.arms] == [
        (CONTROL, "1", pytest.approx(0.7), False, 0.0),
        ("A", "2", 0.1, False, 0.0),
        ("B", "3", 0.2, False, 0.1),
        ("C", "2", 0.0, True, 0.0),
    ]
    assert exp.salt.startswith("fresh/") and exp.unit_key == "user_id" and exp.running
    assert ex.read_experiment(store, "m") == exp
    assert [(e.event, e.by, e.record) for e in ex.read_log(store, "m")] == [("started", "operator", exp)]


@pytest.mark.parametrize(
    "candidates,why",
    [
        ([("2", 0.6), ("3", 0.5)], r"shares add up to 110.0%, over 100%"),
        ([("2", 0.0)], "share 0.0 is not in"),
        ([("9", 0.1)], "arm 'A' version '9' .*does not exist"),
        ([], "no candidate or shadow arm"),
    ],
)
def test_start_refuses_by_name_and_writes_nothing(store, candidates, why):
    with pytest.raises(ExperimentError, match=why):
        ex.start(store, "m", "x", candidates)
    assert ex.read_experiment(store, "m") is None and ex.read_log(store, "m") == []


def test_start_refuses_a_second_running_experiment_and_an_empty_store(store, tmp_path_factory):
    ex.start(store, "m", "one", [("2", 0.1)])
    with pytest.raises(ExperimentError, match="experiment 'one' is running for m: stop it first"):
        ex.start(store, "m", "two", [("3", 0.1)])
    ex.stop(store, "m")
    assert ex.start(store, "m", "two", [("3", 0.1)]).name == "two"
    empty = tmp_path_factory.mktemp("empty")
    write_version(empty)
    with pytest.raises(ExperimentError, match="nothing is published"):
        ex.start(empty, "m", "x", [("1", 0.1)])


def test_promote_publishes_through_the_gate_records_the_decision_and_ends(store):
    ex.start(store, "m", "e", [("2", 0.1), ("3", 0.1)])
    with pytest.raises(ExperimentError, match="cannot promote 'control'"):
        ex.promote(store, "m", CONTROL)
    with pytest.raises(ExperimentError, match="no arm 'Z'"):
        ex.promote(store, "m", "Z")
    exp = ex.promote(store, "m", "B", evidence={"note": "looks good"})
    assert ms.current(store, "m") == "3" and ms.history(store, "m") == ["1", "3"]
    assert exp.state == ex.PROMOTED and exp.ended is not None
    [d] = exp.decisions
    assert (d.arm, d.version, d.decision, d.by, d.evidence) == (
        "B",
        "3",
        "promoted",
        "operator",
        {"note": "looks good"},
    )
    assert ex.read_experiment(store, "m") == exp
    assert [e.event for e in ex.read_log(store, "m")] == ["started", "promoted"]
    with pytest.raises(ExperimentError, match="no experiment is running .*'e' is promoted"):
        ex.abort(store, "m", "A")


def test_a_promotion_the_gate_refuses_records_nothing(store):
    ex.start(store, "m", "e", [("2", 0.1)])
    (ms.version_dir(store, "m", "2") / "payload.bin").write_bytes(b"y" * 100)  # corrupt since the start
    with pytest.raises(ms.CorruptVersion, match="checksum"):
        ex.promote(store, "m", "A")
    assert ms.current(store, "m") == "1" and ex.read_experiment(store, "m").running
    assert [e.event for e in ex.read_log(store, "m")] == ["started"]


def test_abort_hands_the_arms_units_to_control_and_moves_no_other_unit(store):
    exp = ex.start(store, "m", "e", [("2", 0.1), ("3", 0.1)], shadows=["3"])
    keys = np.array([f"u{i}" for i in range(20_000)])
    before = np.array(exp.names())[ex.assign(keys, exp)]
    after_a = ex.abort(store, "m", "A", by="rule", evidence={"p": 0.01})
    now = np.array(after_a.names())[ex.assign(keys, after_a)]
    assert after_a.names() == [CONTROL, "B", "C"] and after_a.arm(CONTROL).share == pytest.approx(0.9)
    assert (now[before == "B"] == "B").all() and (now[before == "A"] == CONTROL).all()
    assert (now[before == CONTROL] == CONTROL).all() and after_a.running
    assert ex.abort(store, "m", "C").running  # a shadow: no share moves, B still runs
    last = ex.abort(store, "m", "B")
    assert (
        last.state == ex.ABORTED
        and last.names() == [CONTROL]
        and last.arm(CONTROL).share == pytest.approx(1.0)
    )
    assert [(d.arm, d.decision, d.by) for d in last.decisions] == [
        ("A", "aborted", "rule"), ("C", "aborted", "operator"), ("B", "aborted", "operator")
    ]  # fmt: skip
    assert [e.event for e in ex.read_log(store, "m")] == ["started", "aborted", "aborted", "aborted"]
    assert ms.current(store, "m") == "1"


def test_stop_ends_it_and_an_ended_experiment_assigns_no_unit(store):
    ex.start(store, "m", "e", [("2", 0.5)])
    stopped = ex.stop(store, "m")
    assert stopped.state == ex.STOPPED and ex.read_experiment(store, "m") == stopped
    with pytest.raises(ExperimentError, match="'e' is stopped: it assigns no unit"):
        ex.assign(["u1"], stopped)
    with pytest.raises(ExperimentError, match="no experiment is running"):
        ex.stop(store, "m")
    assert [(e.event, e.record.state) for e in ex.read_log(store, "m")] == [
        ("started", "running"),
        ("stopped", "stopped"),
    ]


# ---- assignment ----------------------------------------------------------------------------------
SPLIT = record(
    Arm(CONTROL, "1", 0.7), Arm("A", "2", 0.1), Arm("B", "3", 0.2, offset=0.1), Arm("S", "2", 0.0, True)
)
KEYS = np.array([f"user-{i}" for i in range(100_000)])


def test_the_split_follows_the_shares_and_never_assigns_a_shadow():
    arms = ex.assign(KEYS, SPLIT)
    shares = np.bincount(arms, minlength=len(SPLIT.arms)) / len(KEYS)
    assert shares == pytest.approx([0.7, 0.1, 0.2, 0.0], abs=0.01)


def test_the_position_is_the_documented_formula():
    seed = ex.salt_seed("s")
    keys = ["", "user-1", "ünïcode ✓"]
    expected = [(xxhash.xxh64_intdigest(k.encode("utf-8"), seed) >> 11) * 2.0**-53 for k in keys]
    assert ex.unit_positions(keys, "s").tolist() == expected
    assert seed == int.from_bytes(bytes.fromhex("043a718774c572bd"), "little")  # sha256("s")[:8]


def test_a_unit_keeps_its_arm_in_another_process_and_a_new_salt_reshuffles():
    here = ex.assign(KEYS[:1000], SPLIT)
    code = (
        "import numpy as np, sys; from model_store import experiments as ex; "
        "from tests.model_store.test_experiments import KEYS, SPLIT; "
        "sys.stdout.write(','.join(map(str, ex.assign(KEYS[:1000], SPLIT))))"
    )
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}, check=True, timeout=120)  # fmt: skip
        assert out.stdout == ",".join(map(str, here))
    other = ex.assign(KEYS, replace(SPLIT, salt="another"))
    moved = (other != ex.assign(KEYS, SPLIT)).mean()
    assert moved == pytest.approx(1 - (0.7**2 + 0.1**2 + 0.2**2), abs=0.01)  # independent draws
