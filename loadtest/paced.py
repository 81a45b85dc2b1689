"""Paced load for the stream benches: ranking requests at a fixed rate from a few client threads,
every response recorded with when it came, its latency, its status and the delta that scored it.

    with Paced(endpoint, body, rate=25) as load:
        ...                                   # the load runs meanwhile
    r = load.responses()                      # Responses: one row per request, in arrival order

``interleaved`` loads several endpoints in turn (A B B A A B ...), so a busy minute of a shared
machine falls on each of them alike, and pools each one's latencies.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np
import orjson
from numpy.typing import NDArray

from serving.scoring.client import ScoringClient


@dataclass(frozen=True)
class Responses:
    """One row per request, in the order the responses came."""

    done: NDArray[np.float64]
    """Wall time (``time.time``) the response was read."""
    latency_s: NDArray[np.float64]
    status: NDArray[np.int64]
    """HTTP status (0: no response, the connection failed)."""
    delta_seq: NDArray[np.int64]
    """The delta of the embedding version that scored it (the response's ``versions``; -1 for a
    failed request)."""

    @classmethod
    def of(cls, rows: list[tuple[float, float, int, int]]) -> Responses:
        a = np.array(sorted(rows), np.float64).reshape(-1, 4)
        return cls(a[:, 0], a[:, 1], a[:, 2].astype(np.int64), a[:, 3].astype(np.int64))

    @classmethod
    def cat(cls, parts: list[Responses]) -> Responses:
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("done", "latency_s", "status",
                                                                             "delta_seq")))  # fmt: skip

    @property
    def ok(self) -> int:
        return int((self.status == 200).sum())

    def p99_ms(self) -> float | None:
        good = self.latency_s[self.status == 200]
        return round(float(np.percentile(good, 99)) * 1e3, 3) if len(good) else None


class Paced:
    """``rate`` requests/s of ``body`` to ``endpoint`` from ``threads`` clients, each on its own
    schedule (``threads / rate`` s apart, offset from each other), from ``__enter__`` to
    ``__exit__``. A request that comes due while its client still waits for the previous one goes
    as soon as that returns."""

    def __init__(self, endpoint: str, body: bytes, rate: float, threads: int = 4) -> None:
        if not rate > 0 or threads < 1:
            raise ValueError(f"need rate > 0 and threads >= 1, got {rate}, {threads}")
        self.endpoint, self.body, self.rate, self.threads = endpoint, body, rate, threads
        self._stop = threading.Event()
        self._rows: list[list[tuple[float, float, int, int]]] = [[] for _ in range(threads)]
        self._workers = [threading.Thread(target=self._client, args=(i,), name=f"paced-{i}", daemon=True)
                         for i in range(threads)]  # fmt: skip

    def _client(self, i: int) -> None:
        c, rows = ScoringClient(self.endpoint, None), self._rows[i]
        every = self.threads / self.rate
        due = time.monotonic() + i * every / self.threads
        try:
            while not self._stop.is_set():
                if (wait := due - time.monotonic()) > 0 and self._stop.wait(wait):
                    return
                t0 = time.perf_counter()
                try:
                    status, payload = c.post(self.body)
                except OSError:
                    status, payload = 0, b""
                latency = time.perf_counter() - t0
                seq = int(orjson.loads(payload)["versions"]["delta_seq"]) if status == 200 else -1
                rows.append((time.time(), latency, status, seq))
                due += every
        finally:
            c.close()

    def __enter__(self) -> Paced:
        for w in self._workers:
            w.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for w in self._workers:
            w.join(30)

    def responses(self) -> Responses:
        return Responses.of([r for rows in self._rows for r in rows])


def interleaved(endpoints: dict[str, str], body: bytes, rate: float, phase_s: float,
                rounds: int) -> dict[str, Responses]:  # fmt: skip
    """Load each endpoint for ``phase_s`` in turn, ``rounds`` times, the order reversed every other
    round (A B, B A, A B, ...: neither side always goes first); every side's responses, pooled."""
    names = list(endpoints)
    out: dict[str, list[Responses]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            with Paced(endpoints[name], body, rate) as load:
                time.sleep(phase_s)
            out[name].append(load.responses())
    return {n: Responses.cat(parts) for n, parts in out.items()}
