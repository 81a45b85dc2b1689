"""Keys of their own for each start of a torchrun job's ranks.

torchrun restarts every rank when one dies, but on several nodes the ranks keep the rendezvous of
the first start (c10d rendezvous shares one TCPStore, a key-value store, across rounds), where the last start's keys are
still set: a new rank reading a dead rank's gloo address fails to connect. Nor can the ranks name
their start: ``TORCHELASTIC_RESTART_COUNT`` counts only the restarts a node caused itself
(pytorch/pytorch#108158, #135712), so two nodes can disagree on it and wait for each other's keys
forever.

``attempt_rendezvous`` agrees on a fresh prefix instead: rank 0 draws a random one and sets it as the
current one; every other rank reads it, joins under it with a random id of its own, and waits for
rank 0's go, which lists the ids of the ranks that joined. A rank that read a stale prefix (a
previous start's; rank 0 has not set its own yet) finds its id missing from that start's go, or no
go at all, and reads the current prefix again.
"""

from __future__ import annotations

import secrets
import time
from datetime import timedelta

import torch.distributed as dist

CURRENT = "recserve/attempt/current"


def attempt_rendezvous(rendezvous: dist.Store, rank: int, world: int, timeout_s: float = 600.0,
                       poll_s: float = 0.1) -> dist.PrefixStore:  # fmt: skip
    """The ``rendezvous`` (torch's key-value store) under a prefix all ``world`` ranks of this
    start agree on, and no other start used. A rank missing for ``timeout_s`` is a TimeoutError
    naming it."""
    if rank == 0:
        prefix = f"recserve/attempt/{secrets.token_hex(8)}"
        rendezvous.set(CURRENT, prefix)
        joined = [f"{prefix}/joined/{r}" for r in range(1, world)]
        try:
            rendezvous.wait(joined, timedelta(seconds=timeout_s))
        except dist.DistStoreError as e:
            missing = [k.rsplit("/", 1)[1] for k in joined if not rendezvous.check([k])]
            raise TimeoutError(
                f"ranks {', '.join(missing)} did not start within {timeout_s:.0f} s: {e}"
            ) from e
        rendezvous.set(f"{prefix}/go", ",".join(rendezvous.get(k).decode() for k in joined))
        return dist.PrefixStore(prefix, rendezvous)

    me = secrets.token_hex(8)
    deadline = time.monotonic() + timeout_s
    rendezvous.wait([CURRENT], timedelta(seconds=timeout_s))
    while time.monotonic() < deadline:
        prefix = rendezvous.get(CURRENT).decode()
        rendezvous.set(f"{prefix}/joined/{rank}", me)
        go = f"{prefix}/go"
        if rendezvous.check([go]):
            if me in rendezvous.get(go).decode().split(","):
                return dist.PrefixStore(prefix, rendezvous)
            # a finished start's prefix: this start's rank 0 has not set its own yet
        time.sleep(poll_s)  # polled with check(): a timed-out wait() logs a warning each time
    raise TimeoutError(f"rank {rank}: rank 0 of this start gave no go within {timeout_s:.0f} s")
