import pytest

import model_store as ms
from model_store import ModelStoreError
from model_store.releases import history, list_versions, publish, retain, rollback, validate


def _version(root, fingerprint="fp", complete=True) -> str:
    v = ms.next_version(root, "m")
    staging = ms.staging_dir(root, "m", v)
    (staging / "payload.bin").write_bytes(b"x" * 100)
    ms.write_manifest(staging, {"model": "m", "version": v, "schema_fingerprint": fingerprint})
    if complete:
        ms.seal(staging, ms.version_dir(root, "m", v))
    else:
        staging.rename(ms.version_dir(root, "m", v))
    return v


def test_publish_validates_and_records_history(tmp_path):
    v1, v2 = _version(tmp_path), _version(tmp_path)
    publish(tmp_path, "m", v1)
    publish(tmp_path, "m", v2)
    assert ms.current(tmp_path, "m") == v2 and history(tmp_path, "m") == [v1, v2]
    assert [(i.version, i.status, i.current) for i in list_versions(tmp_path, "m")] == [
        (v1, "ok", False),
        (v2, "ok", True),
    ]


def test_incomplete_corrupt_and_foreign_schema_versions_are_refused(tmp_path):
    good = _version(tmp_path)
    publish(tmp_path, "m", good)
    incomplete = _version(tmp_path, complete=False)
    with pytest.raises(ModelStoreError, match="_SUCCESS"):
        publish(tmp_path, "m", incomplete)
    corrupt = _version(tmp_path)
    (ms.version_dir(tmp_path, "m", corrupt) / "payload.bin").write_bytes(b"y" * 100)
    with pytest.raises(ModelStoreError, match="checksum"):
        publish(tmp_path, "m", corrupt)
    other = _version(tmp_path, fingerprint="other")
    with pytest.raises(ModelStoreError, match="schema"):
        validate(tmp_path, "m", other, schema_fingerprint="fp")
    assert ms.current(tmp_path, "m") == good
    assert {i.version: i.status for i in list_versions(tmp_path, "m")}[incomplete] == "incomplete"
    assert {i.version: i.status for i in list_versions(tmp_path, "m")}[corrupt] == "corrupt"


def test_rollback_goes_back_one_publish_at_a_time(tmp_path):
    v1, v2, v3 = _version(tmp_path), _version(tmp_path), _version(tmp_path)
    for v in (v1, v2, v3):
        publish(tmp_path, "m", v)
    assert rollback(tmp_path, "m") == v2
    assert rollback(tmp_path, "m") == v1
    with pytest.raises(ModelStoreError, match="no earlier"):
        rollback(tmp_path, "m")
    assert ms.current(tmp_path, "m") == v1


def test_retain_keeps_newest_current_and_rollback_target(tmp_path):
    vs = [_version(tmp_path) for _ in range(6)]
    publish(tmp_path, "m", vs[1])
    publish(tmp_path, "m", vs[2])
    removed = retain(tmp_path, "m", keep=2)
    left = ms.versions(tmp_path, "m")
    assert set(left) == {vs[1], vs[2], vs[4], vs[5]} and set(removed) == {vs[0], vs[3]}
    with pytest.raises(ValueError):
        retain(tmp_path, "m", keep=0)
