"""training/attempt.py: the ranks of one torchrun start agree on a prefix no other start used, over
a real TCPStore that still holds earlier starts' keys (as torchrun's shared store does)."""

from __future__ import annotations

import concurrent.futures as cf
from datetime import timedelta

import pytest
import torch.distributed as dist

from training.attempt import CURRENT, attempt_rendezvous


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))
    yield server


def client(server: dist.TCPStore) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=timedelta(seconds=30))


def start(server: dist.TCPStore, world: int, order: list[int] | None = None) -> list[str]:
    """One start of ``world`` ranks, each on its own store client and thread (rank 0 last when
    ``order`` says so); the prefix each rank got, read back through the key it can see."""
    order = order or list(range(world))
    with cf.ThreadPoolExecutor(world) as pool:
        futures = {r: pool.submit(attempt_rendezvous, client(server), r, world, 20.0, 0.02) for r in order}
        stores = {r: f.result(timeout=30) for r, f in futures.items()}
    for r, s in stores.items():
        s.set(f"rank-{r}", "here")
    return sorted({stores[0].get(f"rank-{r}").decode() for r in range(world)})


def test_every_rank_of_a_start_gets_the_same_fresh_prefix(store):
    assert start(store, 3) == ["here"]  # each rank's key is visible through rank 0's prefix
    first = store.get(CURRENT)
    assert start(store, 3) == ["here"]
    assert store.get(CURRENT) != first


def test_a_rank_that_reads_the_last_starts_prefix_waits_for_this_starts_rank_0(store):
    start(store, 2)  # a finished start: its prefix is still current, with its go
    stale = store.get(CURRENT).decode()
    with cf.ThreadPoolExecutor(2) as pool:
        one = pool.submit(attempt_rendezvous, client(store), 1, 2, 20.0, 0.02)
        # rank 1 joined the stale prefix and is waiting; only then does this start's rank 0 come
        store.wait([f"{stale}/joined/1"], timedelta(seconds=20))
        zero = pool.submit(attempt_rendezvous, client(store), 0, 2, 20.0, 0.02)
        s0, s1 = zero.result(timeout=30), one.result(timeout=30)
    s1.set("from-1", "x")
    assert s0.get("from-1") == b"x"
    assert store.get(CURRENT).decode() != stale


def test_a_start_that_died_before_its_go_leaves_no_trap(store):
    store.set(CURRENT, "recserve/attempt/dead")  # rank 0 set it, then the start died
    store.set("recserve/attempt/dead/joined/1", "someone")
    assert start(store, 2, order=[1, 0]) == ["here"]


def test_a_missing_rank_is_a_timeout_naming_it(store):
    with cf.ThreadPoolExecutor(1) as pool:
        one = pool.submit(attempt_rendezvous, client(store), 1, 3, 3.0, 0.02)
        with pytest.raises(TimeoutError, match="ranks 2 did not start"):
            attempt_rendezvous(client(store), 0, 3, 1.0, 0.02)
        with pytest.raises(TimeoutError, match="rank 1: rank 0 of this start gave no go"):
            one.result(timeout=10)
