"""``from_json``: a list of records or a ranking request (rows or columns) read from its bytes gives
exactly the batch orjson + ``transform`` give, and any body outside the scan's form is left to them
(None)."""

from __future__ import annotations

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from features import stream
from features.codec import encode
from features.readers import to_records
from features.schema import load_schema, schema_from_dict
from features.transform import FeatureError, from_json, transform
from serving.scoring.client import column_form

CRITEO = load_schema("data/schemas/criteo.yaml")
OBD = load_schema("data/schemas/obd.yaml")
SMALL = schema_from_dict(
    {
        "name": "small",
        "slots": [
            {"name": "user", "scope": "context"},
            {"name": "age", "kind": "dense", "scope": "context"},
            {"name": "item", "required": True},
            {"name": "cat"},
            {"name": "x", "kind": "dense", "transform": {"clip_min": 0.0, "log1p": True}},
            {"name": "y", "kind": "dense", "transform": {"default": -1.0, "mean": 1.0, "std": 2.0}},
            {"name": "z", "kind": "dense", "required": True},
        ],
        "crosses": [{"name": "user_x_item", "slots": ["user", "item"]}],
    }
)
DENSE = {s.column for s in SMALL.slots if s.kind == "dense"}


def reference(body: bytes, schema=SMALL) -> bytes | None:
    """What the general path makes of ``body``: the batch's bytes, or None for an error."""
    try:
        return encode(transform(orjson.loads(body), schema))
    except (orjson.JSONDecodeError, FeatureError):
        return None


def scanned(body: bytes, schema=SMALL) -> bytes | None:
    batch = from_json(body, schema)
    return None if batch is None else encode(batch)


def test_criteo_requests_scan_to_the_parsed_batch():
    table = stream.read("data/criteo/wide_resdnn_criteo_test.tsv", CRITEO, limit=600)
    records = to_records(table, CRITEO)
    dense = {s.column for s in CRITEO.slots if s.kind == "dense"}
    for start in range(0, 600, 200):
        body = orjson.dumps({"items": column_form(records[start : start + 200], dense)})
        assert scanned(body, CRITEO) == reference(body, CRITEO) is not None


def test_criteo_records_and_rows_scan_to_the_parsed_batch():
    table = stream.read("data/criteo/wide_resdnn_criteo_test.tsv", CRITEO, limit=600)
    records = to_records(table, CRITEO)
    for start, n in ((0, 200), (200, 1), (201, 64), (265, 65), (330, 270)):  # across its growth steps
        for body in (
            orjson.dumps(records[start : start + n]),
            orjson.dumps({"items": records[start : start + n]}),
            orjson.dumps({"context": None, "items": records[start : start + n]}, option=orjson.OPT_INDENT_2),
        ):
            assert scanned(body, CRITEO) == reference(body, CRITEO) is not None


def test_records_with_their_label_are_left_to_orjson_which_keeps_it():
    table = stream.read("data/criteo/wide_resdnn_criteo_test.tsv", CRITEO, limit=3)
    body = orjson.dumps(to_records(table, CRITEO, with_label=True))
    assert from_json(body, CRITEO) is None
    assert transform(orjson.loads(body), CRITEO).labels is not None


def test_records_in_any_field_order_with_absent_and_null_values():
    body = (
        b'[{"item": "a", "z": 1, "user": "u", "cat": null, "x": null},'
        b' {"z": 2.5, "y": 3, "item": "b"}, {"age": 4, "item": "c", "z": -0.0, "cat": ""}]'
    )
    assert scanned(body) == reference(body) is not None
    body = b'{"items": [{"z": 2, "item": "b"}, {"item": "a", "z": 1, "x": null}], "context": {"user": "u"}}'
    assert scanned(body) == reference(body) is not None
    body = b' [ {\n "item" : "a" , "z" : 1 } ,\r\n{"item":"b","z":2}\t]\n'  # whitespace anywhere
    assert scanned(body) == reference(body) is not None


def test_records_over_the_row_limit_are_left_to_the_caller():
    body = b'[{"item": "a", "z": 1}, {"item": "b", "z": 2}, {"item": "c", "z": 3}]'
    assert from_json(body, SMALL, max_rows=2) is None
    assert scanned(body) == encode(from_json(body, SMALL, max_rows=3)) == reference(body)
    body = b'{"items": [{"item": "a", "z": 1}, {"item": "b", "z": 2}, {"item": "c", "z": 3}]}'
    assert from_json(body, SMALL, max_rows=2) is None
    assert scanned(body) == encode(from_json(body, SMALL, max_rows=3)) == reference(body)


def test_a_request_with_a_context_scans_and_stores_it_once():
    items = to_records(stream.read("data/obd/item_context.csv", OBD), OBD)
    items[3].pop("item_feature_0", None)
    columns = column_form(items, {s.column for s in OBD.slots if s.kind == "dense"})
    ctx = {"user_feature_0": "u0", "user-item_affinity_3": 0.5}
    for context in (ctx, {}, None):
        body = orjson.dumps({"context": context, "items": columns})
        batch = from_json(body, OBD)
        assert batch is not None and batch.has_context
        assert encode(batch) == reference(body, OBD)
    body = orjson.dumps({"items": columns, "context": ctx})  # members in either order
    assert scanned(body, OBD) == reference(body, OBD) is not None
    body = b'{"context": {"user": "caf\\u00e9 \\"}\\" ]"}, "items": {"item": ["a"], "z": [1]}}'
    assert scanned(body) == reference(body) is not None  # the context is orjson's: escapes and all


