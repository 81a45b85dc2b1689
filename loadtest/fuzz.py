"""Fuzz a running stack's four entry points (``loadtest/bench_faults.py`` runs it after the faults).

    fuzz_stack(stack.state, cases=100_000) -> {"fuzz_cases", "fuzz_server_errors", "fuzz_by_target", ...}

The cases are split evenly over four targets, each generated from valid requests by seeded,
structure-aware mutations (so that most of them get past the first check and reach the deeper
ones):

- ``http_json``: scoring requests (flat records, or context + items) with fields set to values of
  every wrong type and size, fields dropped or added, records replaced, too many items, invalid
  JSON tokens (NaN), and byte-level flips, insertions and truncations;
- ``http_binary``: compact batches with header fields overwritten by boundary values, body bytes
  flipped, truncated or extended -- mostly with the checksum recomputed, so that the decoder's
  structural checks are reached -- and random bytes after the magic;
- ``ps_grpc``: every ``EmbeddingPS`` method with random bytes, and Lookups with sign buffers of any
  length, unknown dtypes, inserts, versions the shard does not hold, paths; byte-mutated messages;
- ``worker_grpc``: every ``EmbeddingWorker`` method: Forwards of mutated batches with any dtype
  and version, random bytes.

A *server error* is an HTTP status >= 500, or a gRPC UNKNOWN or INTERNAL: a mistake of the client
must get a 4xx / INVALID_ARGUMENT (or a refusal), and nothing may crash a server. Every status seen
is counted per target; the first few server errors are kept as examples.
"""

from __future__ import annotations

import json
import struct
import threading
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Callable

    import grpc
    from google.protobuf.message import Message

    from recserve.v1 import common_pb2
    from serving.stack.state import StackState

ROOT = Path(__file__).resolve().parent.parent
TEST = ROOT / "data" / "criteo" / "wide_resdnn_criteo_test.tsv"
SCHEMA = ROOT / "data" / "schemas" / "criteo.yaml"
TARGETS = ("http_json", "http_binary", "ps_grpc", "worker_grpc")
WEIRD: list[Any] = [None, True, False, -1, 0, 2**63, 2**64 + 5, -(2**70), 1e308, -1e308, float("nan"), float("inf"), "",
         "NaN", "x" * 10_000, "\u0000", "日本語", "../../etc/passwd", [], {}, [1, "a"], {"a": {"b": []}}]  # fmt: skip
HEADER_FIELDS = [(4, "<H"), (6, "<H"), (16, "<Q"), (24, "<I"), (28, "<I"), (32, "<I"), (36, "<I"), (40, "<B")]
BOUNDARY = [
    0,
    1,
    2,
    3,
    7,
    8,
    255,
    256,
    4095,
    4096,
    65535,
    65536,
    2**24,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**63,
    2**64 - 1,
]


class Corpus:
    """Valid requests to mutate: JSON record lists and compact batches of 1-50 rows."""

    def __init__(self):
        import orjson

        from features import stream
        from features.codec import encode
        from features.readers import to_records
        from features.schema import load_schema
        from features.transform import transform

        schema = load_schema(SCHEMA)
        table = stream.read(TEST, schema, limit=200)
        records = to_records(table, schema)
        self.records = [records[i : i + n] for i, n in ((0, 1), (1, 5), (10, 20), (40, 50))]
        self.blobs = [encode(transform(r, schema)) for r in self.records]
        self.json = [orjson.dumps(r) for r in self.records]


def _mutate_bytes(rng: np.random.Generator, data: bytes, start: int = 0) -> bytes:
    b = bytearray(data)
    for _ in range(int(rng.integers(1, 4))):
        op = rng.integers(4)
        if op == 0 and len(b) > start:  # flip bytes
            for i in rng.integers(start, len(b), int(rng.integers(1, 8))):
                b[i] ^= int(rng.integers(1, 256))
        elif op == 1:  # truncate
            del b[int(rng.integers(0, len(b) + 1)) :]
        elif op == 2:  # insert
            at = int(rng.integers(min(start, len(b)), len(b) + 1))
            b[at:at] = rng.bytes(int(rng.integers(1, 64)))
        else:  # duplicate a slice
            i = int(rng.integers(0, len(b) + 1))
            b[i:i] = b[i : i + int(rng.integers(1, 256))]
    return bytes(b)


