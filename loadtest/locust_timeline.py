"""The scoring locust user (``loadtest/locustfile.py``) plus a timeline: every request's wall-clock
end time, latency, outcome and the versions that answered, written to ``--timeline-out`` when the
run stops. ``loadtest/bench_swap.py`` plots latency over time with the swap events on it."""

from __future__ import annotations

import time

from locust import events

from loadtest.locustfile import ScoringUser  # noqa: F401 - the user class locust runs

_timeline: list[tuple[float, float, int]] = []


@events.init_command_line_parser.add_listener
def _args(parser) -> None:
    parser.add_argument("--timeline-out", default="", help="file for (end time, ms, failed) per request")


@events.request.add_listener
def _record(response_time, exception, **_) -> None:
    _timeline.append((time.time(), float(response_time), 1 if exception else 0))


@events.quitting.add_listener
def _dump(environment, **_) -> None:
    out = environment.parsed_options.timeline_out
    if out:
        with open(out, "w") as f:
            f.writelines(f"{t:.6f} {ms:.4f} {failed}\n" for t, ms, failed in _timeline)