def test_a_request_over_the_row_limit_is_left_to_the_caller_before_any_work():
    body = b'{"items": {"item": ["a", "b", "c"], "z": [1, 2, 3]}}'
    assert from_json(body, SMALL, max_rows=2) is None  # the caller's parse then answers its 413
    assert scanned(body) == encode(from_json(body, SMALL, max_rows=3)) == reference(body)


def test_absent_and_null_values_are_missing_as_in_the_parsed_form():
    body = b'{"items": {"item": ["a", "b"], "cat": [null, ""], "x": [null, 2], "z": [1, 2.5]}}'
    assert scanned(body) == reference(body) is not None
    body = b' {\n\t"items" :{ "z" : [ 0 , -0 ] , "item" : [ "a" , "b" ] } }\r\n'  # whitespace anywhere
    assert scanned(body) == reference(body) is not None


@pytest.mark.parametrize(
    "body",
    [
        b'{"items": {"item": ["a\\u0062"], "z": [1]}}',  # an escape: orjson reads it
        b'{"items": {"item": ["caf\xc3\xa9"], "z": [1]}}',  # non-ASCII
        b'{"items": {"item": [5], "z": [1]}}',  # an int in a categorical column
        b'{"items": {"item": ["a"], "z": ["1"]}}',  # a string in a dense column
        b'{"items": {"item": ["a"], "z": [1e23]}}',  # too near a tie for features.floats
        b'{"items": {"item": ["a"], "z": [1234567890123456789]}}',  # 19 digits
        b'{"items": {"item": ["a"], "z": [1e-320]}}',  # subnormal
        b'{"items": {"item": ["a"], "z": [true]}}',
        b'{"items": {"item": ["a"], "item": ["b"], "z": [1]}}',  # a duplicate: orjson keeps the last
        b'{"items": {"item": ["a"], "z": [1]}, "items": {"item": ["b"], "z": [2]}}',
        b'[{"item": "a", "z": 1, "item": "b"}]',  # a duplicate field
        b'[{"item": "a\\u0062", "z": 1}]',
        b'[{"item": 5, "z": 1}]',
        b'[{"item": "a", "z": "1"}]',
        b'{"items": [{"item": "a", "z": true}]}',
        b'{"items": [{"item": "a", "z": 1}], "items": [{"item": "b", "z": 2}]}',
    ],
)
def test_bodies_outside_the_form_go_to_orjson(body):
    assert from_json(body, SMALL) is None
    assert reference(body) is not None  # valid requests: orjson + transform serve them


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"{",
        b'{"items": {"item": ["a"], "z": [1]}',  # unterminated
        b'{"items": {"item": ["a"], "z": [1]}} x',  # trailing garbage
        b'{"items": {"item": ["a"], "z": [1,]}}',
        b'{"items": {"item": ["a"], "z": [01]}}',
        b'{"items": {"item": ["a"], "z": [1.]}}',
        b'{"items": {"item": ["a"], "z": [.5]}}',
        b'{"items": {"item": ["a"], "z": [1e]}}',
        b'{"items": {"item": ["a"], "z": [NaN]}}',
        b'{"items": {"item": ["a"], "z": [-]}}',
        b'{"items": {"item": ["a\tb"], "z": [1]}}',  # a raw control character
        b'{"items": {"item": ["a", "b"], "z": [1]}}',  # unequal lengths
        b'{"items": {"item": [], "z": []}}',
        b'{"items": {}}',
        b'{"items": {"item": [null], "z": [1]}}',  # required
        b'{"items": {"item": [""], "z": [1]}}',
        b'{"items": {"item": ["a"], "z": [null]}}',
        b'{"items": {"item": ["a"]}}',  # a required column absent
        b'{"items": {"item": ["a"], "z": [1], "bogus": [1]}}',
        b'{"items": {"item": ["a"], "z": [1], "user": ["u"]}}',  # a context field among the items
        b'{"context": {"item": "a"}, "items": {"item": ["a"], "z": [1]}}',
        b'{"context": [], "items": {"item": ["a"], "z": [1]}}',
        b'{"context": {"user": "u", "items": {"item": ["a"], "z": [1]}}',  # context never closed
        b'{"context": {"user": "u"]}, "items": {"item": ["a"], "z": [1]}}',
        b'{"items": {"item": [["a"]], "z": [1]}}',
        b'{"items": {"item": ["a"], "z": [1]}, "other": 1}',
        b"[]",
        b"[{}]",  # required fields absent
        b"[1]",
        b'[{"item": "a", "z": 1}',
        b'[{"item": "a", "z": 1},]',
        b'[{"item": "a", "z": 1,}]',
        b'[{"item": "a" "z": 1}]',
        b'[{"item": "a", "z": 1}] x',
        b'[{"item": null, "z": 1}]',
        b'[{"item": "", "z": 1}]',
        b'[{"item": "a"}]',
        b'[{"item": "a", "z": 1, "bogus": 1}]',
        b'[{"item": "a", "z": [1]}]',
        b'[{"item": "a", "z": 1}, {"item": "b"}]',  # the second lacks a required field
        b'{"items": []}',
        b'{"items": [{"item": "a", "z": 1, "user": "u"}]}',  # a context field among the items
        b'{"items": [{"item": "a", "z": 1}, 2]}',
        b'{"items": [{"item": "a", "z": 1}]',
    ],
)
def test_mistakes_are_left_to_the_general_path_which_names_them(body):
    assert from_json(body, SMALL) is None
    assert reference(body) is None


