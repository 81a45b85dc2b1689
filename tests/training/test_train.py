"""The hybrid trainer: one step against the in-process baseline, a real training run, DDP, export.

Fast tests use in-process PS stores; the ``slow`` ones start real processes (PS shards via
``recserve train``, a fresh scorer, two DDP ranks).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import model_store
from features import stream
from features.schema import load_schema
from model_store.shards import read_meta
from training import data
from training.config import TrainConfig, train_table
from training.ctx import TrainCtx
from training.inprocess import InProcessCtx, SignTable, sparse_optimizer
from training.models import ModelConfig, build_model
from training.train import train

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "data/schemas/criteo.yaml"
TRAIN = ROOT / "data/criteo/wide_resdnn_criteo_train.tsv"
TEST = ROOT / "data/criteo/wide_resdnn_criteo_test.tsv"


def _config(tmp_path: Path, **kw) -> TrainConfig:
    base = dict(
        schema=str(SCHEMA),
        data=str(TRAIN),
        test=str(TEST),
        store=str(tmp_path / "store"),
        model="criteo",
        progress=False,
        num_shards=2,
    )
    return TrainConfig(**(base | kw))


# ---- one hybrid step == the same step in torch ----------------------------------------------------
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_hybrid_step_matches_in_process_torch_step(optimizer):
    from serving.ps.shard import OptimizerSpec, TableShard, TableShardConfig
    from serving.ps.spec import TableSpec
    from serving.worker.core import EmbeddingWorker, InProcessShard, WorkerConfig

    schema = load_schema(SCHEMA)
    batch = data.batches(data.take(stream.read(TRAIN, schema, limit=64), slice(0, 64)), schema, 64)[0]
    lr = 0.1
    stores = [
        TableShard(
            TableShardConfig(
                table=TableSpec(dim=8, capacity=10_000, optimizer=OptimizerSpec(optimizer, lr=lr)),
                shard=i,
                num_shards=2,
            )
        )
        for i in range(2)
    ]
    worker = EmbeddingWorker([InProcessShard(s) for s in stores], schema, WorkerConfig(staleness=0))

    def rows(signs):  # what the PS holds now, in sign order
        from features.hashing import shard_of

        out = np.empty((len(signs), 8), np.float32)
        owner = shard_of(signs, 2)
        for i, s in enumerate(stores):
            out[owner == i] = s.lookup(signs[owner == i])[0]
        return out

    cfg = ModelConfig(
        kind="dlrm", num_slots=len(schema.sparse), dim=8, num_dense=len(schema.dense), bottom_mlp=[16, 8]
    )
    torch.manual_seed(0)
    model_ps = build_model(cfg)
    model_ref = copy.deepcopy(model_ps)
    ctx = TrainCtx(worker, model_ps, torch.optim.Adam(model_ps.parameters(), lr=1e-3), schema)

    table = SignTable(batch.signs, schema, dim=8, init_scale=0.01, seed=0)
    ref = InProcessCtx(
        table,
        model_ref,
        torch.optim.Adam(model_ref.parameters(), lr=1e-3),
        sparse_optimizer(OptimizerSpec(optimizer, lr=lr), table.parameters()),
        schema,
    )
    labels = torch.from_numpy(batch.labels)
    loss_fn = torch.nn.BCEWithLogitsLoss()

    logits = ctx.forward(batch)  # inserts the rows
    ps_rows0 = rows(batch.signs)
    with torch.no_grad():  # the baseline starts from the PS's own initial rows
        table.bag.weight[torch.from_numpy(table.rows(batch.signs))] = torch.from_numpy(ps_rows0)
    ref_logits = ref.forward(batch)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-6)

    ctx.backward(loss_fn(logits, labels))
    ref.backward(loss_fn(ref_logits, labels))
    ctx.flush()

    updated = rows(batch.signs)
    assert not np.allclose(updated, ps_rows0)  # the step changed the rows
    expected = table.bag.weight.detach()[torch.from_numpy(table.rows(batch.signs))].numpy()
    # Adagrad's first step is lr * g / (|g| + eps): where a sign's gradient nearly cancels over the
    # batch (|g| ~ 1e-6), float32 summation order (worker scatter vs torch's sparse grad) shows
    # up as ~eps / |g| relative to the step: 3e-5 * lr seen, allow 1e-4 * lr (the step is lr)
    atol = 1e-7 if optimizer == "sgd" else 1e-4 * lr
    np.testing.assert_allclose(updated, expected, rtol=1e-5, atol=atol)
    for (name, a), b in zip(model_ps.state_dict().items(), model_ref.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)
    worker.close()


def test_ctx_verbs_must_alternate():
    ctx = TrainCtx(
        worker=None, dense_model=torch.nn.Linear(1, 1), dense_optimizer=None, schema=load_schema(SCHEMA)
    )
    with pytest.raises(RuntimeError, match="without a forward"):
        ctx.backward(torch.zeros(()))


# ---- a real (short) training run ----------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Default hyper-parameters, in-process PS stores, exported + published (~5 s). The shards
    start at 1,024 rows: they must grow, without losing an ID, to hold the split's."""
    tmp = tmp_path_factory.mktemp("train")
    cfg = _config(tmp, inprocess_ps=True, publish=True, delta_rows=5000, table=train_table(capacity=1024))
    return cfg, train(cfg)


