import os
import time
from pathlib import Path

import model_store as ms
from loadtest.processes import wait_for
from loadtest.series import Series, disk_bytes
from model_store.layout import set_current


def test_the_series_samples_each_process_by_name_the_stores_disk_and_current(tmp_path):
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "blob").write_bytes(b"x" * 100_000)
    set_current(tmp_path, "m", "1")
    series = Series(lambda: {"me": [os.getpid()], "gone": [2**22 + 7]}, model_dir, 0.01)
    series.start()
    try:
        wait_for(lambda: len(series.samples) >= 2, 30, "two samples")
        t_busy, busy_until = time.time(), time.process_time() + 0.2
        while time.process_time() < busy_until:  # this process uses 0.2 s of CPU between samples
            pass
        set_current(tmp_path, "m", "2")
        wait_for(lambda: series.samples[-1].current == "2", 30, "CURRENT 2 sampled")
    finally:
        series.halt()
    first = series.samples[0]
    cpu = series.cpu_pct(first.t, time.time() + 1)
    assert cpu["gone"] == 0 and cpu["me"] > 0 and first.cpu["me"] <= series.samples[-1].cpu["me"] - 0.15
    assert series.cpu_pct(t_busy + 60, t_busy + 61) == {}  # no samples there
    assert first.rss["me"] > 0 and first.rss["gone"] == 0  # a process that is not there uses nothing
    assert 100_000 <= first.disk <= disk_bytes(model_dir)  # CURRENT's file came on top
    assert first.current == "1"
    floors = series.floors()
    assert [v for v, _ in floors] == ["1", "2"] and floors[0][1] == min(x.disk for x in series.samples[:-1]
                                                                         if x.current == "1")  # fmt: skip


def test_a_floor_counts_only_once_retention_is_done(tmp_path):
    from loadtest.series import Sample

    series = Series(lambda: {}, tmp_path, 1.0)
    for t, (disk, current, retained) in enumerate([(50, "1", True), (90, "2", False), (70, "2", True),
                                                   (80, "2", True), (120, "3", False), (110, "3", False)]):  # fmt: skip
        series.samples.append(Sample(float(t), {}, {}, disk, current, retained))
    assert series.floors() == [("1", 50), ("2", 70), ("3", None)]  # 3's retention never finished


def test_the_series_samples_whether_retention_is_done(tmp_path):
    """Done once no version is left that retention would delete, however many it keeps (here the
    one published before CURRENT beside the newest two: three of keep=2)."""
    from model_store.releases import publish
    from model_store.retention import retain
    from tests.model_store.helpers import write_version

    vs = [write_version(tmp_path) for _ in range(4)]
    publish(tmp_path, "m", vs[0])
    publish(tmp_path, "m", vs[3])
    series = Series(lambda: {}, tmp_path / "m", 0.01, keep=2)
    series.start()
    try:
        wait_for(lambda: series.samples and not series.samples[-1].retained, 30, "a sample with work left")
        retain(tmp_path, "m", keep=2)
        wait_for(lambda: series.samples[-1].retained, 30, "a sample after retention")
    finally:
        series.halt()


def test_a_name_whose_pid_changed_counts_the_new_pid_from_its_use_at_the_sample_before():
    from loadtest.series import Sample

    series = Series(lambda: {}, Path("."), 1.0)
    # the standby (pid 2, 30 s of CPU used standing by) takes over from the trainer (pid 1) at t=1;
    # a new standby (pid 3) starts
    series.samples += [
        Sample(0.0, {}, {"trainer": 50.0, "standby": 30.0}, 0, "1", True, {"trainer": (1,), "standby": (2,)},
               {1: 50.0, 2: 30.0}),
        Sample(1.0, {}, {"trainer": 30.5, "standby": 2.0}, 0, "1", True, {"trainer": (2,), "standby": (3,)},
               {2: 30.5, 3: 2.0}),
    ]  # fmt: skip
    assert series.cpu_pct(0.0, 2.0) == {"trainer": 50.0, "standby": 200.0}  # 0.5 s, 2 s: not 30.5 s


def test_disk_bytes_counts_a_complete_delta_once_and_then_from_what_it_counted(tmp_path):
    vdir = ms.version_dir(tmp_path, "m", "1")
    (vdir / "embeddings").mkdir(parents=True)
    (vdir / "embeddings" / "rows.npy").write_bytes(b"x" * 50_000)
    done, open_ = ms.delta_dir(vdir, 0), ms.delta_dir(vdir, 1)
    for d in (done, open_):
        (d / "shard-0-of-1").mkdir(parents=True)
        (d / "shard-0-of-1" / "rows.npy").write_bytes(b"x" * 20_000)
    (done / ms.SUCCESS).touch()
    sealed: dict = {}
    total = disk_bytes(tmp_path / "m", sealed)
    assert total == disk_bytes(tmp_path / "m") and list(sealed) == [(str(done), done.stat().st_ino)]
    (open_ / "shard-0-of-1" / "more.npy").write_bytes(b"x" * 20_000)  # a delta being written: looked at
    grown = disk_bytes(tmp_path / "m", sealed)
    assert grown == disk_bytes(tmp_path / "m") > total
    (done / "shard-0-of-1" / "rows.npy").write_bytes(b"x" * 90_000)  # (never done to a complete delta)
    assert disk_bytes(tmp_path / "m", sealed) == grown < disk_bytes(tmp_path / "m")  # counted from before
