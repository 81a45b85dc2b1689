"""Which version a continuous trainer moves to (training/follow/current.py): CURRENT when it names
another version that the gate lets replace the one followed, read once a poll; a refusal remembered;
under torchrun only rank 0 proposes, and only a version whose every file checks out."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

import model_store as ms
from tests.training.follow.helpers import NAME, retrained
from training.follow.current import CurrentWatch


@dataclass
class _Followed:
    """What the watch reads of the version followed (``training.follow.types.Loaded``)."""

    version: str
    manifest: ms.VersionManifest


def _watch(store, poll_s: float = 1.0, clock=lambda: 0.0) -> tuple[CurrentWatch, _Followed]:
    v1 = ms.current(store, NAME)
    assert v1 is not None
    return CurrentWatch(str(store), NAME, poll_s, clock), _Followed(
        v1, ms.read_manifest(ms.version_dir(store, NAME, v1))
    )


def test_current_is_read_once_a_poll():
    times = iter([0.0, 0.5, 1.0, 1.9, 2.0])
    watch = CurrentWatch("store", NAME, 1.0, lambda: next(times))
    assert [watch.due() for _ in range(5)] == [True, False, True, False, True]


def test_a_new_current_is_moved_to_and_the_one_followed_is_not(store):
    watch, followed = _watch(store)
    assert watch.first() == followed.version and watch.moved(followed) is None
    v2 = retrained(store, followed.version)
    ms.publish(store, NAME, v2)
    assert watch.moved(followed) == v2


def test_a_version_the_gate_refuses_is_refused_once(store, caplog):
    watch, followed = _watch(store)
    v2 = retrained(store, followed.version, dim=32)
    ms.layout.set_current(store, NAME, v2)  # forced past publish's gate
    assert watch.moved(followed) is None and watch.refused == {v2}
    assert watch.moved(followed) is None
    assert caplog.text.count(f"CURRENT moved to {v2}, which cannot be loaded") == 1


def test_nothing_published_is_an_error(tmp_path):
    with pytest.raises(ms.ModelStoreError, match="nothing published"):
        CurrentWatch(str(tmp_path), NAME, 1.0).first()


def test_rank_0_alone_proposes_once_a_poll_and_only_a_version_whose_files_check_out(store):
    now = [0.0]
    watch, followed = _watch(store, poll_s=1.0, clock=lambda: now[0])
    good = retrained(store, followed.version)
    ms.publish(store, NAME, good)
    assert watch.proposed(1, followed) is None  # another rank: never
    assert watch.proposed(0, None) is None  # nothing followed yet
    assert watch.proposed(0, followed) == good
    assert watch.proposed(0, followed) is None  # within the poll

    broken = retrained(store, good)
    shard = next((ms.version_dir(store, NAME, broken) / "embeddings").glob("shard-*/*.npy"))
    shard.write_bytes(shard.read_bytes()[:-8] + b"\xff" * 8)  # no longer the file its checksum names
    ms.layout.set_current(store, NAME, broken)
    assert watch.moved(followed) == broken  # one process verifies every file as it loads them
    now[0] += 1.0
    assert watch.proposed(0, followed) is None and watch.refused == {broken}
