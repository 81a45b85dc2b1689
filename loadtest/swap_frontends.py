"""bench-swap's frontends: what answers the requests while the versions change, and when each change
is live in it.

``serve`` (``recserve serve --workers N``, the frontend a user deploys; ``auto``: one worker per
CPU, serve's default): token auth on, as deployed. Remote lookups go through the embedding worker
of a ``recserve up --no-torchserve`` stack (the PS shards and the worker, no TorchServe, no
controller: as the Kubernetes manifests run them); co-located lookups map the version's shard files
in every worker process, with no PS shard running. Every worker follows the store itself; the roster
(``serving.scoring.roster``: each worker's version and co-located deltas, rewritten every 2 s) says
that every worker has a change, and each response names the worker that answered it
(``X-Recserve-Pid``), so the analysis times each one's switch from its responses.

``torchserve`` (``recserve up``): TorchServe's scoring handler in front, its lookups remote or
co-located, the PS shards running in both modes, the controller switching the dense model.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from loadtest.processes import wait_for
from loadtest.swap_analysis import FRONTEND_SWITCH

if TYPE_CHECKING:
    from serving.scoring.roster import FrontendRecord
    from serving.stack.local import LocalStack

FRONTENDS = ("serve", "torchserve")
MODEL = "criteo"


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


class TorchServeFront:
    """``recserve up``'s TorchServe in front of the stack."""

    def __init__(self, stack: LocalStack):
        self.stack, self.shards = stack, Shards(stack.state.ps)
        self.host, self.key_file, self.workers = stack.state.inference, "", 0

    def delta(self, seq: int, published: float) -> float:
        """When every PS shard serves delta ``seq`` (the handler's co-located shards: the responses)."""
        return self.shards.wait(lambda v, s: s >= seq)

    def switch(self, root: Path, version: str, old: str, t0: float) -> list[dict]:
        """The events of the switch to ``version`` published at ``t0``: every PS shard, then the
        controller's dense switch, then the old dense version's retirement."""
        from serving.stack.state import read_state

        live = self.shards.wait(lambda v, s: v == version, timeout_s=120)
        events = [{"kind": "full version switch", "version": version, "start": t0, "live": live}]
        # the controller's record: registered + default
        dense_live = wait_for(lambda: read_state(self.stack.run_dir).dense_version == version, 120,
                              "dense version switch live", poll_s=0.05)  # fmt: skip
        events.append({"kind": "dense version switch", "version": version, "start": live, "live": dense_live})
        # the controller drains the old dense version, then unregisters it (its worker process exits)
        mgmt = self.stack.dense.management()
        retired = wait_for(lambda: old not in {d.get("modelVersion") for d in mgmt.describe(MODEL, "all")}, 60,
                           "old dense version unregistered", poll_s=0.05)  # fmt: skip
        events.append(
            {"kind": "old dense version retired", "version": old, "start": dense_live, "live": retired}
        )
        return events


class ServeFront:
    """``recserve serve --workers N`` (the process ``parent``) in front; ``shards``: the stack's PS
    shards of remote lookups (None: co-located, none run)."""

    def __init__(
        self, root: Path, host: str, key_file: str, parent: int, workers: int, shards: Shards | None
    ):
        from serving.scoring.lean import ServeConfig
        from serving.scoring.roster import roster_dir

        self.host, self.key_file, self.parent, self.workers, self.shards = (
            host,
            key_file,
            parent,
            workers,
            shards,
        )
        self.roster = roster_dir(root, MODEL)
        self.drain_s = ServeConfig.drain_s

    def listed(self, pred: Callable[[FrontendRecord], bool], what: str, timeout_s: float = 30.0) -> float:
        """When each of the frontend's ``workers`` processes is listed in the roster as ``pred``."""
        from serving.scoring import roster

        def ok() -> bool:
            mine = [r for r in roster.read(self.roster) if self.parent in (r.pid, r.parent)]
            return len(mine) == self.workers and all(pred(r) for r in mine)

        return wait_for(ok, timeout_s, what, poll_s=0.05)

    def delta(self, seq: int, published: float) -> float:
        """Remote: when every PS shard serves delta ``seq``. Co-located: ``published`` (no server
        applies it before the workers, whose responses time it), once every worker lists it."""
        if self.shards is not None:
            return self.shards.wait(lambda v, s: s >= seq)
        self.listed(lambda r: bool(r.deltas) and min(r.deltas) >= seq, f"every worker applying delta {seq}")
        return published

    def switch(self, root: Path, version: str, old: str, t0: float) -> list[dict]:
        """The events of the switch to ``version`` published at ``t0``: every PS shard (remote),
        then every worker (listed in the roster; the analysis times it by the responses)."""
        events = []
        if self.shards is not None:
            live = self.shards.wait(lambda v, s: v == version, timeout_s=120)
            events.append({"kind": "full version switch", "version": version, "start": t0, "live": live})
        listed = self.listed(lambda r: r.version == version, f"every worker serving version {version}", 120)
        events.append({"kind": FRONTEND_SWITCH, "version": version, "start": t0, "live": listed,
                       "drain_s": self.drain_s})  # fmt: skip
        return events


@contextlib.contextmanager
def started(
    frontend: str, root: Path, lookups: str, work: Path, args
) -> Iterator[TorchServeFront | ServeFront]:
    """``frontend`` over the store at ``root`` with ``lookups``, serving CURRENT, every process
    ready; stopped on the way out."""
    from serving.stack.local import LocalStack, StackConfig

    ts = frontend == "torchserve"
    cfg = StackConfig(store=str(root), model=MODEL, http_port=0, management_port=0, metrics_port=0,
                      disable_token_auth=True, poll_s=args.poll_s, lookups=lookups, torchserve=ts)  # fmt: skip
    with contextlib.ExitStack() as es:
        if ts:
            yield TorchServeFront(es.enter_context(LocalStack(cfg)))
            return
        from loadtest.drive import lean_frontend
        from model_store.dense import AUTO
        from serving.scoring.lean import ServeConfig

        stack = es.enter_context(LocalStack(cfg)) if lookups == "remote" else None
        key_file = work / "serve-key.json"  # made by serve: token auth on, as deployed
        extra = ("--workers", args.workers, "--poll-s", f"{args.poll_s:g}")
        endpoint, procs = es.enter_context(lean_frontend(root, MODEL, lookups, stack.state if stack else None, work,
                                                         AUTO, ServeConfig.batch_wait_ms, extra, key_file))  # fmt: skip
        workers = ServeConfig(workers=args.workers).worker_count()
        front = ServeFront(root, endpoint.split("/predictions/")[0], str(key_file), procs["lean"][0], workers,
                           Shards(stack.state.ps) if stack else None)  # fmt: skip
        t0 = time.time()
        front.listed(lambda r: bool(r.version), f"{workers} workers serving", 120)
        print(f"  recserve serve --workers {args.workers}: {workers} processes serving after "
              f"{time.time() - t0:.1f} s more", flush=True)  # fmt: skip
        yield front
