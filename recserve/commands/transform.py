"""``recserve transform``: read a data file, transform it with a schema, write compact batches.

Writes one ``.rscb`` file per batch (the compact-batch codec) and prints what it did. Useful to
inspect what training and serving see, and to produce binary request bodies for the endpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class TransformConfig:
    """``recserve transform``."""

    schema: str = "data/schemas/criteo.yaml"
    """Feature schema YAML."""
    data: str = ""
    """Criteo TSV/CSV, or OBD all.csv (with --items)."""
    items: str = ""
    """OBD item_context.csv to join item features from."""
    batch_size: int = 200
    """Rows per compact batch."""
    limit: int | None = None
    """Read at most this many rows."""
    out: str = ""
    """Directory for <n>.rscb files ('': only report)."""

    def __post_init__(self) -> None:
        if not self.data:
            raise ValueError("--data is required")
        if self.batch_size < 1:
            raise ValueError("batch_size must be >= 1")


CONFIG = TransformConfig


def run(args: TransformConfig) -> int:
    from features.codec import decode, encode
    from features.readers import read_criteo, read_obd
    from features.schema import load_schema
    from features.transform import Table, transform

    schema = load_schema(args.schema)
    table = read_obd(args.data, args.items, args.limit) if args.items else read_criteo(args.data, args.limit)
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    total = unique = 0
    n = 0
    for n, start in enumerate(range(0, table.num_rows, args.batch_size)):
        stop = min(start + args.batch_size, table.num_rows)
        part = Table({k: v[start:stop] for k, v in table.columns.items()}, stop - start)
        blob = encode(transform(part, schema))
        batch = decode(blob)
        total += len(blob)
        unique += len(batch.signs)
        if out:
            (out / f"{n:06d}.rscb").write_bytes(blob)
    batches = n + 1 if table.num_rows else 0
    print(
        f"{table.num_rows} rows of {args.data} -> {batches} compact batches of <= {args.batch_size} rows, "
        f"{total:,} bytes ({total / max(table.num_rows, 1):.1f} B/row), "
        f"{unique:,} unique signs; schema {schema.name} {schema.fingerprint[:12]}"
        + (f"; written to {args.out}" if args.out else "")
    )
    return 0
