"""The peer of ``make bench-train``: DLRM as a user would write it in plain PyTorch, no recserve.

Criteo-layout TSV (label, 13 integer columns, 26 hex categorical columns, no header) read with
pyarrow; each categorical column gets a vocabulary from the training file (``dictionary_encode``;
index 0 is "unseen", what a test value outside the vocabulary maps to); integer columns are
``log1p(max(x, 0))`` with missing as 0. One ``nn.EmbeddingBag`` per column with sparse gradients
(Adagrad, as torch's DLRM examples), the dense network Adam; the dense network is recserve's
``DLRM`` class, so the two trainers compare the embedding path, not two dense networks.

    python -m loadtest.peer_dlrm --train synth/train.tsv --test synth/test.tsv [--device cuda]

``--device cuda``: the tables, the dense network and the data on the GPU (the GPU peer of
``make bench-gpu``); the default trains on the CPU.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import torch
from torch import nn

from training.evaluate import auc_logloss
from training.models import ModelConfig, build_model

NUM_DENSE, NUM_SPARSE = 13, 26


def read_tsv(path: str) -> pa.Table:
    names = (
        ["label"] + [f"I{i}" for i in range(1, NUM_DENSE + 1)] + [f"C{i}" for i in range(1, NUM_SPARSE + 1)]
    )
    types = {n: pa.string() for n in names[1 + NUM_DENSE :]} | {
        n: pa.float64() for n in names[: 1 + NUM_DENSE]
    }
    return pcsv.read_csv(
        path,
        read_options=pcsv.ReadOptions(column_names=names),
        parse_options=pcsv.ParseOptions(delimiter="\t"),
        convert_options=pcsv.ConvertOptions(column_types=types),
    )


def encode(train: pa.Table, test: pa.Table) -> tuple[list[np.ndarray], list[np.ndarray], list[int]]:
    """Per categorical column: train and test indices into the training vocabulary (0: unseen)."""
    tr, te, sizes = [], [], []
    for i in range(1, NUM_SPARSE + 1):
        col = train.column(f"C{i}")
        vocab = pc.unique(col)
        tr.append(pc.fill_null(pc.index_in(col, vocab), -1).to_numpy().astype(np.int64) + 1)
        te.append(pc.fill_null(pc.index_in(test.column(f"C{i}"), vocab), -1).to_numpy().astype(np.int64) + 1)
        sizes.append(len(vocab) + 1)
    return tr, te, sizes


def dense(t: pa.Table) -> np.ndarray:
    cols = [pc.fill_null(t.column(f"I{i}"), 0.0).to_numpy() for i in range(1, NUM_DENSE + 1)]
    return np.log1p(np.maximum(np.stack(cols, axis=1), 0.0)).astype(np.float32)


class Embeddings(nn.Module):
    def __init__(self, sizes: list[int], dim: int):
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(n, dim, mode="sum", sparse=True) for n in sizes)
        for t in self.tables:
            nn.init.uniform_(t.weight, -0.01, 0.01)  # type: ignore[arg-type]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, 26) -> (B, 26, dim)
        return torch.stack([t(ids[:, i : i + 1]) for i, t in enumerate(self.tables)], dim=1)


def run(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    train_t, test_t = read_tsv(args.train), read_tsv(args.test)
    tr_ids, te_ids, sizes = encode(train_t, test_t)
    device = torch.device(args.device)

    def on(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device)

    x_tr, x_te = on(np.stack(tr_ids, 1)), on(np.stack(te_ids, 1))
    d_tr, d_te = on(dense(train_t)), on(dense(test_t))
    y_tr = on(train_t.column("label").to_numpy().astype(np.float32))
    y_te = test_t.column("label").to_numpy().astype(np.float32)
    mean, std = d_tr.mean(0), d_tr.std(0).clamp_min(1e-6)
    emb = Embeddings(sizes, args.dim).to(device)
    net = build_model(
        ModelConfig(num_slots=NUM_SPARSE, num_dense=NUM_DENSE, dim=args.dim,
                    dense_mean=mean.tolist(), dense_std=std.tolist())
    ).to(device)  # fmt: skip
    sparse_opt = torch.optim.Adagrad(list(emb.parameters()), lr=args.lr)
    dense_opt = torch.optim.Adam(net.parameters(), lr=args.dense_lr, foreach=True)
    loss_fn = nn.BCEWithLogitsLoss()
    n = len(y_tr)
    t_loop, steps = 0.0, 0
    for _ in range(args.epochs):
        order = torch.randperm(n, device=device)
        t1 = time.perf_counter()
        for s in range(0, n, args.batch_size):
            idx = order[s : s + args.batch_size]
            loss = loss_fn(net(emb(x_tr[idx]), d_tr[idx]), y_tr[idx])
            sparse_opt.zero_grad()
            dense_opt.zero_grad()
            loss.backward()
            sparse_opt.step()
            dense_opt.step()
            steps += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the loop's time includes its last queued kernels
        t_loop += time.perf_counter() - t1
    with torch.inference_mode():
        logits = torch.cat([
            net(emb(x_te[s : s + 8192]), d_te[s : s + 8192]) for s in range(0, len(y_te), 8192)
        ])  # fmt: skip
    auc, logloss = auc_logloss(y_te, torch.sigmoid(logits).cpu().numpy())
    return {
        "auc": auc,
        "logloss": logloss,
        "samples_per_s": n * args.epochs / t_loop,
        "train_s": t_loop,
        "wall_s": time.perf_counter() - t0,
        "steps": steps,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", required=True)
    p.add_argument("--test", required=True)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.005)
    p.add_argument("--dense-lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where it trains (default: cpu)")
    print(json.dumps(run(p.parse_args(argv))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