def test_short_training_reaches_auc(trained):
    _, result = trained
    assert result.auc > 0.70, result.history.auc
    assert result.logloss < 0.52
    assert result.steps == 2 * 63
    assert len(result.history.auc) == 2 and Path(result.curve).is_file()


def test_export_writes_a_complete_verified_version(trained):
    cfg, result = trained
    version = Path(result.version_dir)
    assert version == Path(cfg.store) / "criteo" / "1"
    assert model_store.current(cfg.store, "criteo") == "1"
    manifest = model_store.read_manifest(version)  # checks every sha256
    schema = load_schema(version / "schema.yaml")
    assert manifest.schema_fingerprint == schema.fingerprint
    assert schema == load_schema(SCHEMA)  # the schema file as written: the feature contract
    assert len(manifest.model_config["dense_std"]) == 13  # the fitted statistics: the model's
    assert manifest.num_shards == 2 and manifest.dim == 16
    assert manifest.model_config["kind"] == "dlrm"
    assert abs(manifest.metrics["auc"] - result.auc) < 1e-12
    # both runtimes timed on a request-sized batch; the faster is what --runtime auto serves
    runtime = manifest.dense_runtime
    assert runtime is not None
    assert set(runtime.p50_ms) == {"torchscript", "onnx"} and all(v > 0 for v in runtime.p50_ms.values())
    assert runtime.default == min(runtime.p50_ms, key=runtime.p50_ms.__getitem__)
    assert (runtime.rows, runtime.threads) == (200, 1)
    assert {
        "embeddings/shard-0-of-2/rows.npy",
        "dense/model.pt",
        "dense/model.onnx",
        "eval/scores.npy",
    } <= set(manifest.files)
    np.testing.assert_array_equal(np.load(version / "eval/scores.npy"), result.evaluation.scores)
    # deltas were cut while training (every 5000 rows: 3 over 16k rows), each complete
    assert model_store.list_deltas(version) == [0, 1, 2]
    assert (version / "deltas/0/shard-1-of-2/_SUCCESS").is_file()


def test_the_ps_keeps_every_training_id_and_the_result_says_so(trained):
    _, result = trained
    version = Path(result.version_dir)
    schema = load_schema(version / "schema.yaml")
    signs = np.unique(
        np.concatenate([b.signs for b in data.batches(stream.read(TRAIN, schema), schema, 4096)])
    )
    exported = sum(read_meta(p).rows for p in version.glob("embeddings/shard-*"))
    assert result.ps["ps_rows"] == len(signs) == exported > 2 * 1024
    assert result.ps["evictions"] == result.ps["expired"] == 0 and result.ps["grows"] >= 2


def test_a_shard_out_of_memory_stops_training_loudly(tmp_path, caplog):
    from recserve.commands.train import main

    argv = ["--schema", str(SCHEMA), "--data", str(TRAIN), "--test", str(TEST), "--store", str(tmp_path)]
    argv += ["--inprocess-ps", "--capacity", "64", "--max-memory-gb", "0.00002", "--no-progress"]
    argv += ["--sharding", "ps"]  # the shards' limit (the replicated tables have the plan's budget)
    with caplog.at_level("ERROR", logger="recserve.train"):
        assert main(argv) == 1
    message = caplog.records[-1].getMessage()
    assert "training stopped" in message and "max_memory_gb=2e-05" in message and "--eviction" in message
    assert not model_store.versions(tmp_path, "criteo")  # nothing half-trained is exported


def test_corrupt_or_incomplete_versions_are_refused(trained, tmp_path):
    import shutil

    cfg, result = trained
    copy_dir = tmp_path / "criteo" / "7"
    shutil.copytree(result.version_dir, copy_dir)
    model_store.read_manifest(copy_dir)
    (copy_dir / "dense/model.onnx").write_bytes(b"not a model")
    with pytest.raises(model_store.ModelStoreError, match="checksum mismatch"):
        model_store.read_manifest(copy_dir)
    (copy_dir / "_SUCCESS").unlink()
    with pytest.raises(model_store.ModelStoreError, match="incomplete"):
        model_store.read_manifest(copy_dir)
    with pytest.raises(model_store.ModelStoreError):
        model_store.publish(tmp_path, "criteo", "7")
    assert model_store.current(tmp_path, "criteo") is None


