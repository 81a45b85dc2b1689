"""The model store ``make bench-scale`` serves: versions of random rows written straight into it
(bucket-ordered shard dumps with their checksums, sealed; nothing is trained), and deltas. A
version may be written in a serving dtype (float16, int8: ``model_store.quant``), its rows made
and encoded a chunk at a time (a 300M-row int8 version never holds its float32 rows)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from features.hashing import unique_signs

MODEL = "scale"
DIM = 16
SHARDS = 2


def _shard_data(kind: str, shard: int, version: str, signs: np.ndarray, rows: np.ndarray,
                qparams: np.ndarray | None = None, dtype: str = "float32"):  # fmt: skip
    from model_store.meta import ShardMeta
    from model_store.shards import ShardData
    from serving.ps.optim import OptimizerSpec
    from serving.ps.spec import TableSpec

    n = len(signs)
    meta = ShardMeta(kind=kind, shard=shard, num_shards=SHARDS, state=[], version=version,
                     table=TableSpec(dim=DIM, optimizer=OptimizerSpec("sgd")).to_json(),
                     delta_seq=0 if kind == "delta" else -1,
                     base_version=version if kind == "delta" else "",
                     row_dtype="" if dtype == "float32" else dtype)  # fmt: skip
    return ShardData(meta, signs, rows, {}, np.zeros(n, np.uint32), np.zeros(n, np.uint32), qparams=qparams)


def _random_rows(rng: np.random.Generator, n: int, dtype: str) -> tuple[np.ndarray, np.ndarray | None]:
    """(rows, qparams) of ``n`` random rows in serving dtype ``dtype``, made a chunk at a time. int8
    rows are random codes with a random fp16 scale and bias each, made as they lie (quantizing
    300M normal rows took ~8 minutes here; what is measured -- bytes, loads, lookups -- does not
    depend on the values)."""
    from model_store.quant import QPARAMS, row_codec

    if dtype == "float32":
        return rng.standard_normal((n, DIM), dtype=np.float32), None
    codec = row_codec(dtype)
    rows = np.empty((n, DIM), codec.storage)
    qparams = np.empty((n, 2), QPARAMS) if codec.qparams else None
    step = 1 << 22
    for i in range(0, n, step):
        m = min(step, n - i)
        if qparams is None:
            rows[i : i + m] = rng.standard_normal((m, DIM), dtype=np.float32)
        else:
            rows[i : i + m] = np.frombuffer(rng.bytes(m * DIM), np.uint8).reshape(m, DIM)
            qparams[i : i + m, 0] = rng.uniform(2e-3, 2e-2, m)  # scale: a row spanning 0.5-5
            qparams[i : i + m, 1] = rng.uniform(-3.0, -0.25, m)  # bias: the row's low end
    return rows, qparams


def shard_signs(rows: int, shard: int, seed: int) -> np.ndarray:
    """~rows/SHARDS distinct random signs that route to ``shard``."""
    from features.hashing import shard_of

    rng = np.random.default_rng(seed * 1000 + shard)
    want = rows // SHARDS
    out: list[np.ndarray] = []
    have = 0
    while have < want:  # candidates a chunk at a time: 150M signs a shard without 10 GB of temporaries
        s = rng.integers(1, 2**63, min(1 << 24, int((want - have) * SHARDS * 1.05) + 16), dtype=np.uint64)
        out.append(s[shard_of(s, SHARDS) == shard][: want - have])
        have += len(out[-1])
        if have >= want:  # distinct and sorted, in place (a repeat of a random 63-bit sign is rare: top up)
            signs = np.concatenate(out)
            out.clear()
            signs.sort()
            repeat = signs[1:] == signs[:-1]
            if repeat.any():
                signs = signs[np.concatenate(([True], ~repeat))]
            out, have = [signs], len(signs)
    return out[0]


def build_version(root: Path, rows: int, seed: int, dtype: str = "float32") -> tuple[str, np.ndarray]:
    """A sealed version of random rows in serving dtype ``dtype``; returns its name and a sample of
    its signs."""
    import model_store as ms

    version = ms.next_version(root, MODEL)
    staging = ms.staging_dir(root, MODEL, version)
    sample = []
    for shard in range(SHARDS):
        signs = shard_signs(rows, shard, seed=1)  # the same signs in every version, new rows
        rng = np.random.default_rng(seed * 1000 + shard)
        n = len(signs)
        values, qparams = _random_rows(rng, n, dtype)
        data = _shard_data("full", shard, version, signs, values, qparams, dtype)
        ms.shards.write_shard(staging / "embeddings", data)
        sample.append(signs[rng.integers(0, n, 200_000)])
        del data, signs, values, qparams
    ms.write_manifest(staging, ms.VersionManifest(model=MODEL, version=version, schema_fingerprint="scale",
                                                  dim=DIM, num_shards=SHARDS))  # fmt: skip
    ms.seal(staging, ms.version_dir(root, MODEL, version))
    return version, np.concatenate(sample)


def write_delta(root: Path, version: str, sample: np.ndarray, rows: int) -> Path:
    """Delta 0 of ``version``: ``rows`` rows a shard (some of ``sample``'s signs, the rest new),
    cut as every delta is (``training.follow.cut.DeltaCut``); its directory."""
    import model_store as ms
    from features.hashing import shard_of
    from training.follow.cut import DeltaCut

    rng = np.random.default_rng(7)

    def dump(ddir: Path) -> None:
        for shard in range(SHARDS):
            mine = unique_signs(sample[shard_of(sample, SHARDS) == shard])
            extra = rng.integers(1, 2**63, rows, dtype=np.uint64)
            signs = unique_signs(np.concatenate([mine, extra[shard_of(extra, SHARDS) == shard]]))[:rows]
            rows_ = np.full((len(signs), DIM), 0.5, np.float32)
            ms.shards.write_shard(ddir, _shard_data("delta", shard, version, signs, rows_))

    return DeltaCut.write(ms.version_dir(root, MODEL, version), 0, dump)


def reuse(root: Path, rows: int):
    """(v1, v2, sample) of a store an earlier ``--keep`` run built with ``rows`` rows, its deltas
    removed; None when there is none."""
    import model_store as ms

    sample = root.parent / "sample.npy"
    meta = sorted((root / MODEL).glob("[12]/embeddings/*/meta.json"))
    if not sample.exists() or len(meta) != 2 * SHARDS:
        return None
    if sum(json.loads(m.read_text())["rows"] for m in meta) != 2 * rows // SHARDS * SHARDS:
        return None
    for v in ("1", "2"):
        shutil.rmtree(ms.version_dir(root, MODEL, v) / ms.DELTAS, ignore_errors=True)
    return "1", "2", np.load(sample)
