import http.server
import threading

import numpy as np
import orjson
import pytest

from loadtest.processes import wait_for
from loadtest.recorder import Recorder, Responses, request_id, rid_ints, versions_of


@pytest.mark.parametrize("rid", ["0123456789abcdef0123456789abcdef", "12345x7890"])
def test_request_ids_of_another_client_are_refused_by_name(rid):
    assert rid_ints([request_id(1, 123), request_id(9, 5)]).tolist() == [1000000123, 9000000005]
    with pytest.raises(ValueError, match="request ids"):
        rid_ints([rid])


def test_a_response_is_mixed_when_a_version_it_read_is_not_its_dense_version():
    body = lambda emb, shards: orjson.dumps({"scores": [0.5], "versions": {  # noqa: E731
        "embedding": emb, "delta_seq": 9, "dense": "4", "shards": shards}})  # fmt: skip
    assert versions_of(body("4", [["4", 7], ["4", 5]])) == (4, 5, False)
    assert versions_of(body("4", [["4", 7], ["3", 5]])) == (4, 5, True)
    assert versions_of(body("3", [])) == (3, 9, True)


class _Scoring(http.server.BaseHTTPRequestHandler):
    seen: list[str] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["Content-Length"]))
        self.seen.append(self.headers["X-Request-Id"])
        status = 503 if len(self.seen) == 3 else 200
        body = orjson.dumps({"scores": [0.1], "versions": {"embedding": "2", "delta_seq": 1, "dense": "2",
                                                           "shards": [["2", 1]]}})  # fmt: skip
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_) -> None:
        pass


def test_the_recorder_keeps_each_responses_time_status_and_versions_and_names_each_request():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Scoring)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    rec = Recorder(f"http://127.0.0.1:{server.server_port}/predictions/m", b"{}", 200.0, stream=3, clients=2)
    try:
        rec.start()
        wait_for(lambda: len(_Scoring.seen) >= 10, 30, "10 requests")
    finally:
        rec.stop.set()
        rec.join(30)
        server.shutdown()
    r = rec.responses()
    assert len(r.end) == len(_Scoring.seen) >= 10 and (np.diff(r.end) >= 0).all()
    assert (r.status == 503).sum() == 1 and ((r.status == 200) | (r.status == 503)).all()
    ok = r.status == 200
    assert (r.version[ok] == 2).all() and (r.seq[ok] == 1).all() and not r.mixed.any()
    assert (r.version[~ok] == -1).all() and (r.ms > 0).all()
    assert sorted(_Scoring.seen) == [request_id(3, n) for n in range(len(_Scoring.seen))]
    assert sorted(r.rid.tolist()) == [int(rid) for rid in sorted(_Scoring.seen)]
    assert len(r.window(r.end[0], r.end[-1]).end) == len(r.end) - 1  # [a, b)
    both = Responses.cat([r.window(r.end[2], np.inf), r.window(0, r.end[2])])
    assert (both.end == r.end).all() and (both.rid == r.rid).all()  # in the order they ended
    p = r.paced()
    assert (p.done == r.end).all() and (p.latency_s == r.ms / 1e3).all()
    assert (p.delta_seq[ok] == (2 << 32) + 1).all()  # version 2, delta 1
