"""``make bench-codec``: compact-batch size and speed against the naive layout and JSON.

Two workloads: ``criteo_200`` (200 consecutive rows of the Criteo test split, as flat records)
and ``ranking_80`` (one Open Bandit user context + all 80 candidate items of item_context.csv).
Writes loadtest/results/codec.json.

    python -m loadtest.bench_codec [--quick] [--results-dir DIR]
"""

from __future__ import annotations

import orjson

from features import stream
from features.codec import decode, encode
from features.readers import read_obd, to_records
from features.schema import load_schema
from features.transform import transform
from loadtest.common import median_us, parser, print_table, report_targets, write_results

TARGETS = {
    "ranking_80": {"compact/naive": 0.10, "compact/json": 0.12},
    "criteo_200": {"compact/naive": 0.65, "transform_us": 2000.0},
}


def criteo_request():
    schema = load_schema("data/schemas/criteo.yaml")
    table = stream.read("data/criteo/wide_resdnn_criteo_test.tsv", schema, limit=200)
    return schema, to_records(table, schema, with_label=True)


def ranking_request():
    schema = load_schema("data/schemas/obd.yaml")
    first = to_records(read_obd("data/obd/all.csv", "data/obd/item_context.csv", schema, limit=1), schema)[0]
    context = {k: v for k, v in first.items() if k.startswith(("user_feature", "user-item_affinity"))}
    items = to_records(stream.read("data/obd/item_context.csv", schema), schema)
    for item in items:
        item["position"] = "1"  # score every candidate as if shown in the first slot
    return schema, {"context": context, "items": items}


def naive_bytes(batch, schema) -> int:
    """int64 sign per slot per row + float32 dense per row + float32 label per row."""
    rows = batch.num_rows
    return rows * (8 * len(schema.sparse) + 4 * len(schema.dense) + 4)


def measure(schema, request, quick: bool = False) -> dict:
    js = orjson.dumps(request)
    parsed = orjson.loads(js)
    batch = transform(parsed, schema)
    blob = encode(batch)

    def decode_touch():  # decode and materialise every array view
        b = decode(blob)
        return (
            b.signs,
            b.values,
            b.offsets,
            b.flags,
            b.sign_counts,
            b.value_counts,
            b.dense,
            b.context_dense,
            b.labels,
        )

    assert decode(blob) == batch
    runs, seconds = (5, 0.0) if quick else (200, 0.3)
    return {
        "rows": batch.num_rows,
        "compact_bytes": len(blob),
        "naive_bytes": naive_bytes(batch, schema),
        "json_bytes": len(js),
        "encode_us": median_us(lambda: encode(batch), runs, seconds),
        "decode_us": median_us(lambda: decode(blob), runs, seconds),
        "decode_touch_all_us": median_us(decode_touch, runs, seconds),
        "json_loads_us": median_us(lambda: orjson.loads(js), runs, seconds),
        "transform_us": median_us(lambda: transform(parsed, schema), min(runs, 100), seconds),
    }


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__).parse_args(argv)
    results = {}
    for name, request in (("criteo_200", criteo_request), ("ranking_80", ranking_request)):
        schema, body = request()
        results[name] = measure(schema, body, args.quick)
    rows = []
    for name, r in results.items():
        r["compact/naive"] = r["compact_bytes"] / r["naive_bytes"]
        r["compact/json"] = r["compact_bytes"] / r["json_bytes"]
        r["json_loads/decode"] = r["json_loads_us"] / r["decode_us"]
        rows.append({"workload": name, **r})
    cols = ["workload", "rows", "compact_bytes", "naive_bytes", "json_bytes", "compact/naive", "compact/json",
            "encode_us", "decode_us", "decode_touch_all_us", "json_loads_us", "json_loads/decode", "transform_us"]  # fmt: skip
    print_table("compact batch codec (medians)", rows, cols)
    checks = [
        ("ranking_80 compact <= 0.1x naive", results["ranking_80"]["compact/naive"] <= 0.10),
        ("ranking_80 compact <= 0.12x JSON", results["ranking_80"]["compact/json"] <= 0.12),
        ("criteo_200 compact <= 0.65x naive", results["criteo_200"]["compact/naive"] <= 0.65),
        (
            "decode >= 10x faster than orjson.loads (both)",
            all(r["json_loads/decode"] >= 10 for r in results.values()),
        ),
        ("criteo_200 transform from JSON records <= 2 ms", results["criteo_200"]["transform_us"] <= 2000),
    ]
    print()
    report_targets(results, dict(checks))
    print(f"\nwrote {write_results('codec', results, args.results_dir)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
