import numpy as np
import pytest

from loadtest import stream_figures as sf
from loadtest.paced import Responses
from model_store.deltas import DeltaManifest


def log_of(rows: list[tuple[int, int, str, int, float]]) -> sf.SampleLog:
    """(partition, offset, request id, item, label) per sample."""
    part, offset, rid, item, label = (list(c) for c in zip(*rows, strict=True))
    keys = sf.keys_of(np.array([r.encode() for r in rid]), np.array(item, np.int64))
    return sf.SampleLog(
        np.array(part, np.int64), np.array(offset, np.int64), keys, np.array(label, np.float32)
    )


def record(positions: dict[int, int], samples: int, auc: float | None = None) -> DeltaManifest:
    return DeltaManifest(
        "kafka://b/samples", {f"samples/{p}": o for p, o in positions.items()}, samples, auc=auc
    )


def test_keys_are_the_trainers_item_then_request_id():
    keys = sf.keys_of(np.array([b"req-1", b"r2"]), np.array([3, 70000]))
    assert keys.tolist() == [(3).to_bytes(4, "big") + b"req-1", (70000).to_bytes(4, "big") + b"r2"]
    assert sf.item_of(keys).tolist() == [3, 70000]


def test_clicks_keep_each_batchs_keys_and_hand_over_time_whatever_the_request_ids_widths():
    from stream.records import Event

    clicks = sf.Clicks()
    clicks([Event("req-10", 3, 1.0, 5.0), Event("r2", 7, 1.0, 5.5)], 100.0)
    clicks([], 101.0)
    clicks([Event("request-3", 0, 1.0, 6.0)], 102.5)
    keys, t = clicks.arrays()
    assert (
        keys.tolist() == sf.keys_of(np.array([b"req-10", b"r2", b"request-3"]), np.array([3, 7, 0])).tolist()
    )
    assert t.tolist() == [100.0, 100.0, 102.5]
    assert [len(a) for a in sf.Clicks().arrays()] == [0, 0]


def test_a_sample_belongs_to_the_first_delta_whose_offsets_pass_it_across_a_restart():
    log = log_of(
        [(0, 0, "a", 0, 1), (0, 1, "a", 1, 0), (0, 2, "b", 0, 0), (1, 0, "c", 0, 1), (0, 3, "d", 0, 0)]
    )
    # delta 0 consumed partition 0 up to 2 and partition 1 not at all; a restart resumed there, and
    # delta 1 took partition 0 to 3 and partition 1 to 1; offset 3 of partition 0 was never published
    deltas = [record({0: 2}, 2), record({0: 3, 1: 1}, 2)]
    assert sf.delta_index(log, deltas, "samples").tolist() == [0, 0, 1, 1, -1]


def test_a_key_emitted_twice_is_trained_where_it_came_first():
    log = log_of([(0, 0, "a", 0, 1), (0, 1, "a", 1, 0), (0, 2, "a", 0, 1), (0, 3, "b", 0, 0)])
    where = np.array([0, 0, 1, -1])
    assert sf.first_trained(log, where).tolist() == [True, True, False, False]


def test_the_frozen_auc_scores_the_samples_of_each_delta_with_the_start_scores():
    # item 0 is clicked, item 1 not: the start scores rank them right in delta 0 and wrong in delta 1
    log = log_of([(0, 0, "a", 0, 1), (0, 1, "a", 1, 0), (0, 2, "b", 2, 1), (0, 3, "b", 3, 0)])
    deltas = [record({0: 2}, 2, auc=0.5), record({0: 4}, 2, auc=1.0)]
    where = sf.delta_index(log, deltas, "samples")
    pair = sf.progressive_auc(
        log, where, sf.first_trained(log, where), deltas, np.array([0.9, 0.1, 0.1, 0.9])
    )
    assert (pair.streaming, pair.frozen, pair.windows, pair.samples_differ) == (0.75, 0.5, 2, 0)


def test_a_record_whose_count_differs_from_the_samples_placed_in_it_is_counted():
    log = log_of([(0, 0, "a", 0, 1), (0, 1, "a", 1, 0)])
    deltas = [record({0: 2}, 3, auc=1.0)]
    where = sf.delta_index(log, deltas, "samples")
    assert (
        sf.progressive_auc(log, where, sf.first_trained(log, where), deltas, np.ones(2)).samples_differ == 1
    )


def test_a_click_is_served_by_the_first_response_with_its_delta_or_a_later_one():
    log = log_of([(0, 0, "a", 0, 1), (0, 1, "b", 5, 1), (0, 2, "c", 1, 1)])
    deltas = [record({0: 1}, 1), record({0: 2}, 1)]  # delta seqs 7 and 8; "c" never published
    where = sf.delta_index(log, deltas, "samples")
    clicks = (
        sf.keys_of(np.array([b"a", b"b", b"c", b"x"]), np.array([0, 5, 1, 0])),
        np.array([10.0, 11.0, 12.0, 13.0]),
    )
    # responses at 10.5 (seq 6), 11.5 (seq 8: holds both), 12.5 (seq 7: an older client's, ignored)
    responses = Responses.of([(10.5, 0.01, 200, 6), (11.5, 0.01, 200, 8), (12.5, 0.01, 200, 7)])
    t, seconds, unserved = sf.event_to_served(
        clicks, log, where, sf.first_trained(log, where), np.array([7, 8]), responses
    )
    assert t.tolist() == [10.0, 11.0]
    assert seconds == pytest.approx([1.5, 0.5])
    assert unserved == 0


