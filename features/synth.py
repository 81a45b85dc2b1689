"""``recserve synth``: Criteo-shaped click logs of any size, written in chunks.

Each row is ``label, I1..I13, C1..C26`` like the Kaggle Display Advertising Challenge set:

- ``I*``: non-negative integer counts, log-normal (heavy-tailed), missing at Kaggle-like rates;
- ``C*``: 8-hex-digit IDs. Slot ``j`` has ``cardinality[j]`` possible IDs (the distinct counts of
  the Kaggle train set, times ``--scale``); an ID's rank is drawn from a truncated power law
  (Zipf-like, exponent ``ZIPF_S``), so a few IDs are very frequent and most are rare. The rank ->
  ID map is a fixed bijection of 32-bit integers per slot, the same in every file;
- ``label``: Bernoulli(sigmoid(logit)) of a hidden logistic model over some slots (a weight per
  ID) and the log-counts. The model depends on ``--model-seed`` only, so files written with
  different ``--seed`` (a training and a test file) follow the same model and a trained model's
  test AUC means something.

Rows are made ``CHUNK_ROWS`` at a time from a generator seeded by (seed, chunk number), so a file is
the same for the same arguments whatever the machine, and memory stays one chunk. Everything is
vectorised numpy; pyarrow writes the text (headerless TSV, optionally gzip) or Parquet.

    recserve synth --rows 1000000 --out data/synth/train.tsv --seed 1
    recserve synth --rows 100000 --out data/synth/test.parquet --seed 2 --scale 0.01
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

if TYPE_CHECKING:
    import pyarrow as pa

CHUNK_ROWS = 1 << 16
ZIPF_S = 1.1  # rank frequency ~ rank^-s

# Distinct values per categorical column of the Criteo Kaggle train set (45.8M rows).
KAGGLE_CARDINALITY = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
# Approximate fraction of empty values per column in the Kaggle set.
C_MISSING = (
    0, 0, 0.034, 0.034, 0, 0.12, 0, 0, 0, 0, 0, 0.034, 0,
    0, 0, 0.034, 0, 0, 0.44, 0.44, 0.034, 0.76, 0, 0.034, 0.44, 0.44,
)  # fmt: skip
I_MISSING = (0.45, 0, 0.21, 0.22, 0.03, 0.22, 0.04, 0.001, 0.04, 0.45, 0.04, 0.77, 0.22)
I_MEDIAN = (1, 3, 8, 5, 2900, 33, 3, 7, 38, 1, 1, 0, 4)  # log-normal location per count column
I_SIGMA = 1.3  # log-normal shape: heavy right tail

# Hidden model: weight scale of an ID per slot (0: the slot carries no signal), dense coefficients.
ID_WEIGHT = (
    0.4, 0.3, 0.3, 0.3, 0.4, 0.5, 0.3, 0.4, 0.5, 0, 0.3, 0.3, 0.3,
    0.5, 0.3, 0.3, 0.5, 0, 0.3, 0.5, 0.3, 0.4, 0.5, 0.3, 0.4, 0,
)  # fmt: skip
DENSE_COEF = (0.15, -0.1, 0, 0.1, -0.05, 0, 0.2, 0, -0.1, 0.3, 0.2, 0, -0.1)
BIAS = -1.85  # ~25% positives (Kaggle: 25.6%)

COLUMNS = ["label"] + [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]
_HEX = np.frombuffer(b"0123456789abcdef", np.uint8)
# the two hex digits of every byte value, as the uint16 whose little-endian bytes spell them
_HEX_PAIRS = (_HEX[np.arange(256) >> 4] | (_HEX[np.arange(256) & 15].astype(np.uint16) << 8)).astype(
    np.uint16
)
_M64 = 0xFFFFFFFFFFFFFFFF


@dataclass(frozen=True)
class SynthConfig:
    """What ``recserve synth`` writes."""

    rows: int = 0
    """Rows to write."""
    out: str = ""
    """Output file: .tsv/.txt (headerless TSV, Criteo column order), .gz (gzip TSV), .parquet."""
    format: str = field(default="auto", metadata={"choices": ["auto", "tsv", "parquet"]})
    """tsv, parquet, or auto (from the suffix of ``out``)."""
    seed: int = 0
    """Seeds the rows (use different seeds for a training and a test file)."""
    model_seed: int = 0
    """Seeds the hidden model (keep it equal across the files of one data set)."""
    scale: float = 1.0
    """Multiplies the Kaggle per-slot cardinalities (C3: 10.1M at 1.0); small slots keep at least
    min(cardinality, 16) IDs."""

    def __post_init__(self) -> None:
        if self.rows < 1:
            raise ValueError("--rows must be >= 1")
        if not self.out:
            raise ValueError("--out is required")
        if not self.scale > 0:
            raise ValueError("scale must be > 0")
        if self.kind not in ("tsv", "parquet"):
            raise ValueError(f"format must be tsv, parquet or auto, got {self.format!r}")

    @property
    def kind(self) -> str:
        if self.format != "auto":
            return self.format
        return "parquet" if Path(self.out).suffix in (".parquet", ".pq") else "tsv"

    @property
    def cardinality(self) -> np.ndarray:
        k = np.asarray(KAGGLE_CARDINALITY, np.int64)
        return np.maximum(np.minimum(k, 16), np.round(k * self.scale).astype(np.int64))


# --- vectorised building blocks ----------------------------------------------------------------
def _mix(x: np.ndarray, key: int) -> np.ndarray:
    """splitmix64 of (x + key): a well-spread 64-bit hash of integers."""
    with np.errstate(over="ignore"):
        z = np.asarray(x, np.uint64) + np.uint64((key * 0x9E3779B97F4A7C15) & _M64)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _permute32(x: np.ndarray, key: int) -> np.ndarray:
    """A bijection of uint32 keyed by ``key`` (odd multiplies, an add and xorshifts): distinct
    ranks get distinct IDs, and the same rank differs between slots."""
    offset = np.uint32(int(_mix(np.array([key]), 0x5EED)[0]) & 0xFFFFFFFF)
    with np.errstate(over="ignore"):
        z = x.astype(np.uint32) * np.uint32(0x9E3779B1) + offset
        z ^= z >> np.uint32(15)
        z = z * np.uint32(0x85EBCA6B)
        z ^= z >> np.uint32(13)
        z = z * np.uint32(0xC2B2AE35)
        return z ^ (z >> np.uint32(16))


def zipf_ranks(rng: np.random.Generator, n: int, k: int, s: float = ZIPF_S) -> np.ndarray:
    """``n`` ranks in [0, k), P(rank r) ~ (r + 1)^-s (inverse CDF of a bounded power law)."""
    u = rng.random(n)
    a = 1.0 - s
    x = (1.0 + u * ((k + 1.0) ** a - 1.0)) ** (1.0 / a)
    ranks: NDArray[np.int64] = np.minimum(x.astype(np.int64) - 1, k - 1)
    return ranks


def hex_ids(slot: int, ranks: np.ndarray) -> np.ndarray:
    """(n, 8) uint8: the 8 lowercase hex digits of each rank's ID in ``slot``."""
    big_endian = _permute32(ranks, slot).astype(">u4").view(np.uint8).reshape(-1, 4)
    digits: NDArray[np.uint8] = _HEX_PAIRS[big_endian].view(np.uint8).reshape(-1, 8)
    return digits


