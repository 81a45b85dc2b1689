"""docs/guards-and-experiments.md runs as printed: each command line, ``bash -c`` in a directory
holding the store ``artifacts/`` (model criteo: versions 1, CURRENT, 2 and 3), the venv first on
PATH and ``$BROKERS`` a mock Kafka cluster with the guide's default topics:

- the input guard: the joiner at its defaults trips when the clicks stop and clears when they come
  back, each in GUARDS.log with why; the metrics line and ``recserve versions`` show it; the replay
  moves quarantined samples to the samples topic;
- an experiment started as printed and decided by ``watch --auto`` on its arms' samples (B aborted
  by the calibration guardrail, A promoted on log loss, with the rule's evidence); then by hand:
  abort, promote, stop;
- the defaults, the metric names and the A/A figures the guide states are the code's and the
  bench's.

The lines that train (``recserve train --follow ...``) are parsed only: tests/test_docs.py names the
tests that cover what they do."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from dataclasses import fields

import numpy as np
import pytest

import model_store as ms
from loadtest import mockbroker
from model_store import experiments as ex
from model_store.guards import read_guards
from stream.guard import GuardConfig
from stream.records import decode_sample
from stream.sequential import SequentialConfig
from tests.helpers import ROOT, bash_block, doc_blocks, port_free, wait_until
from tests.model_store.helpers import write_version
from tests.stream.helpers import N_ITEMS, TopicReader, event, impression, produce
from tests.stream.watch.helpers import impressions, inverted, mixed, noisy, truthful
from training.follow.guard import OutputGuardConfig

DOC = "docs/guards-and-experiments.md"
JOIN_PORT, WATCH_PORT = 9481, 9482
TOPICS = ("impressions", "events", "samples", "impressions.dead", "events.dead", "samples.quarantine")
PARTS = 4


@pytest.fixture(scope="module")
def brokers():
    with mockbroker.running([mockbroker.TopicSpec(t, PARTS) for t in TOPICS]) as broker:
        yield broker


@pytest.fixture
def here(tmp_path):
    """The directory the lines run in: ``artifacts/criteo`` with versions 1 (CURRENT), 2 and 3."""
    for _ in range(3):
        write_version(tmp_path / "artifacts", model="criteo")
    ms.publish(tmp_path / "artifacts", "criteo", "1")
    return tmp_path


def run(line: str, cwd) -> str:
    """One documented line run to its end as printed; its output (exit 0 asserted)."""
    with bash_block([line], cwd, out="line.txt") as proc:
        code = proc.wait(timeout=120)
    out = (cwd / "line.txt").read_text()
    assert code == 0, f"{line}\n{out[-3000:]}"
    return out


def scrape(port: int) -> str:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return ""


def gauge(body: str, name: str) -> float | None:
    found = re.search(rf"^{name} (\S+)$", body, re.M)
    return float(found.group(1)) if found else None


def requests(prefix: str, n: int) -> tuple[list[tuple[str, bytes]], list[tuple[str, bytes]]]:
    """``n`` impressions of N_ITEMS items scored now, and one click on each (label rate 1/N_ITEMS)."""
    now = time.time()
    rids = [f"{prefix}{i}" for i in range(n)]
    return ([(r, impression(r, now)) for r in rids],
            [(r, event(r, i % N_ITEMS, now + 0.1)) for i, r in enumerate(rids)])  # fmt: skip


def recorded(here, what: str):
    """The input guard's last ``what`` (trip | clear) in artifacts/criteo/GUARDS.log, or None."""
    events = [e for e in read_guards(here / "artifacts" / "criteo")[0] if e.event == what]
    return events[-1] if events else None


