import numpy as np

from loadtest.common import TIMELINE_COLUMNS, read_timeline


def test_a_timeline_reads_as_one_row_per_request_whatever_its_length(tmp_path):
    path = tmp_path / "timeline.txt"
    path.write_text("1700000000.5 4.25 0 0 1 3\n1700000000.7 9.5 1 0 -1 -1\n\n")
    tl = read_timeline(path)
    assert tl.shape == (2, len(TIMELINE_COLUMNS))
    np.testing.assert_array_equal(tl[:, TIMELINE_COLUMNS.index("delta_seq")], [3, -1])
    path.write_text("")
    assert read_timeline(path).shape == (0, len(TIMELINE_COLUMNS))