def test_a_clicks_wait_splits_into_the_joiner_and_its_deltas_record():
    log = log_of([(0, 0, "a", 0, 1), (0, 1, "b", 5, 1)])
    log = sf.SampleLog(log.partition, log.offset, log.keys, log.labels, np.array([10.2, 11.1]))
    deltas = [record({0: 1}, 1), record({0: 2}, 1)]
    where = sf.delta_index(log, deltas, "samples")
    clicks = (sf.keys_of(np.array([b"b", b"a", b"x"]), np.array([5, 0, 0])), np.array([11.0, 10.0, 12.0]))
    parts = sf.event_to_written(clicks, log, where, sf.first_trained(log, where), np.array([10.9, 11.6]))
    assert parts["click"].tolist() == [11.0, 10.0]  # "x" was never joined
    assert parts["joined"] == pytest.approx([0.1, 0.2])
    assert parts["written"] == pytest.approx([0.6, 0.9])
    both = sf.SampleLog.cat([log, log_of([(1, 0, "c", 0, 0)])])
    assert both.produced is None and len(both.keys) == 3  # a part without produce times: none


def test_a_trained_click_no_response_saw_is_counted_unserved():
    log = log_of([(0, 0, "a", 0, 1)])
    deltas = [record({0: 1}, 1)]
    where = sf.delta_index(log, deltas, "samples")
    clicks = (sf.keys_of(np.array([b"a"]), np.array([0])), np.array([10.0]))
    responses = Responses.of([(10.5, 0.01, 200, 0)])
    _, seconds, unserved = sf.event_to_served(
        clicks, log, where, sf.first_trained(log, where), np.array([1]), responses
    )
    assert (len(seconds), unserved) == (0, 1)


def test_missing_counts_wanted_keys_absent_whatever_their_widths():
    wanted = sf.keys_of(np.array([b"abc", b"abcd"]), np.array([0, 1]))
    have = np.array([(0).to_bytes(4, "big") + b"abc"], dtype="S40")
    assert sf.missing(wanted, have) == 1


def test_exactly_once_counts_a_retrained_key_and_a_skipped_sample_against_the_impression_log():
    log = log_of([(0, 0, "a", 0, 1), (0, 1, "a", 1, 0), (0, 2, "a", 0, 1), (0, 3, "b", 0, 0)])
    expected = sf.keys_of(np.array([b"a", b"a", b"b", b"c"]), np.array([0, 1, 0, 0]))
    # delta 0 says 2 samples (a/0, a/1: right); delta 1 says 2 over a re-emitted a/0 and b/0: one
    # trained twice; c/0 never reached the topic: lost
    deltas = [record({0: 2}, 2), record({0: 4}, 2)]
    where = sf.delta_index(log, deltas, "samples")
    assert sf.exactly_once(log, where, sf.first_trained(log, where), deltas, expected) == sf.Counted(1, 1)
    # a delta whose offsets hold a new key it does not say it trained: skipped, lost
    deltas = [record({0: 2}, 2), record({0: 4}, 0)]
    assert sf.exactly_once(log, where, sf.first_trained(log, where), deltas, expected) == sf.Counted(0, 2)


def test_recovery_is_the_first_lag_sample_under_a_second_of_traffic_after_the_last_over_it():
    t = np.arange(100.0, 140.0)  # one lag sample a second; the kill at 110.5, the next one at 135
    lag = np.full(40, 2_000)
    lag[11:20] = 50_000  # behind from 111 to 119
    lag[22] = 12_000  # over again at 122 (a restarted joiner's replay): not recovered till 123
    assert sf.recovery_s(t, lag, 110.5, 135.0, 10_000) == 12.5
    lag[22] = 10_000  # one second of traffic exactly is not under it
    assert sf.recovery_s(t, lag, 110.5, 135.0, 10_000) == 12.5
    lag[22] = 9_999
    assert sf.recovery_s(t, lag, 110.5, 135.0, 10_000) == 9.5  # under from 120 on


