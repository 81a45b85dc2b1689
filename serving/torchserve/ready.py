"""Whether TorchServe's models can answer: each one's workers READY in the management API.

TorchServe's ``/ping`` cannot say it. It counts a worker that is still starting, so it answers
``Healthy`` while the handler's ``initialize`` runs: in TorchServe 0.12 it did so before a model was
even registered and all through an 8 s ``initialize``, while the management API's describe said
``UNLOADING`` for that worker until ``initialize`` returned and ``READY`` after. recserve's handler
maps a whole version in ``initialize``, so the gap grows with the model. ``recserve up`` and the
TorchServe component's readiness probe therefore ask describe, through ``not_ready``.

    python -m serving.torchserve.ready [--management http://127.0.0.1:8081] [--timeout-s 2]

is that probe (an exec probe: the component binds the management API to 127.0.0.1 inside the pod).
It exits 0 once a model is registered and every registered model's default version has workers,
all of them READY, printing ``ready: <models>``; else 1, printing why (a model's workers and their
states, no model registered, the API not answering).
"""

from __future__ import annotations

import argparse
import sys

from serving.torchserve.api import ManagementClient, TorchServeError

READY = "READY"
"""A worker's status in describe once its handler's ``initialize`` has returned."""


def not_ready(mgmt: ManagementClient, model: str, version: str | None = None) -> str | None:
    """Why ``model`` (its ``version``, else its default one) cannot answer yet; None once it has
    workers and all of them are READY."""
    workers = [w for d in mgmt.describe(model, version) for w in d.get("workers", [])]
    if not workers:
        return f"{model}: no worker"
    waiting = [f"{w.get('id')} {w.get('status')}" for w in workers if w.get("status") != READY]
    return f"{model}: worker {', '.join(waiting)}" if waiting else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m serving.torchserve.ready", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--management", default="http://127.0.0.1:8081", help="the management API's URL")
    p.add_argument("--timeout-s", type=float, default=2.0, help="each call's timeout (default: 2)")
    args = p.parse_args(argv)
    mgmt = ManagementClient(args.management, timeout_s=args.timeout_s)
    try:
        models = [m["modelName"] for m in mgmt.list_models()]
        why = [r for m in models if (r := not_ready(mgmt, m))] if models else ["no model registered"]
    except (OSError, TorchServeError, ValueError, KeyError) as e:
        why = [f"the management API at {args.management} did not answer: {e}"]
    print("; ".join(why) if why else f"ready: {', '.join(models)}")
    return 1 if why else 0


if __name__ == "__main__":
    sys.exit(main())
