"""Where a bench-e2e request's time goes: each stage of the scoring path timed alone, sequentially
(medians), for the TorchServe + remote run (``stages_ms``), and the one timer of such medians."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from loadtest.common import call_times

if TYPE_CHECKING:
    from serving.stack.state import StackState


@dataclass(frozen=True)
class Sampling:
    """How long each sequential median runs: at least ``runs`` calls over at least ``seconds``
    (``--quick``: a few calls, enough to check the path, not to time it)."""

    runs: int = 100
    seconds: float = 1.0


def median_ms(fn, args: list, sampling: Sampling) -> float:
    """Median wall time of ``fn(a)`` in ms, cycling through ``args`` (after one pass of warm-up)."""
    return round(float(np.median(call_times(fn, sampling.runs, sampling.seconds, args))) * 1e3, 3)


def stages(
    vdir: Path,
    state: StackState,
    bodies: list[bytes],
    runtime: str,
    worker_in_handler: bool,
    sampling: Sampling,
) -> tuple[dict, float]:
    """Per-stage medians (ms) of the handler's path, and the in-process p50 (ms); the paced pass
    (10 requests/s) scores half as many requests as a median's ``sampling.runs``."""
    import orjson

    import model_store
    from features.codec import encode
    from features.schema import load_schema
    from features.transform import dense_matrix, transform
    from serving.scoring.config import ScoringConfig
    from serving.scoring.core import JSON, Scorer
    from serving.scoring.loop import score
    from serving.worker.client import WorkerClient
    from serving.worker.core import EmbeddingWorker, InProcessShard, PSClient
    from training.offline import load_stores

    manifest = model_store.read_manifest(vdir)
    schema = load_schema(vdir / "schema.yaml")
    cfg = ScoringConfig(str(vdir), lookups="remote", worker=state.worker, runtime=runtime)
    with contextlib.ExitStack() as es:
        inproc_worker = EmbeddingWorker([InProcessShard(s) for s in load_stores(vdir, manifest)], schema)
        es.callback(inproc_worker.close)
        inproc = Scorer(cfg, worker=inproc_worker)
        # what the handler runs: the worker process over gRPC, or the worker library over the PS
        remote = Scorer(ScoringConfig(str(vdir), lookups="remote", worker=state.worker, runtime=runtime,
                                      ps=state.ps if worker_in_handler else None))  # fmt: skip
        es.callback(remote.close)
        client = WorkerClient(state.worker)
        es.callback(client.close)
        ps = EmbeddingWorker([PSClient(a) for a in state.ps], schema)  # this process -> PS shards
        es.callback(ps.close)

        batches = [inproc.decode(b, JSON).batch for b in bodies]
        blobs = [encode(b) for b in batches]
        signs = [np.asarray(b.signs) for b in batches]
        pooled = [(inproc_worker.forward(b).pooled, dense_matrix(b, schema)) for b in batches]
        looked_up = [inproc.lookup(inproc.decode(b, JSON)) for b in bodies]
        scored = [(inproc.predict([i])[0], i.versions) for i in looked_up]

        def check(status_payload):
            if status_payload[0] != 200:
                raise RuntimeError(f"scoring failed: {status_payload}")

        def timed(fn, args: list) -> float:
            return median_ms(fn, args, sampling)

        inprocess_p50 = timed(lambda b: check(score(inproc, b, JSON)), bodies)
        paced = []  # the same at 10 requests/s: caches go cold between requests, as at the 10 rps run
        for i in range(max(1, sampling.runs // 2)):
            time.sleep(0.1)
            t0 = time.perf_counter()
            check(score(inproc, bodies[i % len(bodies)], JSON))
            paced.append((time.perf_counter() - t0) * 1e3)
        out = {
            "inprocess_paced_10rps": round(float(np.median(paced)), 3),
            "handler_score": timed(lambda b: check(score(remote, b, JSON)), bodies),
            "decode": timed(lambda b: inproc.decode(b, JSON), bodies),  # what the scoring core runs
            "orjson_transform": timed(lambda b: transform(orjson.loads(b), schema), bodies),  # baseline
            "codec_encode": timed(encode, batches),
            "worker_forward_rpc": timed(lambda blob: client.forward(blob), blobs),
            "worker_core_over_ps": timed(lambda b: ps.forward(b), batches),
            "ps_lookup_fanout": timed(lambda s: ps._lookup(s, insert=False), signs),
            "worker_core_inprocess_tables": timed(lambda b: inproc_worker.forward(b), batches),
            "dense": timed(lambda pd: inproc.dense(*pd), pooled),
            "encode_response": timed(lambda sv: inproc.encode(*sv), scored),
        }
    # derived: the worker's gRPC hop (server + client + codec decode) and its own compute
    out["worker_rpc_hop"] = round(out["worker_forward_rpc"] - out["worker_core_over_ps"], 3)
    out["worker_compute"] = round(out["worker_core_over_ps"] - out["ps_lookup_fanout"], 3)
    return out, inprocess_p50
