"""Least privilege, unit by unit (no network): the admin token file (0600, refused when others
can read it), the one token check, path confinement (``..``, absolute paths, symlinks out), an
``Access`` policy's verdicts, requests parsed at the boundary, and the PS configuration
that refuses a token it would not use or cannot trust."""

from __future__ import annotations

import os
import stat

import pytest

from serving.rpc.auth import (
    Access,
    check_token,
    confine,
    new_token_file,
    read_token_file,
    token_metadata,
)
from serving.rpc.errors import BadRequest, PermissionDenied, Unauthenticated, Undecoded, status_of


class Context:
    """The one thing ``Access`` reads of a gRPC call context: its metadata."""

    def __init__(self, metadata=()):
        self.metadata = tuple(metadata)

    def invocation_metadata(self):
        return self.metadata


def test_token_file_is_created_0600_and_never_over_another_file(tmp_path):
    umask = os.umask(0o000)  # the file is 0600 whatever the umask lets through
    try:
        path = new_token_file(tmp_path / "admin.token")
    finally:
        os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    token = read_token_file(path)
    assert len(token) >= 40 and token != read_token_file(new_token_file(tmp_path / "other.token"))
    with pytest.raises(FileExistsError):
        new_token_file(path)


def test_a_token_file_others_can_read_or_an_empty_or_missing_one_is_refused(tmp_path):
    path = new_token_file(tmp_path / "admin.token")
    path.chmod(0o644)
    with pytest.raises(ValueError, match=r"mode 0644: group and others must not read it \(chmod 600"):
        read_token_file(path)
    empty = tmp_path / "empty.token"
    empty.touch(mode=0o600)
    with pytest.raises(ValueError, match="is empty"):
        read_token_file(empty)
    with pytest.raises(ValueError, match="cannot read the admin token file .*missing"):
        read_token_file(tmp_path / "missing")


def test_check_token_missing_wrong_right():
    with pytest.raises(Unauthenticated, match="Update needs the admin token"):
        check_token((), "s3cret", "Update")
    with pytest.raises(Unauthenticated):
        check_token((("other-key", "x"),), "s3cret", "Update")
    for wrong in ("Bearer nope", "s3cret", "Bearer s3cret2", "Basic s3cret", ""):
        with pytest.raises(PermissionDenied, match="Update: wrong admin token"):
            check_token((("authorization", wrong),), "s3cret", "Update")
    check_token(token_metadata("s3cret"), "s3cret", "Update")
    assert token_metadata("") == ()


def test_refusals_map_to_their_status():
    import grpc

    assert status_of(Unauthenticated("x"))[0] == grpc.StatusCode.UNAUTHENTICATED
    assert status_of(PermissionDenied("x"))[0] == grpc.StatusCode.PERMISSION_DENIED


def test_confine_keeps_paths_under_the_root(tmp_path):
    root = tmp_path / "root"
    (root / "inside").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (root / "out").symlink_to(tmp_path / "outside")  # a symlink pointing out of the root
    (root / "in").symlink_to(root / "inside")  # one that stays in
    assert confine(str(root / "a" / "b"), root, "dump") == root.resolve() / "a" / "b"
    assert confine("rel/x", root, "dump") == root.resolve() / "rel" / "x"  # relative: under the root
    assert confine(str(root / "in" / "x"), root, "dump") == root.resolve() / "inside" / "x"
    assert confine(str(root / "x" / ".." / "y"), root, "dump") == root.resolve() / "y"
    refused = {
        "..": str(root / ".." / "outside"),
        "relative ..": "../outside",
        "absolute elsewhere": str(tmp_path / "outside"),
        "system path": "/etc",
        "symlink out": str(root / "out" / "x"),
    }
    for name, path in refused.items():
        with pytest.raises(PermissionDenied) as e:
            confine(path, root, "dump")
        assert f"dump path {path!r}" in str(e.value) and f"outside the data root {root.resolve()}" in str(
            e.value
        ), name
    with pytest.raises(BadRequest, match="load path is empty"):
        confine("", root, "load")


def test_confine_follows_a_symlinked_root(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    assert confine(str(tmp_path / "real" / "x"), tmp_path / "alias", "dump") == (tmp_path / "real" / "x")


def test_access_open_guarded_and_everything_else(tmp_path):
    token = "s3cret"
    training = Access("training PS", open=frozenset({"Lookup"}), guarded=frozenset({"Dump"}), token=token,
                      root=tmp_path)  # fmt: skip
    anonymous, holder = Context(), Context(token_metadata(token))
    training.check("Lookup", anonymous)
    training.check("Dump", holder)
    with pytest.raises(Unauthenticated):
        training.check("Dump", anonymous)
    with pytest.raises(PermissionDenied, match="wrong admin token"):
        training.check("Dump", Context(token_metadata("guess")))
    with pytest.raises(PermissionDenied, match="Load is not served by a training PS: it answers Lookup"):
        training.check("Load", holder)

    tokenless = Access("training PS", open=frozenset({"Lookup"}), guarded=frozenset({"Dump"}))
    with pytest.raises(
        PermissionDenied, match="Dump is off: this training PS was started without --admin-token"
    ):
        tokenless.check("Dump", Context(token_metadata("")))
    serving = Access("serving PS (recserve ps-serve)", open=frozenset({"Lookup", "Stats"}))
    for method in ("Update", "Dump", "Load"):
        with pytest.raises(
            PermissionDenied, match=rf"{method} is not served by a serving PS \(recserve ps-serve\)"
        ):
            serving.check(method, holder)
    with pytest.raises(PermissionDenied, match="accepts no paths"):
        serving.path("/x", "dump")


def test_undecodable_requests_are_bad_requests():
    from recserve.v1 import ps_pb2

    good = ps_pb2.LookupRequest(signs=b"\1" * 8, version="v1")
    assert Undecoded(ps_pb2.LookupRequest, good.SerializeToString()).parse("Lookup") == good
    for junk in (b"\xff\xff\xff", b"\x0a\x05ab", b"\x22\x02\xc3\x28"):  # bad tag, short field, bad UTF-8
        with pytest.raises(
            BadRequest, match=r"Lookup: the request \(\d+ bytes\) is not a valid recserve.v1.Lookup"
        ):
            Undecoded(ps_pb2.LookupRequest, junk).parse("Lookup")


def test_ps_config_refuses_a_token_it_cannot_use_or_trust(tmp_path):
    from recserve import config
    from recserve.cli import build_parser
    from serving.ps.config import ServingShardConfig, TrainingShardConfig
    from serving.ps.server import ps_access

    token = new_token_file(tmp_path / "admin.token")
    token.chmod(0o640)
    args = build_parser("ps").parse_args(["ps", "--admin-token-file", str(token)])
    with pytest.raises(ValueError, match="mode 0640"):
        config.from_args(TrainingShardConfig, args)
    token.chmod(0o600)
    args = build_parser("ps").parse_args(
        ["ps", "--admin-token-file", str(token), "--data-root", str(tmp_path)]
    )
    access = ps_access(config.from_args(TrainingShardConfig, args))
    assert access.token == read_token_file(token) and access.root == tmp_path.resolve()
    assert access.guarded == {"Update", "UpdateLookup", "Assign", "Dump", "Load"}
    assert access.open == {"Lookup", "Stats"}
    serving = ps_access(ServingShardConfig(str(tmp_path / "m")))  # no token to give it
    assert serving.guarded == frozenset() and serving.token == "" and serving.root is None
