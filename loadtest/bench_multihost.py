"""bench-multihost: recserve across hosts made of network namespaces (``loadtest/netns.py``).

Serving (``loadtest/multihost_serving.py``): PS shards with 2 replicas on different hosts, two
worker hosts and the lean frontend under 50 requests/s: failed requests while one PS host's link
drops every packet, the same with one worker host, responses mixing versions while a retrained
version switches in across hosts, p99 across hosts against the same stack on one host.
Training (``loadtest/multihost_training.py``): a two-node torchrun job whose rank 1 is killed
mid-epoch and restarted from its checkpoint against the uninterrupted run (AUC delta), samples/s
on 2 nodes against 1. Writes ``loadtest/results/multihost.json``.

    python -m loadtest.bench_multihost [--quick] [--only serving|training] [--results-dir DIR]

``--quick``: 5 s load windows, one epoch of training, no one-host or 1-node comparison.
"""

from __future__ import annotations

import sys

from loadtest import netns
from loadtest.common import parser, print_table, report_targets, write_results


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--only", choices=["serving", "training"], help="run one half")
    args = p.parse_args(argv)
    if reason := netns.unavailable():
        print(f"bench-multihost needs network namespaces: {reason}", file=sys.stderr)
        return 2
    result: dict = {"quick": args.quick}
    if args.only in (None, "serving"):
        from loadtest import multihost_serving

        result["serving"] = multihost_serving.measure(quick=args.quick)
    if args.only in (None, "training"):
        from loadtest import multihost_training

        result["training"] = multihost_training.measure(quick=args.quick)
    figures = {**result.get("serving", {}), **result.get("training", {})}
    rows = [{"figure": k, "value": v} for k, v in figures.items() if isinstance(v, (int, float))]
    print_table("recserve across hosts (network namespaces on this machine)", rows, ["figure", "value"])
    checks = {}
    for key, text, ok in [
        ("failures_host_down", "0 failed requests while a PS host is down", lambda v: v == 0),
        ("failures_worker_down", "0 failed requests while a worker host is down", lambda v: v == 0),
        ("mixed_responses", "0 responses mixing versions across a switch", lambda v: v == 0),
        ("resume_auc_delta", "resumed run's AUC within 0.005 of the uninterrupted one", lambda v: v <= 0.005),
    ]:
        if key in figures:
            checks[text] = bool(ok(figures[key]))
    report_targets(result, checks)
    print(f"wrote {write_results('multihost', result, args.results_dir)}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
