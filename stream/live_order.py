"""What a join that held its windows (``stream.join``'s input guard) emits when the guard clears
and the clicks came: every sample a live join would have produced by now, in the order it would
have produced them.

A live join emits a click's sample when the click comes and the negatives of a request when its
window closes, a window later, so the trainer always has the last window's clicks before their
requests' negatives. The held windows, closed at once request by request, and the clicks of the
windows still open, kept for their close, gave the trainer something no live run gives: the
negatives of the requests impressed before the trip (their clicks trained before the outage) first,
then whole requests, then for a window no click before its negatives. bench-guard measured it
(loadtest/results/guard.json ``around_clears``): the 208,165 samples the clear produced had a mean
label of 0.091 and the next 30 s 0.10-0.108, against 0.125 trained live before the outage, and the
served mean predicted CTR fell from 0.22 to 0.12 in those 30 s (the live loop's level then, 0.23 at a
label rate of 0.126, was the over-prediction c8b2f00's streaming loss fixed), and rose back once
clicks came ahead again.

So the clicks of the windows still open are emitted now (``clicks_due``; their later clicks label
at once, as usual), and the samples are sorted by the event time a live join would have emitted
each at (``in_live_order``): a sample's impression ``ts`` plus its ``elapsed`` (a click's delay,
a negative's horizon), which every sample record carries.
"""

from __future__ import annotations

import itertools

import numpy as np

from stream.join_state import Emit, JoinCounts, _Request
from stream.records import SAMPLE_HEAD


def clicks_due(requests: dict[str, _Request], counts: JoinCounts) -> list[Emit]:
    """The samples of the clicks that the windows still open (and not quarantined) kept for their
    close; from now on their clicks label at once (a loop per request, at a clear only)."""
    out = []
    for rid, req in requests.items():
        if req.closed or req.quarantine or req.writer is None:
            continue
        req.defer = False
        if req.deferred:
            out.append(Emit(rid.encode(), [req.writer.labelled(e) for e in req.deferred], token=rid))
            req.unacked += len(req.deferred)
            counts.positives += len(req.deferred)
            req.deferred = []
    return out


def live_times(values: list[bytes]) -> np.ndarray:
    """Each sample record's live time: its impression's ts plus its elapsed (from the header)."""
    sizes = np.fromiter(map(len, values), np.int64, len(values))
    if len(values) and sizes.min() < SAMPLE_HEAD.itemsize:
        raise ValueError(f"a sample record of {sizes.min()} bytes is shorter than its header")
    buf = np.frombuffer(b"".join(values), np.uint8)
    begin = np.cumsum(sizes) - sizes
    head = buf[begin[:, None] + np.arange(SAMPLE_HEAD.itemsize)].view(SAMPLE_HEAD).ravel()
    return head["ts"].astype(np.float64) + head["elapsed"]


def in_live_order(emits: list[Emit]) -> list[Emit]:
    """``emits``' samples sorted by live time (ties in the order given), each run of one emit's
    samples an emit of its own (same key, token and topic); dead letters first, as they were."""
    dead, live = [e for e in emits if e.dead], [e for e in emits if not e.dead]
    if not live:
        return dead
    values = np.empty(sum(len(e.values) for e in live), object)
    values[:] = list(itertools.chain.from_iterable(e.values for e in live))
    owner = np.repeat(np.arange(len(live)), [len(e.values) for e in live])
    order = np.argsort(live_times(values.tolist()), kind="stable")
    owner, values = owner[order], values[order]
    cuts = np.flatnonzero(np.diff(owner)) + 1
    starts, stops = np.r_[0, cuts], np.r_[cuts, len(owner)]
    return dead + [
        Emit(live[o].key, values[a:b].tolist(), token=live[o].token, quarantine=live[o].quarantine)
        for o, a, b in zip(owner[starts].tolist(), starts.tolist(), stops.tolist(), strict=True)
    ]
