"""``make demo``: the whole recserve loop on the bundled real data, each step reported, served the
way a user should deploy it (docs/serving.md): ``recserve serve`` with co-located lookups.

1. features: the same transform offline (TSV) and online (JSON) -> byte-identical batches
2. train DLRM on the Criteo split (the sharding planner places each table in the trainer or on
   PS shard processes it starts), export a versioned model into the model store, publish it
3. ``recserve serve --lookups colocated``: the lean frontend maps the version's shard files itself
4. score the test split through HTTP in 200-row requests (column form); compare with the
   trainer's offline scores (max abs diff must be <= 1e-5); online AUC
5. latency: the quietest of 3 rounds of 300 sequential requests after a warm-up, next to
   docs/benchmarks.md's figure for this path
6. continuous training: new rows arrive, ``recserve train --follow`` cuts a delta into the served
   version, the frontend applies it live; the scores of the same requests change
7. stop the frontend (SIGTERM: it drains, then exits 0)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from model_store.layout import default_root

ROOT = Path(__file__).resolve().parent.parent
STORE = ROOT / default_root()  # ./artifacts, or $RECSERVE_STORE (an absolute path wins)
TEST = ROOT / "data/criteo/wide_resdnn_criteo_test.tsv"
SCHEMA = ROOT / "data/schemas/criteo.yaml"


def step(title: str) -> None:
    print(f"\n== {title}", flush=True)


def features_step() -> None:
    import orjson

    from features import stream
    from features.codec import encode
    from features.readers import to_records
    from features.schema import load_schema
    from features.transform import transform

    step("1. features: one transform for files and for JSON requests")
    schema = load_schema(SCHEMA)
    table = stream.read(TEST, schema, limit=200)
    offline = encode(transform(table, schema))
    records = orjson.loads(orjson.dumps(to_records(table, schema, with_label=True)))
    online = encode(transform(records, schema))
    print(
        f"   200 Criteo test rows: compact batch {len(offline):,} B vs JSON {len(orjson.dumps(records)):,} B"
    )
    print(f"   TSV rows and the same rows as JSON records -> byte-identical batches: {offline == online}")
    if offline != online:
        raise SystemExit("offline and online features differ")


def train_step():
    from training.config import TrainConfig
    from training.train import train

    step("2. train DLRM on the Criteo split (8,000 rows), export a version and publish it")
    cfg = TrainConfig(store=str(STORE), model="criteo", publish=False, progress=False)
    t0 = time.time()
    result = train(cfg)
    # the demo starts a stack of its own below, so a version of another schema left in the store
    # by an earlier release's demo (fitted statistics used to live in schema.yaml) may be replaced
    import model_store

    model_store.publish(STORE, "criteo", Path(result.version_dir).name, allow_schema_change=True)
    print(
        f"   test AUC {result.auc:.4f}, logloss {result.logloss:.4f}; {result.samples_per_s:,.0f} samples/s; {time.time() - t0:.1f} s"
    )
    print(f"   exported and published {result.version_dir}")
    return result


LATENCY_REQUESTS = 300
"""Sequential requests of one round timed in step 5 (after a warm-up of 50): enough for a p99."""
LATENCY_ROUNDS = 3
"""Rounds timed in step 5; the quietest one is reported."""
BENCH_ROW = "| `serve` + co-located |"
"""The row of docs/benchmarks.md's latency table for the path the demo serves."""


def bench_figure() -> tuple[float, float]:
    """(p50, p99) ms that docs/benchmarks.md reports for ``serve`` + co-located at its lowest rate."""
    import re

    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    row = next((line for line in doc.splitlines() if line.startswith(BENCH_ROW)), None)
    found = re.match(r"\| [^|]+\| ([0-9.]+) / ([0-9.]+) \|", row or "")
    if found is None:
        raise SystemExit(f"docs/benchmarks.md has no latency row starting {BENCH_ROW!r}")
    return float(found.group(1)), float(found.group(2))


def start_frontend(log: Path):
    """``recserve serve --lookups colocated`` on a free loopback port, token auth on (its key file in
    the store); (process, endpoint, key file) once /ping says a version is served."""
    import http.client

    from serving.rpc.procs import free_ports, spawn

    port = free_ports(1)[0]
    proc = spawn(["serve", "--store", str(STORE), "--model", "criteo", "--port", str(port),
                  "--lookups", "colocated"], log)  # fmt: skip
    deadline = time.monotonic() + 120
    while True:  # a process of our own starting: poll its health endpoint until it serves
        if proc.poll() is not None:
            raise SystemExit(f"recserve serve exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/ping")
            if conn.getresponse().status == 200:
                break
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.terminate()
            raise SystemExit(f"recserve serve did not serve within 120 s: {log.read_text()[-2000:]}")
        time.sleep(0.2)
    key_file = STORE / ".run" / "criteo" / "serve-key_file.json"
    return proc, f"http://127.0.0.1:{port}/predictions/criteo", key_file


