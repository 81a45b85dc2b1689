"""``--device`` in both frontends: ``cuda`` without CUDA is refused at start (exit 2, naming it),
``auto`` scores on the CPU without CUDA and says so, the TorchServe handler's scoring.json
carries the device; with CUDA, the CUDA runtimes score as the CPU does."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import orjson
import pytest

import model_store
from features.schema import load_schema
from recserve.cli import main
from serving.scoring.client import requests_from_file
from serving.scoring.config import ScoringConfig
from serving.scoring.core import Scorer
from serving.scoring.loop import score
from serving.worker.core import EmbeddingWorker, InProcessShard
from tests.cuda import needs_cuda, without_cuda
from tests.serving.helpers import TEST


@without_cuda
@pytest.mark.parametrize("command", ["serve", "up"])
def test_device_cuda_without_cuda_exits_2_naming_it(command: str, tmp_path, capsys) -> None:
    assert main([command, "--store", str(tmp_path), "--device", "cuda", "--no-token-auth"]) == 2
    err = capsys.readouterr().err
    assert f"recserve {command}: bad configuration: --device cuda: torch sees no CUDA device" in err


def test_the_handlers_scoring_json_carries_the_device(tmp_path) -> None:
    from serving.stack.config import StackConfig
    from serving.stack.packaging import scoring_json
    from serving.stack.state import StackState

    cfg = StackConfig(store=str(tmp_path), model="m", lookups="remote", device="auto")
    fields = scoring_json(cfg, StackState("m", "7", str(tmp_path), cfg, worker="127.0.0.1:1"), tmp_path / "7")
    assert fields["device"] == "auto" and ScoringConfig.from_dict(fields).device == "auto"
    assert StackConfig(store=str(tmp_path)).device == "cpu"  # the tested default


@pytest.fixture(scope="module")
def version(trained) -> Path:
    return Path(trained[1].version_dir)


def _scores(version: Path, **config) -> tuple[Scorer, np.ndarray]:
    from training.offline import load_stores

    schema = load_schema(version / "schema.yaml")
    stores = load_stores(version, model_store.read_manifest(version))
    worker = EmbeddingWorker([InProcessShard(s) for s in stores], schema)
    scorer = Scorer(ScoringConfig(str(version), **config), worker=worker)
    scores = []
    for body, ctype in requests_from_file(TEST, "data/schemas/criteo.yaml", 200, 400):
        status, payload, _, _ = score(scorer, body, ctype)
        assert status == 200, payload
        scores.extend(orjson.loads(payload)["scores"])
    return scorer, np.array(scores)


@pytest.mark.slow
@without_cuda
def test_auto_scores_on_the_cpu_without_cuda_and_says_so(version, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="recserve.scoring"):
        scorer, scores = _scores(version, device="auto")
    manifest = model_store.read_manifest(version)
    assert scorer.choice.device == "cpu" and scorer.runtime == manifest.dense_runtime.default  # type: ignore[union-attr]
    assert any("on the cpu" in r.message and "no CUDA device" in r.message for r in caplog.records)
    offline = np.load(version / "eval" / "scores.npy")[:400]
    assert np.abs(scores - offline).max() <= 1e-5


@pytest.mark.slow
@needs_cuda
@pytest.mark.parametrize("runtime", ["torchscript-cuda", "cuda-graphs", "auto"])
def test_cuda_runtimes_score_as_the_cpu(version, runtime: str) -> None:
    scorer, scores = _scores(version, device="cuda", runtime=runtime)
    assert scorer.choice.device == "cuda" and scorer.runtime in ("torchscript-cuda", "cuda-graphs")
    offline = np.load(version / "eval" / "scores.npy")[:400]
    assert np.abs(scores - offline).max() <= 1e-5