def test_back_under_is_the_first_lag_sample_under_the_line_after_the_kills_first_over_it():
    t = np.arange(100.0, 140.0)
    lag = np.full(40, 2_000)
    lag[11:20] = 50_000  # behind from 111 to 119: under again at 120
    lag[30] = 12_000  # a look over the line at 130, the steady state's noise: recovery_s waits it out
    assert sf.back_under_s(t, lag, 110.5, 135.0, 10_000) == 9.5
    assert sf.recovery_s(t, lag, 110.5, 135.0, 10_000) == 20.5
    lag[11:20] = 2_000
    assert sf.back_under_s(t, lag, 110.5, 129.5, 10_000) == 0.0  # never a second of traffic behind
    lag[25:] = 80_000  # still behind when the next kill came
    assert sf.back_under_s(t, lag, 110.5, 135.0, 10_000) is None
    assert sf.back_under_s(t, lag, 150.0, 160.0, 10_000) is None  # no sample after the kill


def test_recovery_counts_only_the_samples_before_the_next_kill():
    t = np.arange(100.0, 140.0)
    lag = np.full(40, 2_000)
    lag[30:] = 80_000  # the next kill's (at 129.5) lag is not this one's
    assert sf.recovery_s(t, lag, 110.5, 129.5, 10_000) == 0.0  # never a second of traffic behind
    lag[25:] = 80_000  # still behind when the next kill came: never recovered
    assert sf.recovery_s(t, lag, 110.5, 129.5, 10_000) is None
    assert sf.recovery_s(t, lag, 150.0, 160.0, 10_000) is None  # no sample after the kill


def test_the_clicks_outside_the_kills_windows_are_steady():
    t = np.array([0.0, 97.9, 98.0, 129.9, 130.0, 150.0, 199.0])
    assert sf.outside_kills(t, [100.0, 200.0], 2.0).tolist() == [True, True, False, False, True, True, False]
    assert sf.outside_kills(t, [], 2.0).all()


def test_served_figures_leave_out_the_kills_windows_and_the_last_seconds():
    t = np.array([10.0, 20.0, 99.0, 110.0, 140.0, 250.0, 298.0])  # load from 0 to 300, kills at 100, 200
    seconds = np.array([0.5, 0.6, 9.0, 5.0, 0.7, 0.8, 0.9])
    out = sf.served_figures(t, seconds, 0.0, 300.0, {"trainer": 100.0, "joiner": 200.0}, 2.0)
    assert out["event_to_served_s"]["n"] == 4 and out["event_to_served_s"]["p99"] < 1.0
    assert out["event_to_served_s_all"]["n"] == 6  # the click at 298 s: no response left to see it
    assert [p["n"] for p in out["event_to_served_s_by_phase"].values()] == [2, 3, 1]


def test_a_role_not_recovered_or_a_p99_not_measured_misses_its_target():
    out = {"duplicate_samples": 0, "lost_samples": 0, "event_to_served_s": {"p99": 1.2},
           "recovery_s": {"trainer": 14.0, "joiner": None}, "logging_p99_ratio": 1.01,
           "progressive_auc": {"streaming": 0.7, "frozen": 0.5}}  # fmt: skip
    ok = sf.targets(out, 1.15)
    assert ok["trainer_recovery_s_le_30"] and not ok["joiner_recovery_s_le_30"]
    assert ok["event_to_served_p99_outside_the_kills_le_2s"] and ok["streaming_auc_ge_frozen_plus_0.02"]
    out |= {"event_to_served_s": {"p99": None}, "recovery_s": {"trainer": 30.5}}
    ok = sf.targets(out, 1.15)
    assert not ok["event_to_served_p99_outside_the_kills_le_2s"] and not ok["trainer_recovery_s_le_30"]


def test_the_machines_cpu_less_the_bench_processes_is_the_others():
    busy = [(0.0, 100.0), (10.0, 112.0), (20.0, 130.0)]  # busy CPU seconds of the whole machine
    assert sf.busy_pct(busy, 0.0, 20.0) == 150.0 and sf.busy_pct(busy, 5.0, 15.0) is None
    out = sf.cpu_figures(lambda a, b: {"trainer": 40.0, "joiner": 20.0}, busy,
                         {"load": (0.0, 20.0), "after": (10.0, 20.0)})  # fmt: skip
    assert out["load"] == {"trainer": 40.0, "joiner": 20.0, "machine": 150.0, "others": 90.0}
    assert out["after"]["machine"] == 180.0


def test_the_joiner_owes_the_samples_of_a_closed_window_until_it_produces_them():
    imps = [("a", 100.0, 2, 0), ("b", 101.0, 1, 0)]  # windows of 10 s: due at 110 and 111
    log = log_of([(0, 0, "a", 0, 1), (0, 1, "a", 1, 0), (0, 2, "a", 1, 0)])
    # a/0 clicked early (103), a/1 written late (114) and again (115: a restarted joiner's replay),
    # b/0 never
    log = sf.SampleLog(log.partition, log.offset, log.keys, log.labels, np.array([103.0, 114.0, 115.0]))
    t = np.array([105.0, 110.0, 112.0, 114.0, 120.0])
    assert sf.owed_by_the_joiner(imps, 10.0, log, t).tolist() == [0, 1, 2, 1, 1]
    assert sf.owed_by_the_joiner([], 10.0, log, t).tolist() == [0] * 5
