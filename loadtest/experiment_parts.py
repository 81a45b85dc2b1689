"""``make bench-experiment``'s parts: its versions (``shuffled_labels``, ``trained_on_samples``,
``adopt_fresh``), the world's reference (``reference_scores``), TorchServe following the store
(``torchserve_frontend``), the requests of many units over both frontends (``UnitLoad``, an
open-loop ``Paced`` that records each reply's arm and versions), the topics' facts
(``impression_facts``, ``sample_facts``) and the split's p99 (``split_p99``). The counts over what
they log: ``loadtest.experiment_figures``.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from numpy.typing import NDArray

import model_store as ms
from loadtest.common import train_version
from loadtest.drive import TEST
from loadtest.paced import Paced, Responses
from model_store import experiments as ex
from serving.rpc.procs import free_ports, stop_children
from serving.scoring.arms import Unit
from serving.scoring.client import ScoringClient
from stream.records import decode_impression
from stream.sample_batch import read_samples
from stream.watch.reader import request_ids

REPLY = ("frontend", "unit", "arm", "experiment", "dense", "embedding")
"""What ``UnitLoad`` keeps of each reply besides ``Paced``'s row (status 200 only; '' otherwise)."""


def unit_bodies(base: bytes, units: int, slot: str) -> list[bytes]:
    """``units`` copies of a flat-records request whose first record's ``slot`` names a user
    (``user-0000``, ...): the unit key an experiment with ``--unit-key slot`` reads."""
    records = orjson.loads(base)
    out = []
    for u in range(units):
        records[0][slot] = f"user-{u:04d}"
        out.append(orjson.dumps(records))
    return out


class UnitLoad(Paced):
    """``Paced`` over several frontends and units: each request goes to the next frontend in turn
    (per client thread) with the body of a unit drawn at random (seeded); each reply's arm and
    versions are kept in ``replies`` (one row of ``REPLY`` per request, in its thread's order)."""

    def __init__(self, endpoints: dict[str, str], bodies: list[bytes], rate: float, threads: int = 4,
                 seed: int = 0) -> None:  # fmt: skip
        super().__init__(next(iter(endpoints.values())), bodies[0], rate, threads)
        self.endpoints, self.bodies, self.seed = list(endpoints.items()), bodies, seed
        self.replies: list[list[tuple[str, int, str, str, str, str]]] = [[] for _ in range(threads)]
        self._lock = threading.Lock()

    def __enter__(self) -> UnitLoad:
        super().__enter__()
        return self

    def _client(self, i: int) -> None:
        clients = [(name, ScoringClient(url, None)) for name, url in self.endpoints]
        rows, replies = self._rows[i], self.replies[i]
        rng = np.random.default_rng(self.seed * 1000 + i)
        every = self.threads / self.rate
        due, n = time.monotonic() + i * every / self.threads, i
        try:
            while not self._stop.is_set():
                if (wait := due - time.monotonic()) > 0 and self._stop.wait(wait):
                    return
                name, client = clients[n % len(clients)]
                unit = int(rng.integers(len(self.bodies)))
                t0 = time.perf_counter()
                try:
                    status, payload = client.post(self.bodies[unit])
                except OSError:
                    status, payload = 0, b""
                latency = time.perf_counter() - t0
                v = orjson.loads(payload)["versions"] if status == 200 else {}
                rows.append((time.time(), latency, status, int(v.get("delta_seq", -1))))
                replies.append((name, unit, str(v.get("arm", "")), str(v.get("experiment", "")),
                                str(v.get("dense", "")), str(v.get("embedding", ""))))  # fmt: skip
                due, n = due + every, n + 1
        finally:
            for _, c in clients:
                c.close()

    def table(self) -> dict[str, NDArray[Any]]:
        """Every request: ``done``, ``latency_s``, ``status`` and the ``REPLY`` columns, by ``done``."""
        rows = [r for part in self._rows for r in part]
        replies = [r for part in self.replies for r in part]
        order = np.argsort([r[0] for r in rows], kind="stable")
        out: dict[str, NDArray[Any]] = {
            "done": np.array([r[0] for r in rows], np.float64)[order],
            "latency_s": np.array([r[1] for r in rows], np.float64)[order],
            "status": np.array([r[2] for r in rows], np.int64)[order],
        }
        for k, name in enumerate(REPLY):
            out[name] = np.array([r[k] for r in replies], object)[order]
        return out


def unit_keys(batches: list[bytes], slot: int, missing: int | None, request_ids: list[str]) -> list[str]:
    """Each impression's unit key, as ``serving.scoring.arms.Unit.key`` reads its request."""
    from features.codec import decode
    from serving.scoring.arms import first_sign

    out = []
    for batch, rid in zip(batches, request_ids, strict=True):
        sign = first_sign(decode(batch), slot)
        out.append(rid if sign is None or sign == missing else str(sign))
    return out


