"""What the streaming trainer's tests share (its fixtures are in conftest.py beside): the model
followed, the sample file, its config for a stream, rows looked up as serving routes them, the
environment a documented line runs in, and a new version to publish."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

import model_store as ms
from features import stream
from features.schema import Schema, load_schema
from features.transform import transform
from tests.helpers import ROOT
from training.follow.config import FollowConfig

NAME = "criteo"
"""The model the tests follow (``<store>/criteo``)."""
SAMPLE = ROOT / "data/criteo/deepctr_criteo_sample.csv"
"""200 Criteo rows with a header: what the watched directory receives."""


def stream_cfg(store: Path, spec: str, **kw) -> FollowConfig:
    """A follower of ``store``'s model reading the stream ``spec`` (``kafka://...``): batches of
    64, a look every 0.2 s; ``kw`` overrides."""
    return FollowConfig(
        **({"follow": str(store / NAME), "stream": spec, "poll_s": 0.2, "batch_size": 64} | kw)
    )


def schema_of(store: Path) -> Schema:
    """The schema of the version ``store`` serves."""
    return load_schema(ms.version_dir(store, NAME, ms.current(store, NAME)) / "schema.yaml")


def file_signs(store: Path, path: Path) -> np.ndarray:
    """The signs of a file's rows under the served version's schema."""
    schema = schema_of(store)
    return transform(stream.read(path, schema), schema).signs


def lookup(stores, signs: np.ndarray) -> np.ndarray:
    """Rows of ``signs`` in stores routed like the PS (the default zero row where absent)."""
    from features.hashing import shard_of

    owner = shard_of(signs, len(stores))
    out = np.zeros((len(signs), stores[0].config.dim), np.float32)
    for i, s in enumerate(stores):
        out[owner == i] = s.lookup(signs[owner == i])[0]
    return out


def serving_stores(store: Path, deltas: bool = True):
    """Serving-side shards of the served version: its dump, plus (``deltas``) its deltas through
    the PS's own Follower."""
    from serving.ps.follow import Follower
    from serving.ps.shard import TableShard, TableShardConfig
    from serving.ps.spec import TableSpec

    version = ms.current(store, NAME)
    manifest = ms.read_manifest(ms.version_dir(store, NAME, version))
    n, dim = manifest.num_shards, manifest.dim
    stores = [
        TableShard(TableShardConfig(table=TableSpec(dim=dim, capacity=100_000), shard=i, num_shards=n))
        for i in range(n)
    ]
    for s in stores:
        if deltas:
            Follower(s, ms.model_dir(store, NAME)).poll()
        else:
            s.load(ms.version_dir(store, NAME, version) / "embeddings")
    return stores


def doc_env() -> dict[str, str]:
    """The environment a documented line runs in: the repository importable, this venv's
    ``recserve`` and ``python`` first on PATH."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    return os.environ | {"PYTHONPATH": str(ROOT), "PATH": path}


def bash(line: str, cwd: Path, env: dict, **kw) -> subprocess.Popen:
    """``line`` started under ``bash -c`` in a session of its own (kill it with ``os.killpg``)."""
    return subprocess.Popen(["bash", "-c", line], cwd=cwd, env=env, start_new_session=True, **kw)


def rows_at(store: Path, upto: int | None = None) -> dict[int, np.ndarray]:
    """Every sign's row in the served version with its deltas up to ``upto`` (None: all) applied,
    read afresh from the store."""
    version = ms.current(store, NAME)
    vdir = ms.version_dir(store, NAME, version)
    out = {}
    for s in serving_stores(store, deltas=False):
        s.version = version
        for seq in ms.list_deltas(vdir, after=s.delta_seq):
            if upto is None or seq <= upto:
                s.apply_delta(ms.delta_dir(vdir, seq))
        snap = s.snapshot()
        out.update(zip(snap.signs.tolist(), snap.rows, strict=True))
    return out


def retrained(store: Path, v1: str, **changes) -> str:
    """A new full version of v1's schema and shape (its rows, without its deltas), sealed;
    ``changes`` go into its manifest."""
    manifest = ms.read_manifest(ms.version_dir(store, NAME, v1))
    v2 = ms.next_version(store, NAME)
    staging = ms.staging_dir(store, NAME, v2)
    src = ms.version_dir(store, NAME, v1)
    top = {ms.DELTAS, ms.MANIFEST, ms.SUCCESS}  # (the shard dumps keep their own)
    shutil.copytree(
        src, staging, dirs_exist_ok=True, ignore=lambda d, names: top & set(names) if Path(d) == src else []
    )
    ms.write_manifest(staging, replace(manifest, version=v2, parent=v1, deltas=0, **changes))
    ms.seal(staging, ms.version_dir(store, NAME, v2))
    return v2


def torchrun_workers(hosts) -> dict[int, int]:
    """{rank: pid} of the torchrun workers running on ``hosts`` (``loadtest.netns.Host``: its
    namespace's processes): those torchrun gave a RANK whose argv runs ``train`` (the PS shards a
    rank starts inherit its environment; the agent has no RANK)."""
    out = {}
    for host in hosts:
        listed = subprocess.run(["ip", "netns", "pids", host.name], capture_output=True, text=True)
        for pid in listed.stdout.split():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:  # gone meanwhile
                continue
            rank = [e.removeprefix(b"RANK=") for e in env if e.startswith(b"RANK=")]
            if rank and b"train" in argv:
                out[int(rank[0])] = int(pid)
    return out
