"""``recserve experiment start | status | stop | promote | abort``, run as an operator runs it, over a
store with three versions of model m (version 1 published)."""

from __future__ import annotations

import json
import subprocess
from dataclasses import asdict

import pytest

import model_store as ms
from model_store import experiments as ex
from tests.helpers import ROOT, recserve_argv
from tests.model_store.helpers import write_version


@pytest.fixture
def store(tmp_path):
    for _ in range(3):
        write_version(tmp_path)
    ms.publish(tmp_path, "m", "1")
    return tmp_path


def recserve(store, line: str) -> subprocess.CompletedProcess[str]:
    argv = recserve_argv(f"recserve {line} --store {store} --model m")
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)


def ok(store, line: str) -> str:
    done = recserve(store, line)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_start_status_abort_and_promote(store):
    out = ok(store, "experiment start --name fresh --candidate 2 --share 0.1 --candidate 3 --share 0.1 "
                    "--shadow 3 --unit-key user_id")  # fmt: skip
    assert "m: experiment fresh running since" in out
    assert "control v1 80.0%, A v2 10.0%, B v3 10.0%, C v3 shadow (unit: user_id)" in out
    status = ok(store, "experiment status")
    assert "experiment fresh (m): running since" in status and "unit key user_id, salt fresh/" in status
    assert (
        "  control  version 1      share 80.0%\n" in status and "  C        version 3      shadow\n" in status
    )
    assert json.loads(ok(store, "experiment status --json")) == asdict(ex.read_experiment(store, "m"))
    assert "\nexperiment fresh running since" in ok(store, "versions")

    out = ok(store, "experiment abort B")
    assert "m: arm B (version 3) aborted, its units back to control" in out and "control v1 90.0%" in out
    out = ok(store, "experiment promote A")
    assert "m: arm A (version 2) promoted, CURRENT -> 2" in out
    assert ms.current(store, "m") == "2" and ms.history(store, "m") == ["1", "2"]
    status = ok(store, "experiment status")
    assert "experiment fresh (m): promoted since" in status
    assert "B (version 3) aborted by operator" in status and "A (version 2) promoted by operator" in status
    assert "experiment" not in ok(store, "versions")  # none runs
    assert [e.event for e in ex.read_log(store, "m")] == ["started", "aborted", "promoted"]


def test_aborting_the_last_candidate_ends_it_and_stop_ends_one_with_no_decision(store):
    ok(store, "experiment start --name one --candidate 2 --share 0.5")
    assert "experiment one aborted since" in ok(store, "experiment abort A")
    ok(store, "experiment start --name two --candidate 3 --share 0.2")
    assert "experiment two stopped since" in ok(store, "experiment stop")
    assert ms.current(store, "m") == "1"
    refused = recserve(store, "experiment stop")
    assert (
        refused.returncode == 1
        and "refused: m: no experiment is running ('two' is stopped)" in refused.stderr
    )


@pytest.mark.parametrize(
    "line,code,why",
    [
        ("experiment start --name x --candidate 9 --share 0.1", 1, "arm 'A' version '9' cannot be served"),
        ("experiment start --name x --candidate 2 --share 0.6 --candidate 3 --share 0.5", 1, "over 100%"),
        ("experiment start --name x --candidate 2", 2, "1 --candidate but 0 --share"),
        ("experiment start --candidate 2 --share 0.1", 2, "`start` needs --name"),
        ("experiment promote", 2, "`promote` takes an ARM"),
        ("experiment promote A", 1, "no experiment is running"),
    ],
)
def test_a_bad_start_or_change_is_refused_naming_the_problem(store, line, code, why):
    done = recserve(store, line)
    assert done.returncode == code and why in done.stderr, done.stderr
    assert ex.read_experiment(store, "m") is None


def test_a_second_start_an_unknown_arm_and_a_malformed_record_are_refused(store):
    ok(store, "experiment start --name one --candidate 2 --share 0.1")
    for line, why in (("experiment start --name two --candidate 3 --share 0.1", "'one' is running for m: stop it first"),
                      ("experiment abort Z", "experiment 'one' has no arm 'Z'"),
                      ("experiment promote control", "cannot promote 'control'")):  # fmt: skip
        done = recserve(store, line)
        assert done.returncode == 1 and why in done.stderr, done.stderr
    (ms.model_dir(store, "m") / ex.NAME).write_text('{"format": "recserve-experiment/1", "name": 1}')
    done = recserve(store, "experiment status")
    assert done.returncode == 1 and "refused:" in done.stderr and "'name' is 1" in done.stderr
    assert "experiment: unreadable (" in ok(store, "versions")
