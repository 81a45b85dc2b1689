import subprocess
import sys

import pytest

import model_store as ms
from model_store import IncompatibleVersion, ModelStoreError, SchemaMismatch
from model_store.releases import history, list_versions, publish, rollback, validate
from tests.helpers import ROOT
from tests.model_store.helpers import write_version


def test_publish_validates_and_records_history(tmp_path):
    v1, v2 = write_version(tmp_path), write_version(tmp_path)
    publish(tmp_path, "m", v1)
    publish(tmp_path, "m", v2)
    assert ms.current(tmp_path, "m") == v2 and history(tmp_path, "m") == [v1, v2]
    assert [(i.version, i.status, i.current) for i in list_versions(tmp_path, "m")] == [
        (v1, "ok", False),
        (v2, "ok", True),
    ]


def test_incomplete_corrupt_and_foreign_schema_versions_are_refused(tmp_path):
    good = write_version(tmp_path)
    publish(tmp_path, "m", good)
    incomplete = write_version(tmp_path, complete=False)
    with pytest.raises(ModelStoreError, match="_SUCCESS"):
        publish(tmp_path, "m", incomplete)
    corrupt = write_version(tmp_path)
    (ms.version_dir(tmp_path, "m", corrupt) / "payload.bin").write_bytes(b"y" * 100)
    with pytest.raises(ModelStoreError, match="checksum"):
        publish(tmp_path, "m", corrupt)
    other = write_version(tmp_path, fingerprint="other")
    with pytest.raises(SchemaMismatch, match="schema"):
        publish(tmp_path, "m", other)
    assert ms.current(tmp_path, "m") == good
    assert {i.version: i.status for i in list_versions(tmp_path, "m")}[incomplete] == "incomplete"
    assert {i.version: i.status for i in list_versions(tmp_path, "m")}[corrupt] == "corrupt"


def test_manifests_of_xxh3_and_of_older_sha256_digests_both_verify_and_catch_corruption(tmp_path):
    import json

    for old in (False, True):
        v = write_version(tmp_path)
        vdir = ms.version_dir(tmp_path, "m", v)
        manifest = json.loads((vdir / ms.MANIFEST).read_text())
        assert manifest["files"]["payload.bin"].startswith("xxh3_128:")
        if old:  # as written before XXH3: plain sha256 hex
            manifest["files"] = {rel: ms.sha256_file(vdir / rel) for rel in manifest["files"]}
            (vdir / ms.MANIFEST).write_text(json.dumps(manifest))
        assert validate(tmp_path, "m", v).files == manifest["files"]
        (vdir / "payload.bin").write_bytes(b"y" + b"x" * 99)
        with pytest.raises(ModelStoreError, match="checksum mismatch for payload.bin"):
            validate(tmp_path, "m", v)


def test_the_gate_refuses_a_progressive_auc_drop_past_max_auc_drop_and_records_it(tmp_path):
    publish(tmp_path, "m", write_version(tmp_path))
    worse = write_version(tmp_path, stream=ms.StreamRecord("1", 500, auc=0.70, served_auc=0.72))
    with pytest.raises(
        ms.QualityDrop, match=r"0.70000 on the latest 500 samples is 0.02000 below version 1's"
    ):
        publish(tmp_path, "m", worse)
    assert ms.current(tmp_path, "m") == "1" and "--max-auc-drop" in ms.refusals(tmp_path, "m")[worse]
    assert {i.version: i.refused for i in list_versions(tmp_path, "m")} == {
        "1": "",
        worse: ms.refusals(tmp_path, "m")[worse],
    }
    # within the allowance, or with nothing to compare (one class in the window), it passes
    publish(tmp_path, "m", worse, max_auc_drop=0.021)
    level = write_version(tmp_path, stream=ms.StreamRecord(worse, 500, auc=None, served_auc=0.72))
    publish(tmp_path, "m", level)
    assert ms.current(tmp_path, "m") == level
    # a release decision: serving components (no allowance given) do not judge it again
    served = ms.current_manifest(tmp_path, "m")
    assert validate(tmp_path, "m", worse, served).stream is not None
    with pytest.raises(ms.QualityDrop):
        validate(tmp_path, "m", worse, served, max_auc_drop=0.01)


def test_rollback_goes_back_one_publish_at_a_time(tmp_path):
    v1, v2, v3 = write_version(tmp_path), write_version(tmp_path), write_version(tmp_path)
    for v in (v1, v2, v3):
        publish(tmp_path, "m", v)
    assert rollback(tmp_path, "m") == v2
    assert rollback(tmp_path, "m") == v1
    with pytest.raises(ModelStoreError, match="no earlier"):
        rollback(tmp_path, "m")
    assert ms.current(tmp_path, "m") == v1


