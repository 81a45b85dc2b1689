"""Training with a sharding plan: replicated tables in the trainer, the rest on the PS. Whatever
the plan, every table is exported as PS shards; ``--staleness 0`` with a seed is reproducible."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from features.hashing import SLOT_SHIFT
from features.schema import load_schema
from model_store import shards
from training.config import TrainConfig
from training.planning import plan as sharding
from training.train import train

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "data/schemas/criteo.yaml"


def _config(store: Path, **kw) -> TrainConfig:
    base = dict(schema=str(SCHEMA), data=str(ROOT / "data/criteo/wide_resdnn_criteo_train.tsv"),
                test=str(ROOT / "data/criteo/wide_resdnn_criteo_test.tsv"), store=str(store), progress=False,
                inprocess_ps=True, epochs=1, num_shards=2)  # fmt: skip
    return TrainConfig(**(base | kw))


def _exported(version_dir: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(signs, rows, adagrad state) of a version's shards, sorted by sign."""
    parts = [shards.read_shard(d) for d in shards.shard_dirs(Path(version_dir) / "embeddings")]
    signs = np.concatenate([p.signs for p in parts])
    order = np.argsort(signs)
    rows = np.concatenate([p.rows for p in parts])[order]
    state = np.concatenate([p.state["sum"] for p in parts])[order]
    return signs[order], rows, state


def test_a_mixed_plan_trains_and_exports_every_table_as_shards(tmp_path):
    schema = load_schema(SCHEMA)
    plan = sharding.uniform(schema, "ps")
    half = [s.name for s in schema.sparse][:13]
    for name in half:
        plan.tables[name].strategy = "replicated"
    plan_file = plan.save(tmp_path / "plan.yaml")
    result = train(_config(tmp_path / "store", plan=str(plan_file)))
    assert result.auc > 0.66
    signs, rows, state = _exported(result.version_dir)
    slot_ids = set((signs >> SLOT_SHIFT).tolist())
    assert slot_ids == {s.id for s in schema.sparse}  # every table, wherever it trained
    replicated_ids = {s.id for s in schema.sparse if s.name in half}
    from_trainer = np.isin(signs >> SLOT_SHIFT, list(replicated_ids))
    assert result.ps["replicated_rows"] == from_trainer.sum() > 0
    assert result.ps["ps_rows"] == len(signs)
    assert (state[from_trainer] > 0).mean() > 0.5  # their optimizer state came along (Adagrad sums)
    assert np.isfinite(rows).all()


@pytest.mark.parametrize("sharding_", ["ps", "auto"])
def test_staleness_0_with_a_seed_gives_the_same_model_twice(tmp_path, sharding_, caplog):
    runs = []
    for i in range(2):
        with caplog.at_level(logging.INFO, logger="recserve.train"):
            r = train(_config(tmp_path / str(i), staleness=0, seed=7, sharding=sharding_, limit=2048))
        runs.append((r.auc, _exported(r.version_dir)))
    (auc_a, (signs_a, rows_a, state_a)), (auc_b, (signs_b, rows_b, state_b)) = runs
    assert abs(auc_a - auc_b) <= 1e-6
    np.testing.assert_array_equal(signs_a, signs_b)
    np.testing.assert_array_equal(rows_a, rows_b)
    np.testing.assert_array_equal(state_a, state_b)
    assert "not bit-reproducible" not in caplog.text


def test_an_asynchronous_run_says_it_is_not_reproducible(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="recserve.train"):
        train(_config(tmp_path, staleness=2, sharding="ps", export=False, limit=1024))
    assert "not bit-reproducible" in caplog.text


def test_the_digest_is_the_rows_by_sign_whatever_order_they_were_inserted_in():
    from training.replicated import Replicated

    spec = TrainConfig().store_config(load_schema("data/schemas/criteo.yaml").fingerprint)
    signs = (np.arange(1, 3001, dtype=np.uint64) | (np.uint64(3) << np.uint64(SLOT_SHIFT))).astype(np.uint64)
    grads = np.random.default_rng(0).standard_normal((len(signs), spec.dim)).astype(np.float32)
    a, b = Replicated(spec, 4096), Replicated(spec, 4096)
    a.rows(signs, True)
    b.rows(signs[::-1].copy(), True)  # another insertion order: other slots in the store
    a.update(signs, grads)
    b.update(signs[::-1].copy(), grads[::-1].copy())
    assert a.digest() == b.digest() == a.check_equal()  # one rank: nothing to compare with
    assert a.digest().startswith("3000:")
    b.update(signs[:1], grads[:1])  # one row more trained on one copy
    assert a.digest() != b.digest()
