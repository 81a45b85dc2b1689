"""``recserve transform``: stream a data file, transform it with a schema, write compact batches.

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
    """Data file, directory or glob in any format training reads (TSV/CSV, Parquet, gzip), e.g.
    the Criteo TSV, or OBD all.csv (with --items)."""
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
    from features import stream
    from features.codec import decode, encode
    from features.readers import join_items
    from features.schema import load_schema
    from features.transform import transform
    from training.data import rebatch

    schema = load_schema(args.schema)
    items = stream.read(args.items, schema) if args.items else None
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    rows = total = unique = batches = 0
    for part in rebatch(stream.stream(args.data, schema, limit=args.limit), args.batch_size):
        if items is not None:
            part = join_items(part, items, args.items)
        blob = encode(transform(part, schema))
        total += len(blob)
        unique += len(decode(blob).signs)
        if out:
            (out / f"{batches:06d}.rscb").write_bytes(blob)
        batches += 1
        rows += part.num_rows
    print(
        f"{rows} rows of {args.data} -> {batches} compact batches of <= {args.batch_size} rows, "
        f"{total:,} bytes ({total / max(rows, 1):.1f} B/row), "
        f"{unique:,} unique signs; schema {schema.name} {schema.fingerprint[:12]}"
        + (f"; written to {args.out}" if args.out else "")
    )
    return 0
