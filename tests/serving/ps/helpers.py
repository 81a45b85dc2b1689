"""Helpers of the PS tests."""

from __future__ import annotations

from dataclasses import fields

from serving.ps.config import TableShardConfig
from serving.ps.spec import TableSpec

TABLE_FIELDS = frozenset(f.name for f in fields(TableSpec))


def store_config(**kw) -> TableShardConfig:
    """A TableShardConfig from flat keywords, as tests write them: the table spec's fields go into its
    ``table``, the rest (seed, shard, num_shards, schema_hash) stay the store's."""
    table = TableSpec(**{k: kw.pop(k) for k in TABLE_FIELDS & set(kw)})
    return TableShardConfig(table=table, **kw)


class FakeClock:
    """A store's clock that stands still at ``t`` until a test moves it (``clock.t += 60``)."""

    def __init__(self, t: float = 1_700_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t
