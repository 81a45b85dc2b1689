"""The scoring core's ``decode`` verb: request bytes -> a ``CompactBatch`` checked against the
served schema and the request limits.

A binary compact batch is decoded and checked (``features.batch.check_fits``, the check the
worker runs too: another slot count or dense width is refused before any hop) and keeps its bytes,
which a worker process is then sent as they came. A JSON body in the forms ``features.jsonscan``
takes (a list of records, or a ranking request in rows or columns) is read straight from its bytes
by ``features.transform.from_json``; any other JSON body goes through orjson and
``features.transform``, which decide it and name its mistakes. Errors are raised as found
(``serving.scoring.errors`` maps them).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import orjson

from features.batch import CompactBatch, check_fits
from features.codec import decode, encode
from features.schema import Schema
from features.transform import from_json, transform
from serving.scoring.errors import BadRequest, TooLarge, UnsupportedType

log = logging.getLogger("recserve.scoring")

JSON = "application/json"
BINARY = "application/octet-stream"


@dataclass(frozen=True)
class Request:
    """A decoded request: its batch, and its bytes when the client sent the batch itself."""

    batch: CompactBatch
    wire: bytes | None = None


class Decoder:
    """Decodes request bodies for one schema within the request limits."""

    def __init__(self, schema: Schema, max_items: int, max_body_bytes: int):
        self.schema = schema
        self.max_items = max_items
        self.max_body_bytes = max_body_bytes
        # a valid request missed the compiled scan, which takes every form of this schema (logged once)
        self._said_parsed = any(s.kind == "multi" for s in schema.slots)

    def decode(self, body: bytes, content_type: str | None) -> Request:
        if len(body) > self.max_body_bytes:
            raise TooLarge(f"request body of {len(body)} bytes exceeds the limit of {self.max_body_bytes}")
        if not body:
            raise BadRequest("empty request body")
        ctype = (content_type or JSON).split(";")[0].strip().lower()
        if ctype == BINARY:
            batch = decode(body, schema_hash=self.schema.hash64)
            check_fits(batch, self.schema)
            self._check_rows(batch.num_rows)
            return Request(batch, body)
        if ctype not in (JSON, "text/json", ""):
            raise UnsupportedType(f"unsupported content type {ctype!r}: send {JSON} or {BINARY}")
        scanned = from_json(body, self.schema, self.max_items)  # straight from its bytes
        return Request(scanned if scanned is not None else self._parsed(body))

    def _parsed(self, body: bytes) -> CompactBatch:
        """Any other body, or a mistake (named by orjson and transform)."""
        request: Any = orjson.loads(body)
        items = request.get("items") if isinstance(request, dict) else request
        if isinstance(items, list):
            self._check_rows(len(items))
        elif isinstance(items, dict):  # the column form: the longest column counts
            self._check_rows(max((len(v) for v in items.values() if isinstance(v, list)), default=0))
        batch = transform(request, self.schema)
        if not self._said_parsed:  # a slower path a client can leave
            self._said_parsed = True
            log.warning("a JSON request was parsed by orjson: the compiled scan (features/jsonscan.py) takes "
                        "strings of printable ASCII without escapes, numbers of at most 18 significant "
                        "digits, no label and no multi-valued slot stored per row; its decode takes about "
                        "half the time (said once per process)")  # fmt: skip
        return batch

    def _check_rows(self, n: int) -> None:
        if n > self.max_items:
            raise TooLarge(f"{n} items exceed the limit of {self.max_items} per request")


def warmup_requests(decoder: Decoder) -> list[tuple[bytes, str]]:
    """One-row requests of the decoder's schema in every form it takes (a list of records, a ranking
    request in column form, and that request's compact batch), with their content types: decoding
    them compiles (or loads from numba's cache) every kernel a request of each form runs."""
    slots = decoder.schema.slots
    value = {s.column: ("0" if s.kind != "dense" else 0.0) for s in slots}
    context = {s.column: value[s.column] for s in slots if s.scope == "context"}
    items = {s.column: [value[s.column]] for s in slots if s.scope == "item"}
    bodies = [(orjson.dumps(body), JSON) for body in ([value], {"context": context, "items": items})]
    bodies.append((encode(decoder.decode(*bodies[1]).batch), BINARY))
    return bodies