def shuffled_labels(path: Path, out: Path, seed: int = 0) -> Path:
    """A copy of a Criteo TSV (label first) with its labels permuted: the same rows, no signal."""
    lines = path.read_text().splitlines()
    labels = [line.split("\t", 1)[0] for line in lines]
    perm = np.random.default_rng(seed).permutation(len(lines))
    out.write_text(
        "".join(f"{labels[j]}\t{line.split(chr(9), 1)[1]}\n" for j, line in zip(perm, lines, strict=True))
    )
    return out


def reference_scores(url: str, body: bytes, version: str) -> tuple[float, ...]:
    """The scores ``version`` gives the items of ``body`` at ``url`` (a reply of another version:
    RuntimeError): the world's reference."""
    client = ScoringClient(url, None)
    try:
        status, payload = client.post(body)
    finally:
        client.close()
    reply = orjson.loads(payload) if status == 200 else {}
    if reply.get("versions", {}).get("dense") != version:
        raise RuntimeError(f"{url}: no reply of version {version} to read the reference from: {status} "
                           f"{payload[:200]!r}")  # fmt: skip
    return tuple(float(x) for x in np.clip(reply["scores"], 1e-4, 1 - 1e-4))  # a logit each


@contextlib.contextmanager
def torchserve_frontend(root: Path, model: str, work: Path, log_uri: str):
    """TorchServe with the recserve handler following ``model`` in ``root`` (``scoring.json``
    ``"store"``), co-located lookups, impressions to ``log_uri``; yields its endpoint."""
    from serving.stack.packaging import HANDLER
    from serving.torchserve import TorchServe, TorchServeConfig, archive
    from serving.torchserve.config import niced_python

    run_dir = work / "torchserve"
    (run_dir / "mar").mkdir(parents=True)
    scoring = {"store": str(root), "model": model, "drain_s": 1.0, "lookups": "colocated", "poll_s": 1.0,
               "log_impressions": log_uri}  # fmt: skip
    (run_dir / "scoring.json").write_text(json.dumps(scoring))
    mar = archive(HANDLER, [run_dir / "scoring.json"], model, "1.0", run_dir / "mar")
    ports = free_ports(5)
    cfg = TorchServeConfig(model_store=run_dir / "mar", run_dir=run_dir / "ts", inference_port=ports[0],
                           management_port=ports[1], metrics_port=ports[2], grpc_inference_port=ports[3],
                           grpc_management_port=ports[4], disable_token_auth=True,
                           python=str(niced_python(run_dir / "python-niced")))  # fmt: skip
    with TorchServe(cfg) as ts:
        ts.management().register(mar.name, model, initial_workers=1)
        yield f"http://127.0.0.1:{ports[0]}/predictions/{model}"


def impression_facts(msgs: list, unit: Unit) -> dict:
    """Request id, ts, arm, dense version and unit key of each impression."""
    imps = [decode_impression(m.value() or b"") for m in msgs]
    keys = unit_keys([i.batch for i in imps], unit.slot, unit.missing, [i.request_id for i in imps])
    return {"request": np.array([i.request_id for i in imps], object), "ts": np.array([i.ts for i in imps]),
            "arm": np.array([i.arm for i in imps], object), "dense": np.array([i.versions.dense for i in imps], object),
            "unit": np.array(keys, object)}  # fmt: skip


def sample_facts(msgs: list) -> dict:
    s, bad = read_samples([m.value() or b"" for m in msgs])
    if bad:
        raise RuntimeError(f"samples topic: {len(bad)} records unreadable, e.g. {bad[0]}")
    return {"arm": np.char.decode(s.arms, "utf-8").astype(object), "score": s.scores.astype(np.float64),
            "label": s.labels.astype(np.float64), "ts": s.ts, "request": request_ids(s.keys).astype(object),
            "item": np.array([int.from_bytes(k[:4], "big") for k in s.keys.tolist()], np.int64)}  # fmt: skip


def cat(parts: list[dict]) -> dict:
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]} if parts else {}


def trained_on_samples(root: Path, samples: dict, seconds: float, work: Path) -> str:
    """A version trained offline (``train_version``, unpublished) on the joined samples of the
    last ``seconds`` of event time: each sample as its item's Criteo row (every request holds the
    same 200 rows of the test file) with the sample's label. Its name."""
    rows = [line.split("\t", 1)[1] for line in TEST.read_text().splitlines()]
    recent = samples["ts"] >= samples["ts"].max() - seconds
    path = work / "fresh.tsv"
    with path.open("w") as f:
        for item, label in zip(
            samples["item"][recent].tolist(), samples["label"][recent].tolist(), strict=True
        ):
            f.write(f"{int(label)}\t{rows[item]}\n")
    print(
        f"training A on the last {seconds:g} s of joined samples ({int(recent.sum())} rows) ...", flush=True
    )
    return Path(train_version(root, seed=2, publish=False, data=path).version_dir).name


