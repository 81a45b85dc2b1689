"""Paced load for the benches: ranking requests at a fixed rate from a few client threads, every
response recorded with when it came, its latency, its status and the delta that scored it.

    with Paced(endpoint, body, rate=25) as load:
        ...                                   # the load runs meanwhile
    r = load.responses()                      # Responses: one row per request, in arrival order

Arrivals keep their schedule whatever the answers take (open loop). Latency counts from the send,
or with ``from_schedule`` from when the request was due, as wrk2 counts it: a request that waited
for its client's previous answer counts that wait too, so queueing in the server shows in the
figures instead of thinning the arrivals (what a closed loop, locust's users, hides).

``interleaved`` loads several endpoints in turn (A B B A A B ...), so a busy minute of a shared
machine falls on each of them alike, and pools each one's latencies.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
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
    as soon as that returns. ``body`` may be several bodies, sent in turn; ``key_file``: the
    frontend's token file (token auth on); ``from_schedule``: latency from when each was due."""

    def __init__(self, endpoint: str, body: bytes | Sequence[bytes], rate: float, threads: int = 4, *,
                 key_file: str | None = None, from_schedule: bool = False) -> None:  # fmt: skip
        if not rate > 0 or threads < 1:
            raise ValueError(f"need rate > 0 and threads >= 1, got {rate}, {threads}")
        self.endpoint, self.rate, self.threads = endpoint, rate, threads
        self.body = [body] if isinstance(body, bytes) else list(body)
        self.key_file, self.from_schedule = key_file, from_schedule
        self._stop = threading.Event()
        self._rows: list[list[tuple[float, float, int, int]]] = [[] for _ in range(threads)]
        self._workers = [threading.Thread(target=self._client, args=(i,), name=f"paced-{i}", daemon=True)
                         for i in range(threads)]  # fmt: skip

    def _client(self, i: int) -> None:
        c, rows = ScoringClient(self.endpoint, self.key_file), self._rows[i]
        every = self.threads / self.rate
        due, n = time.monotonic() + i * every / self.threads, i
        try:
            while not self._stop.is_set():
                if (wait := due - time.monotonic()) > 0 and self._stop.wait(wait):
                    return
                t0 = due if self.from_schedule else time.monotonic()
                try:
                    status, payload = c.post(self.body[n % len(self.body)])
                except OSError:
                    status, payload = 0, b""
                latency = time.monotonic() - t0
                seq = int(orjson.loads(payload)["versions"]["delta_seq"]) if status == 200 else -1
                rows.append((time.time(), latency, status, seq))
                due, n = due + every, n + self.threads
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
