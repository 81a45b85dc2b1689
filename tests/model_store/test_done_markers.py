"""The done marker: one writer (``layout.mark_done``) for a sealed version, a shard dump and a
delta, always the last file written; and the one table salt shared by dumps and the PS index."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import model_store as ms
from model_store import layout, shards
from model_store.meta import ShardMeta


def _shard(kind: str) -> shards.ShardData:
    signs = np.arange(1, 41, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    meta = ShardMeta(kind, 0, 1, {"dim": 4, "dtype": "float32", "optimizer": {"name": "sgd"}}, state=[])
    rows = np.ones((40, 4), np.float32)
    return shards.ShardData(meta, signs, rows, {}, np.zeros(40, np.uint32), np.zeros(40, np.uint32))


def _marked_last(d: Path) -> bool:
    marker = (d / ms.SUCCESS).stat().st_mtime_ns
    others = [p.stat().st_mtime_ns for p in d.rglob("*") if p.is_file() and p.name != ms.SUCCESS]
    return (d / ms.SUCCESS).read_bytes() == b"" and all(t <= marker for t in others)


@pytest.fixture
def marked(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The directories ``mark_done`` was called on, in order."""
    calls: list[Path] = []
    real = layout.write_atomic

    def spy(path: str | Path, data: bytes) -> None:
        if Path(path).name == ms.SUCCESS:
            calls.append(Path(path).parent)
        real(path, data)

    monkeypatch.setattr(layout, "write_atomic", spy)
    return calls


def test_a_shard_dump_a_delta_and_a_sealed_version_are_marked_done_last_by_mark_done(tmp_path, marked):
    staging = ms.staging_dir(tmp_path, "m", "1")
    full = shards.write_shard(staging / "embeddings", _shard("full"))
    ms.write_manifest(staging, ms.VersionManifest("m", "1", "fp", dim=4, num_shards=1))
    version = ms.seal(staging, ms.version_dir(tmp_path, "m", "1"))
    delta = shards.write_shard(ms.delta_dir(version, 1), _shard("delta"))
    ms.mark_done(ms.delta_dir(version, 1))

    # a shard dump is marked under its temporary name, before the rename
    assert [p.name.startswith(".shard-0-of-1.tmp-") for p in marked] == [True, False, True, False]
    assert marked[1::2] == [staging, ms.delta_dir(version, 1)]
    assert _marked_last(version / "embeddings" / full.name)
    assert _marked_last(version / "deltas/1" / delta.name)
    assert ms.versions(tmp_path, "m") == ["1"] and ms.list_deltas(version) == [1]
    assert len(shards.read_shard(version / "embeddings" / full.name).signs) == 40


def test_a_dump_without_its_marker_is_refused(tmp_path):
    d = shards.write_shard(tmp_path, _shard("full"))
    (d / ms.SUCCESS).unlink()
    with pytest.raises(ms.StoreError, match="no _SUCCESS marker"):
        shards.read_shard(d)


def test_dump_buckets_and_the_ps_index_hash_signs_with_the_one_salt():
    from serving.ps import index

    signs = np.array([0, 1, 2**63 + 5, 12345678901234, 2**64 - 1], np.uint64)
    assert [int(h) for h in shards.table_hash(signs)] == [int(index._hash(s)) for s in signs]
