import dataclasses

import numpy as np
import pytest

from stream.arms import ArmMetrics, ArmsAccumulator, ArmSums, Estimate, Samples, arm_metrics, auc, one_arm


def joined(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """n joined samples over three arms: requests of 1-4 items, event time rising over ~100 s."""
    rng = np.random.default_rng(seed)
    request = np.char.add("r", np.cumsum(rng.random(n) < 0.4).astype(np.str_))
    score = rng.beta(2, 8, n)
    return {
        "arm": rng.choice(np.array(["control", "A", "B"]), n),
        "score": score,
        "label": (rng.random(n) < score).astype(np.float64),
        "ts": np.sort(rng.uniform(0, 100, n)),
        "request": request,
    }


def figures(m: ArmMetrics) -> list[float]:
    out: list[float] = []
    for v in dataclasses.astuple(m):
        out.extend(v if isinstance(v, tuple) else (v,))
    return out


def assert_close(a: ArmMetrics, b: ArmMetrics) -> None:
    np.testing.assert_allclose(figures(a), figures(b), rtol=0, atol=1e-9, equal_nan=True)


def test_chunked_metrics_equal_the_one_shot_recomputation_to_1e_9():
    data = joined(20_000)
    acc = ArmsAccumulator(window_s=30.0)
    bounds = [0, 1, 999, 5000, 5001, 12_345, 20_000]  # uneven chunks, one of a single sample
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        acc.update(**{k: v[lo:hi] for k, v in data.items()})
    whole = arm_metrics(Samples.of(**data), window_s=30.0)
    got = acc.report()
    assert sorted(got) == sorted(whole) == ["A", "B", "control"]
    for arm in whole:
        assert_close(got[arm].cumulative, whole[arm].cumulative)
        assert_close(got[arm].window, whole[arm].window)
        # the running sums the rule reads agree with the arm's samples summed at once
        mine = data["arm"] == arm
        once = ArmSums.of(data["score"][mine], data["label"][mine])
        np.testing.assert_allclose(dataclasses.astuple(acc.sums[arm]), dataclasses.astuple(once), atol=1e-9)


def test_metrics_are_the_plain_formulas():
    data = joined(5000, seed=1)
    report = arm_metrics(Samples.of(**data), window_s=1e9)["A"].cumulative
    mine = data["arm"] == "A"
    s, y = data["score"][mine], data["label"][mine]
    loss = -(y * np.log(s) + (1 - y) * np.log(1 - s))
    assert report.samples == mine.sum() and report.clicks == y.sum()
    assert report.impressions == len(np.unique(data["request"][mine]))
    assert report.ctr.value == pytest.approx(y.mean(), abs=1e-12)
    assert report.mean_predicted.value == pytest.approx(s.mean(), abs=1e-12)
    assert report.calibration.value == pytest.approx(s.mean() / y.mean(), abs=1e-12)
    assert report.logloss.value == pytest.approx(loss.mean(), abs=1e-12)
    half = 1.959964 * loss.std(ddof=1) / np.sqrt(len(loss))
    assert (report.logloss.low, report.logloss.high) == pytest.approx(
        (loss.mean() - half, loss.mean() + half)
    )
    for est in (report.ctr, report.mean_predicted, report.calibration, report.logloss, report.auc):
        assert est.low < est.value < est.high


def test_the_window_holds_the_last_window_s_seconds_of_event_time():
    data = joined(3000, seed=2)
    reports = arm_metrics(Samples.of(**data), window_s=10.0)
    recent = (data["ts"] >= data["ts"].max() - 10.0) & (data["arm"] == "B")
    expect = one_arm(data["score"][recent], data["label"][recent], None)
    assert reports["B"].window.samples == recent.sum() < reports["B"].cumulative.samples
    assert_close(dataclasses.replace(reports["B"].window, impressions=expect.impressions), expect)


def test_without_request_ids_each_sample_is_an_impression_and_integer_arms_work():
    m = arm_metrics(Samples.of([0, 0, 1], [0.1, 0.2, 0.3], [0, 1, 0]), window_s=60.0)
    assert m[0].cumulative.impressions == 2 and m[1].cumulative.impressions == 1
    assert np.isnan(m[1].cumulative.auc.value) and np.isnan(m[1].cumulative.calibration.value)
    assert m[0].cumulative.auc == Estimate(1.0, 1.0, 1.0)  # the one click outranks the one non-click


def test_auc_matches_sklearn_with_ties():
    metrics = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(3)
    for _ in range(5):
        s = np.round(rng.random(2000), 2)  # many ties
        y = (rng.random(2000) < 0.2 + 0.5 * s).astype(np.float64)
        assert auc(s, y) == pytest.approx(metrics.roc_auc_score(y, s), abs=1e-12)


@pytest.mark.parametrize(
    "change, problem",
    [
        ({"score": [0.1, 0.2]}, "different lengths"),
        ({"score": [0.1, np.nan, 0.3]}, "NaN"),
        ({"score": [0.1, 1.5, 0.3]}, r"probabilities in \[0, 1\]"),
        ({"label": [0, 2, 1]}, "labels must be 0 or 1"),
        ({"ts": [0, np.inf, 1]}, "ts are not finite"),
    ],
)
def test_malformed_samples_are_refused_by_name(change, problem):
    good = {"arm": [0, 1, 0], "score": [0.1, 0.2, 0.3], "label": [0, 1, 1], "ts": [0, 1, 2]}
    with pytest.raises(ValueError, match=problem):
        Samples.of(**{**good, **change})
    acc = ArmsAccumulator()
    with pytest.raises(ValueError, match=problem):
        acc.update(**{**good, **change})
    assert acc.sums == {}  # nothing of a refused chunk is counted


def test_dropping_the_samples_after_a_time_leaves_the_figures_of_the_rest():
    data = joined(5_000, seed=3)
    acc = ArmsAccumulator(window_s=30.0)
    acc.update(**data)
    assert acc.drop_after(60.0) == int((data["ts"] > 60.0).sum()) > 0
    assert acc.drop_after(60.0) == 0  # nothing later is left
    early = data["ts"] <= 60.0
    whole = arm_metrics(Samples.of(**{k: v[early] for k, v in data.items()}), window_s=30.0)
    got = acc.report()
    for arm in whole:
        assert_close(got[arm].cumulative, whole[arm].cumulative)
        assert_close(got[arm].window, whole[arm].window)
        mine = early & (data["arm"] == arm)
        once = ArmSums.of(data["score"][mine], data["label"][mine])
        np.testing.assert_allclose(dataclasses.astuple(acc.sums[arm]), dataclasses.astuple(once), atol=1e-9)


def test_request_ids_must_come_with_every_chunk_or_none():
    acc = ArmsAccumulator()
    acc.update([0], [0.1], [0], [0.0], request=["r1"])
    with pytest.raises(ValueError, match="every chunk or with none"):
        acc.update([0], [0.1], [0], [1.0])
    with pytest.raises(ValueError, match="window_s must be positive"):
        ArmsAccumulator(window_s=0)
