"""A shard dump's ``meta.json``: the typed, versioned record ``ShardMeta``, its one writer
(``to_json``, called by ``model_store.shards.write_shard``) and its one reader (``from_json``).

Format ``recserve-ps-shard/2`` nests the table's spec under ``table`` (dim, dtype, capacity,
eviction, limits, init scale and the optimizer with every hyper-parameter: the JSON of
``serving.ps.spec.TableSpec``, which the PS reads back). Format 1 (those fields but the optimizer's
at the top, the rest unrecorded) is read as format 2 with the fields it has; any other format is
refused by name (``UnknownFormat``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from model_store.errors import RecordError
from model_store.records import decode

FORMAT = "recserve-ps-shard/2"
FORMAT_1 = "recserve-ps-shard/1"
KINDS = ("full", "delta")
_V1_TABLE = ("dim", "dtype", "optimizer", "init_scale")  # format 1's table fields, at the top


@dataclass
class ShardMeta:
    """What a shard dump (full or delta) is: which shard, of which table, at which point."""

    kind: str
    """full (every row; bucket order) or delta (rows changed and signs deleted since the last cut)."""
    shard: int
    num_shards: int
    table: dict[str, Any]
    """The table's spec as JSON (``serving.ps.spec.TableSpec``): ``dim`` and ``dtype`` are read
    here; the rest is the PS's to read back."""
    state: list[str]
    """Names of the optimizer's per-row state arrays (``state.<name>.npy``), in dump order."""
    format: str = FORMAT
    schema_hash: str = ""
    """Feature-schema hash of the rows ('' = not recorded)."""
    version: str = ""
    """The model version the rows belong to ('' = none yet)."""
    delta_seq: int = -1
    """Full dump: the last delta applied (-1: none); delta: its own seq."""
    base_version: str = ""
    """Delta: the version it applies to."""
    step: int = 0
    """The shard's optimizer step (Adam's bias correction)."""
    seed: int = 0
    """Salt of the deterministic row initialisation."""
    created: float = 0.0
    rows: int = 0
    """Rows in the dump (written by ``write_shard``)."""
    deleted: int = 0
    """Delta: signs deleted (written by ``write_shard``)."""
    bucket_bits: int | None = None
    """Full dump: bits of its bucket directory (written by ``write_shard``; None: a delta, or a
    dump in another order)."""
    row_dtype: str = ""
    """The serving dtype ``rows.npy`` is in (float32, float16 or int8: ``model_store.quant``) when a
    version's export wrote it so; '' = the table's own ``dtype`` (a training dump)."""

    @property
    def dim(self) -> int:
        return int(self.table["dim"])

    @property
    def dtype(self) -> str:
        """The row type of ``rows.npy``: the serving dtype, else the table's."""
        return self.row_dtype or str(self.table["dtype"])

    @property
    def optimizer(self) -> str:
        """The optimizer's name (its state arrays only fit a store with the same one)."""
        return str(self.table["optimizer"]["name"])

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, body: bytes | str, where: str) -> ShardMeta:
        """The meta in ``body``; RecordError (UnknownFormat: another format) naming ``where``."""
        try:
            raw = json.loads(body)
        except ValueError as e:
            raise RecordError(f"{where}: unreadable shard meta: {e}") from None
        if isinstance(raw, dict) and raw.get("format") == FORMAT_1:
            raw = {k: v for k, v in raw.items() if k not in _V1_TABLE} | {
                "format": FORMAT, "table": {k: raw[k] for k in _V1_TABLE if k in raw}
            }  # fmt: skip
        meta = decode(cls, raw, "shard meta", where)
        if meta.kind not in KINDS:
            raise RecordError(f"{where}: shard meta kind {meta.kind!r}, expected one of {', '.join(KINDS)}")
        optimizer = meta.table.get("optimizer")
        if not (isinstance(meta.table.get("dim"), int) and isinstance(meta.table.get("dtype"), str)
                and isinstance(optimizer, dict) and isinstance(optimizer.get("name"), str)):  # fmt: skip
            raise RecordError(
                f"{where}: the shard meta's table needs dim, dtype and optimizer.name: {meta.table}"
            )
        return meta
