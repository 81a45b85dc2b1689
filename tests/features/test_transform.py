import numpy as np
import orjson
import pytest

from features import stream
from features.codec import decode, encode
from features.readers import read_obd, to_records
from features.schema import SchemaError, load_schema, schema_from_dict
from features.transform import FeatureError, Table, dedup_spans, dense_matrix, from_json, transform
from serving.scoring.client import column_form

CRITEO = load_schema("data/schemas/criteo.yaml")
OBD = load_schema("data/schemas/obd.yaml")


def test_shipped_schemas():
    assert len(CRITEO.dense) == 13 and len(CRITEO.sparse) == 26
    assert {s.scope for s in OBD.slots if s.name.startswith("user_feature")} == {"context"}
    assert {s.scope for s in OBD.slots if s.name.startswith("affinity")} == {"context"}
    assert {s.scope for s in OBD.slots if s.name in ("item_id", "position", "item_feature_0")} == {"item"}


def test_criteo_tsv_and_json_records_give_identical_bytes():
    table = stream.read("data/criteo/wide_resdnn_criteo_test.tsv", CRITEO, limit=200)
    records = orjson.loads(orjson.dumps(to_records(table, CRITEO, with_label=True)))  # as a client sends them
    assert encode(transform(table, CRITEO)) == encode(transform(records, CRITEO))


def test_criteo_csv_sample_and_json_give_identical_bytes():
    table = stream.read("data/criteo/deepctr_criteo_sample.csv", CRITEO)
    assert table.num_rows == 200
    records = orjson.loads(orjson.dumps(to_records(table, CRITEO, with_label=True)))
    assert encode(transform(table, CRITEO)) == encode(transform(records, CRITEO))


def test_criteo_batch_contents():
    table = stream.read("data/criteo/wide_resdnn_criteo_test.tsv", CRITEO, limit=50)
    b = transform(table, CRITEO)
    assert b.num_rows == 50 and b.num_slots == 26 and b.dense.shape == (50, 13)
    assert b.labels.tolist() == table.columns["label"].astype(np.float32).tolist()
    for i in range(26):  # every slot reconstructs its column's signs
        s = b.slot(i)
        assert np.all(np.diff(s.signs.astype(np.float64)) > 0)
        assert len(s.values) == 50
    i1 = table.columns["I1"]
    expect = np.log1p(np.clip(np.where(i1 == "", "0", i1).astype(np.float64), 0, None)).astype(np.float32)
    assert np.allclose(b.dense[:, 0], expect)


def test_obd_offline_rows_equal_request_rows():
    """A logged impression transformed offline and the same impression sent as a ranking request
    give the same per-row features."""
    table = read_obd("data/obd/all.csv", "data/obd/item_context.csv", OBD, limit=5)
    offline = transform(table, OBD)
    rec = to_records(table, OBD, slice(0, 1))[0]
    ctx_cols = {s.column for s in OBD.slots if s.scope == "context"}
    request = {"context": {k: v for k, v in rec.items() if k in ctx_cols},
               "items": [{k: v for k, v in rec.items() if k not in ctx_cols}]}  # fmt: skip
    online = transform(request, OBD)
    assert online.has_context and offline.labels is not None and online.labels is None
    for i in range(OBD.sparse.__len__()):
        off, on = offline.slot(i), online.slot(i)
        assert off.signs[off.values[0]] == on.signs[on.values[0]]
    assert np.array_equal(dense_matrix(online, OBD)[0], offline.dense[0])


def test_ranking_request_stores_context_once():
    items = to_records(stream.read("data/obd/item_context.csv", OBD), OBD)
    ctx = {"user_feature_0": "u0", "user_feature_1": "u1", "user-item_affinity_3": 0.5}
    b = transform({"context": ctx, "items": items}, OBD)
    assert b.num_rows == 80 and b.dense.shape == (80, 1) and b.context_dense.shape == (80,)
    assert b.context_dense[3] == 0.5
    for i, f in enumerate(OBD.sparse):
        assert len(b.slot(i).values) == (1 if f.scope == "context" else 80)
    assert decode(encode(b)) == b


