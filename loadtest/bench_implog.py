"""What the impression log costs a request: `recserve serve` + co-located lookups at 50 rps, log on /
off, measured in the same run.

    python -m loadtest.bench_implog [--quick] [--results-dir DIR] [--store DIR] [--rate 50]
                                    [--duration 30] [--pairs 3]

Two `recserve serve` processes over one store, one with ``--log-impressions
kafka://<mock cluster>/impressions`` (``loadtest.mockbroker``, a process of its own) and one
without, both started before any load; locust then loads them in turn, off / on, ``--pairs`` times,
so a busy minute of a shared machine falls on both. ``logging_p99_ratio`` is the median p99 with
the log on over the median p99 with it off (target <= 1.15). The logging frontend's /metrics says
how many impressions the broker acknowledged and how many were dropped (every request logged: 0
dropped). Writes ``loadtest/results/implog.json``.

``--quick``: 10 rps for 2 s, one pair (checks the bench, not the system).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from loadtest.common import (
    given_or_trained,
    parse,
    parser,
    print_table,
    report_targets,
    write_results,
)
from loadtest.drive import lean_frontend, run_locust, warm_up
from model_store.dense import AUTO
from serving.scoring.impressions import DROPPED, LOGGED

TARGET_RATIO = 1.15
TOPIC = "impressions"


def log_counters(endpoint: str) -> dict[str, int]:
    """The impression counters on the /metrics of the frontend at ``endpoint``."""
    from prometheus_client.parser import text_string_to_metric_families

    host = endpoint.split("/predictions/")[0]
    with urllib.request.urlopen(f"{host}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {"logged": 0, "dropped": 0}
    for family in text_string_to_metric_families(text):
        for name, key in ((LOGGED, "logged"), (DROPPED, "dropped")):
            out[key] += int(sum(s.value for s in family.samples if s.name == name))
    return out


def settled(endpoint: str, before: dict[str, int], n: int, timeout_s: float = 15.0) -> dict[str, int]:
    """The counters once ``n`` impressions since ``before`` are settled (acknowledged or dropped),
    or as they are after ``timeout_s`` (the last deliveries wait out the producer's linger)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = log_counters(endpoint)
        if sum(now.values()) - sum(before.values()) >= n or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--store", help="existing model store (default: train one into a temp dir)")
    p.add_argument("--model", default="criteo")
    p.add_argument("--rate", type=float, default=50.0, help="requests/s")
    p.add_argument("--duration", type=float, default=30.0, help="seconds per run")
    p.add_argument("--pairs", type=int, default=3, help="off/on runs, interleaved")
    p.add_argument("--warmup-s", type=float, default=10.0, help="warm-up of each frontend, seconds")
    args = parse(p, argv, {"rate": 10.0, "duration": 2.0, "pairs": 1, "warmup_s": 1.0})

    import contextlib

    from loadtest import mockbroker
    from loadtest.drive import request_bodies

    work = Path(tempfile.mkdtemp(prefix="bench-implog-"))
    try:
        store = given_or_trained(args.store, work)
        bodies = request_bodies()
        with contextlib.ExitStack() as es:
            broker = es.enter_context(mockbroker.running([mockbroker.TopicSpec(TOPIC)]))
            url = f"kafka://{broker.bootstrap}/{TOPIC}"
            sides = {}
            for side, extra in (("off", ()), ("on", ("--log-impressions", url))):
                (work / side).mkdir()
                endpoint, procs = es.enter_context(
                    lean_frontend(store, args.model, "colocated", None, work / side, AUTO, 1.0, extra)
                )
                n = warm_up(endpoint, None, bodies, args.warmup_s)
                print(f"log {side}: {endpoint}; warm-up {n} requests", flush=True)
                sides[side] = (endpoint, procs)
            before = settled(sides["on"][0], {"logged": 0, "dropped": 0}, n)  # the warm-up's, all settled
            runs: dict[str, list[dict]] = {"off": [], "on": []}
            for i in range(args.pairs):
                for side in ("off", "on"):
                    endpoint, procs = sides[side]
                    host = endpoint.split("/predictions/")[0]
                    r = run_locust(host, args.model, args.rate, args.duration, None, work / side, procs)
                    runs[side].append(r)
                    print(f"  pair {i + 1}, log {side}: p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms, "
                          f"{r['requests']} requests, {r['failures']} failures", flush=True)  # fmt: skip
            on_requests = sum(r["requests"] + r["failures"] for r in runs["on"])
            after = settled(sides["on"][0], before, on_requests)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    p99 = {side: statistics.median(r["p99_ms"] for r in rs) for side, rs in runs.items()}
    ratio = round(p99["on"] / p99["off"], 3)
    counters = {k: after[k] - before[k] for k in after}
    out = {
        "logging_p99_ratio": ratio,
        "p99_ms": p99,
        "runs": runs,
        "impressions": {**counters, "requests_logged_side": on_requests},
        "conditions": {
            "frontend": "recserve serve",
            "lookups": "colocated",
            "rate_rps": args.rate,
            "duration_s": args.duration,
            "pairs": args.pairs,
            "request_items": 200,
            "broker": "librdkafka mock cluster, 3 brokers, one process",
            "note": "locust, both frontends and the mock broker share this machine",
        },  # fmt: skip
    }
    print_table(
        f"recserve serve + co-located at {args.rate:g} rps, impression log off / on",
        [{"log": side, "pair": i + 1, **r} for side, rs in runs.items() for i, r in enumerate(rs)],
        ["log", "pair", "p50_ms", "p99_ms", "max_ms", "requests", "failures"],
    )
    print(f"\nlogging_p99_ratio {ratio} (median p99 on {p99['on']} ms / off {p99['off']} ms); impressions "
          f"logged {counters['logged']}, dropped {counters['dropped']} of {on_requests} requests")  # fmt: skip
    report_targets(out, {f"logging_p99_ratio_le_{TARGET_RATIO}": ratio <= TARGET_RATIO,
                         "no_failures": all(r["failures"] == 0 for rs in runs.values() for r in rs)})  # fmt: skip
    path = write_results("implog", out, args.results_dir)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
