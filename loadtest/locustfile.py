"""Locust user for the scoring endpoint: 200-item JSON requests from the Criteo test rows.

    locust -f loadtest/locustfile.py --headless --host http://127.0.0.1:8080 -u 10 -r 10 -t 30s \
        --total-rate 50 --latency-out /tmp/lat.txt [--key-file key_file.json] [--model criteo]

Each user posts to ``/predictions/<model>``, cycling through the requests cut from the test split
(2,000 rows -> ten 200-row requests), paced by ``constant_throughput`` so that ``-u N`` users make
``--total-rate`` requests/s in all. With ``--key-file`` (TorchServe's key_file.json) every request
carries the inference token. Every request's exact latency (perf_counter ms, as locust measures it)
and outcome is appended to ``--latency-out`` when the run stops, so p50/p99 are exact rather than
locust's rounded histogram buckets. ``loadtest/bench_e2e.py`` drives this file.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from locust import FastHttpUser, constant_throughput, events, task

ROOT = Path(__file__).resolve().parent.parent
TEST = ROOT / "data" / "criteo" / "wide_resdnn_criteo_test.tsv"
SCHEMA = ROOT / "data" / "schemas" / "criteo.yaml"

_bodies: list[bytes] = []  # filled once per process in on_test_start
_latencies: list[tuple[float, int]] = []  # (ms, 1 if failed)


@events.init_command_line_parser.add_listener
def _args(parser) -> None:
    parser.add_argument("--total-rate", type=float, default=10.0, help="requests/s of all users together")
    parser.add_argument("--key-file", default="", help="TorchServe key_file.json (token auth on)")
    parser.add_argument("--model", default="criteo", help="model name in /predictions/<model>")
    parser.add_argument("--latency-out", default="", help="file for every request's latency (ms, failed)")
    parser.add_argument("--data", default=str(TEST), help="Criteo TSV rows to build requests from")
    parser.add_argument("--rows", type=int, default=200, help="items per request")


@events.init.add_listener
def _load(environment, **_) -> None:
    from serving.client import requests_from_file

    opts = environment.parsed_options
    if not _bodies:
        _bodies.extend(body for body, _ in requests_from_file(opts.data, str(SCHEMA), opts.rows))


@events.request.add_listener
def _record(response_time, exception, **_) -> None:
    _latencies.append((float(response_time), 1 if exception else 0))


@events.quitting.add_listener
def _dump(environment, **_) -> None:
    out = environment.parsed_options.latency_out
    if out:
        with open(out, "w") as f:
            f.writelines(f"{ms:.4f} {failed}\n" for ms, failed in _latencies)


class ScoringUser(FastHttpUser):
    """One client posting ranking requests at ``--total-rate / users`` requests/s."""

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        users = max(1, self.environment.runner.target_user_count or 1)
        self._pace = constant_throughput(opts.total_rate / users)
        self._path = f"/predictions/{opts.model}"
        self._headers = {"Content-Type": "application/json"}
        if opts.key_file:
            key = json.loads(Path(opts.key_file).read_text())["inference"]["key"]
            self._headers["Authorization"] = f"Bearer {key}"
        # users start at different requests, so concurrent users do not send identical bodies
        start = self.environment.runner.user_count % len(_bodies)
        self._cycle = itertools.islice(itertools.cycle(_bodies), start, None)

    def wait_time(self) -> float:
        return self._pace(self)

    @task
    def score(self) -> None:
        with self.client.post(
            self._path, data=next(self._cycle), headers=self._headers, catch_response=True
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {(resp.text or '')[:200]}")
            elif b'"scores"' not in (resp.content or b""):
                resp.failure("200 without scores")
