"""The scoring locust user (``loadtest/locustfile.py``) plus a timeline: every request's wall-clock
end time, latency, outcome and the versions that answered, written to ``--timeline-out`` when the
run stops. ``loadtest/bench_swap.py`` plots latency over time with the swap events on it.

One line per request: ``end_time ms failed mixed dense_version delta_seq``; ``mixed`` is 1 when
the response's embedding version (or any shard's) differs from its dense version;
``dense_version`` is -1 when the response named none (a failure); ``delta_seq`` is the lowest delta
seq among the shards the response read (-1: none, or not named). ``loadtest.common.read_timeline``
reads it (``TIMELINE_COLUMNS``)."""

from __future__ import annotations

import time

import orjson
from locust import events

from loadtest.locustfile import ScoringUser  # noqa: F401 - the user class locust runs

_timeline: list[tuple[float, float, int, int, str, int]] = []


@events.init_command_line_parser.add_listener
def _args(parser) -> None:
    parser.add_argument(
        "--timeline-out", default="", help="file for (end time, ms, failed, mixed, dense) per request"
    )


def _versions(response) -> tuple[int, str, int]:
    """(mixed, dense version, lowest delta seq read) of a scoring response."""
    try:
        v = orjson.loads(response.content)["versions"]
    except (AttributeError, TypeError, KeyError, orjson.JSONDecodeError):
        return 0, "-1", -1
    dense = str(v.get("dense", ""))
    read = {str(v.get("embedding", ""))} | {str(s) for s, _ in v.get("shards", []) if s}
    seqs = [int(q) for _, q in v.get("shards", [])]
    return int(read != {dense}), dense if dense.isdigit() else "-1", min(seqs, default=-1)


@events.request.add_listener
def _record(response_time, exception, response=None, **_) -> None:
    mixed, dense, seq = _versions(response) if not exception else (0, "-1", -1)
    _timeline.append((time.time(), float(response_time), 1 if exception else 0, mixed, dense, seq))


@events.quitting.add_listener
def _dump(environment, **_) -> None:
    out = environment.parsed_options.timeline_out
    if out:
        with open(out, "w") as f:
            f.writelines(
                f"{t:.6f} {ms:.4f} {failed} {mixed} {dense} {seq}\n"
                for t, ms, failed, mixed, dense, seq in _timeline
            )
