"""A/A replays of the experiment rule on Criteo samples, and its power (issue 56, part 5).

The log: the 10,000 rows of data/criteo (train then test split, file order as arrival order), each
row one unit (its request id ``criteo-<row>``), scored out of fold by a logistic regression fitted
here with numpy (5 folds; hashed categoricals and log integers, full-batch Adagrad): the served
scores of a plain but honest model, not of recserve's DLRM. ``--samples N`` resamples N rows with
replacement (seeded), each a new unit, for a longer stream (default 50,000: the rule needs a few
thousand samples to see the power scenario's difference; ``--samples 0`` replays the rows once).

- A/A: both arms serve the same scores; each replay splits units by a salted stable hash (salts
  0..N-1) and feeds ``--chunk`` samples per look to ``stream.sequential.decide``: every promotion or
  abort is false. Target: false decisions <= 5% of replays (alpha = 0.05).
- Power: the control arm serves the model's scores with Gaussian noise on the logit
  (``--noise``), the candidate the clean ones (it should be promoted); then the other way round
  (it should be aborted). The samples each decision took are reported.

    python -m loadtest.aa_replays --replays 60 --out loadtest/results/aa.json
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from features.hashing import xxh64_strings
from loadtest.common import CRITEO_TEST, CRITEO_TRAIN, parse, parser, print_table, write_results
from stream.aa import aa_replays, in_candidate, replay
from stream.arms import auc, sample_logloss
from stream.sequential import SequentialConfig, Verdict

BUCKETS = 1 << 16


def read_criteo(paths: list[Path]) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.int64]]:
    """(labels, log integer features standardised (n, 13), hashed categorical buckets (n, 26))."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pacsv

    names = ["label"] + [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]
    tables = [
        pacsv.read_csv(
            str(p),
            read_options=pacsv.ReadOptions(column_names=names),
            parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False),
            convert_options=pacsv.ConvertOptions(column_types={c: pa.string() for c in names}),
        )
        for p in paths
    ]
    t = pa.concat_tables(tables)

    def numeric(c: str) -> NDArray[np.float64]:
        col = pc.if_else(pc.equal(t[c], ""), None, t[c])
        return np.asarray(pc.cast(col, pa.float64()).fill_null(0.0), dtype=np.float64)

    y = numeric("label")
    ints = np.log1p(np.maximum(np.stack([numeric(f"I{i}") for i in range(1, 14)], axis=1), 0.0))
    ints = (ints - ints.mean(0)) / (ints.std(0) + 1e-9)
    cats = np.stack(
        [
            (xxh64_strings(np.asarray(t[f"C{i}"].to_pylist(), dtype=np.str_), seed=i) % np.uint64(BUCKETS))
            for i in range(1, 27)
        ],
        axis=1,
    ).astype(np.int64)
    return y, ints, cats


def fit_predict(
    y: NDArray[np.float64], ints: NDArray[np.float64], cats: NDArray[np.int64], train: NDArray[np.bool_],
    epochs: int = 150, lr: float = 0.1, l2: float = 1e-4,
) -> NDArray[np.float64]:  # fmt: skip
    """Logistic regression fitted on the ``train`` rows (full-batch Adagrad); probabilities of all."""
    w, e, b = np.zeros(ints.shape[1]), np.zeros(BUCKETS), 0.0
    gw, ge, gb = np.full_like(w, 1e-8), np.full_like(e, 1e-8), 1e-8
    xi, xc, yt, n = ints[train], cats[train], y[train], int(train.sum())
    for _ in range(epochs):  # a loop per epoch; each is vectorised over the rows
        p = 1 / (1 + np.exp(-(b + xi @ w + e[xc].sum(1))))
        g = (p - yt) / n
        dw, db = xi.T @ g + l2 * w, float(g.sum())
        de = np.bincount(xc.ravel(), weights=np.repeat(g, xc.shape[1]), minlength=BUCKETS) + l2 * e
        gw, ge, gb = gw + dw * dw, ge + de * de, gb + db * db
        w, e, b = w - lr * dw / np.sqrt(gw), e - lr * de / np.sqrt(ge), b - lr * db / np.sqrt(gb)
    return 1 / (1 + np.exp(-(b + ints @ w + e[cats].sum(1))))


def out_of_fold(y: NDArray[np.float64], ints: NDArray[np.float64], cats: NDArray[np.int64], folds: int = 5,
                seed: int = 0) -> NDArray[np.float64]:  # fmt: skip
    """Each row's probability from the model fitted on the other folds."""
    fold = np.random.default_rng(seed).integers(0, folds, len(y))
    out = np.empty(len(y))
    for k in range(folds):
        out[fold == k] = fit_predict(y, ints, cats, fold != k)[fold == k]
    return out


def noisy(score: NDArray[np.float64], sd: float, seed: int) -> NDArray[np.float64]:
    """``score`` with N(0, sd) noise added to its logit: a worse model of the same calibration-ish."""
    s = np.clip(score, 1e-7, 1 - 1e-7)
    z = np.log(s / (1 - s)) + np.random.default_rng(seed).normal(0, sd, len(s))
    return 1 / (1 + np.exp(-z))


