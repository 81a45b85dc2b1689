"""The scoring locust user (``loadtest/locustfile.py``) plus a timeline: every request's wall-clock
end time, latency, outcome and the versions that answered, written to ``--timeline-out`` when the
run stops. ``loadtest/bench_swap.py`` plots latency over time with the swap events on it.

One line per request: ``end_time ms failed mixed dense_version delta_seq server_ms worker_ms
dense_ms pid``; ``mixed`` is 1 when the response's embedding version (or any shard's) differs from its
dense version; ``dense_version`` is -1 when the response named none (a failure); ``delta_seq`` is
the lowest delta seq among the shards the response read (-1: none, or not named); the last three
are the handler's ``Server-Timing`` stages (``serving.scoring.loop``: the whole request in the
handler, its lookup, its dense run; -1 when the response has no such header), so a slow request
says whether it was slow in the lookup, the dense model or waiting outside the handler; ``pid`` is
the process that answered (``recserve serve``'s ``X-Recserve-Pid``; -1: not named, as TorchServe's).
``loadtest.common.read_timeline`` reads it (``TIMELINE_COLUMNS``)."""

from __future__ import annotations

import time

import orjson
from locust import events

from loadtest.locustfile import ScoringUser  # noqa: F401 - the user class locust runs

_timeline: list[tuple] = []
_STAGES = ("total", "worker", "dense")  # of Server-Timing: the timeline's last three columns


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


def _stages(response) -> list[float]:
    """The handler's stage times (ms) of ``_STAGES`` from the response's ``Server-Timing``, -1 each
    one absent."""
    header = getattr(response, "headers", None)
    header = (header.get("Server-Timing") if header is not None else None) or ""
    got = {}
    for part in header.split(","):
        name, _, dur = part.strip().partition(";dur=")
        try:
            got[name] = float(dur)
        except ValueError:
            continue
    return [got.get(s, -1.0) for s in _STAGES]


def _pid(response) -> str:
    """The process that answered (``X-Recserve-Pid``), -1 when not named."""
    header = getattr(response, "headers", None)
    pid = (header.get("X-Recserve-Pid") if header is not None else None) or ""
    return pid if pid.isdigit() else "-1"


@events.request.add_listener
def _record(response_time, exception, response=None, **_) -> None:
    mixed, dense, seq = _versions(response) if not exception else (0, "-1", -1)
    stages = _stages(response) if response is not None else [-1.0] * len(_STAGES)
    row = (
        time.time(),
        float(response_time),
        1 if exception else 0,
        mixed,
        dense,
        seq,
        *stages,
        _pid(response),
    )
    _timeline.append(row)


@events.quitting.add_listener
def _dump(environment, **_) -> None:
    out = environment.parsed_options.timeline_out
    if out:
        with open(out, "w") as f:
            f.writelines(
                f"{t:.6f} {ms:.4f} {failed} {mixed} {dense} {seq} {' '.join(f'{x:.3f}' for x in stages)} {pid}\n"
                for t, ms, failed, mixed, dense, seq, *stages, pid in _timeline
            )
