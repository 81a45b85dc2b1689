"""``make bench-scale``: serving a 50M-row version from memory-mapped files, and training at scale.

Serving (this module):

1. Two versions of ``--rows`` rows (default 50M), dim 16, over 2 shards are written straight into a
   model store with random signs and rows (``model_store.shards.write_shard``: bucket order, the
   manifest's checksums; nothing is trained), sealed, and v1 published.
2. One ``recserve ps-serve <store>/<model> --shard i --num-shards 2`` per shard, as ``recserve up``
   starts them. ``load_s``: spawn -> every shard serves v1 (its files mapped and verified);
   ``load_gb_per_s``: the version's bytes / load_s. ``serving_bytes_per_row``: summed RSS of
   the PS processes / rows, against ``raw_bytes_per_row`` = 8 + 4 x dim
   (``serving_pss_bytes_per_row``: their PSS, shared libraries counted once).
3. A client sends 4,000-ID ``Lookup`` calls (random signs of the version, one shard after the other)
   at ``--rate`` calls/s while ``--switches`` full switches run, to v2 and back to v1 in turn. Each
   is ``nice -n 10 recserve publish`` (the one gate: XXH3-128 of every file) -> every shard answers
   from the new version (``switch_s``, the median) -> 2 s more: ``lookup_p99_during_switch_ms``
   pools those windows. ``lookup_p99_steady_ms`` pools a ``--window-s`` window right before each
   switch, so that each switch is compared with its neighbourhood (this VM's p99 drifts 1.5x
   over a minute with nothing running). The replaced version is released ``--keep-previous-s``
   later, outside both windows (``lookup_p99_during_release_ms``: +-1 s around it). Last, a busy
   loop at idle priority runs in another process for a window (``lookup_p99_idle_spinner_ms``):
   what any background work at all costs the lookups on this machine. ``peak_rss_during_switch_gb``
   (RSS sampled every 50 ms in the switch windows) against ``old_plus_new_gb`` (RSS on v1 alone +
   RSS on v2 alone, after v1's release).
4. ``delta_rows_per_s``: a delta of ``--delta-rows`` rows per shard is written into the version
   served last; rows /
   (its _SUCCESS -> every shard reports its seq).

Reduced precision: ``loadtest.bench_scale_int8`` serves an int8 version of ``--int8-rows`` rows
and a float16 one the same way (``bytes_per_row_ratio``, an ``int8`` and a ``float16`` section),
unless ``--no-int8``.

Training: ``loadtest.bench_scale_train`` (synth files of N and 10N rows streamed through
``recserve train``) runs after, unless ``--no-train``; its keys are merged in.

Writes ``loadtest/results/scale.json`` (``--results-dir``) and ``scale.png`` beside it (lookup latency over
time, the switches marked), and prints each target met or MISSED. Linux only (/proc). Needs
~2 x 4 GB of disk and ~10 GB of RAM at the default size (versions: ``loadtest/scale_store.py``).

    python -m loadtest.bench_scale [--rows 50000000] [--dir /tmp/scale [--keep] [--reuse]] [--no-train]

A quick run at a small size (``--quick``: 20,000 rows, 2 switches, no training part; seconds: it
checks the bench itself, its figures mean little):

    python -m loadtest.bench_scale --quick --results-dir /tmp/scale
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TypedDict

import numpy as np

from loadtest import bench_scale_int8
from loadtest.common import ROOT, Stopwatch, machine, parse, parser, print_table, report_targets
from loadtest.processes import Sampler, pss_bytes, usage, wait_for
from loadtest.scale_store import DIM, MODEL, SHARDS, build_version, reuse, write_delta

IDS_PER_CALL = 4000


# ---- processes --------------------------------------------------------------------------------
def wait_version(clients, version: str, seq: int = -1, timeout_s: float = 600.0) -> float:
    """When every shard serves ``version`` with at least delta ``seq`` (time.time())."""

    def serving() -> bool:
        try:
            st = [c.stats(timeout_s=2) for c in clients]
        except Exception:  # not answering yet
            return False
        return all(s["version"] == version and s["delta_seq"] >= seq for s in st)

    return wait_for(serving, timeout_s, f"every shard serving version {version} (seq {seq})", poll_s=0.02)


def lookup_loop(clients, sample, rate, stop, out):
    """4,000-ID lookups at ``rate`` calls/s (open loop: a late call does not delay the schedule)."""
    rng = np.random.default_rng(3)
    from features.hashing import shard_of

    owner = shard_of(sample, SHARDS)
    by_shard = [sample[owner == i] for i in range(SHARDS)]
    period, k = 1.0 / rate, 0
    t_next = time.time()
    while not stop.is_set():
        shard = k % SHARDS
        ids = by_shard[shard][rng.integers(0, len(by_shard[shard]), IDS_PER_CALL)]
        t0 = time.time()
        try:
            rows, misses = clients[shard].lookup(ids, timeout_s=5)
            ok, version = misses == 0, clients[shard].version
        except Exception:
            ok, version = False, None
        out.append((t0, time.time() - t0, ok, version, shard))
        k += 1
        t_next += period
        delay = t_next - time.time()
        if delay > 0:
            time.sleep(delay)


def p99(values) -> float:
    return float(np.percentile(values, 99)) if len(values) else float("nan")


class _Switch(TypedDict):
    to: str
    steady: tuple[float, float]
    switch: tuple[float, float]
    switch_s: float
    released: float


def _in(calls, a: float, b: float, ok_only: bool = False) -> list[float]:
    return [d for t, d, ok, *_ in calls if a <= t <= b and (ok or not ok_only)]


def _spin_idle(seconds: float) -> None:
    """A busy loop at SCHED_IDLE priority in another process: what any background work costs the
    lookups on this machine, whatever it is (no memory traffic, no lock, lowest priority)."""
    code = ("import os, time\nos.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
            f"t = time.time() + {seconds}\nwhile time.time() < t: pass\n")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True)


def run(args) -> dict:
    import model_store as ms
    from model_store.layout import set_current
    from serving.ps.client import PSClient
    from serving.rpc.procs import free_ports, spawn, stop_children

    base = Path(args.dir)  # main's: removed after the reduced-precision runs, which serve v1 again
    root = base / "store"
    with Stopwatch() as built:
        if args.reuse and (reused := reuse(root, args.rows)):
            v1, v2, sample = reused
        else:
            shutil.rmtree(root, ignore_errors=True)
            v1, sample = build_version(root, args.rows, seed=1)
            v2, _ = build_version(root, args.rows, seed=2)
            np.save(base / "sample.npy", sample)
    build_s = built.s
    set_current(root, MODEL, v1)
    version_bytes = sum(f.stat().st_size for f in (root / MODEL / v1 / "embeddings").rglob("*.npy"))
    rows = sum(
        json.loads(m.read_text())["rows"] for m in (root / MODEL / v1 / "embeddings").glob("*/meta.json")
    )
    print(
        f"built 2 versions of {rows:,} rows ({version_bytes / 1e9:.2f} GB each) in {base}; first in {build_s:.1f} s"
    )
    subprocess.run(["sync"], check=False)

    ports = free_ports(SHARDS)
    procs = []
    t_spawn = time.time()
    for i, port in enumerate(ports):
        procs.append(spawn(["ps-serve", str(root / MODEL), "--shard", str(i), "--num-shards",
                            str(SHARDS), "--dim", str(DIM), "--port", str(port), "--poll-s", "0.2",
                            "--keep-previous-s", str(args.keep_previous_s)],
                           base / f"ps{i}.log"))  # fmt: skip
    pids = [p.pid for p in procs]
    clients = [PSClient(f"127.0.0.1:{p}", timeout_s=5) for p in ports]
    switches: list[_Switch] = []
    try:
        t_loaded = wait_version(clients, v1)
        load_s = t_loaded - t_spawn
        time.sleep(2)
        rss_v1, pss_v1 = usage(pids).rss_bytes, pss_bytes(pids)
        calls: list = []
        stop = threading.Event()
        looper = threading.Thread(
            target=lookup_loop, args=(clients, sample, args.rate, stop, calls), daemon=True
        )
        looper.start()
        sampler = Sampler(pids, interval_s=0.05)
        sampler.start()
        time.sleep(1)  # connections warm
        rss_new = 0
        for k in range(args.switches):
            # a steady window right before each switch, as long as a switch window: the machine's
            # noise drifts over tens of seconds, so each switch is compared with its own neighbour
            target = v2 if k % 2 == 0 else v1
            t_steady = time.time()
            time.sleep(args.window_s)
            t_publish = time.time()
            # as an operator would: `recserve publish` (the gate re-hashes every file) in its own
            # process, niced so that its checksum pass competes less with the lookups
            subprocess.run(["nice", "-n", "10", sys.executable, "-m", "recserve", "publish", "--store",
                            str(root), "--model", MODEL, target], cwd=ROOT, check=True,
                           capture_output=True)  # fmt: skip
            t_switched = wait_answered(calls, target, t_publish)
            time.sleep(2)
            t_end = time.time()
            # the replaced version is released --keep-previous-s after the flip; wait for it, and
            # measure the release apart (it is not part of the publish)
            t_released = wait_released(clients)
            time.sleep(1)
            if k == 0:
                rss_new = usage(pids).rss_bytes  # v2 alone
            switches.append({"to": target, "steady": (t_steady, t_publish), "switch": (t_publish, t_end),
                             "switch_s": t_switched - t_publish, "released": t_released})  # fmt: skip
        t_spin = time.time()
        _spin_idle(args.window_s)
        t_spin_end = time.time()
        time.sleep(0.5)
        stop.set()
        looper.join()
        sampler.stop()
        ddir = write_delta(root, v2 if args.switches % 2 else v1, sample, args.delta_rows)
        t_delta = wait_version(clients, clients[0].stats()["version"], seq=0)
        delta_s = t_delta - (ddir / ms.SUCCESS).stat().st_mtime
    finally:
        for c in clients:
            c.close()
        stop_children(procs)
    steady = [d for sw in switches for d in _in(calls, *sw["steady"], ok_only=True)]
    during = [d for sw in switches for d in _in(calls, *sw["switch"])]
    release = [d for sw in switches for d in _in(calls, sw["released"] - 1, sw["released"] + 1)]
    spinning = _in(calls, t_spin, t_spin_end)
    per_switch = []
    for sw in switches:
        s_, d_ = p99(_in(calls, *sw["steady"], ok_only=True)), p99(_in(calls, *sw["switch"]))
        per_switch.append({"to": sw["to"], "switch_s": round(sw["switch_s"], 2), "p99_steady_ms": round(s_ * 1e3, 2),
                           "p99_during_ms": round(d_ * 1e3, 2), "ratio": round(d_ / s_, 2)})  # fmt: skip
    windows = [sw["switch"] for sw in switches]
    peak = sampler.peak_rss(windows)
    result = {
        "serving_rows": rows,
        "dim": DIM,
        "shards": SHARDS,
        "version_gb": round(version_bytes / 1e9, 3),
        "raw_bytes_per_row": 8 + 4 * DIM,
        "serving_bytes_per_row": round(rss_v1 / rows, 2),
        "serving_pss_bytes_per_row": round(pss_v1 / rows, 2),
        "serving_rss_gb": round(rss_v1 / 1e9, 3),
        "load_s": round(load_s, 2),
        "load_gb_per_s": round(version_bytes / 1e9 / load_s, 2),
        "switches": len(switches),
        "switch_s": round(float(np.median([s["switch_s"] for s in switches])), 2),
        "lookup_rate_per_s": args.rate,
        "lookup_ids_per_call": IDS_PER_CALL,
        "lookup_calls": len(calls),
        "lookup_failures": sum(1 for c in calls if not c[2]),
        "lookup_p50_steady_ms": round(float(np.median(steady)) * 1e3, 3),
        "lookup_p99_steady_ms": round(p99(steady) * 1e3, 3),
        "lookup_p99_during_switch_ms": round(p99(during) * 1e3, 3),
        "lookup_p99_switch_over_steady": round(p99(during) / p99(steady), 3),
        "lookup_calls_steady": len(steady),
        "lookup_calls_during_switch": len(during),
        "lookup_p99_during_release_ms": round(p99(release) * 1e3, 3),
        "lookup_p99_idle_spinner_ms": round(p99(spinning) * 1e3, 3),
        "per_switch": per_switch,
        "peak_rss_during_switch_gb": round(peak / 1e9, 3),
        "old_plus_new_gb": round((rss_v1 + rss_new) / 1e9, 3),
        "delta_rows": args.delta_rows * SHARDS,
        "delta_visible_s": round(delta_s, 3),
        "delta_rows_per_s": round(args.delta_rows * SHARDS / max(delta_s, 1e-9)),
    }
    if not args.no_int8:  # the reduced-precision runs compare their co-located gathers with these
        result |= bench_scale_int8.colocated_figures(root / MODEL / v1, sample)
    plot(calls, windows, (t_spin, t_spin_end), args.results_dir / "scale.png")
    return result


def wait_answered(calls, version: str, since: float, timeout_s: float = 600.0) -> float:
    """When every shard has answered a lookup from ``version`` (read from the lookups' own answers:
    polling Stats would add calls to the switch windows only)."""
    first: dict[int, float] = {}

    def answered() -> bool:
        first.clear()
        for t, _, ok, v, shard in calls[::-1]:
            if t < since:
                break
            if ok and v and v[0] == version:
                first[shard] = t
        return len(first) == SHARDS

    wait_for(answered, timeout_s, f"every shard answering from version {version}", poll_s=0.05)
    return max(first.values())


def wait_released(clients, timeout_s: float = 600.0) -> float:
    """When every shard holds one version again (the replaced one released)."""
    return wait_for(lambda: all(len(c.stats(timeout_s=2)["held"]) <= 1 for c in clients), timeout_s,
                    "the replaced version released", poll_s=0.25)  # fmt: skip


def plot(calls, windows, spin, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = calls[0][0]
    ts = np.array([c[0] - t0 for c in calls])
    ms_ = np.array([c[1] * 1e3 for c in calls])
    fig, ax = plt.subplots(figsize=(11, 4))
    ax.plot(ts, ms_, ".", markersize=2, label=f"{IDS_PER_CALL}-ID Lookup latency")
    for i, (a, b) in enumerate(windows):
        ax.axvspan(a - t0, b - t0, color="orange", alpha=0.3,
                   label="publish -> all shards switched + 2 s" if i == 0 else None)  # fmt: skip
    ax.axvspan(spin[0] - t0, spin[1] - t0, color="grey", alpha=0.3, label="an idle-priority busy loop")
    ax.set_xlabel("seconds")
    ax.set_ylabel("ms")
    ax.set_title("PS lookups while 50M-row versions are published in turn")
    ax.legend(loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def targets(r: dict) -> dict[str, bool]:
    out = {
        "no lookup failed": r["lookup_failures"] == 0,
        "serving_rows >= 50M": r["serving_rows"] >= 50_000_000,
        "serving bytes/row <= 1.1x raw": r["serving_bytes_per_row"] <= 1.1 * r["raw_bytes_per_row"],
        "lookup p99 during the switches <= 1.5x steady": r["lookup_p99_switch_over_steady"] <= 1.5,
        "peak RSS during a switch <= 1.1x (old + new)": r["peak_rss_during_switch_gb"]
        <= 1.1 * r["old_plus_new_gb"],
    }
    if "rss_ratio_10x" in r:
        out["10x the rows -> <= 1.25x the peak RSS"] = r["rss_ratio_10x"] <= 1.25
    if "read_rows_per_s" in r:
        out["read_rows_per_s >= 250k"] = r["read_rows_per_s"] >= 250_000
    return out


def main(argv=None) -> int:
    p = parser(__doc__)
    p.add_argument("--rows", type=int, default=50_000_000, help="rows per version (over 2 shards)")
    p.add_argument("--rate", type=float, default=200.0, help="lookup calls per second")
    p.add_argument("--switches", type=int, default=4, help="full switches, v2 and v1 in turn")
    p.add_argument(
        "--window-s", type=float, default=4.0, help="seconds of the steady window before each switch"
    )
    p.add_argument(
        "--keep-previous-s", type=float, default=3.0, help="the PS flag: when a replaced version is released"
    )
    p.add_argument("--delta-rows", type=int, default=1_000_000, help="rows per shard in the delta")
    p.add_argument("--dir", default="", help="working directory (default: a temp dir, removed after)")
    p.add_argument("--keep", action="store_true", help="keep the working directory")
    p.add_argument(
        "--reuse", action="store_true", help="with --dir: serve the versions an earlier --keep run built"
    )
    p.add_argument("--no-train", action="store_true", help="skip the training part")
    p.add_argument("--no-int8", action="store_true", help="skip the int8 and float16 runs")
    p.add_argument("--int8-rows", type=int, default=300_000_000, help="rows of the int8 version")
    p.add_argument("--float16-rows", type=int, default=0, help="rows of the float16 version (0: --rows)")
    p.add_argument("--wire-calls", type=int, default=300, help="lookups asked as stored and as float32")
    p.add_argument("--train-args", default="", help="extra arguments for loadtest.bench_scale_train")
    p.add_argument("--train-json", default="", help="merge this scale_train.json instead of running it")
    quick = {"rows": 20_000, "switches": 2, "window_s": 1.0, "keep_previous_s": 1.0, "delta_rows": 1000,
             "rate": 50.0, "no_train": True, "int8_rows": 60_000, "wire_calls": 20}  # fmt: skip
    args = parse(p, argv, quick)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    args.dir = args.dir or tempfile.mkdtemp(prefix="recserve-scale-")
    try:
        result = {"machine": machine(), "serving": run(args)}
        if not args.no_int8:
            result |= bench_scale_int8.run(args, result["serving"])
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
    serving = result["serving"]
    print_table("serving a memory-mapped version", [serving], [k for k in serving if k != "per_switch"])
    switches = serving["per_switch"]
    print_table("each switch against the steady window before it", switches, list(switches[0]))
    if not args.no_int8:
        bench_scale_int8.print_tables(result)
    if args.train_json:
        result["training"] = json.loads(Path(args.train_json).read_text())
    elif not args.no_train:
        cmd = [sys.executable, "-m", "loadtest.bench_scale_train", "--results-dir", str(args.results_dir),
               *args.train_args.split()]  # fmt: skip
        subprocess.run(cmd, cwd=ROOT, check=True)
        result["training"] = json.loads((args.results_dir / "scale_train.json").read_text())
    flat = dict(serving)
    for k, v in result.get("training", {}).items():
        if not isinstance(v, dict):
            flat.setdefault(k, v)
    result.update(flat)
    report_targets(result, targets(result) | bench_scale_int8.targets(result))
    out = args.results_dir / "scale.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
