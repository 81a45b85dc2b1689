"""A recording load client: posts one body to a scoring endpoint at a fixed rate and keeps, per
response, when it ended, its latency, its status and the versions that scored it.

Each request carries an ``X-Request-Id`` of ten digits, ``<stream><n:09d>`` (``stream`` 1-9 names
the client, ``n`` counts its requests), which both frontends log as the impression's request id:
each answered request can be looked up in the impression log, and the samples' keys stay short
(14 bytes, not 36 with a generated id) in the trainer's dedupe set and in a bench's memory.

A response is *mixed* when an embedding version it read (the version it names, or any shard's)
differs from its dense version (as ``loadtest/locust_timeline.py`` tells it); its ``seq`` is the
lowest delta seq among the shards it read (what it holds of the stream for sure).
"""

from __future__ import annotations

import http.client
import threading
import time
from dataclasses import dataclass

import numpy as np
import orjson
from numpy.typing import NDArray

from loadtest import paced

RID_DIGITS = 10
"""A request id's digits: the stream (1-9), then the request's number (9 digits)."""


def request_id(stream: int, n: int) -> str:
    return f"{stream}{n:09d}"


def rid_ints(request_ids: list[str]) -> NDArray[np.int64]:
    """Request ids of ours as their integers (a ValueError for another)."""
    bad = [r for r in request_ids[:1000] if len(r) != RID_DIGITS or not r.isdigit()]
    if bad:
        raise ValueError(f"request ids not of this client: {bad[:3]}")
    return np.array(request_ids, dtype=f"S{RID_DIGITS}").astype(np.int64)


@dataclass(frozen=True)
class Responses:
    """One row per request, in the order they ended."""

    end: NDArray[np.float64]
    """time.time() when the response (or the error) came."""
    ms: NDArray[np.float64]
    status: NDArray[np.int64]
    """HTTP status; 0: no response (connection error, timeout)."""
    version: NDArray[np.int64]
    """The embedding version read (-1: none named)."""
    seq: NDArray[np.int64]
    """The lowest delta seq among the shards read (-1: none named)."""
    mixed: NDArray[np.bool_]
    rid: NDArray[np.int64]
    """The request id sent (as its integer)."""

    def window(self, a: float, b: float) -> Responses:
        m = (self.end >= a) & (self.end < b)
        return Responses(*(getattr(self, f)[m] for f in self.__dataclass_fields__))

    @classmethod
    def cat(cls, parts: list[Responses]) -> Responses:
        """``parts`` as one, in the order the responses ended."""
        rows = {f: np.concatenate([getattr(p, f) for p in parts]) for f in cls.__dataclass_fields__}
        order = np.argsort(rows["end"], kind="stable")
        return cls(**{f: v[order] for f, v in rows.items()})

    def paced(self) -> paced.Responses:
        """As ``loadtest.paced.Responses`` (what ``loadtest.stream_figures`` reads), each response's
        delta named across versions (``loadtest.published.code``)."""
        from loadtest.published import code

        return paced.Responses(self.end, self.ms / 1e3, self.status, code(self.version, self.seq))


def versions_of(payload: bytes) -> tuple[int, int, bool]:
    """(embedding version, lowest shard delta seq, mixed) of a 200 response's body."""
    v = orjson.loads(payload)["versions"]
    dense = str(v.get("dense", ""))
    shards = v.get("shards", [])
    read = {str(v.get("embedding", ""))} | {str(s) for s, _ in shards if s}
    seq = min((int(q) for _, q in shards), default=int(v.get("delta_seq", -1)))
    emb = str(v.get("embedding", ""))
    return int(emb) if emb.isdigit() else -1, seq, read != {dense}


class Recorder(threading.Thread):
    """Posts ``body`` to ``endpoint`` at ``rate`` requests/s (``clients`` connections, each on its
    own schedule, staggered) until ``stop``; ``responses()`` afterwards."""

    def __init__(self, endpoint: str, body: bytes, rate: float, stream: int, clients: int = 4) -> None:
        super().__init__(name=f"recorder-{stream}", daemon=True)
        if not 1 <= stream <= 9:
            raise ValueError(f"stream must be 1-9, got {stream}")
        self.endpoint, self.body, self.rate, self.stream, self.clients = endpoint, body, rate, stream, clients
        self.stop = threading.Event()
        self._rows: list[list[tuple]] = [[] for _ in range(clients)]
        self._count = iter(range(10**9))
        self._lock = threading.Lock()

    def run(self) -> None:
        workers = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(self.clients)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    def _client(self, i: int) -> None:
        from serving.scoring.client import ScoringClient

        c = ScoringClient(self.endpoint, None, timeout_s=10.0)
        every = self.clients / self.rate
        t = time.monotonic() + i * every / self.clients
        rows = self._rows[i]
        try:
            while not self.stop.is_set():
                if (wait := t - time.monotonic()) > 0 and self.stop.wait(wait):
                    return
                with self._lock:
                    n = next(self._count)
                c.headers["X-Request-Id"] = rid = request_id(self.stream, n)
                t0 = time.perf_counter()
                try:
                    status, payload = c.post(self.body)
                except (OSError, http.client.HTTPException):
                    status, payload = 0, b""
                ms = (time.perf_counter() - t0) * 1e3
                version, seq, mixed = versions_of(payload) if status == 200 else (-1, -1, False)
                rows.append((time.time(), ms, status, version, seq, mixed, int(rid)))
                t = max(t + every, time.monotonic() - every)  # a stall does not make a burst after it
        finally:
            c.close()

    def responses(self) -> Responses:
        rows = sorted(r for rs in self._rows for r in rs)
        cols: list[tuple] = list(zip(*rows, strict=True)) if rows else [()] * 7
        types = (np.float64, np.float64, np.int64, np.int64, np.int64, np.bool_, np.int64)
        return Responses(*(np.asarray(c, dtype=t) for c, t in zip(cols, types, strict=True)))
