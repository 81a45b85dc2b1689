import numpy as np

import model_store as ms
from loadtest.published import Published, code
from model_store.deltas import DeltaManifest, write_delta


def _delta(root, version: int, seq: int, samples: int, offset: int) -> None:
    vdir = ms.version_dir(root, "m", version)
    vdir.mkdir(parents=True, exist_ok=True)
    (vdir / ms.SUCCESS).touch()
    d = ms.delta_dir(vdir, seq)
    d.mkdir(parents=True)
    write_delta(d, DeltaManifest("kafka://b/samples", {"samples/0": offset}, samples))
    (d / ms.SUCCESS).touch()


def test_every_delta_of_every_version_is_read_once_in_publish_order(tmp_path):
    _delta(tmp_path, 1, 0, 5, 5)
    _delta(tmp_path, 1, 1, 3, 8)
    log = Published(tmp_path / "m")
    log.harvest()
    _delta(tmp_path, 2, 0, 4, 12)
    (ms.delta_dir(ms.version_dir(tmp_path, "m", 2), 1)).mkdir(parents=True)  # no _SUCCESS yet: not read
    log.harvest()
    log.harvest()
    assert [(d.version, d.seq, d.record.samples) for d in log.deltas] == [(1, 0, 5), (1, 1, 3), (2, 0, 4)]
    assert log.offsets() == 12 and log.missed == 0
    assert log.positions() == [12] + [0] * 15  # the samples topic's partitions, the newest delta's
    assert (np.diff(log.codes()) > 0).all()
    late = ms.delta_dir(ms.version_dir(tmp_path, "m", 2), 1)  # complete now: read at the next pass
    write_delta(late, DeltaManifest("kafka://b/samples", {"samples/0": 14}, 2))
    (late / ms.SUCCESS).touch()
    log.harvest()
    assert [(d.version, d.seq) for d in log.deltas][-2:] == [(2, 0), (2, 1)] and log.offsets() == 14
    assert ms.list_deltas(ms.version_dir(tmp_path, "m", 1), known={0}) == [1]  # what a pass looks at


def test_codes_order_a_versions_deltas_before_the_next_and_a_fresh_version_after_them():
    assert code(1, 7) < code(1, 8) < code(2, -1) < code(2, 0)
    assert code(np.array([3]), np.array([-1])).tolist() == [(3 << 32) - 1]
