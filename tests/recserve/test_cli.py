"""Every ``recserve ...`` line in the README and docs/ parses with the real parser and builds its config
(no unknown flag, no crash), and the config mechanism does what the CLI relies on."""

import argparse
import dataclasses
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from recserve import config
from recserve.cli import COMMANDS, build_parser, main, module_of
from tests.helpers import ROOT, doc_files, doc_sections, recserve_argv, split_comment


def documented_command_lines() -> list[str]:
    # docs/hosts.md names files on the store mounted at /mnt/recserve (an admin token a config reads
    # as it is built): tests/test_readme_hosts.py runs those lines, whole, on hosts that mount it
    docs = [doc for doc in doc_files() if doc != "docs/hosts.md"]
    blocks = [block for doc in docs for _, lang, block in doc_sections(doc) if lang == "bash"]
    lines = [split_comment(line)[0] for block in blocks for line in block]
    return [line for line in lines if line.startswith("recserve ")]


LINES = documented_command_lines()
# files a documented line writes (``--out PATH``) that a later line reads, by path
WRITTEN = {m.group(1): line for line in LINES if (m := re.search(r"--out (\S+)", line))}


def test_the_docs_show_every_command():
    assert len(LINES) >= 15
    shown = {shlex.split(line)[1] for line in LINES}
    assert shown == set(COMMANDS), set(COMMANDS) ^ shown


@pytest.mark.parametrize("line", LINES)
def test_documented_line_parses_and_builds_its_config(line, tmp_path):
    for path, writer in WRITTEN.items():  # a file an earlier line writes: made here by that line
        if path in line and writer != line:
            made = str(tmp_path / Path(path).name)
            wrote = subprocess.run(recserve_argv(writer.replace(path, made)), cwd=ROOT, capture_output=True,
                                   text=True, timeout=300)  # fmt: skip
            assert wrote.returncode == 0, wrote.stderr[-2000:]
            line = line.replace(path, made)
    argv = shlex.split(line)[1:]
    args = build_parser(only=argv[0]).parse_args(argv)
    mod = module_of(argv[0])
    if hasattr(mod, "CONFIG"):
        config.from_args(mod.CONFIG, args)
    else:  # train: its two modes
        from training.config import TrainConfig
        from training.follow.config import FollowConfig

        config.from_args(FollowConfig if args.follow else TrainConfig, args)


def test_every_command_has_help():
    parser = build_parser()
    for name in COMMANDS:
        with pytest.raises(SystemExit) as e:
            parser.parse_args([name, "--help"])
        assert e.value.code == 0


def test_an_undefined_flag_is_refused():
    with pytest.raises(SystemExit) as e:
        build_parser(only="up").parse_args(["up", "--model-store", "x"])
    assert e.value.code == 2