def serve_step(result) -> None:
    import signal

    import orjson

    from features import stream
    from features.schema import load_schema
    from serving.scoring.client import ScoringClient, requests_from_file
    from training.evaluate import auc

    step("3. recserve serve --lookups colocated: the lean frontend maps the version's shards itself")
    log = STORE / ".run" / "criteo" / "demo-serve.log"
    t0 = time.time()
    proc, endpoint, key_file = start_frontend(log)
    try:
        print(
            f"   serving in {time.time() - t0:.1f} s: POST {endpoint} (token auth on, key in {key_file}; log {log})"
        )
        step("4. score the test split through HTTP in 200-row requests")
        client = ScoringClient(endpoint, key_file=str(key_file))
        bodies = [body for body, _ in requests_from_file(str(TEST), str(SCHEMA), rows=200, columns=True)]
        scores, versions = [], None
        for body in bodies:
            status, payload = client.post(body)
            if status != 200:
                raise SystemExit(f"scoring failed: HTTP {status} {payload[:200]!r}")
            reply = orjson.loads(payload)
            scores.extend(reply["scores"])
            versions = reply["versions"]
        online = np.array(scores)
        offline = np.load(Path(result.version_dir) / "eval" / "scores.npy")
        labels = stream.read(TEST, load_schema(SCHEMA)).columns["label"].astype(np.float32)
        diff = float(np.abs(online - offline).max())
        print(f"   {len(online)} rows scored online; versions {versions}")
        print(
            f"   max |online - offline| = {diff:.2e} (must be <= 1e-5): {'OK' if diff <= 1e-5 else 'MISMATCH'}"
        )
        print(f"   online AUC {auc(labels, online):.4f}")
        if diff > 1e-5:
            raise SystemExit("online scores differ from offline scores")
        latency_step(client, bodies)
        follow_step(client, result)
        client.close()
    finally:
        step("7. stop the frontend")
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    print(f"   recserve serve drained and exited {code}")
    if code != 0:
        raise SystemExit(f"recserve serve exited {code}: see {log}")


def latency_step(client, bodies: list[bytes]) -> None:
    """Time LATENCY_ROUNDS rounds of LATENCY_REQUESTS sequential requests (after 50 unmeasured) and
    print the quietest round's p50/p99 beside docs/benchmarks.md's figure for this path: a neighbour
    busy for a second (a shared VM, tests in parallel) spoils a round, not the figure."""
    step(f"5. latency: {LATENCY_ROUNDS} rounds of {LATENCY_REQUESTS} sequential 200-item requests")
    for i in range(50):
        client.post(bodies[i % len(bodies)])
    rounds = []
    for _ in range(LATENCY_ROUNDS):
        latency = []
        for i in range(LATENCY_REQUESTS):
            t = time.perf_counter()
            status, payload = client.post(bodies[i % len(bodies)])
            latency.append((time.perf_counter() - t) * 1e3)
            if status != 200:
                raise SystemExit(f"scoring failed: HTTP {status} {payload[:200]!r}")
        rounds.append((float(np.percentile(latency, 99)), float(np.percentile(latency, 50))))
    p99, p50 = min(rounds)
    doc50, doc99 = bench_figure()
    print(f"   rounds' p99: {', '.join(f'{r:.2f}' for r, _ in rounds)} ms")
    print(f"   p50 {p50:.2f} ms, p99 {p99:.2f} ms over {LATENCY_REQUESTS} requests (the quietest round)")
    verdict = "agrees (p99 within 2x)" if p99 <= 2 * doc99 else "slower than 2x: is this machine busy?"
    print(f"   docs/benchmarks.md, serve + co-located: p50 {doc50} ms, p99 {doc99} ms: {verdict}")


def _first_request(client):
    import orjson

    from serving.scoring.client import requests_from_file

    body, _ = next(requests_from_file(str(TEST), str(SCHEMA), rows=200, columns=True))
    status, payload = client.post(body)
    if status != 200:
        raise SystemExit(f"scoring failed: HTTP {status} {payload[:200]!r}")
    reply = orjson.loads(payload)
    return np.array(reply["scores"]), reply["versions"]


def follow_step(client, result) -> None:
    import shutil

    from training.follow.config import FollowConfig
    from training.follow.trainer import follow

    step("6. continuous training: 200 new rows arrive; `recserve train --follow` publishes a delta")
    before, versions = _first_request(client)
    watch = STORE / f".watch-{Path(result.version_dir).name}"
    shutil.rmtree(watch, ignore_errors=True)
    watch.mkdir(parents=True)
    shutil.copy(ROOT / "data/criteo/deepctr_criteo_sample.csv", watch / "new_rows.csv")
    (watch / "new_rows.csv.done").touch()  # the file is complete
    t0 = time.time()
    res = follow(FollowConfig(follow=str(STORE / "criteo"), watch=str(watch), once=True))
    version, seq = res.deltas[-1]
    print(
        f"   trained {res.rows} new rows (dense model frozen) -> delta {seq} of version {version} in {time.time() - t0:.1f} s"
    )
    t1 = time.time()
    while True:
        after, now = _first_request(client)
        if now["delta_seq"] >= seq or time.time() - t1 > 15:
            break
        time.sleep(0.1)
    print(
        f"   served versions before {versions} -> after {now} ({time.time() - t1:.1f} s after the delta was written)"
    )
    changed = np.abs(after - before)
    print(
        f"   same 200 requests rescored: {int((changed > 1e-6).sum())} scores changed, mean |change| {changed.mean():.4f}"
    )
    print(
        f"   first five: {', '.join(f'{a:.4f}->{b:.4f}' for a, b in zip(before[:5], after[:5], strict=True))}"
    )
    if now["delta_seq"] < seq:
        raise SystemExit("the delta did not go live within 15 s")


def main() -> int:
    t0 = time.time()
    features_step()
    result = train_step()
    serve_step(result)
    print(f"\ndemo finished in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