def power(units: NDArray[np.str_], good: NDArray[np.float64], bad: NDArray[np.float64], y: NDArray[np.float64],
          runs: int, cfg: SequentialConfig, chunk: int) -> dict:  # fmt: skip
    """Replays where the candidate is really better (``good`` vs control's ``bad``) and really worse."""
    out: dict = {}
    for name, ctrl, cand, want in (
        ("better", bad, good, Verdict.PROMOTE),
        ("worse", good, bad, Verdict.ABORT),
    ):
        rs = [replay(in_candidate(units, 1000 + s), ctrl, cand, y, cfg, chunk) for s in range(runs)]
        took = [r.samples for r in rs if r.decision.verdict is want]
        out[name] = {
            "runs": runs,
            "expected": want.value,
            "correct": len(took),
            "wrong": sum(r.decision.verdict not in (want, Verdict.CONTINUE) for r in rs),
            "samples_median": int(np.median(took)) if took else None,
            "samples_max": max(took) if took else None,
        }
    return out


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__)
    p.add_argument("--replays", type=int, default=60, help="A/A replays (default 60)")
    p.add_argument("--power-replays", type=int, default=20, help="replays per power scenario (default 20)")
    p.add_argument(
        "--samples",
        type=int,
        default=50_000,
        help="resample to this many rows (default 50000; 0: the rows once)",
    )
    p.add_argument("--chunk", type=int, default=1000, help="samples between two looks (default 1000)")
    p.add_argument("--metric", choices=["logloss", "ctr"], default="logloss")
    p.add_argument("--noise", type=float, default=1.0, help="logit noise of the worse model (default 1.0)")
    p.add_argument(
        "--out", type=Path, default=None, help="write the JSON here (default <results-dir>/aa.json)"
    )
    args = parse(p, argv, {"replays": 5, "power_replays": 2, "samples": 5000})
    cfg = SequentialConfig(metric=args.metric)

    t0 = time.perf_counter()
    y, ints, cats = read_criteo([CRITEO_TRAIN, CRITEO_TEST])
    score = out_of_fold(y, ints, cats)
    fit_s = time.perf_counter() - t0
    rows = np.arange(len(y))
    if args.samples:
        rows = np.random.default_rng(1).integers(0, len(y), args.samples)
    y, score = y[rows], score[rows]
    units = np.char.add("criteo-", np.arange(len(y)).astype(np.str_))
    bad = noisy(score, args.noise, seed=2)
    model = {
        "model": "numpy logistic regression, 5-fold out-of-fold scores on data/criteo (10,000 rows)",
        "auc": auc(score, y),
        "logloss": float(sample_logloss(score, y).mean()),
        "noisy_auc": auc(bad, y),
        "noisy_logloss": float(sample_logloss(bad, y).mean()),
        "ctr": float(y.mean()),
        "rows": len(rows),
        "resampled": bool(args.samples),
        "fit_s": round(fit_s, 2),
    }

    t1 = time.perf_counter()
    aa = aa_replays(units, score, y, args.replays, cfg, args.chunk)
    pw = power(units, score, bad, y, args.power_replays, cfg, args.chunk)
    result = {
        "replays": aa.replays,
        "false_promotions": aa.false_promotions,
        "false_aborts": aa.false_aborts,
        "false_decision_rate": aa.false_decision_rate,
        "samples": aa.samples,
        "alpha": aa.alpha,
        "samples_to_false_decision": aa.samples_to_false_decision,
        "chunk": args.chunk,
        "config": asdict(cfg),
        "data": model,
        "power": pw,
        "replay_s": round(time.perf_counter() - t1, 2),
        "target_met": aa.false_decision_rate <= 0.05,
    }
    print(f"model: AUC {model['auc']:.4f}, log loss {model['logloss']:.4f}; noisy: AUC "
          f"{model['noisy_auc']:.4f}, log loss {model['noisy_logloss']:.4f}; CTR {model['ctr']:.3f}")  # fmt: skip
    print_table(
        f"A/A: {aa.replays} replays of {aa.samples} samples, looks every {args.chunk}, alpha {aa.alpha}",
        [{k: result[k] for k in ("replays", "false_promotions", "false_aborts", "false_decision_rate")}],
        ["replays", "false_promotions", "false_aborts", "false_decision_rate"],
    )
    print_table(
        f"power: logit noise {args.noise} on the worse arm",
        [{"candidate": k, **v} for k, v in pw.items()],
        ["candidate", "runs", "expected", "correct", "wrong", "samples_median", "samples_max"],
    )
    print(f"\n  [{'met' if result['target_met'] else 'MISSED'}] false decisions <= 5% of replays")
    if args.out:
        write_results(args.out.stem, result, args.out.parent)
    else:
        write_results("aa", result, args.results_dir)
    return result


if __name__ == "__main__":
    main()