def test_the_column_form_of_a_request_gives_the_batch_of_its_row_form():
    """{"items": {"C1": [...], ...}} (orjson parses it straight into columns) and the same items as
    objects give identical bytes, missing values (absent or null) included."""
    items = to_records(stream.read("data/obd/item_context.csv", OBD), OBD)
    items[3].pop("item_feature_0", None)
    ctx = {"user_feature_0": "u0", "user-item_affinity_3": 0.5}
    columns = column_form(items, {s.column for s in OBD.slots if s.kind == "dense"})
    rows = transform({"context": ctx, "items": items}, OBD)
    assert encode(transform(orjson.loads(orjson.dumps({"context": ctx, "items": columns})), OBD)) == encode(
        rows
    )
    table = stream.read("data/criteo/wide_resdnn_criteo_test.tsv", CRITEO, limit=200)
    records = orjson.loads(orjson.dumps(to_records(table, CRITEO)))
    columns = column_form(records, {s.column for s in CRITEO.slots if s.kind == "dense"})
    assert encode(transform({"items": columns}, CRITEO)) == encode(transform({"items": records}, CRITEO))


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        ({"items": [{"item_id": "1", "bogus": 1}]}, "unknown field"),
        ({"items": [{"item_id": "1", "user_feature_0": "x"}]}, "wrong part"),
        ({"items": [{"item_id": "1"}], "context": {"item_id": "2"}}, "wrong part"),
        ({"items": [{"item_feature_1": "a"}]}, "required field 'item_id'"),
        ({"items": [{"item_id": {"a": 1}}]}, "expected a string or integer"),
        ({"items": [{"item_id": "1", "item_feature_0": "abc"}]}, "item_feature_0"),
        ({"items": [{"item_id": "1", "item_feature_0": [1]}]}, "item_feature_0"),
        ({"items": []}, "non-empty list"),
        ({"items": 3}, "non-empty list"),
        ({"items": "x"}, "non-empty list"),
        ({"items": [1, 2]}, "JSON object"),
        ({"context": [], "items": [{"item_id": "1"}]}, "must be an object"),
        ({"items": {"item_id": ["1", "2"], "bogus": [1, 2]}}, "unknown field"),
        ({"items": {"item_id": ["1"], "user_feature_0": ["x"]}}, "wrong part"),
        ({"items": {"item_id": ["1", "2"], "item_feature_0": ["1"]}}, "same non-zero length"),
        ({"items": {"item_id": []}}, "same non-zero length"),
        ({"items": {}}, "no columns"),
        ({"items": {"item_id": "1"}}, "must be an array"),
        ({"items": {"item_feature_1": ["a"]}}, "required field 'item_id'"),
        ({"items": {"item_id": ["1", None]}}, "required field 'item_id'"),
        ({"items": {"item_id": [{"a": 1}]}}, "expected a string or integer"),
        ({"foo": 1}, "a request is"),
        ("just a string", "records must be"),
        ([], "no records"),
    ],
)
def test_bad_requests_are_named(request_, message):
    with pytest.raises(FeatureError, match=message):
        transform(request_, OBD)


def test_integer_categoricals_and_missing_values():
    a = transform([{"C1": 5, "I1": 2}, {"C1": None}], CRITEO)
    b = transform([{"C1": "5", "I1": "2"}, {}], CRITEO)
    assert encode(a) == encode(b)


MULTI = schema_from_dict(
    {
        "name": "multi",
        "label": "y",
        "slots": [
            {"name": "user", "scope": "context"},
            {"name": "item"},
            {"name": "tags", "kind": "multi", "separator": ","},
            {"name": "price", "kind": "dense", "transform": {"mean": 10.0, "std": 2.0, "default": 10.0}},
        ],
        "crosses": [{"name": "user_x_item", "slots": ["user", "item"]}],
    }
)


def test_multi_valued_lists_and_joined_strings_agree():
    joined = [
        {"user": "u", "item": "a", "tags": "x,y"},
        {"user": "u", "item": "b", "tags": ""},
        {"user": "v", "item": "a"},
    ]
    lists = [
        {"user": "u", "item": "a", "tags": ["x", "y"]},
        {"user": "u", "item": "b", "tags": []},
        {"user": "v", "item": "a"},
    ]
    a, b = transform(joined, MULTI), transform(lists, MULTI)
    assert encode(a) == encode(b)
    tags = a.slot(2)
    assert tags.offsets.tolist() == [0, 2, 2, 2]
    assert a.dense[:, 0].tolist() == [0.0, 0.0, 0.0]  # default 10 standardised with mean 10


def test_cross_of_context_and_item():
    req = transform({"context": {"user": "u"}, "items": [{"item": "a"}, {"item": "b"}, {"item": "a"}]}, MULTI)
    flat = transform(
        [{"user": "u", "item": "a"}, {"user": "u", "item": "b"}, {"user": "u", "item": "a"}], MULTI
    )
    rc, fc = req.slot(3), flat.slot(3)
    assert not rc.context and len(rc.values) == 3
    assert (rc.signs[rc.values] == fc.signs[fc.values]).all()
    assert rc.signs[rc.values][0] == rc.signs[rc.values][2] != rc.signs[rc.values][1]


def test_schema_validation():
    with pytest.raises(SchemaError, match="duplicate"):
        schema_from_dict({"slots": [{"name": "a"}, {"name": "a"}]})
    with pytest.raises(SchemaError, match="std"):
        schema_from_dict({"slots": [{"name": "a", "kind": "dense", "transform": {"mean": 1.0}}]})
    with pytest.raises(SchemaError, match="not a single-valued"):
        schema_from_dict(
            {
                "slots": [{"name": "a", "kind": "dense"}, {"name": "b"}],
                "crosses": [{"name": "c", "slots": ["a", "b"]}],
            }
        )
    with pytest.raises(SchemaError):
        schema_from_dict({"slots": [{"name": "a", "wrong_key": 1}]})
    assert load_schema("data/schemas/criteo.yaml").fingerprint == CRITEO.fingerprint


