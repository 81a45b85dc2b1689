"""TorchServe's own latency share: start-to-healthy, and echo-handler latency sequentially and at 50 rps.

    python -m loadtest.ts_overhead [--rate 50] [--duration 15] [--rounds 2] [--settings bs1_w1,...] [--quick]
                                   [--results-dir DIR]

The echo handler (tests/serving/torchserve/echo_handler.py) parses the ~20 KB JSON body and answers ~100
bytes, so what is measured is TorchServe (HTTP in, queue, batching, the frontend<->worker hop, the
Python worker loop) plus this stdlib client. Each batching/worker setting is its own model; server
level variants get their own TorchServe. Settings are measured round-robin and the median of the
rounds is reported, because this 2-core machine is shared. Prints a table and writes
loadtest/results/ts_overhead.json. ``--quick``: one setting, one round, 2 s at the rate.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from loadtest.common import ROOT, Stopwatch, call_times, parse, parser, percentiles_ms, write_results
from serving.rpc.procs import free_ports
from serving.torchserve import TorchServe, TorchServeConfig, archive

HANDLER = ROOT / "tests" / "serving" / "torchserve" / "echo_handler.py"

# TorchServe's own out-of-the-box logging/metrics, to show what our TorchServeConfig defaults change.
STOCK = {"log_level": "DEBUG", "async_logging": False, "metrics_mode": "log", "disable_system_metrics": False}
# Server-level variants (each gets its own TorchServe): name -> TorchServeConfig overrides.
SERVERS: dict[str, dict[str, Any]] = {
    "default": {},
    "netty1": {"netty_threads": 1, "netty_client_threads": 1},
    "stock": STOCK,
    # the JVM's collector (G1 is the JVM's choice on 2 cores): the frontend's p99 is what it may move
    "serialgc": {"jvm_options": ("-XX:+UseSerialGC",)},
    "parallelgc": {"jvm_options": ("-XX:+UseParallelGC",)},
}
# name -> (server, workers, batch_size, max_batch_delay_ms)
SETTINGS = {
    "bs1_w1": ("default", 1, 1, 1),
    "bs8_d2_w1": ("default", 1, 8, 2),
    "bs8_d5_w1": ("default", 1, 8, 5),
    "bs1_w2": ("default", 2, 1, 1),
    "bs8_d2_w2": ("default", 2, 8, 2),
    "bs1_w1_netty1": ("netty1", 1, 1, 1),
    "bs1_w1_stock_logging": ("stock", 1, 1, 1),
    "bs1_w1_serialgc": ("serialgc", 1, 1, 1),
    "bs1_w1_parallelgc": ("parallelgc", 1, 1, 1),
}


def make_body(i: int, target_bytes: int = 20_000) -> bytes:
    """A ranking-request-shaped JSON body of about ``target_bytes``."""
    items: list[dict[str, Any]] = []
    body = b""
    while len(body) < target_bytes:
        n = len(items)
        items.append({"item_id": 1_000_000 + n, "cat": f"c{n % 37}", "price": 1.5 * n, "tags": [n, n + 1]})
        body = json.dumps({"id": i, "context": {"user_id": 12345, "device": "ios"}, "items": items}).encode()
    return body


def config_for(store: Path, run_dir: Path, **overrides) -> TorchServeConfig:
    names = (
        "inference_port",
        "management_port",
        "metrics_port",
        "grpc_inference_port",
        "grpc_management_port",
    )
    ports: dict[str, Any] = dict(zip(names, free_ports(5), strict=True))
    return TorchServeConfig(model_store=store, run_dir=run_dir, **ports, **overrides)


class Client:
    """One keep-alive HTTP connection to the inference API."""

    def __init__(self, ts: TorchServe):
        self.conn = http.client.HTTPConnection(ts.cfg.host, ts.cfg.inference_port, timeout=30)
        token = ts.inference().inference_token()
        self.headers = {"Content-Type": "application/json"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"

    def post(self, path: str, body: bytes) -> int:
        self.conn.request("POST", path, body=body, headers=self.headers)
        resp = self.conn.getresponse()
        resp.read()
        return resp.status


def sequential(ts: TorchServe, path: str, bodies: list[bytes], n: int) -> dict:
    client = Client(ts)
    statuses: list[int] = []
    lat = call_times(lambda body: statuses.append(client.post(path, body)), n, 0.0, bodies, warmup=0)
    return {**percentiles_ms(lat), "requests": n, "failures": sum(s != 200 for s in statuses)}


def fixed_rate(
    ts: TorchServe, path: str, bodies: list[bytes], rate: float, duration: float, threads: int = 4
) -> dict:
    """Open loop: request i is due at t0 + i/rate; latency counts from when it was due (no coordinated omission)."""
    total = int(rate * duration)
    lock = threading.Lock()
    next_i = [0]
    lat, service, failures = [], [], [0]
    t0 = time.perf_counter() + 0.1

    def run() -> None:
        client = Client(ts)
        while True:
            with lock:
                i = next_i[0]
                next_i[0] += 1
            if i >= total:
                return
            due = t0 + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            sent = time.perf_counter()
            try:
                ok = client.post(path, bodies[i % len(bodies)]) == 200
            except OSError:
                ok, client = False, Client(ts)
            done = time.perf_counter()
            with lock:
                lat.append(done - due)
                service.append(done - sent)
                failures[0] += not ok

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    achieved = total / (time.perf_counter() - t0)
    return {
        **percentiles_ms(lat),
        "service": percentiles_ms(service),
        "requests": total,
        "failures": failures[0],
        "achieved_rps": round(achieved, 1),
    }


def median_of(rounds: list[dict]) -> dict:
    """Per-key median over rounds (the machine is shared: one round can be hit by a neighbour)."""
    out = {}
    for key, value in rounds[0].items():
        if isinstance(value, dict):
            out[key] = median_of([r[key] for r in rounds])
        elif isinstance(value, (int, float)):
            out[key] = round(statistics.median(r[key] for r in rounds), 3)
    return out


def time_starts(store: Path, work: Path, n: int) -> dict:
    starts = []
    for k in range(n):
        ts = TorchServe(config_for(store, work / f"start{k}"))
        sw = Stopwatch()
        ts.start()
        try:
            ts.wait_healthy(120)
            starts.append(sw.s)
        finally:
            ts.stop()
    return {"median": round(statistics.median(starts), 3), "all": [round(s, 3) for s in starts]}


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--rate", type=float, default=50.0)
    p.add_argument("--duration", type=float, default=15.0, help="seconds at --rate, per setting and round")
    p.add_argument("--sequential", type=int, default=500)
    p.add_argument(
        "--warmup", type=int, default=1500, help="sequential requests per setting before measuring (JIT)"
    )
    p.add_argument("--rounds", type=int, default=2, help="settings are measured round-robin this many times")
    p.add_argument("--starts", type=int, default=3, help="start/stop cycles timed for start-to-healthy")
    p.add_argument(
        "--settings", default=",".join(SETTINGS), help="comma-separated subset of " + ",".join(SETTINGS)
    )
    quick = {"settings": "bs1_w1", "rounds": 1, "starts": 1, "duration": 2.0, "sequential": 20, "warmup": 20}
    args = parse(p, argv, quick)
    chosen = args.settings.split(",")

    work = Path(tempfile.mkdtemp(prefix="ts_overhead-"))
    store = work / "store"
    for name in chosen:
        archive(HANDLER, [], name, "1.0", store)
    bodies = [make_body(i) for i in range(16)]
    out: dict = {
        "machine": {"cpus": os.cpu_count(), "nice": os.nice(0), "loadavg_before": os.getloadavg()},
        "body_bytes": len(bodies[0]),
        "rate_rps": args.rate,
        "duration_s": args.duration,
        "rounds": args.rounds,
    }
    servers: dict[str, TorchServe] = {}
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, work, ignore_errors=True)  # runs last, after every server stopped
        out["start_to_healthy_s"] = time_starts(store, work, args.starts)
        for server in sorted({SETTINGS[n][0] for n in chosen}):
            servers[server] = stack.enter_context(
                TorchServe(config_for(store, work / server, **SERVERS[server]))
            )
        for name in chosen:
            server, workers, batch, delay = SETTINGS[name]
            ts = servers[server]
            ts.management().register(
                f"{name}-1.0.mar", name, initial_workers=workers, batch_size=batch, max_batch_delay_ms=delay
            )
            sequential(ts, f"/predictions/{name}", bodies, args.warmup)
        rounds: dict[str, list[dict]] = {n: [] for n in chosen}
        for k in range(args.rounds):
            for name in chosen:
                ts, path = servers[SETTINGS[name][0]], f"/predictions/{name}"
                seq = sequential(ts, path, bodies, args.sequential)
                rated = fixed_rate(ts, path, bodies, args.rate, args.duration)
                rounds[name].append({"sequential": seq, "rate": rated})
                print(
                    f"  round {k + 1}/{args.rounds} {name}: {args.rate:g} rps p99 {rated['p99_ms']:.2f} ms",
                    flush=True,
                )
        out["settings"] = {
            name: {
                "server": SETTINGS[name][0],
                "server_overrides": SERVERS[SETTINGS[name][0]],
                "workers": SETTINGS[name][1],
                "batch_size": SETTINGS[name][2],
                "max_batch_delay_ms": SETTINGS[name][3],
                **median_of(rounds[name]),
                "rounds": rounds[name],
            }
            for name in chosen
        }
        out["best_p99_at_rate"] = min(chosen, key=lambda n: out["settings"][n]["rate"]["p99_ms"])
        out["machine"]["loadavg_after"] = os.getloadavg()

    print(f"\nTorchServe start-to-healthy: {out['start_to_healthy_s']}   body {out['body_bytes']} B")
    print(
        f"median over {args.rounds} rounds; load average before/after {out['machine']['loadavg_before'][0]:.2f}/"
        f"{out['machine']['loadavg_after'][0]:.2f} on {out['machine']['cpus']} cpus"
    )
    head = f"{'setting':<22}{'seq p50':>9}{'seq p99':>9}{'@rps p50':>10}{'@rps p99':>10}{'@rps max':>10}{'fail':>6}{'rps':>7}"
    print(head)
    for name, r in out["settings"].items():
        s, q = r["sequential"], r["rate"]
        print(
            f"{name:<22}{s['p50_ms']:>9.2f}{s['p99_ms']:>9.2f}{q['p50_ms']:>10.2f}{q['p99_ms']:>10.2f}"
            f"{q['max_ms']:>10.2f}{q['failures']:>6}{q['achieved_rps']:>7.1f}"
        )
    print(f"lowest p99 at {args.rate:g} rps: {out['best_p99_at_rate']}")
    print(f"wrote {write_results('ts_overhead', out, args.results_dir)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
