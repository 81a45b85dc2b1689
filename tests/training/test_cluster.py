"""The PS processes training starts are training shards with a fresh admin token (a 0600 file in
the cluster's private directory) that only the cluster's clients hold, and dump only under the
data root (the model-store root) they were started with; they hold the table spec `recserve train`
was given, every hyper-parameter of its optimizer included."""

from __future__ import annotations

import stat
from pathlib import Path

import numpy as np
import pytest

from serving.ps.client import PSClient, ShardError
from serving.ps.config import TableShardConfig
from serving.ps.spec import TableSpec
from serving.worker.core import WorkerConfig
from tests.serving.helpers import SCHEMA, ranking_batch
from training.cluster import open_cluster

pytestmark = pytest.mark.slow


def test_started_shards_need_the_clusters_token_and_dump_under_the_root(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    store = TableShardConfig(TableSpec(dim=4, capacity=1000))
    with open_cluster(SCHEMA, store, 2, WorkerConfig(), data_root=root) as cluster:
        token = Path(cluster.token_file)
        assert stat.S_IMODE(token.stat().st_mode) == 0o600
        assert stat.S_IMODE(token.parent.stat().st_mode) == 0o700  # the cluster's private directory
        signs = np.arange(1, 9, dtype=np.uint64)
        for address in cluster.addresses:
            with PSClient(address) as anonymous:
                with pytest.raises(ShardError, match="UNAUTHENTICATED"):
                    anonymous.lookup(signs, insert=True)
                with pytest.raises(ShardError, match="UNAUTHENTICATED"):
                    anonymous.dump(str(root / "x"))
        batch_signs = np.asarray(ranking_batch().signs)
        rows, _ = cluster.worker.lookup(batch_signs, True)  # the cluster's worker holds it
        cluster.worker.push(batch_signs, np.ones_like(rows))
        cluster.worker.flush()
        cluster.dump(root / "m" / "embeddings")
        assert sorted(p.name for p in (root / "m" / "embeddings").iterdir()) == [
            "shard-0-of-2",
            "shard-1-of-2",
        ]
        with pytest.raises(ShardError) as e:
            cluster.dump(tmp_path / "elsewhere")
        assert e.value.code == "PERMISSION_DENIED" and f"outside the data root {root.resolve()}" in str(
            e.value
        )
        assert cluster.stats()["ps_rows"] > 0
    assert not token.exists()  # gone with the cluster


def test_an_ftrl_l1_given_to_recserve_train_reaches_the_ps_processes_and_their_dumps(tmp_path):
    from model_store.shards import read_meta
    from recserve import config
    from recserve.cli import build_parser
    from training.config import TrainConfig

    argv = [
        "train",
        "--optimizer",
        "ftrl",
        "--l1",
        "0.25",
        "--beta2",
        "0.9",
        "--dim",
        "4",
        "--capacity",
        "1000",
    ]
    cfg = config.from_args(TrainConfig, build_parser(only="train").parse_args(argv))
    assert (cfg.table.optimizer.name, cfg.table.optimizer.l1, cfg.table.dim) == ("ftrl", 0.25, 4)
    assert cfg.table.optimizer.lr == 0.005  # what the flags do not name keeps the trainer's default
    root = tmp_path / "store"
    root.mkdir()
    with open_cluster(
        SCHEMA, cfg.store_config(SCHEMA.fingerprint), 2, WorkerConfig(), data_root=root
    ) as cluster:
        cluster.dump(root / "dump")  # each `recserve ps` process writes its own store's config
    for part in sorted((root / "dump").iterdir()):
        meta = read_meta(part)
        assert TableSpec.from_meta(meta) == cfg.table, part
        assert meta.state == ["z", "n"] and meta.schema_hash == SCHEMA.fingerprint