@pytest.mark.slow
def test_the_input_guard_lines_run_as_printed(here, brokers, monkeypatch):
    join, metrics, versions = doc_blocks(DOC, "The input guard")[0]
    (replay,) = doc_blocks(DOC, "Quarantine and replay")[0]
    assert join.startswith("recserve join") and f"--metrics-port {JOIN_PORT}" in join
    assert "--guard" not in join  # every threshold at its default
    if not port_free(JOIN_PORT):
        pytest.skip(f"port {JOIN_PORT} (the guide's) is taken")
    monkeypatch.setenv("BROKERS", brokers.bootstrap)
    with bash_block([join], here, out="join.txt") as proc:

        def joining() -> bool:
            assert proc.poll() is None, (here / "join.txt").read_text()[-3000:]
            return 'recserve_join_event_lag_seconds{partition="0"}' in scrape(JOIN_PORT)

        wait_until(joining, 60, "the joiner holding its partitions")
        imps, clicks = requests("band-", 1500)  # 6,000 items, a click a request: the band's 0.25
        produce(brokers.bootstrap, "impressions", imps)
        produce(brokers.bootstrap, "events", clicks)
        wait_until(lambda: gauge(scrape(JOIN_PORT), "recserve_join_label_rate_band") == 0.25, 60,
                   "a band of every healthy item (label rate 0.25)")  # fmt: skip
        imps, withheld = requests("out-", 200)  # the clicks stop: 800 items, no event
        produce(brokers.bootstrap, "impressions", imps)
        trip = wait_until(lambda: recorded(here, "trip"), 30, "the trip in GUARDS.log")
        assert re.fullmatch(r"label rate 0\.0000 over the last 5s \(\d+ items\) is under 0\.25 x its band 0\.2500", trip.reason)  # fmt: skip
        imps, clicks = requests("back-", 200)  # the clicks come back, the withheld ones late
        produce(brokers.bootstrap, "events", withheld)
        produce(brokers.bootstrap, "impressions", imps)
        produce(brokers.bootstrap, "events", clicks)
        clear = wait_until(lambda: recorded(here, "clear"), 30, "the clear in GUARDS.log")
        assert re.fullmatch(r"label rate 0\.\d{4} over the last 5s is back at >= 0\.5 x its band 0\.2500 after \d+\.\ds", clear.reason)  # fmt: skip
        out = run(metrics, here)
        assert "recserve_join_guard_tripped 0.0" in out and "recserve_join_guard_recoveries_total 1.0" in out
        assert 'recserve_join_guard_trips_total{measure="label_rate"} 1.0' in out
        shown = run(versions, here)
        assert re.search(r"^guard  input  trip .*  label rate 0\.0000", shown, re.M), shown
        assert re.search(r"^guard  input  clear .*  label rate .* is back at >= 0\.5 x its band", shown, re.M)
        body = scrape(JOIN_PORT)
        named = set(re.findall(r"recserve_join_\w+", (ROOT / DOC).read_text()))
        assert named and not {n for n in named if n not in body}, "the guide names what /metrics lacks"
    rng = np.random.default_rng(3)
    judged = impressions("", 2, time.time(), rng, truthful, prefix="held-")  # 8 samples judged good
    produce(brokers.bootstrap, "samples.quarantine", judged.records)
    assert "replayed 8 quarantined samples from samples.quarantine to samples" in run(replay, here)
    reader = TopicReader(brokers.bootstrap, "samples", PARTS)
    try:
        want = {decode_sample(v).key for _, v in judged.records}
        wait_until(lambda: reader.poll() and want <= {decode_sample(v).key for _, v, _ in reader.records},
                   30, "the replayed samples on the samples topic")  # fmt: skip
    finally:
        reader.close()


@pytest.mark.slow
def test_an_experiment_the_rule_decides_runs_as_printed(here, brokers, monkeypatch):
    start, status, watch = doc_blocks(DOC, "Running an experiment")[0]
    assert f"--metrics-port {WATCH_PORT} --auto" in watch
    if not port_free(WATCH_PORT):
        pytest.skip(f"port {WATCH_PORT} (the guide's) is taken")
    monkeypatch.setenv("BROKERS", brokers.bootstrap)
    store = here / "artifacts"
    out = run(start, here)
    assert "criteo: experiment fresh running since" in out
    assert "control v1 80.0%, A v2 10.0%, B v3 10.0% (unit: C1)" in out
    exp = ex.read_experiment(store, "criteo")
    slices = [(a.name, a.version, a.share, a.offset) for a in exp.arms]
    assert slices == [("control", "1", 0.8, 0.0), ("A", "2", 0.1, 0.0), ("B", "3", 0.1, pytest.approx(0.1))]
    assert "unit key C1, salt fresh/" in run(status, here)
    rng = np.random.default_rng(5)  # 10,400 samples an arm (the rule's 10,000 and more)
    arms = [impressions(arm, 2600, exp.started + 1, rng, scorer, prefix="doc-")
            for arm, scorer in (("control", noisy), ("A", truthful), ("B", inverted))]  # fmt: skip
    produce(brokers.bootstrap, "samples", mixed(arms, rng))
    with bash_block([watch], here, out="watch.txt") as proc:

        def decided() -> ex.Experiment | None:
            assert proc.poll() is None, (here / "watch.txt").read_text()[-3000:]
            now = ex.read_experiment(store, "criteo")
            return None if now.running else now

        done = wait_until(decided, 120, "the rule's decisions")
        body = wait_until(lambda: scrape(WATCH_PORT), 10, "the watcher's /metrics")
        named = set(re.findall(r"recserve_experiment_\w+", (ROOT / DOC).read_text()))
        assert named and not {n for n in named if n not in body}, "the guide names what /metrics lacks"
    decisions = [(d.arm, d.decision, d.by) for d in done.decisions]
    assert decisions == [("B", "aborted", "rule"), ("A", "promoted", "rule")]
    b, a = done.decisions
    assert "calibration" in b.evidence["reasons"][0]  # inverted scores: the guardrail
    assert a.evidence["statistic"] >= a.evidence["threshold"] and a.evidence["difference"] < 0
    assert ms.current(store, "criteo") == "2"
    assert [(e.event, e.by) for e in ex.read_log(store, "criteo")] == [
        ("started", "operator"), ("aborted", "rule"), ("promoted", "rule")]  # fmt: skip
    shown = run(status, here)
    assert "experiment fresh (criteo): promoted since" in shown and "A (version 2) promoted by rule" in shown


