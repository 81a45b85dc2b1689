"""The embedding worker as a library: route signs to PS shards, pool, and send gradients back.

``forward(batch)`` routes the batch's unique signs to their shards (``features.hashing.shard_of``),
queries all shards at once, and pools the rows per (row, slot) (``pooling``); it never inserts
(serving). The trainer (``training.ctx``) pools itself: ``lookup(signs, train=True)`` inserts
unseen signs, and ``push`` / ``push_lookup`` send per-sign gradients to the shards from
background threads (``updates.UpdateQueue``), returning at once.

Staleness bound K: a training lookup waits while more than K updates are in flight, so K=0 is
fully synchronous (every update is applied before the next lookup). ``push_lookup`` sends a
step's gradients with a later batch's lookup, one call per shard (the trainer's step). A
background update that fails is re-raised (as ``UpdateError``) by the next forward, push or
flush.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from features.batch import CompactBatch
from features.schema import Schema
from serving.worker.pooling import BatchError, make_plan, pool
from serving.worker.shards import HashRouter, InProcessShard, PSClient, ShardBackend, ShardError
from serving.worker.updates import UpdateError, UpdateQueue

if TYPE_CHECKING:
    from serving.rpc.tls import ClientTLS

_T = TypeVar("_T")

__all__ = [
    "BatchError",
    "EmbeddingWorker",
    "ForwardResult",
    "PSClient",
    "InProcessShard",
    "ShardBackend",
    "ShardError",
    "UpdateError",
    "WorkerConfig",
    "connect",
]


@dataclass
class WorkerConfig:
    """Embedding worker settings."""

    staleness: int = 0
    """K: a training lookup waits while more than K updates are in flight; 0 = synchronous."""
    update_threads: int = 2
    """Background threads sending updates."""
    fanout_threads: int = 4
    """Threads for concurrent shard calls (one call per shard runs on the caller's thread)."""

    def __post_init__(self) -> None:
        if self.staleness < 0:
            raise ValueError("staleness must be >= 0")
        if self.update_threads < 1 or self.fanout_threads < 1:
            raise ValueError("update_threads and fanout_threads must be >= 1")


@dataclass
class ForwardResult:
    pooled: np.ndarray
    """float32 (num_rows, num_slots, dim), C-contiguous."""
    version: tuple[str, int]
    """(embedding version, delta seq) this batch's rows were read from: the shards' version (the
    distinct ones joined by "," should shards have differed: an unpinned read across a switch) and
    the lowest delta seq among them; ("", -1) when no shard was asked."""
    shards: list[tuple[str, int]] = field(default_factory=list)
    """Per shard, the (version, delta seq) this batch read; ("", -1) for a shard not asked."""


class EmbeddingWorker:
    """Lookups and updates over a fixed list of shards (shard i owns ``shard_of(sign, n) == i``)."""

    def __init__(self, shards: Sequence[ShardBackend], schema: Schema, config: WorkerConfig | None = None):
        if not shards:
            raise ValueError("need at least one shard")
        self.shards = list(shards)
        self.schema = schema
        self.config = config or WorkerConfig()
        dims = {int(s.dim) for s in self.shards}
        if len(dims) != 1:
            raise ValueError(f"shards disagree on the embedding dim: {sorted(dims)}")
        self.dim = dims.pop()
        self.router = HashRouter(len(self.shards))
        self._fanout = ThreadPoolExecutor(self.config.fanout_threads, thread_name_prefix="worker-fanout")
        self._updates = UpdateQueue(self.config.update_threads)
        self._closed = False

    # ---- public API ----------------------------------------------------------------------------
    def forward(
        self, batch: CompactBatch, version: str = "", timeout_s: float | None = None
    ) -> ForwardResult:
        """Pooled embeddings of ``batch``; never inserts. ``version`` pins the embedding version
        every shard reads ("" = each shard's newest). ``timeout_s``: the caller's deadline, which
        bounds the shard calls (a replicated shard retries another replica within it)."""
        plan = make_plan(batch, self.schema)
        table, read = self.lookup(np.asarray(batch.signs), False, version, timeout_s)
        return ForwardResult(pool(plan, table), _summary(read), read)

    def lookup(
        self, signs: np.ndarray, train: bool, version: str = "", timeout_s: float | None = None
    ) -> tuple[np.ndarray, list[tuple[str, int]]]:
        """Rows (float32 (n, dim), ``signs`` order) of distinct ``signs`` from their shards, and
        per shard the (version, delta seq) it answered from: ``forward`` without the pooling, for
        a caller that pools itself (the trainer's step). ``train`` inserts unseen signs and first
        waits while more than K updates are in flight (the staleness bound)."""
        self._check_open()
        if train:
            self._updates.wait(self.config.staleness)
        else:
            self._updates.raise_error()
        return self._lookup(signs, insert=train, version=version, timeout_s=timeout_s)

    def push(self, signs: np.ndarray, grads: np.ndarray) -> None:
        """Queue per-sign gradients (float32 (n, dim), distinct signs) for their shards; returns
        at once and counts as one update in flight."""
        self._check_open()
        self._updates.raise_error()
        grads = self._checked_grads(signs, grads)
        signs = np.array(signs, dtype=np.uint64)
        self._updates.submit(lambda _: self._send(signs, grads))

    def push_lookup(self, signs: np.ndarray, grads: np.ndarray, lookup: np.ndarray) -> Future[np.ndarray]:
        """``push``, and in the same call to each shard (one round trip: the PS's UpdateLookup)
        the rows of distinct ``lookup`` signs, inserting, read after the update: a Future of float32
        (len(lookup), dim) in ``lookup`` order, failing with the call. These calls run one at a
        time in the order queued, each once at most K older updates are in flight, so the rows
        miss at most K updates queued before this one. A ``push`` queued after it runs on an update
        thread, unordered with it, so the rows may hold it too (fresher, never staler). The trainer
        sends a step's gradients with the batch after next's signs."""
        self._check_open()
        self._updates.raise_error()
        grads = self._checked_grads(signs, grads)
        signs, lookup = np.array(signs, dtype=np.uint64), np.array(lookup, dtype=np.uint64)
        rows: Future[np.ndarray] = Future()
        self._updates.submit(lambda seq: self._send_lookup(seq, signs, grads, lookup, rows), ordered=True)
        return rows

    def _checked_grads(self, signs: np.ndarray, grads: np.ndarray) -> np.ndarray:
        grads = np.array(grads, dtype=np.float32, order="C")  # a copy
        if grads.shape != (len(signs), self.dim) or not np.isfinite(grads).all():
            raise ValueError(f"push needs finite float32 grads of shape ({len(signs)}, {self.dim})")
        return grads

    def flush(self) -> None:
        """Wait until every queued update has been applied (re-raises a failed one)."""
        self._updates.wait(0)

    def close(self) -> None:
        """Apply queued updates, stop the threads and close the shards' connections."""
        if self._closed:
            return
        self._closed = True
        self._updates.close()
        self._fanout.shutdown(wait=True)
        for shard in self.shards:
            close = getattr(shard, "close", None)
            if callable(close):
                close()

    def __enter__(self) -> EmbeddingWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- state ---------------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        """Updates queued or being applied."""
        return self._updates.in_flight

    def version(self) -> tuple[str, int]:
        """(embedding version, min delta seq) over the shards; ("", -1) when a shard's is unknown."""
        versions = [v for s in self.shards if (v := getattr(s, "version", None)) is not None]
        if len(versions) != len(self.shards):
            return "", -1
        names = {v[0] for v in versions}
        return (names.pop() if len(names) == 1 else ""), min(int(v[1]) for v in versions)

    # ---- internals -----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("embedding worker is closed")

    def _fan_out(self, calls: Sequence[Callable[[], _T]], here: Sequence[bool] = ()) -> list[_T]:
        """Run the calls and return their results in order; raises the first failure after every
        call has finished. Calls marked in ``here`` (in-process gathers: co-located shards) run on
        this thread while the others (RPCs) run concurrently in the pool, the last of them on this
        thread too."""
        inline = [bool(here[i]) if i < len(here) else False for i in range(len(calls))]
        pooled = [i for i, x in enumerate(inline) if not x]
        if pooled:
            inline[pooled.pop()] = True
        futures = {i: self._fanout.submit(calls[i]) for i in pooled}
        results: dict[int, _T] = {}
        error: Exception | None = None
        for i in [i for i, x in enumerate(inline) if x] + pooled:
            try:
                results[i] = futures[i].result() if i in futures else calls[i]()
            except Exception as e:
                error = error or e
        if error is not None:
            raise error
        return [results[i] for i in range(len(calls))]

    def _lookup(
        self, signs: np.ndarray, insert: bool, version: str = "", timeout_s: float | None = None
    ) -> tuple[np.ndarray, list[tuple[str, int]]]:
        """Rows of ``signs`` from their shards, and per shard the (version, seq) it answered from."""
        read: list[tuple[str, int]] = [("", -1)] * len(self.shards)
        if not len(signs):
            return np.empty((0, self.dim), np.float32), read
        parts = self.router.split(signs)
        work = [
            (i, s, p) for i, (s, p) in enumerate(zip(self.shards, parts, strict=True)) if p is None or len(p)
        ]
        calls = [
            lambda s=s, p=p: s.rows(_part(signs, p), insert, version, timeout_s=timeout_s) for _, s, p in work
        ]
        results = self._fan_out(calls, [getattr(s, "local", False) for _, s, _ in work])
        for (i, _, _), (_, answered) in zip(work, results, strict=True):
            read[i] = (str(answered[0]), int(answered[1]))
        return self._table(len(signs), [p for _, _, p in work], [rows for rows, _ in results]), read

    def _table(self, n: int, parts: Sequence[np.ndarray | None], rows: Sequence[np.ndarray]) -> np.ndarray:
        """The (n, dim) rows in request order from each shard's rows of its ``parts``."""
        if len(parts) == 1 and parts[0] is None:
            return self._checked(rows[0], n)
        table = np.empty((n, self.dim), np.float32)
        for p, r in zip(parts, rows, strict=True):
            if p is None:
                raise AssertionError("the router split signs over several shards but left one part whole")
            table[p] = self._checked(r, len(p))
        return table

    def _checked(self, rows: np.ndarray, n: int) -> np.ndarray:
        if rows.shape != (n, self.dim):
            raise ShardError(f"a shard answered rows of shape {rows.shape} for {n} signs (dim {self.dim})")
        return rows

    def _send(self, signs: np.ndarray, sign_grads: np.ndarray) -> None:
        calls = [
            lambda s=s, p=p: s.update(_part(signs, p), _part(sign_grads, p))
            for s, p in zip(self.shards, self.router.split(signs), strict=True)
            if len(_part(signs, p))
        ]
        if calls:
            self._fan_out(calls)

    def _send_lookup(
        self, seq: int, signs: np.ndarray, grads: np.ndarray, lookup: np.ndarray, out: Future[np.ndarray]
    ) -> None:
        """``push_lookup``'s job: one ``update_lookup`` per shard owning some of either. Its
        Future fails with the ``UpdateError`` the next call would raise."""
        out.set_running_or_notify_cancel()  # not cancellable from here on
        try:
            self._updates.wait_older(seq, self.config.staleness)
            work = [
                (shard, u, lk)
                for shard, u, lk in zip(self.shards, self.router.split(signs), self.router.split(lookup), strict=True)
                if len(_part(signs, u)) or len(_part(lookup, lk))
            ]  # fmt: skip
            calls = [
                lambda s=s, u=u, lk=lk: s.update_lookup(_part(signs, u), _part(grads, u), _part(lookup, lk))
                for s, u, lk in work
            ]
            results = self._fan_out(calls)
            table = self._table(len(lookup), [lk for _, _, lk in work], [rows for rows, _ in results])
        except BaseException as e:
            failed = UpdateError(f"a background embedding update failed: {e}")
            failed.__cause__ = e
            out.set_exception(failed)
            raise
        out.set_result(table)


def connect(
    ps_addresses: list[str], schema: Schema, config: WorkerConfig | None = None, timeout_s: float = 5.0,
    token_file: str = "", tls: ClientTLS | None = None, health_poll_s: float = 0.5,
) -> EmbeddingWorker:  # fmt: skip
    """A worker over PS processes at ``ps_addresses``: shard i at entry i, a shard's replicas in
    one entry separated by "|" (``serving.worker.replicas.parse_ps_spec``). Waits up to
    ``timeout_s`` for each shard to answer (serving a version or not yet) and checks it is shard i
    of len(ps_addresses). ``token_file``: the training shards' admin token file (inserting
    lookups and updates need it); ``tls``: the shards' ``serving.rpc.tls.ClientTLS`` (None:
    plaintext); ``health_poll_s``: how often a replicated shard checks its replicas' health."""
    from serving.worker.replicas import connect_shards

    shards = connect_shards(ps_addresses, timeout_s, token_file, health_poll_s, tls)
    try:
        return EmbeddingWorker(shards, schema, config)
    except BaseException:
        for shard in shards:
            shard.close()
        raise


def _part(a: np.ndarray, positions: np.ndarray | None) -> np.ndarray:
    """A shard's part of ``a`` (``HashRouter.split``'s positions; None: all of it)."""
    return a if positions is None else a[positions]


def _summary(read: list[tuple[str, int]]) -> tuple[str, int]:
    """One (version, delta seq) for a batch: the shards' version (distinct ones joined by ",") and
    the lowest delta seq, over the shards that were asked."""
    asked = [(v, q) for v, q in read if v or q >= 0]
    if not asked:
        return "", -1
    return ",".join(sorted({v for v, _ in asked})), min(q for _, q in asked)
