"""The scoring endpoint's one errors table (serving/scoring/errors.py): what each exception the verbs
raise answers, and the decode verb's refusals of each JSON form named by orjson and transform,
whether the compiled scan read the body or left it to them."""

from __future__ import annotations

import orjson
import pytest

from features.codec import CodecError
from features.inputs import FeatureError
from features.schema import schema_from_dict
from serving.rpc.errors import NotServing
from serving.scoring.decoding import BINARY, JSON, Decoder
from serving.scoring.errors import (
    BadRequest,
    LookupFailed,
    MethodNotAllowed,
    TooLarge,
    Unavailable,
    status_of,
)
from serving.scoring.loop import Outcome, reply_of

SMALL = schema_from_dict(
    {
        "name": "small",
        "slots": [
            {"name": "user", "scope": "context"},
            {"name": "item", "required": True},
            {"name": "z", "kind": "dense"},
        ],
    }
)


def test_each_row_of_the_table():
    assert status_of(TooLarge("too big")) == (413, "too big")
    assert status_of(MethodNotAllowed("use POST", headers=((b"allow", b"POST"),))) == (405, "use POST")
    assert status_of(Unavailable("no version yet")) == (503, "no version yet")
    assert status_of(CodecError("bad magic")) == (400, "invalid compact batch: bad magic")
    assert status_of(FeatureError("field 'x': expected a number")) == (400, "field 'x': expected a number")
    status, message = status_of(_json_error(b"{"))
    assert status == 400 and message.startswith("malformed JSON: ")
    assert status_of(LookupFailed(NotServing("shard 0 serves no version"))) == (
        503,
        "shard 0 serves no version",
    )
    status, message = status_of(KeyError("boom"))
    assert (status, message) == (500, "internal error: KeyError: 'boom'")


def test_an_outcome_becomes_its_reply():
    scored = Outcome(b'{"scores": []}', None, {"dense": "1"}, {"total": 1.0})
    assert reply_of(scored) == (200, b'{"scores": []}', {"total": 1.0}, {"dense": "1"})
    failed = Outcome(None, BadRequest("empty request body"), {}, {"total": 0.5})
    assert reply_of(failed) == (400, orjson.dumps({"error": "empty request body"}), {"total": 0.5}, {})


@pytest.mark.parametrize(
    "body, ctype, status, words",
    [
        (b"", JSON, 400, "empty request body"),
        (b"x" * 2000, JSON, 413, "exceeds the limit of 1000"),
        (b"[]", "text/plain", 415, "unsupported content type 'text/plain'"),
        (b"\x00\x01", BINARY, 400, "invalid compact batch: "),
        (b'[{"item": "a", "z": 1},]', JSON, 400, "malformed JSON: "),
        (b'[{"item": null, "z": 1}]', JSON, 400, "required field 'item' is missing"),
        (b'[{"item": "a", "z": 1, "bogus": 1}]', JSON, 400, "unknown field(s): ['bogus']"),
        (b'[{"item": "a", "z": [1]}]', JSON, 400, "field 'z'"),
        (b'{"items": [{"item": "a", "user": "u"}]}', JSON, 400, "(sent in the wrong part of the request)"),
        (b'{"items": []}', JSON, 400, '"items" must be a non-empty list'),
        (orjson.dumps([{"item": "a"}] * 4), JSON, 413, "4 items exceed the limit of 3"),
        (orjson.dumps({"items": [{"item": "a"}] * 4}), JSON, 413, "4 items exceed the limit of 3"),
    ],
)
def test_the_decode_verbs_refusals_name_the_problem(body, ctype, status, words):
    with pytest.raises(Exception) as e:
        Decoder(SMALL, max_items=3, max_body_bytes=1000).decode(body, ctype)
    got, message = status_of(e.value)
    assert got == status and words in message, message


def test_every_json_form_decodes_to_one_batch():
    decoder = Decoder(SMALL, max_items=3, max_body_bytes=1000)
    forms = [
        b'[{"user": "u", "item": "a", "z": 1}, {"user": "u", "item": "b"}]',
        b'{"context": {"user": "u"}, "items": [{"item": "a", "z": 1}, {"item": "b"}]}',
        b'{"context": {"user": "u"}, "items": {"item": ["a", "b"], "z": [1, null]}}',
    ]
    batches = [decoder.decode(body, JSON).batch for body in forms]
    assert [b.num_rows for b in batches] == [2, 2, 2]
    assert batches[1].signs.tolist() == batches[2].signs.tolist()  # rows and columns: one request


def _json_error(body: bytes) -> Exception:
    try:
        orjson.loads(body)
    except orjson.JSONDecodeError as e:
        return e
    raise AssertionError("valid JSON")
