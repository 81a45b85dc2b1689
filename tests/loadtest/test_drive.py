"""loadtest/drive.py: the locustfile's latency dump read back (exact latencies, failures, the
handler's stage times and what lies outside it), and the request bodies."""

from __future__ import annotations

import numpy as np
import pytest

from loadtest.drive import read_latencies, request_bodies


def test_the_latency_dump_is_read_with_failures_and_the_handlers_stages(tmp_path):
    dump = tmp_path / "latency-50.txt"
    dump.write_text(
        "4.0\t0\tdecode;dur=0.5, worker;dur=1.0, total;dur=3.0\n"
        "6.0\t0\tdecode;dur=0.7, worker;dur=2.0, total;dur=5.0\n"
        "30.0\t1\t\n"  # a failure: no Server-Timing
    )
    ms, failed, stages = read_latencies(dump)
    assert ms.tolist() == [4.0, 6.0, 30.0] and failed.tolist() == [False, False, True]
    assert stages["decode"] == pytest.approx(0.6) and stages["total"] == pytest.approx(4.0)
    assert stages["outside_handler"] == pytest.approx(1.0)  # 4 - 3 and 6 - 5
    assert stages["handler_total_p99"] == pytest.approx(np.percentile([3.0, 5.0], 99), abs=1e-3)


def test_the_request_bodies_are_the_test_rows_200_records_each():
    import orjson

    bodies = request_bodies()
    assert len(bodies) == 10 and all(len(orjson.loads(b)) == 200 for b in bodies)  # 2,000 test rows