def test_the_by_hand_lines_run_as_printed(here):
    start = doc_blocks(DOC, "Running an experiment")[0][0]
    abort, promote, stop = doc_blocks(DOC, "By hand")[0]
    store = here / "artifacts"
    run(start, here)
    out = run(abort, here)
    assert "criteo: arm B (version 3) aborted, its units back to control" in out and "control v1 90.0%" in out
    a = ex.read_experiment(store, "criteo").arm("A")
    assert (a.share, a.offset) == (0.1, 0.0)  # A's units did not move
    assert "criteo: arm A (version 2) promoted, CURRENT -> 2" in run(promote, here)
    assert ms.current(store, "criteo") == "2"
    ex.start(store, "criteo", "next", [("3", 0.2)])
    assert "criteo: experiment next stopped since" in run(stop, here)
    assert ms.current(store, "criteo") == "2"
    log = [(e.event, e.by) for e in ex.read_log(store, "criteo")]
    assert log == [(e, "operator") for e in ("started", "aborted", "promoted", "started", "stopped")]


def default(text: str, name: str) -> str:
    """The default the guide's table gives for a flag or field ``name`` (backticks dropped)."""
    found = re.search(rf"^\| `{re.escape(name)}`[^|]*\| ([^|]+?) \|", text, re.M)
    assert found, f"{DOC} has no table row for {name}"
    return found.group(1).strip("`")


def shown(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return "[" + ", ".join(f"{v:g}" for v in value) + "]"
    return value if isinstance(value, str) else f"{value:g}"


def test_the_documented_defaults_are_the_configs():
    text = (ROOT / DOC).read_text()
    for cls in (GuardConfig, OutputGuardConfig):
        for f in fields(cls):
            assert default(text, "--" + f.metadata["flag"]) == shown(f.default), f.name
    rule = SequentialConfig()
    for name in ("metric", "alpha", "tau", "min_samples", "calibration_band", "min_clicks"):
        assert default(text, name) == shown(getattr(rule, name)), name


def test_the_measured_figures_and_the_trainers_metric_names_are_the_benches_and_the_codes():
    text = " ".join((ROOT / DOC).read_text().split())
    bench = json.loads((ROOT / "loadtest/results/experiment.json").read_text())
    replays, rate = bench["aa_replays"], bench["aa_false_decision_rate"]
    assert f"{bench['aa']['samples']:,} samples" in text
    assert f"**{round(rate * replays)} false decisions in {replays} replays ({rate:.1%})**" in text
    by_unit = bench["aa_by_unit_key"]
    assert f"{round(by_unit['false_decision_rate'] * replays)} in {replays} with its {by_unit['unit_count']} users" in text  # fmt: skip
    aa = json.loads((ROOT / "loadtest/results/aa.json").read_text())
    false = aa["false_promotions"] + aa["false_aborts"]
    assert f"{false} in {aa['replays']} on {aa['samples']:,} Criteo" in text
    code = " ".join(p.read_text() for p in (ROOT / "training" / "follow").glob("*.py"))
    named = set(re.findall(r"recserve_follow_\w+", text))
    assert named and not {n for n in named if f'"{n.removesuffix("_total")}"' not in code}