NUMBERS = [
    "0", "-0", "-0.0", "0e5", "-0e0", "1", "-1", "181.0", "0.1", "0.000123", "123.456e-7", "1E+22",
    "1e-22", "9007199254740992", "9007199254740993", "4.35", "2.5e3", "0.30000000000000004",
    "-0.49917162609493676", "0.0012345678901234567", "1686987391067817.0", "2.2250738585072014e-308",
    "1.7976931348623157e38", "123456789012345678", "5e-300", "3.14159265358979",
]  # fmt: skip


@pytest.mark.parametrize("text", NUMBERS)
def test_numbers_convert_as_orjson_converts_them(text):
    body = f'{{"items": {{"item": ["a"], "y": [{text}], "z": [{text}]}}}}'.encode()
    assert scanned(body) == reference(body) is not None


def test_doubles_convert_to_themselves():
    """17-digit doubles as orjson prints them, from subnormal up to float32's range (the model's
    inputs): every one is taken."""
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, 4000) * 10.0 ** rng.integers(-300, 38, 4000)
    x = x[np.abs(x) > 2.3e-308]  # subnormals are refused
    body = orjson.dumps({"items": {"item": ["a"] * len(x), "z": x.tolist()}})
    batch = from_json(body, SMALL)
    assert batch is not None
    assert encode(batch) == reference(body)


# --- properties: equal to the general path whenever taken; never taken for what orjson refuses ----
ascii_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=12)
any_text = st.one_of(ascii_text, st.text(max_size=6))
numbers = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.decimals(allow_nan=False, allow_infinity=False, places=3).map(float),
)


@st.composite
def requests(draw):
    n = draw(st.integers(1, 6))
    cat = st.one_of(st.none(), any_text, st.integers(0, 99)) if draw(st.booleans()) else ascii_text
    items = {
        "item": draw(st.lists(ascii_text.filter(bool), min_size=n, max_size=n)),
        "z": draw(st.lists(numbers, min_size=n, max_size=n)),
    }
    for name in draw(st.sets(st.sampled_from(["cat", "x", "y"]))):
        values = st.one_of(st.none(), numbers) if name in DENSE else cat
        items[name] = draw(st.lists(values, min_size=n, max_size=n))
    context = draw(
        st.one_of(
            st.none(),
            st.fixed_dictionaries(
                {}, optional={"user": st.one_of(any_text, numbers, st.booleans()), "age": numbers}
            ),
        )
    )
    form = draw(st.sampled_from(["columns", "rows", "records"]))
    request: object = {"items": items}
    if form != "columns":  # one object per item, a field left out at random (missing, or a mistake)
        rows = [{k: v[r] for k, v in items.items() if draw(st.integers(0, 9))} for r in range(n)]
        rows = [dict(draw(st.permutations(list(row.items())))) for row in rows]  # any field order
        if form == "records":  # context fields in every record
            request = [{**(context or {}), **row} for row in rows]
        else:
            request = {"items": rows}
    if form != "records" and draw(st.booleans()):
        request["context"] = context  # type: ignore[index]
    body = orjson.dumps(request)
    if draw(st.booleans()):  # the same request spelled with whitespace between its tokens
        body = orjson.dumps(request, option=orjson.OPT_INDENT_2)
    return body


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
@example(b'{"items": {"item": ["a"], "z": [-0.0], "x": [-0.0]}}')
def test_a_scanned_request_is_the_parsed_one(body):
    got = scanned(body)
    if got is not None:
        assert got == reference(body)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests(), st.data())
def test_a_damaged_body_is_never_taken_unless_orjson_takes_it_too(body, data):
    at = data.draw(st.integers(0, len(body) - 1))
    damage = data.draw(st.sampled_from(["drop", "insert", "replace"]))
    byte = bytes([data.draw(st.sampled_from(b'{}[],:"\\ 0-.eE+nul\x00\xff5a'))])
    damaged = {
        "drop": body[:at] + body[at + 1 :],
        "insert": body[:at] + byte + body[at:],
        "replace": body[:at] + byte + body[at + 1 :],
    }[damage]
    assume(damaged != body)
    got = scanned(damaged)
    if got is not None:
        assert got == reference(damaged)
