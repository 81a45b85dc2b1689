"""bench-e2e's frontend as deployed: ``recserve serve --workers N`` with token auth on, co-located
lookups (``workers``), and the open-loop pass (``open_loop``).

``workers``: for each count (1 and 2 by default, one after the other on this machine, the load
generator beside them), the frontend's max rate at p99 <= 10 ms: locust at each rate of
``rates`` in turn (every request form at each rate, on the same server), upward until no form holds
a rate (p99 <= 10 ms and no failure); a form that missed a rate is not run at higher ones. Per
count: each form's highest rate held, ``max_rps`` (the highest both forms hold), the CPU time per
request of every process of the frontend together (and locust's) at that rate, and the PSS and
RSS of each process once the load is done (``/proc/<pid>/smaps_rollup``: PSS counts a page shared
by k processes as 1/k in each, so the workers' PSS summed is what they cost together). Then
``ratio`` (max_rps of 2 over 1), ``pss_ratio`` (the summed PSS of the larger count's workers over
the one process of ``--workers 1``) and ``frontend_pss_ratio`` (the same with the parent).

``open_loop``: ``--workers 1`` at each of ``open_rates``, requests in the records form sent on a
fixed schedule from four client threads (``loadtest.paced.Paced``), latency counted from when each
request was due (wrk2's rule: a queue in the server shows in the figures instead of thinning the
arrivals, as a closed loop's users waiting for their answers would).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from loadtest.common import percentiles_ms, print_table
from loadtest.drive import lean_frontend, run_locust, warm_up
from loadtest.paced import Paced
from loadtest.processes import descendants, pss_bytes, usage, wait_for

P99_MS = 10.0
"""The latency bound a rate must hold (p99, ms)."""
TARGETS = {"workers_2_over_1_max_rps": 1.5, "workers_pss_ratio": 1.3, "open_loop_p99_ms": 6.0}
MB = 1 << 20


def held(result: dict) -> bool:
    """A locust run held its rate: p99 within ``P99_MS`` and no failure."""
    return result["p99_ms"] is not None and result["p99_ms"] <= P99_MS and not result["failures"]


def step_up(run, rates: list[float], forms: list[str]) -> dict[str, dict[str, dict]]:
    """``run(rate, form)`` at each rate upward, every form still holding at each; a form stops at
    the first rate it misses. Form -> rate -> result."""
    results: dict[str, dict[str, dict]] = {form: {} for form in forms}
    going = list(forms)
    for rate in rates:
        for form in list(going):
            r = results[form][f"{rate:g}"] = run(rate, form)
            _say(form, f"{rate:g} rps", r)
            if not held(r):
                going.remove(form)
        if not going:
            break
    return results


def refine(run, results: dict[str, dict[str, dict]], step: float) -> None:
    """Narrow each form's max rate down to ``step`` requests/s by bisection between its highest
    rate held and the first it missed (``step_up``'s results, added to in place): the grid is
    ``step``'s multiples, the same for every worker count, so that ``ratio`` is not quantised by
    the coarse rates (100 apart: 1.4 and 1.5 one step). A form that held every rate, or none, is
    left as it is."""
    for form, by_rate in results.items():
        lo = max_held(by_rate)
        above = [float(k) for k, r in by_rate.items() if not held(r) and float(k) > lo]
        if not lo or not above:
            continue
        hi = min(above)
        while True:
            mid = round((lo + hi) / 2 / step) * step
            if not lo < mid < hi:
                break
            r = by_rate[f"{mid:g}"] = run(mid, form)
            _say(form, f"{mid:g} rps (bisecting {lo:g}-{hi:g})", r)
            lo, hi = (mid, hi) if held(r) else (lo, mid)


def _say(form: str, rate: str, r: dict) -> None:
    print(f"    {form}, {rate}: p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms, {r['requests']} requests, "
          f"{r['failures']} failures", flush=True)  # fmt: skip


def max_held(by_rate: dict[str, dict]) -> float:
    return max((float(k) for k, r in by_rate.items() if held(r)), default=0.0)


def serving_workers(endpoint: str, n: int) -> bool:
    """``n`` workers take connections (the frontend's ``recserve_serve_workers``; one process: its
    ``/ping``, already answered)."""
    if n == 1:
        return True
    import urllib.request

    url = endpoint.split("/predictions/")[0] + "/metrics"
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return False
    return any(line.split()[-1] == f"{n}.0" for line in text.splitlines()
               if line.startswith("recserve_serve_workers "))  # fmt: skip


def memory(pids: list[int]) -> dict:
    """PSS and RSS (MB) of each process, as now."""
    return {"pss_mb": [round(pss_bytes([p]) / MB, 1) for p in pids],
            "rss_mb": [round(usage([p]).rss_bytes / MB, 1) for p in pids]}  # fmt: skip


def one_count(args, n: int, store: Path, rates: list[float], bodies: dict[str, list[bytes]], work: Path,
              open_rates: list[float]) -> tuple[dict, dict]:  # fmt: skip
    """``recserve serve --workers n`` (token auth on), loaded at ``rates`` upward in every form;
    with ``open_rates``, the open-loop pass on it first. (its figures, the open-loop figures)."""
    key = work / "serve-key_file.json"
    extra = ("--workers", str(n))
    with lean_frontend(store, args.model, "colocated", None, work, args.runtime, args.batch_wait_ms, extra,
                       key) as (endpoint, procs):  # fmt: skip
        parent = procs["lean"][0]
        wait_for(lambda: serving_workers(endpoint, n), 120, f"{n} workers serving")
        workers = descendants(parent) if n > 1 else [parent]
        pids = [parent, *workers] if n > 1 else [parent]
        warmed = warm_up(endpoint, str(key), [b for form in bodies.values() for b in form], args.warmup_s)
        print(f"  --workers {n} (pids {pids}), token auth on: warm-up {warmed} requests", flush=True)
        opened = {f"{rate:g}": open_loop(endpoint, str(key), bodies[next(iter(bodies))], rate, args.duration)
                  for rate in open_rates}  # fmt: skip
        host = endpoint.split("/predictions/")[0]

        def run(rate: float, form: str) -> dict:
            return run_locust(host, args.model, rate, args.duration, str(key), work, {"lean": pids},
                              columns=form == "columns")  # fmt: skip

        by_form = step_up(run, rates, list(bodies))
        if args.workers_step:
            refine(run, by_form, args.workers_step)
        mem = memory(pids)
    best = {form: max_held(r) for form, r in by_form.items()}
    top = min(best.values())
    at_top = [r[f"{top:g}"] for r in by_form.values() if f"{top:g}" in r]
    out = {
        "max_rps": top,
        "max_rps_by_form": best,
        "cpu_ms_per_request": _mean_cpu(at_top),
        "processes": len(pids),
        "pss_mb": {"parent": mem["pss_mb"][0] if n > 1 else None, "workers": mem["pss_mb"][-len(workers) :]},
        "rss_mb": {"parent": mem["rss_mb"][0] if n > 1 else None, "workers": mem["rss_mb"][-len(workers) :]},
        "forms": by_form,
    }
    return out, opened


def _mean_cpu(runs: list[dict]) -> dict | None:
    """CPU ms per request by process role, averaged over ``runs`` (the forms at one rate)."""
    if not runs:
        return None
    roles = runs[0]["cpu_ms_per_request"]
    return {k: round(float(np.mean([r["cpu_ms_per_request"][k] for r in runs])), 3) for k in roles}


def open_loop(endpoint: str, key_file: str, bodies: list[bytes], rate: float, seconds: float) -> dict:
    """``rate`` requests/s on a fixed schedule for ``seconds``: latency from when each was due."""
    with Paced(endpoint, bodies, rate, key_file=key_file, from_schedule=True) as load:
        time.sleep(seconds)
    r = load.responses()
    ok = r.latency_s[r.status == 200]
    out = {**percentiles_ms(ok), "requests": int(len(r.status)), "failures": int((r.status != 200).sum()),
           "achieved_rps": round(len(r.status) / seconds, 1)}  # fmt: skip
    print(f"    open loop, {rate:g} rps: p50 {out['p50_ms']} ms, p99 {out['p99_ms']} ms, "
          f"{out['requests']} requests, {out['failures']} failures", flush=True)  # fmt: skip
    return out


def workers_section(args, store: Path, rates: list[float], counts: list[int], bodies: dict[str, list[bytes]],
                    work: Path, open_rates: list[float]) -> tuple[dict, dict]:  # fmt: skip
    """Every count of ``counts`` in turn (the open-loop pass on ``--workers 1``): ``workers``
    (per count, then ``ratio``, ``pss_ratio``, ``frontend_pss_ratio``) and ``open_loop``."""
    out: dict = {}
    opened: dict = {}
    for n in counts:
        out[str(n)], o = one_count(args, n, store, rates, bodies, work, open_rates if n == 1 else [])
        opened = opened or o
    if "1" in out and len(counts) > 1:
        one, more = out["1"], out[str(max(counts))]
        single = one["pss_mb"]["workers"][0]
        out["ratio"] = round(more["max_rps"] / one["max_rps"], 2) if one["max_rps"] else None
        out["pss_ratio"] = round(sum(more["pss_mb"]["workers"]) / single, 2)
        out["frontend_pss_ratio"] = round(
            (sum(more["pss_mb"]["workers"]) + more["pss_mb"]["parent"]) / single, 2
        )
    return out, opened


def numbers(text: str) -> list[float]:
    """Comma-separated numbers ('' is none)."""
    return [float(x) for x in text.split(",") if x]


def worker_checks(workers: dict, opened: dict) -> dict[str, bool]:
    """The targets these figures answer (those measured)."""
    checks = {}
    if workers.get("ratio") is not None:
        checks["workers: 2 hold >= 1.5x the max rps of 1"] = (
            workers["ratio"] >= TARGETS["workers_2_over_1_max_rps"]
        )
    if "pss_ratio" in workers:
        checks["workers: their summed PSS <= 1.3x one's"] = (
            workers["pss_ratio"] <= TARGETS["workers_pss_ratio"]
        )
    for rate, r in opened.items():
        checks[f"open loop at {rate} rps: p99 <= 6 ms"] = (
            r["p99_ms"] is not None and r["p99_ms"] <= TARGETS["open_loop_p99_ms"] and not r["failures"]
        )
    return checks


def print_workers(workers: dict, opened: dict) -> None:
    counts = [k for k in workers if k.isdigit()]
    if not counts:
        return
    print_table(
        "recserve serve --workers N, co-located, token auth on (CPU ms per request at the max rate)",
        [{"workers": k, "max_rps": workers[k]["max_rps"], **{f"{f}_max": v for f, v in
          workers[k]["max_rps_by_form"].items()}, "cpu_ms": (workers[k]["cpu_ms_per_request"] or {}).get("lean"),
          "pss_mb": workers[k]["pss_mb"]["workers"], "parent_pss_mb": workers[k]["pss_mb"]["parent"]}
         for k in counts],
        ["workers", "max_rps", "records_max", "columns_max", "cpu_ms", "pss_mb", "parent_pss_mb"],
    )  # fmt: skip
    if "ratio" in workers:
        print(f"ratio {workers['ratio']}, pss_ratio {workers['pss_ratio']} "
              f"(with the parent {workers['frontend_pss_ratio']})")  # fmt: skip
    if opened:
        print_table("open loop, --workers 1, token auth on: latency from the scheduled send",
                    [{"rate": k, **v} for k, v in opened.items()],
                    ["rate", "p50_ms", "p99_ms", "max_ms", "requests", "failures", "achieved_rps"])  # fmt: skip
