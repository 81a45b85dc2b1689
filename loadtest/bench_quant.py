"""The ``quantized`` section of ``make bench-train`` (one per data set): what serving a version's
tables in float16 or int8 costs in test AUC and in scores.

One training run exports a float32 version; each reduced dtype is that version's shards rewritten
by the export's own encoder (``model_store.shards.encode_dump``) into a copy, and every copy is
scored on the test file by ``training.offline.score`` (the rows as serving decodes them):
``float32_auc``, and per dtype ``auc``, ``auc_drop``, ``max_abs_score_diff`` against the float32
scores, and ``bytes_per_row`` of the served rows (key + row, + fp16 scale and bias for int8).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np

import model_store as ms
from features.schema import load_schema
from features.stream import ReadOptions
from model_store import shards
from model_store.quant import bytes_per_row
from training.config import TrainConfig
from training.data import Split
from training.evaluate import auc_logloss
from training.offline import score

DTYPES = ("float16", "int8")


def quantized_section(train_file: str | Path, test_file: str | Path, store: Path, **train_kw: Any) -> dict:
    """Train on ``train_file`` (in-process PS, exported into ``store``), then the figures above."""
    from training.train import train

    cfg = TrainConfig(store=str(store), model="q", data=str(train_file), test=str(test_file), inprocess_ps=True,
                      progress=False, publish=False, curve=str(store / "curve.svg"), **train_kw)  # fmt: skip
    result = train(cfg)
    if result.version_dir is None:
        raise RuntimeError("the training run exported no version")
    vdir = Path(result.version_dir)
    manifest = ms.read_manifest(vdir)
    labels = np.concatenate(
        [b.labels for b in Split(test_file, load_schema(vdir / "schema.yaml"), ReadOptions()).batches(4096)]
    )
    f32 = score(vdir, test_file)
    out: dict[str, Any] = {"float32_auc": auc_logloss(labels, f32)[0], "test_rows": len(f32)}
    out["float32_bytes_per_row"] = 8 + bytes_per_row(manifest.dim, "float32")
    for dtype in DTYPES:
        copy = vdir.parent / f".{vdir.name}-{dtype}"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(vdir, copy)
        shards.encode_dump(copy / "embeddings", dtype)
        ms.write_manifest(copy, manifest)  # the rewritten shards' checksums
        got = score(copy, test_file)
        auc = auc_logloss(labels, got)[0]
        out[dtype] = {
            "auc": auc,
            "auc_drop": out["float32_auc"] - auc,
            "max_abs_score_diff": float(np.abs(got - f32).max()),
            "bytes_per_row": 8 + bytes_per_row(manifest.dim, dtype),
        }
        shutil.rmtree(copy)
    out["targets"] = {
        "int8_auc_ge_float32_minus_0.001": out["int8"]["auc"] >= out["float32_auc"] - 0.001,
        "float16_auc_ge_float32_minus_0.0002": out["float16"]["auc"] >= out["float32_auc"] - 0.0002,
    }
    return out


def show(name: str, q: dict) -> None:
    print(f"\n{name} quantized ({q['test_rows']:,} test rows): float32 AUC {q['float32_auc']:.5f}")
    for dtype in DTYPES:
        r = q[dtype]
        print(f"  {dtype:8s} AUC {r['auc']:.5f} (drop {r['auc_drop']:+.5f}) max |score diff| "
              f"{r['max_abs_score_diff']:.2e}  {r['bytes_per_row']} B/row")  # fmt: skip
    print(f"targets: {q['targets']}")
