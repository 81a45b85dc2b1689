import http.server
import threading

import numpy as np
import orjson
import pytest

from loadtest.bench_stream import sample_key
from loadtest.processes import wait_for
from loadtest.recorder import ITEM_SHIFT, Recorder, key_ints, request_id, rid_ints, versions_of


def test_sample_keys_of_our_request_ids_read_back_as_integers_in_the_same_order():
    rng = np.random.default_rng(0)
    pairs = [(request_id(int(s), int(n)), int(i)) for s, n, i in
             zip(rng.integers(1, 10, 500), rng.integers(0, 10**9, 500), rng.integers(0, 256, 500), strict=True)]  # fmt: skip
    keys = np.sort(np.array([sample_key(r, i) for r, i in pairs]))  # sorted as the trainer keeps them
    ints = key_ints(keys)
    assert (np.diff(ints) >= 0).all()
    want = sorted((i << ITEM_SHIFT) | int(r) for r, i in pairs)
    assert ints.tolist() == want
    assert key_ints(np.array([sample_key("1000000123", 7)])).tolist() == [7 << ITEM_SHIFT | 1000000123]
    assert rid_ints(["2000000005"]).tolist() == [2000000005]


@pytest.mark.parametrize("rid", ["0123456789abcdef0123456789abcdef", "12345x7890"])
def test_a_key_of_another_clients_request_id_is_refused_by_name(rid):
    with pytest.raises(ValueError, match="request id"):
        key_ints(np.array([sample_key(rid, 3)]))
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
