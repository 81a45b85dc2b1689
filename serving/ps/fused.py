"""The optimizers' fast paths: compiled kernels that find each distinct sign's row and update it
and its state in one pass (``SparseOptimizer.fused`` names them; ``serving.ps.optim``).

Contract of a kernel, called by ``TableShard.apply_gradients`` for distinct signs and float32
rows, under the store's lock::

    kernel(table, keys, bits, rows, state, signs, grads, hyper, stamp, now, dirty) -> rows updated

``table``, ``keys``, ``bits``: the store's index (``index.find_one``); ``rows`` (capacity, dim)
float32; ``state``: the optimizer's state matrices in its ``state`` order (a tuple); ``grads``
(len(signs), dim) float32; ``hyper``: float64, the entry's ``hyper(cfg, step)``. A sign without a
row is skipped; an updated row gets ``stamp[row_at] = now`` and ``dirty[row_at] = True``. The float32
expressions are the numpy update's, in the same order, so both paths give the same bits
(``tests/serving/ps/test_fused.py`` checks every registered kernel).

Numba is imported here, not by ``optim``: a serving shard (numpy only) never loads it.
"""

from __future__ import annotations

import numba
import numpy as np

from serving.ps.index import find_one


@numba.njit(cache=True, nogil=True)
def sgd(table, keys, bits, rows, state, signs, grads, hyper, stamp, now, dirty):
    """``optim._sgd`` fused with the find; ``hyper``: (lr,)."""
    nlr = np.float32(-hyper[0])
    done = 0
    for i in range(len(signs)):
        row_at = find_one(table, keys, signs[i], bits)
        if row_at < 0:
            continue
        for j in range(rows.shape[1]):
            rows[row_at, j] = rows[row_at, j] + nlr * grads[i, j]
        stamp[row_at] = now
        dirty[row_at] = True
        done += 1
    return done


@numba.njit(cache=True, nogil=True)
def adagrad(table, keys, bits, rows, state, signs, grads, hyper, stamp, now, dirty):
    """``optim._adagrad`` fused with the find; ``state``: (sum,); ``hyper``: (lr, eps)."""
    (acc,) = state
    nlr = np.float32(-hyper[0])
    eps = np.float32(hyper[1])
    done = 0
    for i in range(len(signs)):
        row_at = find_one(table, keys, signs[i], bits)
        if row_at < 0:
            continue
        for j in range(rows.shape[1]):
            g = grads[i, j]
            s = acc[row_at, j] + g * g
            acc[row_at, j] = s
            std = np.sqrt(s) + eps
            rows[row_at, j] = rows[row_at, j] + nlr * g / std
        stamp[row_at] = now
        dirty[row_at] = True
        done += 1
    return done
