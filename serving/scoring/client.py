"""A small HTTP client for the scoring endpoint (keep-alive, token auth) and request builders."""

from __future__ import annotations

import http.client
import json
import ssl
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson


class ScoringClient:
    """POSTs scoring requests over one keep-alive connection (HTTPS for an https:// URL, the
    server's certificate checked against ``ca``, or the system's CAs without it)."""

    def __init__(self, url: str, key_file: str | None = None, timeout_s: float = 10.0, ca: str = ""):
        u = urllib.parse.urlsplit(url)
        if u.hostname is None or u.scheme not in ("http", "https"):
            raise ValueError(f"scoring URL {url!r} is not http(s)://HOST[:PORT]/PATH")
        if ca and u.scheme != "https":
            raise ValueError(f"a CA ({ca}) is for an https:// URL, not {url}")
        self.host, self.port, self.path = u.hostname, u.port or (443 if u.scheme == "https" else 80), u.path
        self.ssl = ssl.create_default_context(cafile=ca or None) if u.scheme == "https" else None
        self.timeout_s = timeout_s
        self.headers = {}
        if key_file:
            key = json.loads(Path(key_file).read_text())["inference"]["key"]
            self.headers["Authorization"] = f"Bearer {key}"
        self._conn: http.client.HTTPConnection | None = None

    def post(self, body: bytes, content_type: str = "application/json") -> tuple[int, bytes]:
        for attempt in range(2):  # one retry on a connection the server closed
            if self._conn is None:
                self._conn = (
                    http.client.HTTPSConnection(
                        self.host, self.port, timeout=self.timeout_s, context=self.ssl
                    )
                    if self.ssl
                    else http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
                )
            try:
                self._conn.request("POST", self.path, body, {**self.headers, "Content-Type": content_type})
                resp = self._conn.getresponse()
                return resp.status, resp.read()
            except (ConnectionError, http.client.HTTPException):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def requests_from_file(
    path: str, schema_path: str, rows: int = 200, limit: int | None = None, binary: bool = False,
    columns: bool = False,
) -> Iterator[tuple[bytes, str]]:  # fmt: skip
    """(body, content type) per request: a JSON file is sent as is (one request or a list of them);
    a data file is cut into requests of ``rows`` flat records (or compact batches with ``binary``,
    or ranking requests in column form, ``{"items": {field: [values]}}``, with ``columns``)."""
    from features import stream
    from features.codec import encode
    from features.readers import to_records
    from features.schema import load_schema
    from features.transform import Table, transform

    if path.endswith(".json"):
        data = orjson.loads(Path(path).read_bytes())
        for req in (
            data
            if isinstance(data, list) and data and isinstance(data[0], dict) and "items" in data[0]
            else [data]
        ):
            yield orjson.dumps(req), "application/json"
        return
    schema = load_schema(schema_path)
    table = stream.read(path, schema, limit=limit)
    for start in range(0, table.num_rows, rows):
        stop = min(start + rows, table.num_rows)
        part = Table({k: v[start:stop] for k, v in table.columns.items() if k != schema.label}, stop - start)
        if binary:
            yield encode(transform(part, schema)), "application/octet-stream"
        elif columns:
            dense = {sl.column for sl in schema.slots if sl.kind == "dense"}
            yield orjson.dumps({"items": column_form(to_records(part, schema), dense)}), "application/json"
        else:
            yield orjson.dumps(to_records(part, schema)), "application/json"


def column_form(
    records: list[dict[str, Any]], dense: frozenset[str] | set[str] = frozenset()
) -> dict[str, list[Any]]:
    """Flat records -> the column form of a request's items: each field's values, where a record
    lacks one null for the ``dense`` fields and "" for the others (the form the scoring core parses
    without a pass over the items; "" rather than null keeps a categorical column on the one-call
    hashing path)."""
    fields = sorted({f for r in records for f in r})
    return {f: [r.get(f, None if f in dense else "") for r in records] for f in fields}
