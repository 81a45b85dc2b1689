"""Locust user for the scoring endpoint: 200-item JSON requests from the Criteo test rows.

    locust -f loadtest/locustfile.py --headless --host http://127.0.0.1:8080 -u 10 -r 10 -t 30s \
        --total-rate 50 --latency-out /tmp/lat.txt [--key-file key_file.json] [--model criteo]

Each user posts to ``/predictions/<model>``, cycling through the requests cut from the test split
(2,000 rows -> ten 200-row requests), paced at a constant throughput so that ``-u N`` users make
``--total-rate`` requests/s in all, evenly spaced. With ``--key-file`` (TorchServe's key_file.json) every request
carries the inference token. Every request's exact latency (perf_counter ms, as locust measures it),
outcome and the handler's ``Server-Timing`` header (its stage times) are written, tab-separated, to
``--latency-out`` when the run stops, so p50/p99 are exact rather than locust's rounded buckets.
``loadtest/drive.py`` (``run_locust``) drives this file for ``loadtest/bench_e2e.py`` and the others.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import gevent
from locust import FastHttpUser, events, task

ROOT = Path(__file__).resolve().parent.parent
TEST = ROOT / "data" / "criteo" / "wide_resdnn_criteo_test.tsv"
SCHEMA = ROOT / "data" / "schemas" / "criteo.yaml"

_bodies: list[bytes] = []  # filled once per process in on_test_start
_user_index = itertools.count()  # the order users started in: their slot in the schedule
_t0: list[float] = []  # the schedule's start (set by the first user)
_latencies: list[tuple] = []  # (ms, 1 if failed, Server-Timing header or "")


@events.init_command_line_parser.add_listener
def _args(parser) -> None:
    parser.add_argument("--total-rate", type=float, default=10.0, help="requests/s of all users together")
    parser.add_argument("--key-file", default="", help="TorchServe key_file.json (token auth on)")
    parser.add_argument("--model", default="criteo", help="model name in /predictions/<model>")
    parser.add_argument("--latency-out", default="", help="file for every request's latency (ms, failed)")
    parser.add_argument("--data", default=str(TEST), help="Criteo TSV rows to build requests from")
    parser.add_argument("--rows", type=int, default=200, help="items per request")
    parser.add_argument("--columns", action="store_true", help="send ranking requests in column form")
    parser.add_argument(
        "--binary-schema", default="", help="send compact batches built with this (served) schema.yaml"
    )


@events.init.add_listener
def _load(environment, **_) -> None:
    from serving.scoring.client import requests_from_file

    opts = environment.parsed_options
    if not _bodies:
        binary = bool(opts.binary_schema)
        schema = opts.binary_schema or str(SCHEMA)
        _bodies.extend(
            body
            for body, _ in requests_from_file(
                opts.data, schema, opts.rows, binary=binary, columns=opts.columns
            )
        )


@events.request.add_listener
def _record(response_time, exception, response=None, **_) -> None:
    timing = getattr(response, "headers", None) and response.headers.get("Server-Timing")
    _latencies.append((float(response_time), 1 if exception else 0, timing or ""))


@events.quitting.add_listener
def _dump(environment, **_) -> None:
    out = environment.parsed_options.latency_out
    if out:
        with open(out, "w") as f:
            f.writelines(f"{ms:.4f}\t{failed}\t{timing}\n" for ms, failed, timing in _latencies)


class ScoringUser(FastHttpUser):
    """One client posting ranking requests at ``--total-rate / users`` requests/s.

    Pacing is ``constant_throughput`` on an absolute, staggered schedule: user i's k-th request
    is due at ``t0 + (i + k * users) / total_rate``, so the users' requests interleave evenly
    instead of arriving in bursts (users started together and paced alike fire together, and a
    burst of N requests queues N-deep at the handler), and a late request does not shift the
    ones after it."""

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self._users = max(1, int(getattr(opts, "num_users", 1) or 1))
        self._rate = float(opts.total_rate)
        self._index, self._k = next(_user_index), 0
        if not _t0:
            _t0.append(time.time() + 1.0)  # every user is started by then (spawn rate = users/s)
        self._path = f"/predictions/{opts.model}"
        binary = bool(opts.binary_schema)
        self._headers = {"Content-Type": "application/octet-stream" if binary else "application/json"}
        if opts.key_file:
            key = json.loads(Path(opts.key_file).read_text())["inference"]["key"]
            self._headers["Authorization"] = f"Bearer {key}"
        # users start at different requests, so concurrent users do not send identical bodies
        self._cycle = itertools.islice(itertools.cycle(_bodies), self._index % len(_bodies), None)
        gevent.sleep(self.wait_time())

    def wait_time(self) -> float:
        due = _t0[0] + (self._index + self._k * self._users) / self._rate
        self._k += 1
        return max(0.0, due - time.time())

    @task
    def score(self) -> None:
        # locust annotates ``data`` as str | dict, but documents and sends bytes as they are
        with self.client.post(
            self._path,
            data=next(self._cycle),  # type: ignore[arg-type]
            headers=self._headers,
            catch_response=True,
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {(resp.text or '')[:200]}")
            elif b'"scores"' not in (resp.content or b""):
                resp.failure("200 without scores")
