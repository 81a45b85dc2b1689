"""``make demo``: the whole recserve loop on the bundled real data, each step reported.

1. features: the same transform offline (TSV) and online (JSON) -> byte-identical batches
2. train DLRM on the Criteo split (PS shard processes + worker, async sparse / DDP-ready dense)
3. export a versioned model to model_store/ and publish it
4. `recserve up`: PS shards loading the version, the embedding worker, TorchServe + handler
5. score the test split through the HTTP endpoint in 200-row requests; compare with the
   trainer's offline scores (max abs diff must be <= 1e-5); online AUC and latency
6. continuous training: new rows arrive, `recserve train --follow` cuts a delta into the served
   version, the PS shards apply it live; the scores of the same requests change
7. `recserve down`
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

    step("2-3. train DLRM on the Criteo split (8,000 rows) and export a version")
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


def serve_step(result) -> None:
    import orjson
    from sklearn.metrics import roc_auc_score

    from features import stream
    from features.schema import load_schema
    from serving.scoring.client import ScoringClient, requests_from_file
    from serving.stack.local import LocalStack, StackConfig

    step("4. recserve up: PS shards + embedding worker + TorchServe")
    print("   (token auth is DISABLED for this local demo; `recserve up` keeps it on unless --no-token-auth)")
    cfg = StackConfig(
        store=str(STORE),
        model="criteo",
        http_port=0,
        management_port=0,
        metrics_port=0,
        disable_token_auth=True,
    )
    t0 = time.time()
    with LocalStack(cfg) as stack:
        s = stack.state
        print(
            f"   up in {time.time() - t0:.1f} s: PS {', '.join(s.ps)}; worker {s.worker}; POST {s.endpoint}"
        )

        step("5. score the test split through HTTP in 200-row requests")
        client = ScoringClient(s.endpoint)
        scores, latency, versions = [], [], None
        for body, ctype in requests_from_file(str(TEST), str(SCHEMA), rows=200):
            t = time.perf_counter()
            status, payload = client.post(body, ctype)
            latency.append((time.perf_counter() - t) * 1e3)
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
        print(f"   online AUC {roc_auc_score(labels, online):.4f}")
        print(
            f"   latency per 200-row request: p50 {np.percentile(latency, 50):.2f} ms, p99 {np.percentile(latency, 99):.2f} ms (sequential, {len(latency)} requests)"
        )
        if diff > 1e-5:
            raise SystemExit("online scores differ from offline scores")
        follow_step(client, result)
        client.close()
        step("7. recserve down")
    print("   stack stopped")


def _first_request(client):
    import orjson

    from serving.scoring.client import requests_from_file

    body, ctype = next(requests_from_file(str(TEST), str(SCHEMA), rows=200))
    status, payload = client.post(body, ctype)
    if status != 200:
        raise SystemExit(f"scoring failed: HTTP {status} {payload[:200]!r}")
    reply = orjson.loads(payload)
    return np.array(reply["scores"]), reply["versions"]


def follow_step(client, result) -> None:
    import shutil

    from training.config import FollowConfig
    from training.follow import follow

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
