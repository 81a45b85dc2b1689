"""A version exported in int8 (``recserve train --serving-dtype int8``, as docs/serving.md prints
it): its manifest records the score error the export measured on the test split, ``recserve
versions`` shows it and ``recserve publish`` gates on it, offline scoring and every online path
(co-located, PS over gRPC) give the same scores, its deltas are int8 too, and every table of a
trained version quantizes within its rows' bound; the doc's sizing table is what the layout costs."""

from __future__ import annotations

import contextlib
import math
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import orjson
import pytest

import model_store as ms
from model_store import shards
from model_store.quant import dequantize, error_bound, quantize, served_bytes_per_row
from serving.scoring.client import requests_from_file
from serving.scoring.config import ScoringConfig
from serving.scoring.core import Scorer
from serving.scoring.loop import score
from tests.helpers import ROOT, doc_blocks, ps_in_thread, recserve_argv
from tests.serving.helpers import TEST

SCHEMA = "data/schemas/criteo.yaml"
HEADING = "Serving in float16 or int8"  # in docs/serving.md


def _run(line: str, root: Path) -> str:
    env = {**os.environ, "RECSERVE_STORE": str(root)}
    done = subprocess.run(recserve_argv(line), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{line}: {done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def int8_store(tmp_path_factory):
    """The store the doc's ``recserve train ... --serving-dtype int8`` line wrote version 1 into."""
    root = tmp_path_factory.mktemp("int8")
    ((train, *_),) = doc_blocks("docs/serving.md", HEADING)
    assert "--serving-dtype int8" in train
    _run(train, root)
    ms.publish(root, "criteo", "1")  # what the PS processes below follow (the doc's publish line: again)
    return root


@pytest.mark.slow
def test_the_documented_versions_and_publish_lines_run_as_printed(int8_store):
    ((_, versions, publish),) = doc_blocks("docs/serving.md", HEADING)
    q = ms.read_manifest(ms.version_dir(int8_store, "criteo", "1")).quantized
    assert q is not None
    assert f"int8: auc={q.auc:.4f} (float32 {q.float32_auc:.4f})" in _run(versions, int8_store)
    _run(publish, int8_store)
    assert ms.current(int8_store, "criteo") == "1"


def test_the_documented_sizing_table_is_what_the_layout_costs():
    text = (ROOT / "docs" / "serving.md").read_text()
    section = text[text.index(f"## {HEADING}") :]
    rows = re.findall(r"^\| (\d+) +\| (\w+) +\| (\d+) +\| ([\d.]+) +\| (\d+) +\| (\d+) +\|$", section, re.M)
    assert len(rows) == 9
    per_host = 31e9  # 64 GB, two versions during a switch, ~1 GB of processes
    for dim, dtype, row_bytes, gb, hosts_1b, hosts_10b in rows:
        want = served_bytes_per_row(int(dim), dtype)  # key + row (+ scale and bias) + directory
        assert int(row_bytes) == want, (dim, dtype)
        assert float(gb) == round(want * 1e8 / 1e9, 1)
        assert (int(hosts_1b), int(hosts_10b)) == (
            math.ceil(want * 1e9 / per_host),
            math.ceil(want * 1e10 / per_host),
        )


def test_the_documented_measurements_are_the_formula_plus_the_processes():
    """bench-scale's figures in the doc: the formula column is the formula, RSS / raw is the
    measured RSS over 8 + 4 x dim, and what a row costs beyond the formula is at most the two PS
    processes' own ~60 MB (and the directory's part of a byte under the formula's 1)."""
    text = (ROOT / "docs" / "serving.md").read_text()
    section = text[text.index(f"## {HEADING}") :]
    found = re.findall(
        r"^\| (\w+) +\| (\d+)M +\| (\d+) +\| ([\d.]+) +\| ([\d.]+) +\| ([\d.]+) +\|$", section, re.M
    )
    assert [f[0] for f in found] == ["float32", "float16", "int8"]
    for dtype, millions, formula, rss, pss, ratio in found:
        rows = int(millions) * 10**6
        assert int(formula) == served_bytes_per_row(16, dtype)
        assert float(ratio) == round(float(rss) / (8 + 4 * 16), 3)
        for measured in (float(rss), float(pss)):
            assert -0.3 * rows <= (measured - int(formula)) * rows <= 2 * 80e6, (dtype, measured)


def _scores(scorer: Scorer, limit: int = 400) -> np.ndarray:
    scores = []
    for body, ctype in requests_from_file(TEST, SCHEMA, 200, limit):
        status, payload, _, _ = score(scorer, body, ctype)
        assert status == 200, payload
        scores.extend(orjson.loads(payload)["scores"])
    return np.array(scores)


@pytest.mark.slow
def test_the_export_records_the_served_scores_error_and_versions_shows_it(int8_store, capsys):
    from recserve.commands.releases import VersionsConfig, run_versions

    vdir = ms.version_dir(int8_store, "criteo", "1")
    q = ms.read_manifest(vdir).quantized
    assert q is not None and q.dtype == "int8" and q.rows == len(np.load(vdir / "eval" / "scores.npy"))
    assert q.auc_drop <= 0.001 and 0 < q.max_abs_score_diff < 0.01
    f32, served = np.load(vdir / "eval" / "scores_float32.npy"), np.load(vdir / "eval" / "scores.npy")
    assert np.abs(f32 - served).max() == pytest.approx(q.max_abs_score_diff)
    meta = shards.read_meta(vdir / "embeddings" / "shard-0-of-2")
    assert meta.row_dtype == "int8" and (vdir / "embeddings" / "shard-0-of-2" / "qparams.npy").exists()
    run_versions(VersionsConfig(store=str(int8_store), model="criteo"))
    assert f"int8: auc={q.auc:.4f} (float32 {q.float32_auc:.4f})" in capsys.readouterr().out


@pytest.mark.slow
def test_online_equals_offline_for_an_int8_version_colocated_and_over_grpc(int8_store):
    from serving.ps.config import ServingShardConfig
    from serving.rpc.config import ServerConfig
    from training.offline import score

    vdir = ms.version_dir(int8_store, "criteo", "1")
    offline = score(vdir, TEST)
    np.testing.assert_allclose(offline, np.load(vdir / "eval" / "scores.npy"), rtol=0, atol=1e-6)
    scorer = Scorer(ScoringConfig(str(vdir), lookups="colocated"))
    try:
        colocated = _scores(scorer)
    finally:
        scorer.close()
    assert np.abs(colocated - offline[: len(colocated)]).max() <= 1e-6
    with contextlib.ExitStack() as stack:
        addresses = [
            stack.enter_context(ps_in_thread(ServingShardConfig(
                str(ms.model_dir(int8_store, "criteo")), shard=i, num_shards=2, dim=16,
                server=ServerConfig(port=0, grace_s=0.1, max_message_mb=64),
            )))
            for i in range(2)
        ]  # fmt: skip
        scorer = Scorer(ScoringConfig(str(vdir), lookups="remote", ps=addresses, worker_timeout_s=10))
        try:
            remote = _scores(scorer)
        finally:
            scorer.close()
    assert np.abs(remote - offline[: len(remote)]).max() <= 1e-6


@pytest.mark.slow
def test_deltas_of_an_int8_version_are_int8(int8_store):
    from training.follow.cut import DeltaWriter

    writer = DeltaWriter(int8_store, "criteo")
    signs = writer.signs()[:100]
    writer.assign(signs, writer.lookup(signs) + 0.01)
    _, ddir, _ = writer.publish()
    for d in shards.shard_dirs(ddir):
        data = shards.read_shard(d)
        assert data.meta.row_dtype == "int8" and data.qparams is not None


@pytest.mark.slow
def test_every_table_of_a_trained_version_quantizes_within_its_rows_bound(trained):
    vdir = Path(trained[1].version_dir)
    for d in shards.shard_dirs(vdir / "embeddings"):
        rows = shards.read_shard(d).rows.astype(np.float32)
        err = np.abs(dequantize(*quantize(rows)).astype(np.float64) - rows).max(axis=1)
        spread = rows.max(axis=1).astype(np.float64) - rows.min(axis=1)
        assert (err <= error_bound(rows)).all()
        # trained rows: (max - min) / 510, up to fp16's rounding of the scale
        assert (err <= spread / 510 * (1 + 2**-10) + 3e-8 + np.abs(rows).max(axis=1) * 2.0**-23).all()
