import numpy as np

import model_store as ms
from loadtest.bench_stream import sample_key
from loadtest.freshness import TrainedLog, event_to_served, first_served, percentiles_s
from loadtest.recorder import ITEM_SHIFT, Responses, request_id
from model_store.deltas import DeltaManifest, write_delta


def _key(n: int, item: int) -> bytes:
    return sample_key(request_id(1, n), item)


def _int(n: int, item: int) -> int:
    return item << ITEM_SHIFT | int(request_id(1, n))


def _delta(root, version: int, seq: int, samples: int, keys: list[bytes]) -> None:
    vdir = ms.version_dir(root, "m", version)
    (vdir / ms.SUCCESS).parent.mkdir(parents=True, exist_ok=True)
    (vdir / ms.SUCCESS).touch()
    d = ms.delta_dir(vdir, seq)
    d.mkdir(parents=True)
    arr = np.sort(np.array(keys))
    write_delta(
        d, DeltaManifest("kafka://b/samples", {"samples/0": 10 * seq}, samples), (arr, np.zeros(len(arr)))
    )
    (d / ms.SUCCESS).touch()


def _responses(rows: list[tuple[float, int, int]]) -> Responses:
    end, version, seq = (np.array(c) for c in zip(*rows, strict=True))
    n = len(rows)
    return Responses(
        end.astype(float),
        np.ones(n),
        np.where(version >= 0, 200, 503),
        version,
        seq,
        np.zeros(n, bool),
        np.arange(n),
    )


def test_the_log_finds_the_first_delta_of_each_key_across_versions_and_counts_a_retrained_key(tmp_path):
    # the trainer's keys file holds its whole dedupe window: a key stays in the deltas after its own
    _delta(tmp_path, 1, 1, 2, [_key(1, 0), _key(1, 1)])
    _delta(tmp_path, 1, 2, 1, [_key(1, 0), _key(1, 1), _key(2, 0)])
    log = TrainedLog(tmp_path / "m")
    log.harvest()
    _delta(tmp_path, 2, 1, 1, [_key(2, 0), _key(3, 5)])  # (1, *) left the window
    _delta(tmp_path, 2, 2, 1, [_key(2, 0), _key(3, 5), _key(1, 0)])  # (1, 0) trained again
    log.harvest()
    log.harvest()  # nothing new: nothing counted twice
    keys, first = log.trained()
    assert keys.tolist() == sorted([_int(1, 0), _int(1, 1), _int(2, 0), _int(3, 5)])
    assert dict(zip(keys.tolist(), first.tolist(), strict=True)) == {
        _int(1, 0): 0, _int(1, 1): 0, _int(2, 0): 1, _int(3, 5): 2}  # fmt: skip
    assert [(d.version, d.seq) for d in log.deltas] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert log.samples() - len(keys) == 1  # the retrained key: one duplicate
    assert log.offsets() == 20 and log.missed == 0


def test_a_delta_is_served_by_the_first_response_that_holds_it_or_a_later_version():
    log_deltas = [_d(1, 1), _d(1, 2), _d(2, 1)]
    r = _responses([(10.0, 1, 0), (11.0, -1, -1), (12.0, 1, 1), (13.0, 1, 0), (14.0, 2, -1), (15.0, 2, 1)])
    # a response of version 2 before any of its deltas holds every delta of version 1
    assert first_served(log_deltas, r).tolist() == [12.0, 14.0, 15.0]
    assert first_served(log_deltas, _responses([(1.0, 1, 0)])).tolist() == [np.inf] * 3


def _d(version: int, seq: int):
    from loadtest.freshness import Delta

    return Delta(version, seq, 1, 0, 0.0)


def test_event_to_served_runs_from_the_clicks_produce_time_and_is_nan_when_never_served(tmp_path):
    _delta(tmp_path, 1, 1, 1, [_key(1, 0)])
    _delta(tmp_path, 1, 2, 1, [_key(1, 0), _key(2, 3)])
    log = TrainedLog(tmp_path / "m")
    log.harvest()
    r = _responses([(5.0, 1, 1), (8.0, 1, 1)])
    out = event_to_served(np.array([_int(1, 0), _int(2, 3), _int(9, 9)]), np.array([4.0, 4.5, 4.0]), log, r)
    assert out[0] == 1.0 and np.isnan(out[1:]).all()  # (2, 3)'s delta was never served; (9, 9) never trained
    assert percentiles_s(out) == {"p50": 1.0, "p99": 1.0}
    assert percentiles_s(out[1:]) == {"p50": None, "p99": None}