@pytest.mark.parametrize(
    ("kw", "what"),
    [
        ({"fingerprint": "another-schema"}, "its feature schema is another-sche, the served version's is fp"),
        ({"dim": 16}, "its embedding dim is 16, the served version's is 8"),
        ({"num_dense": 0}, "its number of dense inputs is 0, the served version's is 13"),
    ],
)
def test_the_gate_refuses_what_serving_refuses_naming_both_sides(tmp_path, kw, what):
    v1 = write_version(tmp_path)
    publish(tmp_path, "m", v1)  # nothing published yet: its own validity is enough
    v2 = write_version(tmp_path, **kw)
    with pytest.raises(IncompatibleVersion) as e:
        publish(tmp_path, "m", v2)
    assert f"m version {v2} cannot replace the served version {v1}: {what}" in str(e.value)
    assert "--allow-schema-change" in str(e.value)
    assert ms.current(tmp_path, "m") == v1
    # the same function, given the served manifest, is what the serving components run
    served = ms.read_manifest(ms.version_dir(tmp_path, "m", v1))
    with pytest.raises(IncompatibleVersion, match=what):
        validate(tmp_path, "m", v2, served, verify=False)
    assert validate(tmp_path, "m", v2).version == v2  # on its own it is a valid version
    publish(tmp_path, "m", v2, allow_schema_change=True)  # a deliberate change: a new stack
    assert ms.current(tmp_path, "m") == v2


def test_rollback_across_a_schema_change_needs_it_allowed(tmp_path):
    v1, v2 = write_version(tmp_path), write_version(tmp_path, fingerprint="new")
    publish(tmp_path, "m", v1)
    publish(tmp_path, "m", v2, allow_schema_change=True)
    with pytest.raises(ModelStoreError, match="no earlier published version") as e:
        rollback(tmp_path, "m")
    assert "feature schema" in str(e.value) and ms.current(tmp_path, "m") == v2
    assert rollback(tmp_path, "m", allow_schema_change=True) == v1


def _recserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "recserve", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
def test_recserve_publish_refuses_another_schema_or_dim_and_allows_a_schema_change(tmp_path):
    v1 = write_version(tmp_path)
    other_schema, other_dim = (
        write_version(tmp_path, fingerprint="another-schema"),
        write_version(tmp_path, dim=16),
    )
    store = ["--store", str(tmp_path), "--model", "m"]
    assert _recserve("publish", *store, v1).returncode == 0
    for v, why in ((other_schema, "feature schema is another-sche"), (other_dim, "embedding dim is 16")):
        proc = _recserve("publish", *store, v)
        assert proc.returncode == 1 and proc.stderr.startswith("refused: "), proc.stderr
        assert f"version {v} cannot replace the served version {v1}: its {why}" in proc.stderr
        assert ms.current(tmp_path, "m") == v1
    proc = _recserve("publish", *store, "--allow-schema-change", other_schema)
    assert proc.returncode == 0 and f"CURRENT -> {other_schema}" in proc.stdout, proc.stderr
    assert "restart it" in proc.stderr and ms.current(tmp_path, "m") == other_schema
    assert history(tmp_path, "m") == [v1, other_schema]


def _quantized_version(root, auc: float) -> str:
    v = ms.next_version(root, "m")
    staging = ms.staging_dir(root, "m", v)
    q = ms.QuantRecord("int8", float32_auc=0.75, auc=auc, max_abs_score_diff=1e-4, rows=100)
    ms.write_manifest(staging, ms.VersionManifest("m", v, "fp", 8, num_shards=1, quantized=q))
    ms.seal(staging, ms.version_dir(root, "m", v))
    return v


def test_the_gate_refuses_a_quantized_version_that_loses_more_auc_than_allowed(tmp_path):
    from model_store import QuantizationLoss

    ok, lossy = _quantized_version(tmp_path, 0.7495), _quantized_version(tmp_path, 0.748)
    publish(tmp_path, "m", ok)
    with pytest.raises(QuantizationLoss, match=r"int8: its test AUC 0\.74800 is 0\.00200 below"):
        publish(tmp_path, "m", lossy)
    with pytest.raises(QuantizationLoss):
        validate(tmp_path, "m", lossy)  # what every serving component runs
    assert ms.current(tmp_path, "m") == ok
    publish(tmp_path, "m", lossy, max_quant_auc_drop=0.005)
    assert ms.current(tmp_path, "m") == lossy
    assert [i.quantized.auc for i in list_versions(tmp_path, "m")] == [0.7495, 0.748]
