"""``make bench-swap``: hot swaps under load.

    python -m loadtest.bench_swap [--duration 90] [--rate 50] [--deltas 10] [--delta-rows 10000]
                                  [--lookups remote,colocated] [--serving-dtype int8] [--quick]
                                  [--results-dir DIR]

Trains two versions into a temporary model store from the same schema file but on *different
data* (v1 on the first half of the training split, v2 on the second, so their fitted dense
statistics differ, as in a daily retrain; v1 published, v2 held back), starts the local stack,
and runs locust (200-item JSON requests) at a fixed rate for ``--duration`` s. Meanwhile: after a
steady period, ``--deltas`` deltas of ``--delta-rows`` changed rows each are published into the
served version (one every few seconds, by ``serving.ps.deltas.DeltaWriter``), then v2 is published
(the PS shards map v2 beside v1; the controller waits until every shard serves v2, then registers
v2's dense model in TorchServe, makes it the default and unregisters v1). Each event's window runs
from its publish until it is live: a delta until every PS shard reports its seq, the full switch
until every shard serves v2, the dense switch until TorchServe's default is v2; the whole full
switch is publish -> dense default.

The whole schedule runs once per lookup mode of the handler (``--lookups``, each on a fresh
copy of the two trained versions): ``remote`` (rows through the worker and the PS shards) and
``colocated`` (the handler maps the version's shard files and applies its deltas itself; the PS
shards still run, and their Stats still time the PS side).

Every response's ``versions`` are recorded: a response is *mixed* when the embedding version it
read (any shard) differs from its dense model's version. A delta is *visible* when the first
response that read it (its shards' lowest delta seq reaches the delta's) ends: what a client
sees, in either mode.

Writes loadtest/results/swap.json (``runs``, one per mode: ``failures``, ``mixed_responses``,
``p99_steady_ms``, ``p99_during_swap_ms``, ``full_switch_window_s``, ``full_switch_p99_ms``,
``delta_visible_p50_s``, ``delta_visible_p99_s`` (the first response), ``delta_ps_live_p99_s``
(every PS shard), per-window figures) and swap-<mode>.png (latency over time with every event
marked). ``--quick``: 2 deltas and the switch in 16 s of load, co-located lookups only, one epoch of training.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from loadtest.common import (
    CRITEO_TRAIN,
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


def train_versions(root: Path, epochs: int = 2, serving_dtype: str = "float32") -> list[str]:
    """v1 on the first half of the training rows (published), v2 on the second half (held back):
    the same schema file, different fitted dense statistics, tables served in ``serving_dtype``
    (their deltas too). Returns the manifests' fingerprints."""
    import model_store as ms

    lines = CRITEO_TRAIN.read_bytes().splitlines(keepends=True)
    halves = [lines[: len(lines) // 2], lines[len(lines) // 2 :]]
    fingerprints = []
    for seed, (publish, rows) in enumerate(zip((True, False), halves, strict=True)):
        data = root.parent / f"train-{seed}.tsv"
        data.write_bytes(b"".join(rows))
        result = train_version(root, seed, publish, data, epochs, serving_dtype)
        if result.version_dir is None:
            raise RuntimeError(f"training on {data} exported no version")
        fingerprints.append(ms.read_manifest(Path(result.version_dir), verify=False).schema_fingerprint)
    return fingerprints


class Shards:
    """Polls every PS shard's Stats: what (version, delta seq) each one serves."""

    def __init__(self, addresses: list[str]):
        from serving.ps.client import PSClient

        self.clients = [PSClient(a, timeout_s=2.0) for a in addresses]

    def serving(self) -> list[tuple[str, int]]:
        out = []
        for c in self.clients:
            st = c.stats()
            out.append((st["version"], st["delta_seq"]))
        return out

    def wait(self, pred, timeout_s: float = 30.0) -> float:
        """When every shard's (version, delta seq) satisfies ``pred`` (time.time())."""
        try:
            return wait_for(
                lambda: all(pred(v, s) for v, s in self.serving()), timeout_s, "shards live", poll_s=0.02
            )
        except TimeoutError as e:
            raise TimeoutError(f"{e}: {self.serving()}") from None


def swap_schedule(root: Path, stack, args, events: list[dict]) -> None:
    """The swaps, run in a thread while locust runs. Appends {kind, start, live} per event."""
    import model_store as ms
    from model_store.releases import publish
    from serving.ps.deltas import DeltaWriter

    shards = Shards(stack.state.ps)
    rng = np.random.default_rng(0)
    time.sleep(args.steady_s)
    writer = DeltaWriter(root, "criteo")
    all_signs = writer.signs()
    for _ in range(args.deltas):
        signs = rng.choice(all_signs, size=min(args.delta_rows, len(all_signs)), replace=False)
        writer.assign(
            signs, writer.lookup(signs) + rng.normal(0, 0.01, (len(signs), writer.dim)).astype(np.float32)
        )
        seq, _, published = writer.publish()
        live = shards.wait(lambda v, s, seq=seq: s >= seq)
        events.append({"kind": "delta", "seq": seq, "start": published, "live": live})
        time.sleep(max(0.0, args.delta_every_s - (time.time() - published)))
    time.sleep(args.delta_every_s)
    v2 = ms.versions(root, "criteo")[-1]
    t0 = time.time()
    publish(root, "criteo", v2)
    live = shards.wait(lambda v, s: v == v2, timeout_s=120)
    events.append({"kind": "full version switch", "version": v2, "start": t0, "live": live})
    from serving.stack.state import read_state

    # the controller's record: registered + default
    dense_live = wait_for(lambda: read_state(stack.run_dir).dense_version == v2, 120, "dense version switch live",
                          poll_s=0.05)  # fmt: skip
    events.append({"kind": "dense version switch", "version": v2, "start": live, "live": dense_live})
    time.sleep(args.after_s)  # the old dense version drains; responses after the switch count too


def run(args) -> list[dict]:
    work = Path(tempfile.mkdtemp(prefix="bench-swap-"))
    trained = work / "trained"
    try:
        print("training two versions on different halves of the data ...", flush=True)
        fingerprints = train_versions(trained, args.epochs, args.serving_dtype)
        if len(set(fingerprints)) != 1:
            raise RuntimeError(f"the two versions' schema fingerprints differ: {fingerprints}")
        runs = []
        for lookups in args.lookups.split(","):
            root = work / lookups / "store"
            shutil.copytree(trained, root)  # the deltas and the publish change the store: a fresh copy
            runs.append(run_mode(root, lookups, args))
        return runs
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_mode(root: Path, lookups: str, args) -> dict:
    from serving.stack.local import LocalStack, StackConfig

    work = root.parent
    cfg = StackConfig(store=str(root), model="criteo", http_port=0, management_port=0, metrics_port=0,
                      disable_token_auth=True, poll_s=args.poll_s, lookups=lookups)  # fmt: skip
    print(f"starting the stack, lookups {lookups} (token auth disabled for this local benchmark) ...",
          flush=True)  # fmt: skip
    with LocalStack(cfg) as stack:
        timeline = work / "timeline.txt"
        events: list[dict] = []
        t_start = time.time()
        locust = start_locust_timeline(stack.state.inference, args.rate, args.duration, timeline)
        errors: list[BaseException] = []

        def swaps():
            try:
                swap_schedule(root, stack, args, events)
            except BaseException as e:  # reported after the run
                errors.append(e)

        th = threading.Thread(target=swaps)
        th.start()
        th.join()
        _, stderr = locust.communicate(timeout=args.duration + 120)
        if errors:
            raise errors[0]
        if not timeline.exists():
            raise RuntimeError(f"locust wrote no timeline:\n{stderr[-3000:]}")
    return {"lookups": lookups, **analyse(read_timeline(timeline), events, t_start, args, lookups)}


def analyse(tl: np.ndarray, events: list[dict], t_start: float, args, lookups: str) -> dict:
    end, ms, failed, mixed, dense = tl[:, 0], tl[:, 1], tl[:, 2].astype(bool), tl[:, 3].astype(bool), tl[:, 4]
    seq = tl[:, 5]
    start = end - ms / 1e3  # when each request was sent
    first_event = min(e["start"] for e in events)
    steady = (start >= t_start + 3.0) & (end < first_event)  # after a short ramp-up
    in_swap = np.zeros(len(ms), bool)
    per_kind: dict[str, list] = {}
    for e in events:
        window = (end >= e["start"]) & (start <= e["live"])
        in_swap |= window
        per_kind.setdefault(e["kind"], []).append(window)
    ps_live = np.array([e["live"] - e["start"] for e in events if e["kind"] == "delta"])
    first_v = [e for e in events if e["kind"] == "full version switch"][0]["start"]
    visible = []  # publish -> the first response that read the delta (its shards' lowest seq reached it)
    for e in (e for e in events if e["kind"] == "delta"):
        seen = end[(end >= e["start"]) & (seq >= e["seq"]) & (start < first_v)]
        if not len(seen):
            raise RuntimeError(f"no response read delta {e['seq']} ({lookups} lookups)")
        visible.append(seen.min() - e["start"])
    full = [e for e in events if e["kind"] == "full version switch"][0]
    dense_live = [e for e in events if e["kind"] == "dense version switch"][0]["live"]
    in_full = (end >= full["start"]) & (start <= dense_live)
    p99 = lambda m: float(np.percentile(ms[m], 99)) if m.any() else None  # noqa: E731
    windows = {k: {"requests": int(np.any(w, axis=0).sum()), "p99_ms": p99(np.any(w, axis=0)),
                   "window_s": [round(e["live"] - e["start"], 3) for e in events if e["kind"] == k]}
               for k, w in per_kind.items()}  # fmt: skip
    result = {
        "rate": args.rate,
        "duration_s": args.duration,
        "requests": int(len(ms)),
        "failures": int(failed.sum()),
        "mixed_responses": int(mixed.sum()),
        "responses_by_dense_version": {
            str(int(v)): int((dense == v).sum()) for v in np.unique(dense) if v >= 0
        },
        "p50_steady_ms": float(np.percentile(ms[steady], 50)) if steady.any() else None,
        "p99_steady_ms": p99(steady),
        "steady_requests": int(steady.sum()),
        "p99_during_swap_ms": p99(in_swap),
        "swap_requests": int(in_swap.sum()),
        "full_switch_window_s": round(dense_live - full["start"], 3),
        "full_switch_p99_ms": p99(in_full),
        "full_switch_requests": int(in_full.sum()),
        "delta_visible_p50_s": round(float(np.percentile(visible, 50)), 3),
        "delta_visible_p99_s": round(float(np.percentile(visible, 99)), 3),
        "delta_ps_live_p99_s": round(float(np.percentile(ps_live, 99)), 3),
        "windows": windows,
        "events": [
            {**e, "start": round(e["start"] - t_start, 3), "live": round(e["live"] - t_start, 3)}
            for e in events
        ],
        "conditions": {
            "deltas": args.deltas,
            "delta_rows": args.delta_rows,
            "poll_s": args.poll_s,
            "serving_dtype": args.serving_dtype,
            "loadavg": os.getloadavg(),
        },  # fmt: skip
    }
    plot(start - t_start, ms, failed, result["events"], args.results_dir / f"swap-{lookups}.png", lookups)
    return result


def plot(t, ms, failed, events, path: Path, lookups: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 5))
    ax.scatter(t[~failed], ms[~failed], s=4, color="tab:blue", label="request latency")
    if failed.any():
        ax.scatter(t[failed], ms[failed], s=12, color="red", marker="x", label="failed")
    colors = {"delta": "tab:green", "full version switch": "tab:orange", "dense version switch": "tab:purple"}
    seen = set()
    for e in events:
        c = colors[e["kind"]]
        ax.axvspan(
            e["start"],
            e["live"],
            color=c,
            alpha=0.25,
            label=None if e["kind"] in seen else f"{e['kind']} (publish -> live)",
        )
        ax.axvline(e["start"], color=c, lw=0.8)
        seen.add(e["kind"])
    ax.set_xlabel("seconds since load start")
    ax.set_ylabel("latency (ms)")
    ax.set_yscale("log")
    ax.set_title(
        f"recserve ({lookups} lookups): scoring latency at 50 req/s while deltas, a full version and a dense "
        "model are swapped in"
    )
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--duration", type=int, default=90)
    p.add_argument("--rate", type=int, default=50)
    p.add_argument("--deltas", type=int, default=10)
    p.add_argument("--delta-rows", type=int, default=10_000)
    p.add_argument("--delta-every-s", type=float, default=4.0)
    p.add_argument("--steady-s", type=float, default=15.0)
    p.add_argument("--poll-s", type=float, default=0.2)
    p.add_argument("--epochs", type=int, default=2, help="each version's training epochs")
    p.add_argument("--after-s", type=float, default=5.0, help="load kept on after the dense switch")
    p.add_argument("--lookups", default="remote,colocated", help="the handler's lookup modes, one run each")
    p.add_argument(
        "--serving-dtype", default="float32", choices=["float32", "float16", "int8"],
        help="the versions' serving dtype (full versions and deltas)",
    )  # fmt: skip
    quick = {"duration": 16, "deltas": 2, "delta_rows": 1000, "delta_every_s": 1.0, "steady_s": 4.0,
             "after_s": 1.0, "lookups": "colocated", "epochs": 1}  # fmt: skip
    args = parse(p, argv, quick)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    runs = run(args)
    cols = ["lookups", "rate", "requests", "failures", "mixed_responses", "p50_steady_ms", "p99_steady_ms",
            "p99_during_swap_ms", "full_switch_window_s", "full_switch_p99_ms", "delta_visible_p50_s",
            "delta_visible_p99_s", "delta_ps_live_p99_s"]  # fmt: skip
    print_table("hot swap under load", runs, cols)
    print_table("windows (publish -> live)", [{"lookups": r["lookups"], "kind": k, **v} for r in runs
                                               for k, v in r["windows"].items()],
                ["lookups", "kind", "requests", "p99_ms", "window_s"])  # fmt: skip
    checks: dict[str, bool] = {}
    for r in runs:
        m = r["lookups"]
        checks |= {
            f"{m}: 0 failures": r["failures"] == 0,
            f"{m}: 0 mixed responses": r["mixed_responses"] == 0,
            f"{m}: p99_during_swap <= 1.5x p99_steady": (r["p99_during_swap_ms"] or 0)
            <= 1.5 * (r["p99_steady_ms"] or 0),
            f"{m}: delta_visible_p99 <= 1 s": r["delta_visible_p99_s"] <= 1,
        }
    result = {"runs": runs}
    report_targets(result, checks)
    print(f"\nwrote {write_results('swap', result, args.results_dir)} and swap-<mode>.png beside it")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