def test_versions_are_staged_then_sealed(tmp_path):
    assert model_store.next_version(tmp_path, "m") == "1"
    staged = model_store.staging_dir(tmp_path, "m", "1")
    (staged / "a.txt").write_text("a")
    assert model_store.next_version(tmp_path, "m") == "2"  # a staged version holds its number
    assert model_store.versions(tmp_path, "m") == []  # but is not a version yet
    model_store.write_manifest(staged, model_store.VersionManifest("m", "1", "fp", dim=4, num_shards=1))
    final = model_store.seal(staged, model_store.version_dir(tmp_path, "m", "1"))
    assert model_store.read_manifest(final).files == {"a.txt": model_store.file_digest(final / "a.txt")}
    (final / "b.txt").write_text("b")
    with pytest.raises(model_store.ModelStoreError, match="not in the manifest"):
        model_store.read_manifest(final)
    (final / "b.txt").unlink()
    model_store.publish(tmp_path, "m", "1")
    assert model_store.current(tmp_path, "m") == "1"
    assert not list((tmp_path / "m").glob(".*tmp*"))  # no temp files left behind


# ---- processes: recserve train with PS processes, fresh-process scoring, DDP ------------------------
@pytest.mark.slow
def test_recserve_train_exports_and_a_fresh_process_scores_the_same(tmp_path):
    """`recserve train` with its own PS processes; then the exported artifacts alone, loaded in a
    fresh process, reproduce the trainer's evaluation scores."""
    out = tmp_path / "store"
    cmd = [sys.executable, "-m", "recserve", "train", "--store", str(out), "--model", "criteo"]
    cmd += ["--schema", str(SCHEMA), "--data", str(TRAIN), "--test", str(TEST), "--epochs", "1", "--publish"]
    cmd += ["--no-progress", "--log-level", "WARNING", "--capacity", "1000"]  # the PS processes grow
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    version = out / "criteo" / "1"
    assert summary["version_dir"] == str(version) and summary["auc"] > 0.68
    exported = sum(read_meta(p).rows for p in version.glob("embeddings/shard-*"))
    assert summary["ps_rows"] == exported > 2 * 1000 and summary["grows"] >= 2
    assert summary["evictions"] == summary["expired"] == 0
    assert model_store.current(out, "criteo") == "1"
    scores = tmp_path / "scores.npy"
    run = subprocess.run(
        [sys.executable, "-m", "training.offline", str(version), str(TEST), str(scores)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got, want = np.load(scores), np.load(version / "eval/scores.npy")
    assert got.shape == want.shape == (2000,)
    assert np.abs(got - want).max() <= 1e-5


@pytest.mark.slow
def test_recserve_train_stops_with_the_shards_resource_exhausted_message(tmp_path):
    """The gRPC path: a PS process out of room answers RESOURCE_EXHAUSTED, the trainer exits 1
    with the message (~10 s: it stops at the first batch)."""
    cmd = [sys.executable, "-m", "recserve", "train", "--store", str(tmp_path), "--schema", str(SCHEMA)]
    cmd += ["--data", str(TRAIN), "--test", str(TEST), "--no-progress", "--capacity", "64"]
    cmd += ["--max-memory-gb", "0.00002", "--sharding", "ps"]  # the shards fill at the first batch
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 1, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert "training stopped" in last and "RESOURCE_EXHAUSTED" in last, last
    assert "max_memory_gb=2e-05" in last and "--num-shards" in last and "Traceback" not in run.stderr
    assert run.stdout.strip() == ""  # no summary: nothing was trained


def _ddp_rank(rank: int, port: int, tmp: str, sharding: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    cfg = _config(
        Path(tmp),
        epochs=1,
        limit=2048,
        export=False,
        num_shards=1,
        batch_size=128,
        sharding=sharding,
        device="cpu",  # gloo; two ranks on one GPU are refused (tests/training/test_cuda.py)
    )
    result = train(cfg)
    torch.save(
        {"state": result.dense_state, "steps": result.steps, "auc": result.auc,
         "replicated": result.replicated_digest}, f"{tmp}/rank{rank}.pt",
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["ps", "replicated"])
def test_two_rank_ddp_ends_with_identical_dense_weights(tmp_path, sharding):
    """Both sides of the sharding plan under two ranks: the dense weights end equal, and so do
    the replicated tables (each rank's copy, every step's gradients of both ranks applied)."""
    import torch.multiprocessing as mp

    from serving.rpc.procs import free_ports

    mp.start_processes(
        _ddp_rank, args=(free_ports(1)[0], str(tmp_path), sharding), nprocs=2, start_method="spawn"
    )
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["steps"] == r1["steps"] == 8  # 1024 rows per rank, batch 128
    assert np.isfinite(r0["auc"]) and np.isnan(r1["auc"])  # rank 0 evaluates
    for name, w in r0["state"].items():
        assert torch.equal(w, r1["state"][name]), name
    if sharding == "replicated":  # checked by the trainer at every epoch end, and here
        assert r0["replicated"] == r1["replicated"] and int(r0["replicated"].split(":")[0]) > 0
    else:
        assert r0["replicated"] == r1["replicated"] == ""