def adopt_fresh(fresh: Path, root: Path, model: str, control: str, procs: dict) -> str:
    """Stop the streaming trainer (SIGTERM: its last delta) and copy its newest full version (with
    its deltas) into the served store, unpublished; its name."""
    deadline = time.monotonic() + 60
    while (version := ms.current(fresh, model)) in (None, control) and time.monotonic() < deadline:
        time.sleep(1.0)  # the first full version is due
    stop_children([procs.pop("trainer")], 60)
    if version in (None, control):
        raise RuntimeError(f"the streaming trainer wrote no full version into {fresh} (see trainer.log)")
    assert version is not None
    shutil.copytree(ms.version_dir(fresh, model, version), ms.version_dir(root, model, version))
    return version


def split_p99(args, root: Path, model: str, endpoints: dict[str, str], bodies: list[bytes], unit_key: str,
              others: list[str], aa: bool = False) -> dict:  # fmt: skip
    """Each frontend's p99 with a running experiment (CURRENT as control, ``others`` at 10% each:
    a new experiment each time, started and stopped through the store) and without, in turns
    (with, without, without, with, ...), at ``--p99-rate``; each side's latencies pooled. ``aa``:
    the "with" side runs no experiment either (an A/A: what the bench reads as overhead when there
    is none).

    Per frontend: the pooled p99s and their ratio; each round's p99 of each side (the machine's
    drift across the run); ``halves``: the p99 of each side's even rounds over its odd rounds' (an
    A/A of half the requests, free: the bench's own noise beside the ratio)."""
    sides: dict[str, dict[str, list]] = {s: {fe: [] for fe in endpoints} for s in ("with", "without")}
    names = list(endpoints)
    for r in range(args.p99_rounds):
        for side in ("with", "without") if r % 2 == 0 else ("without", "with"):
            running = (exp := ex.read_experiment(root, model)) is not None and exp.running
            if side == "with" and not running and not aa:
                ex.start(root, model, f"split-p99-{r}", [(v, 0.1) for v in others], unit_key=unit_key,
                         salt=f"split-p99-{r}")  # fmt: skip
            elif side == "without" and running:
                ex.stop(root, model)
            for url in endpoints.values():
                serving_split(url, bodies[0], side == "with" and not aa)
            time.sleep(1.5)  # a stopped experiment's scorers drain (drain_s 1) and close
            for fe in names if r % 2 == 0 else names[::-1]:
                with UnitLoad({fe: endpoints[fe]}, bodies, args.p99_rate, seed=r + 1) as load:
                    time.sleep(args.p99_phase_s)
                sides[side][fe].append(load.responses())
    if (exp := ex.read_experiment(root, model)) is not None and exp.running:
        ex.stop(root, model)
    out: dict = {}
    for fe in names:
        with_, without = (Responses.cat(sides[s][fe]) for s in ("with", "without"))
        a, b = with_.p99_ms(), without.p99_ms()
        out[fe] = {"p99_ms_with": a, "p99_ms_without": b, "ratio": _ratio(a, b),
                   "requests": {"with": with_.ok, "without": without.ok},
                   "failed": int((with_.status != 200).sum() + (without.status != 200).sum()),
                   "rounds_p99_ms": {s: [r.p99_ms() for r in sides[s][fe]] for s in ("with", "without")},
                   "halves": {s: _halves(sides[s][fe]) for s in ("with", "without")}}  # fmt: skip
        if aa:
            out[fe]["aa"] = True
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def _halves(rounds: list[Responses]) -> dict:
    """The p99 of the even rounds' pooled latencies over the odd rounds' (one side, one frontend)."""
    even, odd = (Responses.cat(rounds[k::2]).p99_ms() if rounds[k::2] else None for k in (0, 1))
    return {"p99_ms_even": even, "p99_ms_odd": odd, "ratio": _ratio(even, odd)}


def serving_split(url: str, body: bytes, split: bool, timeout_s: float = 60.0) -> None:
    """Return once the frontend's replies name an arm (``split``) or none."""
    from serving.scoring.client import ScoringClient

    client, deadline = ScoringClient(url, None), time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            status, payload = client.post(body)
            if status == 200 and ("arm" in orjson.loads(payload)["versions"]) == split:
                return
            time.sleep(0.2)
    finally:
        client.close()
    raise RuntimeError(f"{url}: still {'without' if split else 'with'} an experiment after {timeout_s:.0f} s")