def json_case(rng: np.random.Generator, corpus: Corpus) -> bytes:
    if rng.random() < 0.25:
        return _mutate_bytes(rng, corpus.json[int(rng.integers(len(corpus.json)))])
    # records, then whatever a mutation put in their place
    records: list[Any] = [dict(r) for r in corpus.records[int(rng.integers(len(corpus.records)))]]
    for _ in range(int(rng.integers(1, 4))):
        r = records[int(rng.integers(len(records)))] if records else {}
        r = r if isinstance(r, dict) else {}  # replaced by a non-record already
        op = rng.integers(5)
        if op == 0 and r:
            r[list(r)[int(rng.integers(len(r)))]] = WEIRD[int(rng.integers(len(WEIRD)))]
        elif op == 1 and r:
            r.pop(list(r)[int(rng.integers(len(r)))])
        elif op == 2:
            r[f"C{int(rng.integers(0, 99))}x"] = 1
        elif op == 3 and records:
            records[int(rng.integers(len(records)))] = WEIRD[int(rng.integers(len(WEIRD)))]
        else:  # up to past the item limit (1000)
            records = (records * int(rng.integers(2, 60)))[:1100]
    shape = rng.integers(5)
    body = (records if shape < 2 else {"items": records} if shape == 2 else
            {"context": records[0] if records else {}, "items": records[1:]} if shape == 3 else
            {"context": WEIRD[int(rng.integers(len(WEIRD)))], "items": WEIRD[int(rng.integers(len(WEIRD)))]})  # fmt: skip
    out = json.dumps(body, allow_nan=True).encode()
    # past the scorer's body limit (4 MB: a 413), not past TorchServe's (16 MB: it drops the connection)
    return out if len(out) <= 8 << 20 else json.dumps(records[:100], allow_nan=True).encode()


def _fix_checksum(blob: bytes) -> bytes:
    import xxhash

    if len(blob) < 16:
        return blob
    return blob[:8] + struct.pack("<Q", xxhash.xxh64_intdigest(blob[16:], seed=0)) + blob[16:]


def binary_case(rng: np.random.Generator, corpus: Corpus) -> bytes:
    blob = corpus.blobs[int(rng.integers(len(corpus.blobs)))]
    op = rng.integers(4)
    if op == 0:  # header fields at their boundaries
        b = bytearray(blob)
        for _ in range(int(rng.integers(1, 3))):
            off, fmt = HEADER_FIELDS[int(rng.integers(len(HEADER_FIELDS)))]
            value = BOUNDARY[int(rng.integers(len(BOUNDARY)))] % (1 << (8 * struct.calcsize(fmt)))
            struct.pack_into(fmt, b, off, value)
        blob = bytes(b)
    elif op == 1:
        blob = _mutate_bytes(rng, blob, start=48)
    elif op == 2:
        blob = _mutate_bytes(rng, blob)
    else:
        blob = b"RSCB" + rng.bytes(int(rng.integers(0, 600)))
    return _fix_checksum(blob) if rng.random() < 0.8 else blob


def ps_case(rng: np.random.Generator, corpus: Corpus, version: str) -> tuple[str, bytes]:
    from recserve.v1 import ps_pb2

    method = ["Lookup", "Lookup", "Lookup", "Stats", "Update", "Dump", "Load"][int(rng.integers(7))]
    if rng.random() < 0.25:
        return method, rng.bytes(int(rng.integers(0, 200)))
    msg: Message
    if method == "Lookup":
        n = int(rng.integers(0, 4000)) * 8 + (int(rng.integers(1, 8)) if rng.random() < 0.2 else 0)
        versions = ["", version, "v999999", "../x", "é" * 300, version + "\u0000"]
        # any int for the enum, unknown values included: protobuf takes them, the server must refuse them
        dtype = cast("common_pb2.DType", int(rng.integers(-2, 6)))
        msg = ps_pb2.LookupRequest(signs=rng.bytes(n), dtype=dtype, insert=rng.random() < 0.1,
                                   version=versions[int(rng.integers(len(versions)))])  # fmt: skip
    elif method == "Update":
        msg = ps_pb2.UpdateRequest(signs=rng.bytes(80), grads=rng.bytes(int(rng.integers(0, 800))), step=7)
    elif method in ("Dump", "Load"):
        paths = ["", "/tmp/x", "../../etc", "a" * 5000, "models/../../x"]
        cls = ps_pb2.DumpRequest if method == "Dump" else ps_pb2.LoadRequest
        msg = cls(path=paths[int(rng.integers(len(paths)))], delta=rng.random() < 0.5)
    else:
        msg = ps_pb2.StatsRequest()
    data = msg.SerializeToString()
    return method, _mutate_bytes(rng, data) if rng.random() < 0.2 and data else data