def id_weights(slot: int, ranks: np.ndarray, scale: float, model_seed: int) -> np.ndarray:
    """The hidden model's weight of each ID: uniform with standard deviation ``scale``."""
    u = (_mix(ranks, (model_seed << 8) + slot) >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    weights: NDArray[np.float64] = (2.0 * u - 1.0) * (scale * np.sqrt(3.0))
    return weights


# --- one chunk ---------------------------------------------------------------------------------
@dataclass
class SynthRows:
    """Columns of ``n`` rows: label (n,), counts (13, n) with missing (13, n), ids (26, n, 8) hex
    digits with missing (26, n), and the hidden model's logit (n,) the label was drawn from."""

    label: np.ndarray
    counts: np.ndarray
    counts_missing: np.ndarray
    ids: np.ndarray
    ids_missing: np.ndarray
    logit: np.ndarray


def make_chunk(cfg: SynthConfig, index: int, n: int) -> SynthRows:
    rng = np.random.default_rng([cfg.seed, index])
    card = cfg.cardinality
    logit = np.full(n, BIAS)
    counts = np.empty((13, n), np.int64)
    counts_missing = rng.random((13, n)) < np.asarray(I_MISSING)[:, None]
    for j in range(13):
        raw = np.exp(rng.normal(np.log1p(I_MEDIAN[j]), I_SIGMA, n)) - 1.0
        counts[j] = np.minimum(raw, 1e9).astype(np.int64)
        if DENSE_COEF[j]:
            x = np.log1p(counts[j]) - np.log1p(I_MEDIAN[j])
            logit += np.where(counts_missing[j], 0.0, DENSE_COEF[j] * x)
    ids = np.empty((26, n, 8), np.uint8)
    ids_missing = rng.random((26, n)) < np.asarray(C_MISSING)[:, None]
    for j in range(26):
        ranks = zipf_ranks(rng, n, int(card[j]))
        ids[j] = hex_ids(j + 1, ranks)
        if ID_WEIGHT[j]:
            w = id_weights(j + 1, ranks, ID_WEIGHT[j], cfg.model_seed)
            logit += np.where(ids_missing[j], 0.0, w)
    label = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int8)
    return SynthRows(label, counts, counts_missing, ids, ids_missing, logit)


