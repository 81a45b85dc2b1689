"""A PS shard served by several replica processes: one ``ShardBackend`` over all of them.

The ``--ps`` spec lists the shards in order, separated by ","; a shard's replicas are separated by
"|" (``parse_ps_spec``)::

    127.0.0.1:7001|127.0.0.1:7002,127.0.0.1:7003|127.0.0.1:7004

is shard 0 on ports 7001 and 7002 and shard 1 on 7003 and 7004. A shard with one address is the
plain ``PSClient`` it always was; a shard with several is a ``ReplicaSet``.

``ReplicaSet`` routing: round robin over the replicas whose gRPC health says SERVING (a daemon
thread checks each every ``health_poll_s``; a replica that turns SERVING is asked its Stats once
and is used only if it is the shard it was given as). A lookup that fails with UNAVAILABLE or
DEADLINE_EXCEEDED, or "not serving" -- which includes a replica that does not hold the pinned
version -- goes to the next replica while the call's deadline allows; each attempt gets an equal
share of the time left among the replicas not yet tried, so one hung replica cannot use up the
deadline. A replica that could not be reached leaves the rotation at once, and comes back when
its health says SERVING again. When no replica is known to be SERVING, the lookup still tries
each in turn: the error then names every replica and why (and one that has just come up answers
before the next health check). Other failures (a bad request) are raised as they are: every
replica would answer the same.

Replicated shards are for serving: ``update`` is refused (training shards are not replicated).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np

from serving.ps.client import PSClient, ShardError
from serving.rpc.failover import Attempt, FailedOver, Failover, is_host_port
from serving.rpc.tls import ClientTLS

log = logging.getLogger("recserve.worker")

__all__ = ["ReplicaSet", "connect_shard", "connect_shards", "format_ps_spec", "parse_ps_spec"]


def parse_ps_spec(shards: Sequence[str] | str) -> list[list[str]]:
    """``["a:1|a:2", "b:1"]`` (or the string ``"a:1|a:2,b:1"``) -> ``[["a:1", "a:2"], ["b:1"]]``.
    Raises ValueError naming the problem: an empty shard or replica, an address that is not
    HOST:PORT, the same address twice."""
    if isinstance(shards, str):
        shards = shards.split(",")
    out: list[list[str]] = []
    seen: dict[str, int] = {}
    for i, shard in enumerate(shards):
        replicas = [r.strip() for r in shard.split("|")]
        if not shard.strip() or not all(replicas):
            raise ValueError(
                f"--ps shard {i} ({shard!r}): empty address; give shards as HOST:PORT separated by ',' "
                "and a shard's replicas separated by '|' (a:1|a:2,b:1|b:2)"
            )
        for address in replicas:
            if not is_host_port(address):
                raise ValueError(f"--ps shard {i}: {address!r} is not HOST:PORT")
            if address in seen:
                raise ValueError(f"--ps: {address} is given twice (shard {seen[address]} and shard {i})")
            seen[address] = i
        out.append(replicas)
    if not out:
        raise ValueError("--ps: no PS shards given")
    return out


def format_ps_spec(shards: Sequence[Sequence[str]]) -> str:
    """The inverse of ``parse_ps_spec``: ``[["a:1", "a:2"], ["b:1"]]`` -> ``"a:1|a:2,b:1"``."""
    return ",".join("|".join(replicas) for replicas in shards)


class ReplicaSet(Failover[PSClient]):
    """Shard ``shard`` of ``num_shards``, served by the PS replicas ``clients`` (see the module doc;
    the routing is ``serving.rpc.failover.Failover``)."""

    def __init__(self, clients: Sequence[PSClient], shard: int, num_shards: int, health_poll_s: float = 0.5):
        if len(clients) < 2:
            raise ValueError("a ReplicaSet needs at least two replicas (one is a plain PSClient)")
        super().__init__(clients, f"PS shard {shard}", health_poll_s)
        self.shard, self.num_shards = shard, num_shards
        self.timeout_s = max(c.timeout_s for c in self.replicas)
        self._checked = [False] * len(self.replicas)  # identity checked since it last turned SERVING
        self._dim: int | None = None
        self.version: tuple[str, int] | None = None
        """(version, delta seq) of the last answer from any replica (None before the first)."""

    # ---- routing -------------------------------------------------------------------------------
    def rows(
        self, signs: np.ndarray, insert: bool, version: str = "", timeout_s: float | None = None
    ) -> tuple[np.ndarray, tuple[str, int]]:
        if insert:
            raise ValueError("a replicated (serving) shard does not insert rows")
        try:
            (rows, answered), _ = self.call(
                lambda client, left: client.rows(signs, insert, version, timeout_s=left),
                self.timeout_s if timeout_s is None else timeout_s,
                _classify,
            )
        except FailedOver as e:
            raise self._failed(e.errors) from None
        self.version = answered
        return rows, answered

    def _failed(self, errors: list) -> ShardError:
        why = "; ".join(str(e) for e in errors) or "no replica was tried"
        if len(errors) < len(self.replicas):
            why += f" (deadline reached after {len(errors)} of {len(self.replicas)} replicas)"
        not_serving = bool(errors) and all(e.not_serving for e in errors)
        code = errors[-1].code if errors else "DEADLINE_EXCEEDED"
        return ShardError(f"PS shard {self.shard} ({self.target}): no replica answered: {why}",
                          unavailable=True, code=code, not_serving=not_serving)  # fmt: skip

    def update(self, signs: np.ndarray, grads: np.ndarray) -> None:
        raise self._not_trained()

    def update_lookup(self, signs, grads, lookup, timeout_s=None) -> tuple[np.ndarray, tuple[str, int]]:
        raise self._not_trained()

    def _not_trained(self) -> ValueError:
        return ValueError(
            f"PS shard {self.shard} is replicated ({self.target}): replicas serve, they are not trained"
        )

    # ---- health --------------------------------------------------------------------------------
    def status_changed(self, i: int, old: str, new: str) -> None:
        if new != "SERVING":
            self._checked[i] = False
        level = logging.WARNING if old == "SERVING" or new == "WRONG_SHARD" else logging.INFO
        log.log(level, "shard %d replica %s: %s -> %s", self.shard, self.replicas[i].target, old, new)

    def admit(self, i: int, client: PSClient, status: str) -> str:
        """A replica that turns SERVING is asked its Stats once: used only if it is this shard."""
        if status == "SERVING" and not self._checked[i]:
            status = self._identity(client)
            self._checked[i] = status == "SERVING"
        return status

    def _identity(self, client: PSClient) -> str:
        """SERVING when ``client`` is shard ``shard`` of ``num_shards``; else why not (logged)."""
        try:
            st = client.stats()
        except ShardError as e:
            return e.code or "UNAVAILABLE"
        if self._dim is None:
            self._dim = int(st["dim"])
        if (st["shard"], st["num_shards"]) != (self.shard, self.num_shards) or int(st["dim"]) != self._dim:
            log.error("replica %s is shard %s of %s (dim %s), not shard %d of %d (dim %d): not used",
                      client.target, st["shard"], st["num_shards"], st["dim"],
                      self.shard, self.num_shards, self._dim)  # fmt: skip
            return "WRONG_SHARD"
        return "SERVING"

    def start(self, wait_s: float) -> ReplicaSet:
        """Check every replica until one is SERVING the right shard or answers at all (``wait_s``
        at most; ShardError then), then keep checking in a daemon thread."""
        deadline = time.monotonic() + wait_s
        while True:
            self.check()
            status = self.statuses()
            wrong = [c.target for c, s in zip(self.replicas, status, strict=True) if s == "WRONG_SHARD"]
            if wrong:
                raise ValueError(
                    f"PS replica(s) {', '.join(wrong)} are not shard {self.shard} of {self.num_shards}"
                )
            if self.serving():
                break
            answering = [c for c, s in zip(self.replicas, status, strict=True) if s == "NOT_SERVING"]
            if answering:  # up but serving no version yet: the worker starts NOT_SERVING, as with one
                if self._identity(answering[0]) == "WRONG_SHARD":
                    raise ValueError(
                        f"PS replica {answering[0].target} is not shard {self.shard} of {self.num_shards}"
                    )
                break
            if time.monotonic() > deadline:
                raise ShardError(f"PS shard {self.shard}: no replica reachable after {wait_s}s ({self.describe()})",
                                 True, "UNAVAILABLE")  # fmt: skip
            time.sleep(0.1)
        self.start_polling()
        return self

    @property
    def dim(self) -> int:
        if self._dim is None:
            raise ShardError(
                f"PS shard {self.shard}: dim unknown (no replica answered yet)", True, "UNAVAILABLE"
            )
        return self._dim


def _classify(e: BaseException) -> Attempt | None:
    """A replica's failure: unreachable or too slow -> the next one, this one out of the rotation;
    serving no (or not the pinned) version -> the next one; anything else is raised."""
    if not isinstance(e, ShardError) or not e.unavailable:
        return None
    return Attempt(retry=True, down=not e.not_serving, status=e.code or "UNAVAILABLE")


def connect_shards(
    spec: Sequence[str] | str, timeout_s: float = 5.0, token_file: str = "", health_poll_s: float = 0.5,
    tls: ClientTLS | None = None,
) -> list:  # fmt: skip
    """One shard backend per shard of ``spec`` (``parse_ps_spec``): a ``PSClient`` for a shard with
    one address, a started ``ReplicaSet`` for one with several (every client with ``tls``; None:
    plaintext). Waits up to ``timeout_s`` for each shard to answer (serving a version or not yet)
    and checks that it is shard i of n."""
    shards = parse_ps_spec(spec)
    backends: list = []
    try:
        for i, addresses in enumerate(shards):
            backends.append(
                connect_shard(addresses, i, len(shards), timeout_s, token_file, health_poll_s, tls)
            )
        return backends
    except BaseException:
        for b in backends:
            b.close()
        raise


def connect_shard(
    addresses: Sequence[str], shard: int, num_shards: int, timeout_s: float = 5.0, token_file: str = "",
    health_poll_s: float = 0.5, tls: ClientTLS | None = None,
):  # fmt: skip
    """The backend of shard ``shard`` of ``num_shards`` served at ``addresses`` (its replicas): a
    ``PSClient`` for one address, a started ``ReplicaSet`` for several; checked to be that shard."""
    clients = [PSClient(a, timeout_s=timeout_s, token_file=token_file, tls=tls) for a in addresses]
    if len(clients) > 1:
        replicas = ReplicaSet(clients, shard, num_shards, health_poll_s)
        try:
            return replicas.start(timeout_s)
        except BaseException:
            replicas.close()
            raise
    (client,) = clients
    try:
        client.wait_connected(timeout_s)
        st = client.stats()
        if (st["shard"], st["num_shards"]) != (shard, num_shards):
            raise ValueError(
                f"PS at {client.target} is shard {st['shard']} of {st['num_shards']}, "
                f"but was given as shard {shard} of {num_shards} (order of --ps matters)"
            )
    except BaseException:
        client.close()
        raise
    return client