def worker_case(rng: np.random.Generator, corpus: Corpus, version: str) -> tuple[str, bytes]:
    from recserve.v1 import worker_pb2

    method = ["Forward", "Forward", "Forward", "Stats"][int(rng.integers(4))]
    if rng.random() < 0.2:
        return method, rng.bytes(int(rng.integers(0, 200)))
    msg: Message
    if method == "Forward":
        blob = (
            binary_case(rng, corpus)
            if rng.random() < 0.7
            else corpus.blobs[int(rng.integers(len(corpus.blobs)))]
        )
        versions = ["", version, "v999999", "x" * 2000]
        # any int for the enum, unknown values included (as in ps_case)
        dtype = cast("common_pb2.DType", int(rng.integers(-1, 4)))
        msg = worker_pb2.ForwardRequest(batch=blob, dtype=dtype,
                                        version=versions[int(rng.integers(len(versions)))])  # fmt: skip
    else:
        msg = worker_pb2.WorkerStatsRequest()
    data = msg.SerializeToString()
    return method, _mutate_bytes(rng, data) if rng.random() < 0.2 and data else data


class _Http:
    def __init__(self, state: StackState, binary: bool):
        from serving.scoring.client import ScoringClient

        self.client = ScoringClient(state.endpoint, key_file=state.key_file, timeout_s=30.0)
        self.ctype = "application/octet-stream" if binary else "application/json"

    def send(self, body: bytes) -> tuple[str, bool, str]:
        try:
            status, payload = self.client.post(body, self.ctype)
        except OSError as e:  # no answer at all (a hang or a dropped connection): the server's fault
            self.client.close()
            return f"no answer ({type(e).__name__})", True, f"{e} ({len(body)}-byte body)"
        return str(status), status >= 500, payload[:300].decode(errors="replace")

    def close(self) -> None:
        self.client.close()


class _Grpc:
    def __init__(self, address: str, service: str):
        import grpc

        self.grpc = grpc
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)])
        self.service = service
        self.calls: dict[str, grpc.UnaryUnaryMultiCallable[bytes, bytes]] = {}

    def send(self, case: tuple[str, bytes]) -> tuple[str, bool, str]:
        method, data = case
        call = self.calls.get(method)
        if call is None:
            call = self.calls[method] = self.channel.unary_unary(f"/{self.service}/{method}")
        try:
            call(data, timeout=30.0)
        except self.grpc.RpcError as e:
            code = e.code().name
            return f"{method}:{code}", code in ("UNKNOWN", "INTERNAL"), (e.details() or "")[:300]
        return f"{method}:OK", False, ""

    def close(self) -> None:
        self.channel.close()


def _fuzz_target(target: str, state: StackState, cases: int, seed: int, threads: int) -> dict:
    corpus = Corpus()
    version = state.version
    statuses: Counter = Counter()
    examples: list[dict] = []
    lock = threading.Lock()

    def work(k: int) -> None:
        rng = np.random.default_rng([seed, TARGETS.index(target), k])
        sender: _Http | _Grpc
        make: Callable[[], Any]  # bytes for _Http, (method, bytes) for _Grpc
        if target.startswith("http"):
            sender = _Http(state, binary=target == "http_binary")
            make = (
                (lambda: json_case(rng, corpus))
                if target == "http_json"
                else (lambda: binary_case(rng, corpus))
            )
        elif target == "ps_grpc":
            sender = _Grpc(state.ps[k % len(state.ps)], "recserve.v1.EmbeddingPS")
            make = lambda: ps_case(rng, corpus, version)  # noqa: E731
        else:
            sender = _Grpc(state.worker, "recserve.v1.EmbeddingWorker")
            make = lambda: worker_case(rng, corpus, version)  # noqa: E731
        mine: Counter = Counter()
        try:
            for _ in range(cases // threads + (k < cases % threads)):
                case: Any = make()  # matches sender: see make
                status, server_error, message = sender.send(case)
                mine[status] += 1
                if server_error:
                    mine["server_errors"] += 1
                    body = case[1] if isinstance(case, tuple) else case
                    with lock:
                        if len(examples) < 5:
                            examples.append(
                                {"status": status, "message": message, "request": body[:120].hex()}
                            )
        finally:
            sender.close()
            with lock:
                statuses.update(mine)

    pool = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    errors = statuses.pop("server_errors", 0)
    return {"cases": sum(statuses.values()), "server_errors": errors, "statuses": dict(statuses.most_common()),
            "examples": examples}  # fmt: skip


def fuzz_stack(state: StackState, cases: int = 100_000, seed: int = 0, threads: int = 4) -> dict:
    per = -(-cases // len(TARGETS))
    by_target = {}
    for target in TARGETS:
        by_target[target] = _fuzz_target(target, state, per, seed, threads)
        print(f"  {target}: {by_target[target]['cases']} cases, {by_target[target]['server_errors']} server errors",
              flush=True)  # fmt: skip
    return {
        "fuzz_cases": sum(t["cases"] for t in by_target.values()),
        "fuzz_server_errors": sum(t["server_errors"] for t in by_target.values()),
        "fuzz_by_target": by_target,
    }