def test_log1p_of_negative_needs_clip():
    s = schema_from_dict({"slots": [{"name": "x", "kind": "dense", "transform": {"log1p": True}}]})
    with pytest.raises(FeatureError, match="log1p"):
        transform([{"x": -3}], s)


@pytest.mark.parametrize("ids", [(2, 7, 30), (30, 7, 2), (7, 30, 2)])
def test_each_slot_holds_its_own_sorted_signs_whatever_the_order_of_slot_ids(ids):
    from features.hashing import sign

    s = schema_from_dict(
        {
            "slots": [{"name": n, "id": i} for n, i in zip("abc", ids, strict=True)]
            + [{"name": "x", "kind": "dense"}]
        }
    )
    rows = [{"a": str(r % 3), "b": str(r % 5), "c": "same", "x": r} for r in range(40)]
    batch = transform(rows, s)
    assert batch.sign_counts.tolist() == [3, 5, 1]
    for j, (name, slot_id) in enumerate(zip("abc", ids, strict=True)):
        got = batch.slot(j)
        assert got.signs.tolist() == sorted(got.signs.tolist())
        assert got.signs[got.values].tolist() == [sign(slot_id, r[name]) for r in rows]


def test_infinite_dense_values_are_refused_in_every_form():
    from features.transform import Table

    with pytest.raises(FeatureError, match="'I1'.*not finite"):
        transform(Table({"I1": np.array(["1", "inf"])}, 2), CRITEO)
    with pytest.raises(FeatureError, match="'I1'.*not finite"):
        transform([{"I1": 1}, {"I1": float("-inf")}], CRITEO)
    with pytest.raises(FeatureError, match="'I1'.*not finite"):
        transform({"items": {"I1": [1.0, 1e999]}}, CRITEO)


def test_a_feature_beyond_float32_is_refused_not_served_as_inf():
    """1e300 is a finite double, but as a float32 model input it would be inf (scores NaN)."""
    for body in ({"items": {"I1": [1.0, 1e300]}}, {"items": [{"I1": 1.0}, {"I1": 1e300}]}):
        assert transform(body, CRITEO).dense.max() < 700  # log1p keeps Criteo's counts small
    unclipped = schema_from_dict({"slots": [{"name": "a"}, {"name": "x", "kind": "dense"}]})
    for body in ({"items": {"a": ["1", "2"], "x": [1.0, 1e300]}}, [{"a": "1", "x": 1e300}]):
        with pytest.raises(FeatureError, match="'x'.*beyond float32"):
            transform(body, unclipped)
    assert from_json(orjson.dumps({"items": {"a": ["1"], "x": [1e300]}}), unclipped) is None


def test_numbers_sent_for_a_categorical_field_are_named_or_hashed_as_text():
    """An int is hashed as its text wherever it comes (a context, a column, a record); a float or
    a bool is a FeatureError naming the field, never a crash, never hashed silently."""
    request = {"context": {"user_feature_0": 5}, "items": {"item_id": ["1"]}}
    as_text = {"context": {"user_feature_0": "5"}, "items": {"item_id": ["1"]}}
    assert encode(transform(request, OBD)) == encode(transform(as_text, OBD))
    bad = [
        {"context": {"user_feature_0": 1.5}, "items": {"item_id": ["1"]}},
        {"context": {"user_feature_0": True, "user_feature_1": 2}, "items": {"item_id": ["1"]}},
        {"items": {"item_id": ["1", "2"], "item_feature_1": [1.5, ""]}},
        [{"C1": 1.5}, {"C1": "x"}],
    ]
    for records in bad:
        schema = CRITEO if isinstance(records, list) else OBD
        with pytest.raises(FeatureError, match="expected a string or integer"):
            transform(records, schema)


def test_dedup_spans_with_slot_ids_that_do_not_ascend_is_the_batch_of_each_span():
    # slot ids 9, 3: sorted signs are not in batch slot order, so the dedup sorts by rank
    schema = schema_from_dict({"slots": [{"name": "a", "id": 9}, {"name": "b", "id": 3}]})
    rows = Table({"a": np.array(["x", "y", "x", "z", "y"]), "b": np.array(["p", "p", "q", "q", "r"])}, 5)
    batch = transform(rows, schema)
    signs = np.stack([batch.signs[batch.values[: 5].astype(np.int64)], batch.signs[int(batch.sign_counts[0]) + batch.values[5:].astype(np.int64)]], axis=1).ravel()  # fmt: skip
    lengths = np.ones((5, 2), np.int64)
    uniq, local, sign_counts, value_counts = dedup_spans(signs, np.arange(0, 11, 2), lengths, np.array([0, 2, 5]), schema)  # fmt: skip
    u = v = 0
    for k, (a, b) in enumerate(((0, 2), (2, 5))):
        want = transform(Table({c: x[a:b] for c, x in rows.columns.items()}, b - a), schema)
        n_u, n_v = int(sign_counts[k].sum()), int(value_counts[k].sum())
        assert (
            uniq[u : u + n_u].tolist() == want.signs.tolist()
            and local[v : v + n_v].tolist() == want.values.tolist()
        )
        assert sign_counts[k].tolist() == want.sign_counts.tolist()
        u, v = u + n_u, v + n_v
