"""The scoring core in ONE process (the reference of ``make bench-e2e``): the Scorer over an
in-process EmbeddingWorker on InProcessShards scores like the trainer's offline scores, and
the request loop reports every stage (what the handler sends as ``Server-Timing``)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import orjson
import pytest

import model_store
from features.schema import load_schema
from serving.scoring.client import requests_from_file
from serving.scoring.config import ScoringConfig
from serving.scoring.core import Scorer, server_timing
from serving.scoring.loop import score
from serving.worker.core import EmbeddingWorker, InProcessShard
from tests.serving.helpers import TEST


@pytest.fixture(scope="module")
def version(trained):
    return Path(trained[1].version_dir)


@pytest.mark.slow
def test_inprocess_scorer_scores_like_offline_and_times_its_stages(version):
    from training.offline import load_stores

    schema = load_schema(version / "schema.yaml")
    stores = load_stores(version, model_store.read_manifest(version))
    scorer = Scorer(
        ScoringConfig(str(version)), worker=EmbeddingWorker([InProcessShard(s) for s in stores], schema)
    )
    scores = []
    for body, ctype in requests_from_file(TEST, "data/schemas/criteo.yaml", 200, 400):
        status, payload, timings, _ = score(scorer, body, ctype)
        assert status == 200, payload
        assert set(timings) == {"decode", "worker", "dense", "encode", "total"}
        assert timings["total"] >= timings["decode"] + timings["worker"] + timings["dense"]
        scores.extend(orjson.loads(payload)["scores"])
    offline = np.load(os.path.join(version, "eval", "scores.npy"))[:400]
    assert np.abs(np.array(scores) - offline).max() <= 1e-5
    status, _, timings, _ = score(scorer, b"{not json", "application/json")
    assert status == 400 and set(timings) == {"total"}  # a refused request still says how long it took


def test_server_timing_header_value():
    assert server_timing({"decode": 1.5, "total": 2.0}) == "decode;dur=1.500, total;dur=2.000"