def test_a_flag_of_the_other_role_is_refused_naming_the_role_it_belongs_to(capsys):
    """Training policies are no flags of a serving shard, serving ones none of a training shard;
    the old `recserve ps --follow` names the serving role. Exit 2, as for any bad flag."""
    refused = [
        (["ps-serve", "/nonexistent/m", "--eviction", "lru"], "--eviction: a flag of `recserve ps`"),
        (["ps-serve", "/nonexistent/m", "--ttl-s", "60", "--min-count", "2"], "--ttl-s, --min-count: flags of `recserve ps`"),
        (["ps-serve", "/nonexistent/m", "--admin-token-file", "t"], "--admin-token-file: a flag of `recserve ps` (the training"),
        (["ps", "--pin", "3"], "--pin: a flag of `recserve ps-serve` (the serving shard"),
        (["ps", "--follow", "/nonexistent/m"], "--follow: a flag of `recserve ps-serve` (the serving shard, following MODEL_DIR)"),
        (["ps", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ]  # fmt: skip
    for argv, said in refused:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and said in capsys.readouterr().err, argv
    assert main(["ps-serve"]) == 2  # no MODEL_DIR
    assert "needs MODEL_DIR" in capsys.readouterr().err


def test_a_former_flag_is_refused_saying_what_became_of_it(capsys):
    """Flags of an earlier release (CHANGELOG.md) exit 2 naming the new spelling or why they went,
    not a bare "unrecognized arguments"."""
    refused = [
        (["train", "--sparse-optimizer", "sgd"], "--sparse-optimizer: renamed --optimizer (`recserve train`)"),
        (["train", "--sparse-optimizer=sgd"], "--sparse-optimizer: renamed --optimizer"),
        (["worker", "--staleness", "2"], "--staleness: gone: the worker only reads"),
        (["worker", "--admin-token-file", "t"], "--admin-token-file: gone: the worker only reads"),
        (["join", "--window-s", "5"], "--window-s: renamed --label-after-s (the first horizon; --attribution-s"),
    ]  # fmt: skip
    for argv, said in refused:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and said in capsys.readouterr().err, argv


def test_a_yaml_key_of_a_nested_config_given_at_the_top_says_where_it_goes(tmp_path, capsys):
    (tmp_path / "ps.yaml").write_text("port: 6000\n")  # a PS config before `server:` nested it
    assert main(["ps", "--config", str(tmp_path / "ps.yaml")]) == 2
    assert "unknown TrainingShardConfig field(s) ['port']" in (err := capsys.readouterr().err)
    assert "port goes under server:" in err


@pytest.mark.parametrize("command", ["up", "serve"])
def test_a_negative_flag_turns_its_field_on(command):
    """``--no-token-auth`` (field ``disable_token_auth``) must mean True: argparse's
    BooleanOptionalAction reads a flag named --no-x as the off switch of --x."""
    cls = module_of(command).CONFIG
    given = config.from_args(cls, build_parser(only=command).parse_args([command, "--no-token-auth"]))
    assert given.disable_token_auth is True
    assert config.from_args(cls, build_parser(only=command).parse_args([command])).disable_token_auth is False


@dataclasses.dataclass
class Inner:
    lr: float = 0.1
    """Learning rate."""
    name: str = dataclasses.field(default="sgd", metadata={"flag": "optimizer", "choices": ["sgd", "adam"]})
    """Optimizer."""


@dataclasses.dataclass
class Outer:
    port: int = 1
    """Port."""
    ps: list[str] = dataclasses.field(default_factory=list)
    """Addresses."""
    fast: bool = False
    """Go fast."""
    inner: Inner = dataclasses.field(default_factory=Inner)
    """Nested."""


def test_defaults_then_yaml_then_flags(tmp_path):
    p = argparse.ArgumentParser()
    config.add_arguments(p, Outer)
    (tmp_path / "c.yaml").write_text("port: 5\ninner: {lr: 0.5, name: adam}\n")
    cfg = config.from_args(Outer, p.parse_args(["--config", str(tmp_path / "c.yaml"), "--lr", "0.7"]))
    assert cfg == Outer(port=5, inner=Inner(lr=0.7, name="adam"))
    cfg = config.from_args(Outer, p.parse_args(["--ps", "a:1,b:2", "--fast", "--optimizer", "sgd"]))
    assert cfg.ps == ["a:1", "b:2"] and cfg.fast and cfg.inner.name == "sgd" and cfg.port == 1
    assert "Learning rate." in p.format_help()
    with pytest.raises(SystemExit):
        p.parse_args(["--optimizer", "ftrl"])


@dataclasses.dataclass
class Tuned:
    inner: Inner = dataclasses.field(default_factory=lambda: Inner(lr=0.005, name="adam"))
    """Nested, with defaults of its own."""


@dataclasses.dataclass
class Other:
    lr: float | None = None
    """Learning rate (None: keep)."""
    steps: int = 1
    """Steps."""


def test_a_nested_config_keeps_its_parents_defaults_for_what_is_not_given(tmp_path):
    p = argparse.ArgumentParser()
    config.add_arguments(p, Tuned)
    assert config.from_args(Tuned, p.parse_args(["--optimizer", "sgd"])).inner == Inner(lr=0.005, name="sgd")
    assert config.from_args(Tuned, p.parse_args([])).inner == Inner(lr=0.005, name="adam")
    (tmp_path / "c.yaml").write_text("inner: {lr: 0.5}\n")
    assert config.load_yaml(Tuned, tmp_path / "c.yaml").inner == Inner(lr=0.5, name="adam")
    assert "(default: 0.005)" in p.format_help() and "(default: adam)" in p.format_help()


def test_two_configs_of_one_parser_share_a_flag_they_both_have():
    p = argparse.ArgumentParser()
    config.add_arguments(p, Outer)
    config.add_arguments(p, Other, yaml_flag=False, skip=config.dests(Outer))
    args = p.parse_args(["--lr", "0.3", "--steps", "4"])
    assert config.from_args(Outer, args).inner.lr == 0.3 and config.from_args(Other, args) == Other(0.3, 4)
    assert config.given(Other, args) == ["--lr", "--steps"] and config.given(Outer, args) == ["--lr"]


def test_unknown_yaml_key_is_an_error_naming_it(tmp_path):
    (tmp_path / "c.yaml").write_text("prot: 5\n")
    p = argparse.ArgumentParser()
    config.add_arguments(p, Outer)
    with pytest.raises(ValueError, match="prot"):
        config.from_args(Outer, p.parse_args(["--config", str(tmp_path / "c.yaml")]))


def test_store_root_defaults_to_artifacts_or_the_environment(monkeypatch):
    from training.config import TrainConfig

    monkeypatch.delenv("RECSERVE_STORE", raising=False)
    assert TrainConfig().store == "artifacts"
    monkeypatch.setenv("RECSERVE_STORE", "/srv/store")
    assert TrainConfig().store == "/srv/store"
    assert module_of("up").CONFIG().store == "/srv/store"
