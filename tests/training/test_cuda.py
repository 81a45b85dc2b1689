"""The trainer where torch sees a CUDA device: the dense network and its step run on the GPU, the
embedding rows stay on the PS; what it exports serves on a CPU host. Skipped without a GPU (CI has
none); run on a GPU machine with ``pytest tests/training/test_cuda.py``."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import model_store
from features import stream
from features.hashing import shard_of
from features.schema import load_schema
from serving.ps.shard import OptimizerSpec, TableShard, TableShardConfig
from serving.ps.spec import TableSpec
from serving.worker.core import EmbeddingWorker, InProcessShard, WorkerConfig
from training import data
from training.config import TrainConfig
from training.ctx import TrainCtx
from training.models import ModelConfig, build_model
from training.train import train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "data/schemas/criteo.yaml"
TRAIN = ROOT / "data/criteo/wide_resdnn_criteo_train.tsv"
TEST = ROOT / "data/criteo/wide_resdnn_criteo_test.tsv"
DIM = 8


def _config(tmp_path: Path, **kw) -> TrainConfig:
    base = dict(schema=str(SCHEMA), data=str(TRAIN), test=str(TEST), store=str(tmp_path / "store"),
                model="criteo", progress=False, num_shards=2, epochs=1)  # fmt: skip
    return TrainConfig(**(base | kw))


def _step(device: str, batches: list) -> tuple[list[TableShard], dict]:
    """A prefetching step per batch on ``device``, from the same seed, SGD on both sides (its
    step is linear in the gradient: summation order stays at float32's rounding): the shards'
    stores and the dense weights (on the CPU) they end with."""
    schema = load_schema(SCHEMA)
    opt = OptimizerSpec("sgd", lr=0.05)
    stores = [
        TableShard(
            TableShardConfig(table=TableSpec(dim=DIM, capacity=10_000, optimizer=opt), shard=i, num_shards=2)
        )
        for i in range(2)
    ]
    worker = EmbeddingWorker([InProcessShard(s) for s in stores], schema, WorkerConfig(staleness=0))
    cfg = ModelConfig(kind="dlrm", num_slots=len(schema.sparse), dim=DIM, num_dense=len(schema.dense),
                      bottom_mlp=[16, DIM])  # fmt: skip
    torch.manual_seed(0)
    model = build_model(cfg).to(device)
    ctx = TrainCtx(worker, model, torch.optim.SGD(model.parameters(), lr=0.05), schema, prefetch=True)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    try:
        for batch in ctx.steps(batches):
            logits = ctx.forward(batch)
            assert logits.device.type == torch.device(device).type
            ctx.backward(loss_fn(logits, torch.from_numpy(batch.labels).to(logits.device)))
        ctx.flush()
    finally:
        ctx.close()
        worker.close()
    return stores, {k: v.detach().cpu() for k, v in model.state_dict().items()}


def test_the_steps_on_the_gpu_update_the_ps_and_the_weights_as_on_the_cpu():
    """The same four batches from the same seed, stepped with the dense network on the GPU and on
    the CPU: the PS rows and the dense weights end equal up to float32 summation order."""
    schema = load_schema(SCHEMA)
    batches = data.batches(data.take(stream.read(TRAIN, schema, limit=128), slice(0, 128)), schema, 32)
    gpu_stores, gpu_weights = _step("cuda", batches)
    cpu_stores, cpu_weights = _step("cpu", copy.deepcopy(batches))
    signs = np.unique(np.concatenate([b.signs for b in batches]))
    owner = shard_of(signs, 2)
    for i in range(2):
        mine = signs[owner == i]
        (gpu_rows, gpu_misses), (cpu_rows, cpu_misses) = (
            gpu_stores[i].lookup(mine),
            cpu_stores[i].lookup(mine),
        )
        assert len(mine) and gpu_misses == cpu_misses == 0  # every sign trained holds a row
        np.testing.assert_allclose(gpu_rows, cpu_rows, rtol=1e-5, atol=1e-6)
    for name, w in gpu_weights.items():
        torch.testing.assert_close(w, cpu_weights[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_run_on_the_gpu_exports_a_version_a_cpu_only_process_scores_the_same(tmp_path):
    """`train` on the GPU (in-process PS stores), exported and published: a fresh process that
    sees no GPU loads the version and reproduces the trainer's evaluation scores."""
    torch.cuda.reset_peak_memory_stats()
    cfg = _config(tmp_path, inprocess_ps=True, publish=True)
    result = train(cfg)
    assert torch.cuda.max_memory_allocated() > 0  # the dense network ran on the GPU
    assert result.auc > 0.68, result.history.auc
    version = Path(result.version_dir or "")
    assert model_store.current(cfg.store, "criteo") == "1"
    model_store.read_manifest(version)  # every file's sha256
    scores = tmp_path / "scores.npy"
    env = os.environ | {"CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(
        [sys.executable, "-m", "training.offline", str(version), str(TEST), str(scores)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    got, want = np.load(scores), np.load(version / "eval/scores.npy")
    assert got.shape == want.shape == (2000,)
    assert np.abs(got - want).max() <= 1e-5


def test_the_in_process_baseline_trains_its_table_on_the_gpu(tmp_path):
    """``--embeddings inprocess``: the EmbeddingBag moves to the dense network's GPU."""
    torch.cuda.reset_peak_memory_stats()
    result = train(_config(tmp_path, embeddings="inprocess", export=False))
    assert torch.cuda.max_memory_allocated() > 0
    assert result.auc > 0.68, result.history.auc


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="a host with a GPU per rank takes them")
def test_two_ranks_on_one_gpu_are_refused_with_the_ways_out(tmp_path):
    """docs/training.md's two-rank torchrun line where the host has one GPU: each rank exits 2 before
    joining (NCCL would fail at the first collective with 'Duplicate GPU detected')."""
    cmd = ["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "recserve", "train"]
    cmd += ["--store", str(tmp_path / "store"), "--no-progress"]
    env = os.environ | {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode != 0
    want = "cannot train here: 2 ranks on this host and 1 GPU: NCCL needs a GPU of its own for each rank"
    assert want in run.stderr and "--device cpu" in run.stderr, run.stderr[-3000:]
    assert not (tmp_path / "store").exists()  # nothing started, nothing written
