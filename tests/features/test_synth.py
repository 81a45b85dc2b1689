"""`recserve synth`: Criteo-shaped, deterministic, heavy-tailed, and learnable (small sizes)."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from features import stream, synth
from features.codec import encode
from features.schema import load_schema
from features.transform import transform

CRITEO = load_schema("data/schemas/criteo.yaml")


def _synth(tmp_path: Path, name: str, rows: int, **kw) -> Path:
    assert synth.run(synth.SynthConfig(rows=rows, out=str(tmp_path / name), **kw)) == 0
    return tmp_path / name


def test_rows_look_like_criteo(tmp_path):
    path = _synth(tmp_path, "s.tsv", 70_000, seed=3)  # more than one chunk
    assert not list(tmp_path.glob(".*"))  # written through a temporary name
    t = stream.read(path, CRITEO)  # headerless, Criteo column order
    assert t.num_rows == 70_000
    assert set(np.unique(t.columns["label"])) == {"0", "1"}
    ctr = (t.columns["label"] == "1").mean()
    assert 0.15 < ctr < 0.4
    for i in range(1, 14):
        col = t.columns[f"I{i}"]
        present = col[col != ""]
        assert (present.astype(np.int64) >= 0).all()
    i1 = t.columns["I1"]
    assert 0.3 < (i1 == "").mean() < 0.6  # missing at Kaggle-like rates
    assert np.percentile(t.columns["I5"][t.columns["I5"] != ""].astype(np.int64), 99) > 20 * 2900 / 10
    for i in range(1, 27):
        col = t.columns[f"C{i}"]
        present = col[col != ""]
        assert (np.char.str_len(present) == 8).all()
        assert all(set(v) <= set("0123456789abcdef") for v in present[:50])
    assert (t.columns["C22"] == "").mean() > 0.6 and (t.columns["C1"] == "").mean() == 0


def test_ids_are_heavy_tailed_with_scaled_kaggle_cardinalities(tmp_path):
    cfg = synth.SynthConfig(100_000, str(tmp_path / "x.tsv"), scale=0.01)
    card = cfg.cardinality
    assert card[2] == round(10_131_227 * 0.01) and card[8] == 3  # C3 scaled, C9 (3 IDs) kept
    chunk = synth.make_chunk(cfg, 0, 60_000)
    c3 = chunk.ids[2][~chunk.ids_missing[2]].view("S8").ravel()
    _, counts = np.unique(c3, return_counts=True)
    counts = np.sort(counts)[::-1]
    assert len(counts) <= card[2]
    assert counts[0] > 50 * np.median(counts)  # a head of frequent IDs
    assert (counts == 1).mean() > 0.3  # and a long tail of rare ones
    # distinct ranks map to distinct IDs (a bijection), and slots do not share IDs
    ranks = np.arange(100_000)
    ids = synth.hex_ids(3, ranks).view("S8").ravel()
    assert len(np.unique(ids)) == len(ranks)
    assert not set(ids[:1000].tolist()) & set(synth.hex_ids(4, ranks[:1000]).view("S8").ravel().tolist())


def test_deterministic_given_the_seed_and_formats_agree(tmp_path):
    from recserve.cli import main

    a = _synth(tmp_path, "a.tsv", 5000, seed=7)
    b = tmp_path / "b.tsv"
    assert main(["synth", "--rows", "5000", "--out", str(b), "--seed", "7"]) == 0  # as a user types it
    c = _synth(tmp_path, "c.tsv", 5000, seed=8)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    pq = _synth(tmp_path, "a.parquet", 5000, seed=7)
    gz = _synth(tmp_path, "a.tsv.gz", 5000, seed=7)
    assert gzip.decompress(gz.read_bytes()) == a.read_bytes()
    want = encode(transform(stream.read(a, CRITEO), CRITEO))
    for path in (pq, gz):
        assert encode(transform(stream.read(path, CRITEO), CRITEO)) == want


def test_the_hidden_model_is_shared_by_files_of_different_seeds():
    from sklearn.metrics import roc_auc_score

    one = synth.make_chunk(synth.SynthConfig(1, "x.tsv", seed=1), 0, 40_000)
    two = synth.make_chunk(synth.SynthConfig(1, "x.tsv", seed=2), 0, 40_000)
    assert roc_auc_score(one.label, one.logit) > 0.75  # the labels follow the hidden logits
    w1 = synth.id_weights(6, np.arange(24), 0.5, model_seed=0)
    np.testing.assert_array_equal(w1, synth.id_weights(6, np.arange(24), 0.5, model_seed=0))
    assert not np.array_equal(w1, synth.id_weights(6, np.arange(24), 0.5, model_seed=1))
    assert not np.array_equal(one.label, two.label)


def test_bad_arguments_are_refused(tmp_path, capsys):
    from recserve.cli import main

    assert main(["synth", "--rows", "10", "--out", str(tmp_path / "x.tsv"), "--scale", "0"]) == 2
    assert main(["synth", "--rows", "10"]) == 2  # no --out
    with pytest.raises(ValueError, match="format"):
        synth.SynthConfig(10, "x.tsv", format="xlsx")
    with pytest.raises(ValueError, match="scale"):
        synth.SynthConfig(10, "x.tsv", scale=0)


def test_a_model_trained_on_synth_data_beats_chance_on_a_held_out_file(tmp_path):
    from training.config import TrainConfig
    from training.train import train

    train_file = _synth(tmp_path, "train.tsv", 20_000, seed=1, scale=0.01)
    test_file = _synth(tmp_path, "test.parquet", 5_000, seed=2, scale=0.01)
    cfg = TrainConfig(
        data=str(train_file), test=str(test_file), epochs=1, inprocess_ps=True, num_shards=1,
        export=False, progress=False,
    )  # fmt: skip
    result = train(cfg)
    assert result.auc > 0.6, result.history.auc