def batches(cfg: SynthConfig, threads: int = 2) -> Iterator[pa.RecordBatch]:
    """The file's record batches in order; chunks are made ``threads`` at a time (numpy releases
    the GIL in its array loops) with at most ``2 * threads`` in memory."""
    import collections
    from concurrent.futures import Future, ThreadPoolExecutor

    starts = iter(enumerate(range(0, cfg.rows, CHUNK_ROWS)))
    with ThreadPoolExecutor(threads) as pool:
        window: collections.deque[Future[pa.RecordBatch]] = collections.deque()
        while True:
            while len(window) < 2 * threads and (nxt := next(starts, None)) is not None:
                index, start = nxt
                n = min(CHUNK_ROWS, cfg.rows - start)
                window.append(pool.submit(_arrow_chunk, cfg, index, n))
            if not window:
                return
            yield window.popleft().result()


def _arrow_chunk(cfg: SynthConfig, index: int, n: int) -> pa.RecordBatch:
    return to_arrow(make_chunk(cfg, index, n))


def to_arrow(chunk: SynthRows) -> pa.RecordBatch:
    """The chunk as a pyarrow RecordBatch (nulls where missing); string columns share the numpy
    hex buffer (no per-value objects)."""
    import pyarrow as pa

    n = len(chunk.label)
    offsets = pa.py_buffer(np.arange(0, 8 * n + 1, 8, dtype=np.int32))
    arrays = [pa.array(chunk.label)]
    arrays += [pa.array(chunk.counts[j], mask=chunk.counts_missing[j]) for j in range(13)]
    for j in range(26):
        missing = chunk.ids_missing[j]
        valid = pa.py_buffer(np.packbits(~missing, bitorder="little"))
        data = pa.py_buffer(np.ascontiguousarray(chunk.ids[j]))
        arrays.append(
            pa.Array.from_buffers(pa.string(), n, [valid, offsets, data], null_count=int(missing.sum()))
        )
    return pa.record_batch(arrays, names=COLUMNS)


def write(cfg: SynthConfig) -> int:
    """Write the file (through a temporary name, renamed when complete); returns its size."""
    import gzip

    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    schema = to_arrow(make_chunk(cfg, 0, 1)).schema
    if cfg.kind == "parquet":
        writer = pq.ParquetWriter(tmp, schema, compression="snappy")
        sink = None
    else:
        # gzip level 1: ~4x faster than the default level, ~1.4x its size on this data
        sink = gzip.open(tmp, "wb", compresslevel=1) if out.suffix == ".gz" else pa.OSFile(str(tmp), "wb")
        options = pacsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
        writer = pacsv.CSVWriter(sink, schema, write_options=options)
    try:
        for batch in batches(cfg):
            writer.write_batch(batch)
    finally:
        writer.close()
        if sink is not None:
            sink.close()
    tmp.rename(out)
    return out.stat().st_size


# --- CLI -----------------------------------------------------------------------------------------
CONFIG = SynthConfig


def run(cfg: SynthConfig) -> int:
    t0 = time.perf_counter()
    size = write(cfg)
    dt = time.perf_counter() - t0
    print(
        f"wrote {cfg.rows:,} rows ({cfg.kind}, {size / 1e6:.1f} MB) to {cfg.out} in {dt:.1f} s "
        f"({cfg.rows / max(dt, 1e-9):,.0f} rows/s); seed {cfg.seed}, model seed {cfg.model_seed}, "
        f"scale {cfg.scale:g} (C3: {int(cfg.cardinality[2]):,} IDs)"
    )
    return 0
