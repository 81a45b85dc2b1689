"""The PS processes training starts are training shards with a fresh admin token (a 0600 file in
the cluster's private directory) that only the cluster's clients hold, and dump only under the
data root (the model-store root) they were started with."""

from __future__ import annotations

import stat
from pathlib import Path

import numpy as np
import pytest

from serving.ps.client import PSClient, ShardError
from serving.worker.core import WorkerConfig
from tests.serving.helpers import SCHEMA, ranking_batch
from training.cluster import ShardSpec, open_cluster

pytestmark = pytest.mark.slow


def test_started_shards_need_the_clusters_token_and_dump_under_the_root(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    spec = ShardSpec(dim=4, capacity=1000)
    with open_cluster(SCHEMA, spec, 2, WorkerConfig(), data_root=root) as cluster:
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
