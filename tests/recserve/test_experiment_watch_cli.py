"""``recserve experiment watch`` run as an operator runs it, against the session's mock broker: its
/metrics show every arm's figures equal to a recomputation from the samples topic (to 1e-9),
``recserve experiment status`` prints the latest look, SIGTERM ends it cleanly, and what it cannot
start on (a missing samples topic, a bad --rule file) or a watch flag given to another action is refused by name."""

from __future__ import annotations

import signal
import subprocess
import urllib.request
import uuid

import numpy as np
import pytest

from model_store import experiments as ex
from stream.arms import arm_metrics
from tests.helpers import ROOT, free_port, recserve_argv, wait_until
from tests.stream.helpers import produce
from tests.stream.watch.helpers import concat, experiment_store, impressions, inverted, mixed, noisy, truthful


def scrape(port: int) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in body.splitlines() if ln and ln[0] != "#"
    }


def test_watch_shows_every_arms_figures_on_metrics_and_in_status(kafka, tmp_path):
    exp = experiment_store(tmp_path)
    topic = kafka.create_topic(f"samples-cli-{uuid.uuid4().hex[:8]}", 2)
    rng = np.random.default_rng(2)
    ours = [
        impressions(a, 100, exp.started + 1, rng, s)
        for a, s in (("control", noisy), ("A", truthful), ("B", inverted))
    ]
    produce(kafka.bootstrap, topic, mixed(ours, rng))
    port, log = free_port(), tmp_path / "watch.log"
    rule = tmp_path / "rule.yaml"
    rule.write_text("min_samples: 1000\nmin_clicks: 100\n")  # a few hundred requests' samples: decided early
    line = (f"recserve experiment watch --brokers {kafka.bootstrap} --samples {topic} --store {tmp_path} --model m "
            f"--metrics-port {port} --every-s 0.2 --window-s 2 --rule {rule}")  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(recserve_argv(line), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        key = 'recserve_experiment_samples_total{arm="%s",experiment="t"}'

        def all_read() -> dict[str, float] | None:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                shown = scrape(port)
            except OSError:
                return None
            return shown if all(shown.get(key % a) == 400 for a in ("control", "A", "B")) else None

        shown = wait_until(all_read, 60, "every arm's 400 samples on /metrics")
        want = arm_metrics(concat(ours).samples(), 2.0)
        for arm, w in want.items():
            for window, m in (("all", w.cumulative), ("2s", w.window)):
                labels = f'{{arm="{arm}",experiment="t",window="{window}"}}'
                assert shown["recserve_experiment_logloss" + labels] == pytest.approx(
                    m.logloss.value, abs=1e-9
                )
                assert shown["recserve_experiment_auc_low" + labels] == pytest.approx(m.auc.low, abs=1e-9)
        assert shown['recserve_experiment_rule_verdict{arm="B",experiment="t",verdict="abort"}'] == 1
        assert shown["recserve_experiment_auto"] == 0

        status = subprocess.run(recserve_argv(f"recserve experiment status --store {tmp_path} --model m"),
                                cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
        assert status.returncode == 0, status.stderr
        assert "figures at" in status.stdout and "verdicts not acted on (no --auto)" in status.stdout
        assert "  rule: B abort: calibration" in status.stdout
        assert f"  control       400 {want['control'].cumulative.clicks:>7}" in status.stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()[-3000:]
    assert "arm B: abort (not acted on: --auto is off)" in log.read_text()
    assert ex.read_experiment(tmp_path, "m").decisions == []


def test_watch_refuses_a_missing_topic_and_other_actions_refuse_its_flags(kafka, tmp_path):
    experiment_store(tmp_path)
    argv = recserve_argv(f"recserve experiment watch --brokers {kafka.bootstrap} --samples no-such-topic "
                         f"--store {tmp_path} --model m")  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "topic 'no-such-topic' does not exist" in done.stderr, done.stderr
    rule = tmp_path / "rule.yaml"
    rule.write_text("metric: auc\n")
    argv = recserve_argv(
        f"recserve experiment watch --brokers {kafka.bootstrap} --rule {rule} --store {tmp_path} --model m"
    )
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "unknown metric 'auc'" in done.stderr, done.stderr
    argv = recserve_argv(f"recserve experiment status --auto --store {tmp_path} --model m")
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "are for `watch`" in done.stderr, done.stderr
