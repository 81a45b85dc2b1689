"""stack.json: a typed, versioned record with one reader and one writer (serving/stack/state.py)."""

import json

import pytest

from serving.stack.config import StackConfig
from serving.stack.state import (
    FORMAT,
    Command,
    Death,
    ServedShard,
    StackState,
    read_state,
    update_state,
    write_state,
)


def _state(tmp_path) -> StackState:
    state = StackState("m", "7", str(tmp_path), StackConfig(store=str(tmp_path), model="m", replicas=2))
    state.pids = {"ps0": 11, "worker": 12}
    state.commands["ps0"] = Command(["ps", "--shard", "0"], str(tmp_path / "ps0.log"))
    state.shards = [ServedShard("127.0.0.1:1", 0, "7", 3, 100)]
    state.last_death["ps0"] = Death(at=1.5, how="was killed by SIGKILL")
    return state


def test_the_record_round_trips_with_its_types(tmp_path):
    write_state(tmp_path, _state(tmp_path))
    back = read_state(tmp_path)
    assert back == _state(tmp_path)
    assert isinstance(back.config, StackConfig) and back.config.replicas == 2
    assert back.commands["ps0"].args == ["ps", "--shard", "0"] and back.shards[0].delta_seq == 3
    assert json.loads((tmp_path / "stack.json").read_text())["format"] == FORMAT


def test_an_update_changes_only_what_it_names(tmp_path):
    write_state(tmp_path, _state(tmp_path))
    new = update_state(tmp_path, lambda s: s.restarts.update(ps0=1))
    assert new.restarts == {"ps0": 1} and read_state(tmp_path).restarts == {"ps0": 1}
    assert read_state(tmp_path).pids == {"ps0": 11, "worker": 12}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda raw: raw.update(format=FORMAT + 1),
            f"format {FORMAT + 1}, this recserve reads format {FORMAT}",
        ),
        (lambda raw: raw.pop("format"), "format None"),
        (lambda raw: raw.update(surprise=1), "unknown fields ['surprise']"),
    ],
)
def test_a_state_of_another_format_is_refused_naming_the_file(tmp_path, change, message):
    write_state(tmp_path, _state(tmp_path))
    raw = json.loads((tmp_path / "stack.json").read_text())
    change(raw)
    (tmp_path / "stack.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="stack.json") as e:
        read_state(tmp_path)
    assert message in str(e.value)


def test_up_hands_its_impression_log_to_the_handler_as_a_scoring_config_field(tmp_path):
    """``recserve up --log-impressions URL``: the handler's scoring.json names it, and the
    ScoringConfig the handler builds from that file takes it."""
    from serving.scoring.config import ScoringConfig
    from serving.stack.config import StackConfig
    from serving.stack.packaging import scoring_json
    from serving.stack.state import StackState

    url = "kafka://127.0.0.1:9092/impressions"
    for given, expected in (("", None), (url, url)):
        cfg = StackConfig(store=str(tmp_path), model="m", lookups="remote", log_impressions=given)
        fields = scoring_json(
            cfg, StackState("m", "7", str(tmp_path), cfg, worker="127.0.0.1:1"), tmp_path / "7"
        )
        assert fields.get("log_impressions") == expected
        assert ScoringConfig.from_dict(fields).log_impressions == given
