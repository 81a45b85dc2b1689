"""serving/versions.py: the one target-and-refusals object the PS follower, the controller and
the lean frontend share."""

from prometheus_client import CollectorRegistry

from model_store.layout import set_current
from serving.versions import VersionTarget


def _refusals(registry: CollectorRegistry, kind: str) -> float | None:
    return registry.get_sample_value("recserve_version_refusals_total", {"component": "ps", "kind": kind})


def test_the_target_is_the_pin_or_what_current_names(tmp_path):
    follows = VersionTarget(tmp_path, "m", "ps")
    pinned = VersionTarget(tmp_path, "m", "ps", pin="3")
    assert follows.target() is None and pinned.target() == "3"
    (tmp_path / "m").mkdir()
    set_current(tmp_path, "m", "5")
    assert follows.target() == "5" and pinned.target() == "3"
    assert follows.wanted("5", "4") and not follows.wanted("5", "5") and not follows.wanted(None, "4")


def test_a_refusal_is_final_logged_and_counted_once(tmp_path, caplog):
    registry = CollectorRegistry()
    versions = VersionTarget(tmp_path, "m", "ps", registry=registry)
    assert _refusals(registry, "version") == 0 and _refusals(registry, "delta") == 0
    for _ in range(3):
        versions.refuse("5", "its schema differs")
        versions.refuse("4", "delta 2 is corrupt", seq=2)
    assert _refusals(registry, "version") == 1 and _refusals(registry, "delta") == 1
    assert [r.getMessage() for r in caplog.records] == ["ps: its schema differs", "ps: delta 2 is corrupt"]
    assert not versions.wanted("5", "4") and versions.is_refused("4", 2) and not versions.is_refused("4")
    assert versions.refusal("5", "4") == "its schema differs" and versions.refusal("5", "5") == ""


def test_why_nothing_is_served_is_worded_one_way(tmp_path):
    versions = VersionTarget(tmp_path, "m", "scorer")
    assert versions.not_serving(None) == f"no version published yet for model m in {tmp_path}"
    assert versions.not_serving("5") == "version 5 of model m not loaded yet"
    assert (
        versions.not_serving("5", "version 5 not loaded: shard 0 down")
        == "version 5 not loaded: shard 0 down"
    )
    versions.refuse("5", "version 5 refused: corrupt")
    assert versions.not_serving("5", "a failure") == "version 5 refused: corrupt"
