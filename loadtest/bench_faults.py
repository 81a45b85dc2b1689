"""``make bench-faults``: kill -9 under load, against ``recserve up --replicas 2``.

    python -m loadtest.bench_faults [--duration 80] [--rate 50] [--delta-every-s 2] [--delta-rows 2000]
                                    [--fuzz-cases 100000] [--quick] [--results-dir DIR]

Trains a model on the Criteo split into a temporary store, starts the local stack with 2 replicas
per PS shard (supervised), and runs locust (200-item JSON requests, ``locust_timeline.py``) at
``--rate`` requests/s for ``--duration`` s while a ``DeltaWriter`` publishes a delta of
``--delta-rows`` rows every ``--delta-every-s`` s. Meanwhile, with ``--gap-s`` between them: kill -9
one PS replica, then the worker, then the controller; each replacement is watched until it is back
(a PS replica: SERVING with the version and delta seq of its twin).

Each failed request is put down to the fault before it (from ``--gap-s``/2 before the kill).
``lost_deltas``: once the last delta is live everywhere, the rows of every delta (each sign's last
write) are read from the recovered replica and compared with what the writer wrote; a delta with a
row that differs, or that the replica's delta seq does not reach, is lost.

Then the test split is scored, the stack is fuzzed (``loadtest/fuzz.py``), and the test split is
scored again: every request must succeed both times with the same scores.

Writes loadtest/results/faults.json: ``failures_with_replicas``, ``failures_worker_kill``,
``failures_controller_kill``, ``ps_recovery_s``, ``worker_recovery_s``, ``controller_recovery_s``,
``lost_deltas``, ``fuzz_cases``, ``fuzz_server_errors``, ``scores_unchanged_by_fuzz``, and more.
``--quick``: 12 s of load, a kill every 3 s (the next waits for the last one's replacement), 400 fuzz
cases.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from loadtest.common import (
    CRITEO_SCHEMA,
    CRITEO_TEST,
    parse,
    parser,
    print_table,
    read_timeline,
    report_targets,
    start_locust_timeline,
    train_version,
    write_results,
)
from loadtest.processes import wait_for

if TYPE_CHECKING:
    from serving.stack.state import StackState

KILLED_PS = "ps0.1"  # its twin ps0.0 keeps serving shard 0


class Deltas(threading.Thread):
    """Publishes a delta of ``rows`` random rows every ``every_s`` until stopped; remembers every
    sign written and the seq that wrote it last."""

    def __init__(self, root: Path, rows: int, every_s: float):
        super().__init__(name="deltas", daemon=True)
        from training.follow.cut import DeltaWriter

        self.writer = DeltaWriter(root, "criteo")
        self.rows, self.every_s = rows, every_s
        self.stop = threading.Event()
        self.published: list[tuple[int, float]] = []  # (seq, time)
        self.signs: list[np.ndarray] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        rng = np.random.default_rng(0)
        all_signs = self.writer.signs()
        try:
            while not self.stop.wait(self.every_s):
                signs = rng.choice(all_signs, size=min(self.rows, len(all_signs)), replace=False)
                rows = self.writer.lookup(signs) + rng.normal(0, 0.01, (len(signs), self.writer.dim))
                self.writer.assign(signs, rows.astype(np.float32))
                seq, _, at = self.writer.publish()
                self.published.append((seq, at))
                self.signs.append(signs)
        except BaseException as e:  # reported after the run
            self.error = e

    def last_writer(self) -> tuple[np.ndarray, np.ndarray]:
        """(every sign written, the seq that wrote it last)."""
        signs = np.concatenate(self.signs)
        seqs = np.repeat([s for s, _ in self.published], [len(s) for s in self.signs])
        rev_signs, first = np.unique(signs[::-1], return_index=True)  # first in reverse = last written
        return rev_signs, seqs[::-1][first]


def _ps_view(address: str) -> tuple[str, str, int] | None:
    """(health, version, delta seq) of the PS at ``address``; None when it does not answer."""
    from serving.ps.client import PSClient, ShardError

    with PSClient(address, timeout_s=1.0) as ps:
        try:
            st = ps.stats()
        except ShardError:
            return None
        return ps.health(), st["version"], st["delta_seq"]


def kill_and_watch(run_dir: Path, name: str, back, timeout_s: float = 120.0) -> dict:
    """SIGKILL ``name`` (pid from stack.json), then poll until the supervisor's replacement
    satisfies ``back(state)``. Returns {name, kill, back} (times)."""
    from serving.stack.state import read_state

    old = read_state(run_dir).pids[name]
    t0 = time.time()
    os.kill(old, signal.SIGKILL)

    def replaced() -> bool:
        state = read_state(run_dir)
        return state.pids[name] != old and back(state)

    at = wait_for(replaced, timeout_s, f"{name} back after kill -9", poll_s=0.05)
    return {"name": name, "kill": t0, "back": at, "restarts": read_state(run_dir).restarts[name]}


def faults(run_dir: Path, state: StackState, args, events: list[dict]) -> None:
    from serving.rpc.health import check
    from serving.rpc.procs import running

    ps_address = state.ps_shards[0][1]
    twin = state.ps_shards[0][0]

    def ps_back(_state) -> bool:  # SERVING what its twin serves: the same version and delta seq
        got, want = _ps_view(ps_address), _ps_view(twin)
        return got is not None and want is not None and got[0] == "SERVING" and got[1:] == want[1:]

    def worker_back(_state) -> bool:
        import grpc

        with grpc.insecure_channel(state.worker) as ch:
            return check(ch) == "SERVING"

    def controller_back(s: StackState) -> bool:
        return running(s.pids["controller"], s.started_at["controller"])

    time.sleep(args.steady_s)
    for name, back in ((KILLED_PS, ps_back), ("worker", worker_back), ("controller", controller_back)):
        events.append(kill_and_watch(run_dir, name, back))
        time.sleep(max(0.0, args.gap_s - (events[-1]["back"] - events[-1]["kill"])))


def lost_deltas(deltas: Deltas, address: str, shard: int, num_shards: int, version: str) -> tuple[int, int]:
    """(deltas missing from the PS at ``address``, its delta seq)."""
    from features.hashing import shard_of
    from serving.ps.client import PSClient

    signs, seqs = deltas.last_writer()
    own = shard_of(signs, num_shards) == shard
    signs, seqs = signs[own], seqs[own]
    with PSClient(address, timeout_s=30.0) as ps:
        got, _ = ps.lookup(signs, version=version)
        served_seq = ps.stats()["delta_seq"]
    differ = ~np.all(np.isclose(got, deltas.writer.lookup(signs), rtol=0, atol=1e-6), axis=1)
    missing = set(np.unique(seqs[differ]).tolist()) | {s for s, _ in deltas.published if s > served_seq}
    return len(missing), served_seq


def score_test_split(endpoint: str) -> np.ndarray:
    import orjson

    from serving.scoring.client import ScoringClient, requests_from_file

    out = []
    client = ScoringClient(endpoint)
    try:
        for body, ctype in requests_from_file(str(CRITEO_TEST), str(CRITEO_SCHEMA), 200, 2000, False):
            status, payload = client.post(body, ctype)
            if status != 200:
                raise RuntimeError(f"scoring the test split: HTTP {status}: {payload[:300]!r}")
            out.extend(orjson.loads(payload)["scores"])
    finally:
        client.close()
    return np.array(out)


def run(args) -> dict:
    from serving.stack.local import LocalStack, StackConfig

    work = Path(tempfile.mkdtemp(prefix="bench-faults-"))
    root = work / "store"
    try:
        print("training a model ...", flush=True)
        train_version(root)
        cfg = StackConfig(store=str(root), model="criteo", replicas=2, http_port=0, management_port=0,
                          metrics_port=0, disable_token_auth=True, poll_s=args.poll_s, lookups="remote")  # fmt: skip
        print("starting the stack: 2 PS shards x 2 replicas (token auth off for this local benchmark) ...")
        with LocalStack(cfg) as stack:
            timeline = work / "timeline.txt"
            deltas = Deltas(root, args.delta_rows, args.delta_every_s)
            events: list[dict] = []
            t_start = time.time()
            locust = start_locust_timeline(stack.state.inference, args.rate, args.duration, timeline)
            deltas.start()
            faults(stack.run_dir, stack.state, args, events)
            _, stderr = locust.communicate(timeout=args.duration + 120)
            deltas.stop.set()
            deltas.join()
            if deltas.error is not None:
                raise deltas.error
            if not timeline.exists():
                raise RuntimeError(f"locust wrote no timeline:\n{stderr[-3000:]}")
            last = deltas.published[-1][0]
            address = stack.state.ps_shards[0][1]
            with contextlib.suppress(TimeoutError):  # what is not there by then counts as lost below
                wait_for(
                    lambda: (view := _ps_view(address)) is not None and view[2] >= last, 60, "the last delta"
                )
            lost, seq = lost_deltas(deltas, address, 0, len(stack.state.ps_shards), stack.state.version)
            before = score_test_split(stack.state.endpoint)
            fuzz = {}
            if args.fuzz_cases:
                from loadtest.fuzz import fuzz_stack

                print(f"fuzzing the stack with {args.fuzz_cases} cases ...", flush=True)
                fuzz = fuzz_stack(stack.state, args.fuzz_cases)
            after = score_test_split(stack.state.endpoint)
            result = analyse(read_timeline(timeline), events, t_start, args)
            result.update(lost_deltas=lost, deltas_published=len(deltas.published), recovered_delta_seq=seq,
                          last_delta_seq=last, scores_unchanged_by_fuzz=bool(np.array_equal(before, after)),
                          restarts=stack_restarts(stack.run_dir), **fuzz)  # fmt: skip
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def stack_restarts(run_dir: Path) -> dict:
    from serving.stack.state import read_state

    return read_state(run_dir).restarts


def analyse(tl: np.ndarray, events: list[dict], t_start: float, args) -> dict:
    end, ms, failed = tl[:, 0], tl[:, 1], tl[:, 2].astype(bool)
    start = end - ms / 1e3
    bounds = [e["kill"] - args.gap_s / 2 for e in events] + [np.inf]
    per_fault = {e["name"]: int((failed & (end >= a) & (end < b)).sum()) for e, a, b in
                 zip(events, bounds, bounds[1:], strict=False)}  # fmt: skip
    ps, worker, ctl = events
    steady = (start >= t_start + 3.0) & (end < ps["kill"])
    around_ps = (end >= ps["kill"] - 1) & (start <= ps["back"] + 1)
    p99 = lambda m: float(np.percentile(ms[m], 99)) if m.any() else None  # noqa: E731
    return {
        "rate": args.rate,
        "duration_s": args.duration,
        "requests": int(len(ms)),
        "failures": int(failed.sum()),
        "failures_before_faults": int((failed & (end < bounds[0])).sum()),
        "failures_with_replicas": per_fault[KILLED_PS],
        "failures_worker_kill": per_fault["worker"],
        "failures_controller_kill": per_fault["controller"],
        "ps_recovery_s": round(ps["back"] - ps["kill"], 3),
        "worker_recovery_s": round(worker["back"] - worker["kill"], 3),
        "controller_recovery_s": round(ctl["back"] - ctl["kill"], 3),
        "p99_steady_ms": p99(steady),
        "p99_around_ps_kill_ms": p99(around_ps),
        "events": [
            {**e, "kill": round(e["kill"] - t_start, 3), "back": round(e["back"] - t_start, 3)}
            for e in events
        ],
        "conditions": {
            "replicas": 2,
            "delta_every_s": args.delta_every_s,
            "delta_rows": args.delta_rows,
            "poll_s": args.poll_s,
            "gap_s": args.gap_s,
            "loadavg": os.getloadavg(),
        },  # fmt: skip
    }


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--duration", type=int, default=80)
    p.add_argument("--rate", type=int, default=50)
    p.add_argument("--delta-rows", type=int, default=2000)
    p.add_argument("--delta-every-s", type=float, default=2.0)
    p.add_argument("--steady-s", type=float, default=12.0, help="load before the first kill")
    p.add_argument("--gap-s", type=float, default=20.0, help="from one kill to the next")
    p.add_argument("--poll-s", type=float, default=0.2)
    p.add_argument("--fuzz-cases", type=int, default=100_000, help="0: no fuzz")
    args = parse(p, argv, {"duration": 12, "steady_s": 3.0, "gap_s": 3.0, "fuzz_cases": 400})
    result = run(args)
    print_table("kill -9 under load (up --replicas 2, deltas publishing)", [result],
                ["rate", "duration_s", "requests", "failures", "failures_with_replicas", "failures_worker_kill",
                 "failures_controller_kill", "ps_recovery_s", "worker_recovery_s", "controller_recovery_s",
                 "deltas_published", "lost_deltas", "p99_steady_ms", "p99_around_ps_kill_ms"])  # fmt: skip
    if args.fuzz_cases:
        rows = [{"target": k, **v, "top statuses": ", ".join(f"{s} {n}" for s, n in list(v["statuses"].items())[:4])}
                for k, v in result["fuzz_by_target"].items()]  # fmt: skip
        print_table("fuzz", rows, ["target", "cases", "server_errors", "top statuses"])
    checks = {
        "0 failures around the PS replica kill": result["failures_with_replicas"] == 0,
        "ps_recovery_s < 10": result["ps_recovery_s"] < 10,
        "0 lost deltas": result["lost_deltas"] == 0,
        "the test split scores the same before and after the fuzz": result["scores_unchanged_by_fuzz"],
    }
    if args.fuzz_cases:
        checks["fuzz_cases >= 100,000"] = result["fuzz_cases"] >= 100_000
        checks["0 fuzz server errors"] = result["fuzz_server_errors"] == 0
    report_targets(result, checks)
    print(f"\nwrote {write_results('faults', result, args.results_dir)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
