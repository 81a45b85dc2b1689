"""Retention (model_store/retention.py): the newest K complete versions stay, and never the
served version, the one published before it, or a pinned one; deltas go with their version."""

from __future__ import annotations

import pytest

import model_store as ms
from model_store.releases import publish
from model_store.retention import doomed, pin, pins, protected, retain, unpin
from tests.model_store.helpers import write_version


def _with_delta(root, v: str) -> None:
    d = ms.delta_dir(ms.version_dir(root, "m", v), 0)
    d.mkdir(parents=True)
    (d / "rows.bin").write_bytes(b"r" * 10)
    ms.mark_done(d)


def test_retain_keeps_newest_current_and_rollback_target(tmp_path):
    vs = [write_version(tmp_path) for _ in range(6)]
    publish(tmp_path, "m", vs[1])
    publish(tmp_path, "m", vs[2])
    assert set(doomed(tmp_path, "m", keep=2)) == {vs[0], vs[3]}
    removed = retain(tmp_path, "m", keep=2)
    left = ms.versions(tmp_path, "m")
    assert set(left) == {vs[1], vs[2], vs[4], vs[5]} and set(removed) == {vs[0], vs[3]}
    assert doomed(tmp_path, "m", keep=2) == []  # done, with four versions left of keep=2
    with pytest.raises(ValueError):
        retain(tmp_path, "m", keep=0)
    with pytest.raises(ValueError):
        doomed(tmp_path, "m", keep=0)


def test_a_refused_version_among_the_newest_leaves_more_than_keep_and_nothing_doomed(tmp_path):
    """The streaming trainer's gate refused versions 2 and 3: the newest two (3, 4) and the one
    published before 4 (1) stay, and retention is done."""
    vs = [write_version(tmp_path) for _ in range(4)]
    publish(tmp_path, "m", vs[0])
    publish(tmp_path, "m", vs[3])
    assert doomed(tmp_path, "m", keep=2) == [vs[1]]
    assert retain(tmp_path, "m", keep=2) == [vs[1]]
    assert ms.versions(tmp_path, "m") == [vs[0], vs[2], vs[3]] and doomed(tmp_path, "m", keep=2) == []


def test_retention_never_deletes_a_served_or_pinned_version_and_takes_deltas_along(tmp_path):
    vs = [write_version(tmp_path) for _ in range(8)]
    for v in vs:
        _with_delta(tmp_path, v)
    publish(tmp_path, "m", vs[2])
    publish(tmp_path, "m", vs[3])  # served; vs[2] the one before it, a draining process may read it
    assert pin(tmp_path, "m", vs[0]) == [vs[0]] and pins(tmp_path, "m") == [vs[0]]
    assert protected(tmp_path, "m") == {vs[0], vs[2], vs[3]}
    removed = retain(tmp_path, "m", keep=1)
    assert ms.versions(tmp_path, "m") == [vs[0], vs[2], vs[3], vs[7]]
    assert set(removed) == {vs[1], vs[4], vs[5], vs[6]}
    assert not any(
        ms.model_dir(tmp_path, "m").glob(f"{vs[1]}/deltas/*")
    )  # the version dir is gone, deltas too
    for v in ms.versions(tmp_path, "m"):
        assert ms.list_deltas(ms.version_dir(tmp_path, "m", v)) == [0]
    # however long it runs: each new version published, retention after it, the store stays bounded
    for _ in range(5):
        v = write_version(tmp_path)
        publish(tmp_path, "m", v)
        retain(tmp_path, "m", keep=2)
        left = ms.versions(tmp_path, "m")  # the newest 2, the pin, the one published before v
        assert len(left) <= 4 and {vs[0], v, ms.history(tmp_path, "m")[-2]} <= set(left)
    # unpinned, it goes at the next retention
    assert unpin(tmp_path, "m", vs[0]) == []
    retain(tmp_path, "m", keep=2)
    assert vs[0] not in ms.versions(tmp_path, "m")


def test_pin_and_unpin_refuse_what_cannot_be_meant(tmp_path):
    v = write_version(tmp_path)
    incomplete = write_version(tmp_path, complete=False)
    with pytest.raises(ms.VersionNotFound, match="does not exist"):
        pin(tmp_path, "m", "9")
    with pytest.raises(ms.IncompleteVersion, match="only a complete version"):
        pin(tmp_path, "m", incomplete)
    with pytest.raises(ms.VersionNotFound, match=r"not pinned \(pinned: none\)"):
        unpin(tmp_path, "m", v)
    pin(tmp_path, "m", v)
    assert pin(tmp_path, "m", v) == [v]  # pinning twice: one pin
