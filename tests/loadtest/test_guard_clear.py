import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import numpy as np

from loadtest import guard_clear


def test_trained_at_is_the_first_look_whose_offset_passed_the_sample():
    t = np.array([10.0, 11.0, 12.0])
    offs = np.array([[0, 5], [3, 5], [2, 9]], np.float64)  # partition 0 lower at 12 s: a restart
    where = np.array([[0, 0], [0, 2], [0, 3], [1, 4], [1, 5], [1, 9]])
    np.testing.assert_array_equal(
        guard_clear.trained_at(t, offs, where), [11.0, 11.0, np.inf, 10.0, 12.0, np.inf]
    )


def test_around_buckets_what_was_read_produced_trained_and_served():
    t = np.arange(0.0, 100.0, 0.5)
    joined = {"ts": np.array([1.0, 50.0, 60.0, 60.0]), "labels": np.array([0.0, 1.0, 0.0, 0.0]),
              "at": np.array([41.0, 41.0, 42.0, 47.0])}  # fmt: skip
    trained = np.array([43.0, np.inf, 43.5, 44.0])
    rows = guard_clear.around(40.0, 30.0, t, np.full(len(t), 0.25), t * 2, joined, trained)
    b = next(r for r in rows if r["from_s"] == 0.0)
    assert (b["produced"], b["produced_label"], b["produced_pre_trip"], b["pre_trip_label"]) == (
        3,
        0.3333,
        1,
        0.0,
    )
    assert (b["trained"], b["trained_label"], b["served_mean"], b["events_read"]) == (3, 0.0, 0.25, 11)
    assert (
        rows[0]["from_s"] == -guard_clear.BEFORE_S
        and rows[0]["produced"] == 0
        and rows[0]["trained_label"] is None
    )


def test_metrics_reads_every_line_with_its_labels_and_nothing_from_a_silent_port():
    page = b'# HELP x\nrecserve_follow_offset{unit="samples/1"} 7.0\nrecserve_join_events_total 3.0\n'

    class Page(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *_):
            pass

    server = HTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        got = guard_clear.metrics(server.server_address[1])
    finally:
        server.shutdown()
    assert got["recserve_join_events_total"] == 3.0
    assert guard_clear.offsets(got, 3) == [0.0, 7.0, 0.0]
    assert guard_clear.metrics(server.server_address[1]) == {}
