"""The records that flow through Kafka for learning from the stream, each with one reader and one
writer. Every reader validates the whole record first and raises ``RecordError`` naming the
problem, and nothing else.

**Event** (clients -> events topic; JSON, key = request id)::

    {"request_id": "r-1", "item": 3, "label": 1.0, "ts": 1767225600.25}

``item`` is the index of the item in the scored request, ``label`` a finite float (1.0 a click),
``ts`` seconds since the epoch when it happened. No other keys.

**Impression** (frontends -> impressions topic; binary, little-endian, key = request id)::

    offset  size  field
    0       4     magic b"RSIM"
    4       2     version (2; 1 is still read)
    6       2     reserved, zero
    8       8     ts f64: when the request was scored (seconds since the epoch)
    16      8     delta_seq i64: the embedding version's delta applied when scored
    24      4     num_items u32 (= the batch's rows = the number of scores)
    28      4     batch_len u32
    32      2,2,2 lengths of request_id, embedding_version, dense_version (utf-8 bytes)
    38      2     length of arm (version 2; zero in version 1, which this reader still reads)
    40            request_id, embedding_version, dense_version, arm; scores f32[num_items];
                  the compact batch exactly as scored (``features.codec`` bytes)

``arm`` names the experiment arm whose version scored the request ("" when no experiment ran).

**Sample** (``recserve join`` -> samples topic; binary, key = request id)::

    0       4     magic b"RSSM"
    4       2     version (2)
    6       2     length of arm
    8       8     ts f64: the impression's
    16      8     delta_seq i64
    24      8     schema_hash u64 (the batch's)
    32      4     item u32
    36      4     label f32
    40      4     score f32: what the served model predicted for the item (the impression's)
    44      4,4,4,4  num_slots S, per-row dense F_row, context dense F_ctx, signs in the row
    60      2,2,2 lengths of request_id, embedding_version, dense_version
    66      1     kind u8: 0 the item's label (at ``--label-after-s``), 1 a correction (a click after
                  it, within ``--attribution-s``: the same item again, positive)
    67      1     reserved, zero
    68      4     elapsed f32: event-time seconds from the impression to the label (a click's delay;
                  a negative's, the first horizon)
    72            the four strings (request_id, embedding_version, dense_version, arm); slot
                  flags u8[S]; lengths u32[S]; signs u64[...]; dense f32[F_row]; context dense f32[F_ctx]

A sample is one (request, item, kind): ``Sample.key`` is what the trainer deduplicates on.
Versions 1 (no score, no arm) and 2 (no kind, no elapsed) are refused by name: a joiner and the
trainers reading its samples upgrade together (CHANGELOG).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np
import orjson
from numpy.typing import NDArray

from stream.rows import Row, RowTable


class RecordError(ValueError):
    """A record that is not what its topic carries; the message says what is wrong."""


@dataclass(frozen=True)
class Versions:
    """What scored a request: the embedding version, its delta, the dense version."""

    embedding: str
    delta_seq: int
    dense: str


# --- events ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Event:
    request_id: str
    item: int
    label: float
    ts: float


_EVENT_KEYS = ("request_id", "item", "label", "ts")


def encode_event(e: Event) -> bytes:
    return orjson.dumps({"request_id": e.request_id, "item": e.item, "label": e.label, "ts": e.ts})


_LABEL_MAX = float(np.finfo(np.float32).max)


def decode_event(data: bytes) -> Event:
    try:
        d = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise RecordError(f"event is not JSON: {e}") from None
    if not isinstance(d, dict):
        raise RecordError(f"event must be a JSON object, got {type(d).__name__}")
    if sorted(d) != sorted(_EVENT_KEYS):
        missing, extra = sorted(set(_EVENT_KEYS) - set(d)), sorted(set(d) - set(_EVENT_KEYS))
        raise RecordError(f"event keys must be {list(_EVENT_KEYS)}: missing {missing}, unknown {extra}")
    rid, item, label, ts = (d[k] for k in _EVENT_KEYS)
    if not isinstance(rid, str) or not rid:
        raise RecordError(f"event request_id must be a non-empty string, got {rid!r}")
    if type(item) is not int or item < 0:
        raise RecordError(f"event item must be an integer >= 0 (an index in the request), got {item!r}")
    for name, v in (("label", label), ("ts", ts)):
        if type(v) not in (int, float) or not math.isfinite(v):
            raise RecordError(f"event {name} must be a finite number, got {v!r}")
    if abs(label) > _LABEL_MAX:  # a sample holds it as a float32
        raise RecordError(f"event label must be within +-{_LABEL_MAX:.4g} (a float32), got {label!r}")
    return Event(rid, item, float(label), float(ts))


# --- impressions ----------------------------------------------------------------------------
_IMP = struct.Struct("<4sHHdqIIHHHH")
_IMP_VERSIONS = (1, 2)  # 1: no arm (its length field was reserved, zero)
_IMP_MAGIC = b"RSIM"


@dataclass(frozen=True, eq=False)
class Impression:
    request_id: str
    ts: float
    versions: Versions
    scores: NDArray[np.float32]
    batch: bytes  # the compact batch exactly as scored
    arm: str = ""  # the experiment arm that scored it ("" : none ran)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Impression):
            return NotImplemented
        return (self.request_id, self.ts, self.versions, self.batch, self.arm) == (
            other.request_id, other.ts, other.versions, other.batch, other.arm) and np.array_equal(
            self.scores, other.scores)  # fmt: skip

    __hash__ = None  # type: ignore[assignment]


def _utf8(*texts: str) -> list[bytes]:
    out = [t.encode() for t in texts]
    if any(len(b) > 0xFFFF for b in out):
        raise RecordError("request id and version names must be under 64 KiB")
    return out


def encode_impression(imp: Impression) -> bytes:
    v = imp.versions
    strings = _utf8(imp.request_id, v.embedding, v.dense, imp.arm)
    scores = np.ascontiguousarray(imp.scores, "<f4")
    head = _IMP.pack(_IMP_MAGIC, 2, 0, imp.ts, v.delta_seq, len(scores), len(imp.batch), *map(len, strings))
    return b"".join([head, *strings, scores.tobytes(), bytes(imp.batch)])


def _strings(data: bytes, at: int, lengths: tuple[int, ...], what: str) -> tuple[list[str], int]:
    out = []
    for n in lengths:
        try:
            out.append(bytes(data[at : at + n]).decode())
        except UnicodeDecodeError:
            raise RecordError(f"{what}: a request id or version name is not utf-8") from None
        at += n
    return out, at


def _header(data: bytes, st: struct.Struct, magic: bytes, what: str, versions: tuple[int, ...]) -> tuple:
    if len(data) < st.size:
        raise RecordError(f"{what} too short: {len(data)} bytes, the header alone is {st.size}")
    head = st.unpack_from(data)
    if head[0] != magic:
        raise RecordError(f"not {what}: magic {head[0]!r}, expected {magic!r}")
    if head[1] not in versions:
        known = " and ".join(map(str, versions))
        raise RecordError(f"{what} version {head[1]} is not supported (this reader knows {known})")
    return head


def decode_impression(data: bytes) -> Impression:
    """An impression; its batch is returned as bytes, not decoded (``features.codec.decode`` is
    the batch's one reader)."""
    _, version, _, ts, seq, n, blen, *lens = _header(data, _IMP, _IMP_MAGIC, "an impression", _IMP_VERSIONS)
    if version == 1 and lens[3]:
        raise RecordError("impression version 1 has a non-zero reserved field")
    size = _IMP.size + sum(lens) + 4 * n + blen
    if len(data) != size:
        raise RecordError(f"impression is {len(data)} bytes, its header says {size}")
    (rid, emb, dense, arm), at = _strings(data, _IMP.size, tuple(lens), "impression")
    scores = np.frombuffer(data, "<f4", n, at)
    if not rid:
        raise RecordError("impression has an empty request id")
    if not math.isfinite(ts):
        raise RecordError(f"impression ts must be finite, got {ts}")
    return Impression(rid, ts, Versions(emb, seq, dense), scores, bytes(data[at + 4 * n :]), arm)


# --- samples --------------------------------------------------------------------------------
_SAM_FIELDS = (("magic", "4s"), ("version", "H"), ("l_arm", "H"), ("ts", "d"), ("delta_seq", "q"),
               ("schema_hash", "Q"), ("item", "I"), ("label", "f"), ("score", "f"), ("slots", "I"), ("f_row", "I"),
               ("f_ctx", "I"), ("nsigns", "I"), ("l_rid", "H"), ("l_emb", "H"), ("l_dense", "H"), ("kind", "B"),
               ("reserved", "B"), ("elapsed", "f"))  # fmt: skip
"""The sample header's fields in order (the layout above, written once): ``_SAM`` packs and unpacks
one record's, ``SAMPLE_HEAD`` views many records' at once (``stream.sample_batch``)."""
_SAM = struct.Struct("<" + "".join(f for _, f in _SAM_FIELDS))
SAMPLE_HEAD = np.dtype(
    {
        "names": [name for name, _ in _SAM_FIELDS],
        "formats": ["S4" if f == "4s" else "<" + f for _, f in _SAM_FIELDS],
        "offsets": [
            struct.calcsize("<" + "".join(f for _, f in _SAM_FIELDS[:i])) for i in range(len(_SAM_FIELDS))
        ],
        "itemsize": _SAM.size,
    }
)
"""The sample header as a numpy record: what ``_SAM`` packs, field by field."""
_SAM_MAGIC = b"RSSM"
SAMPLE_VERSION = 3
LABEL, CORRECTION = 0, 1
"""A sample's kind: the item's label when its first horizon closed (or its click came within it),
or a correction (a click that came after it, within the attribution window)."""


@dataclass(frozen=True)
class Sample:
    request_id: str
    item: int
    label: float
    ts: float
    versions: Versions
    row: Row
    score: float = 0.0  # what the served model predicted for the item
    arm: str = ""  # the experiment arm that scored it
    kind: int = LABEL
    elapsed: float = 0.0  # event-time seconds from the impression to the label

    @property
    def key(self) -> tuple[str, int, int]:
        return self.request_id, self.item, self.kind


class SampleWriter:
    """Encodes the samples of one impression: its strings and the row table are laid out once,
    each sample is then a header and slices (``encode``, the reference), or the samples of many
    items at once (``encode_many``: one numpy pass over them, the joiner's path at a window's
    close)."""

    def __init__(self, imp: Impression, rows: RowTable) -> None:
        v = imp.versions
        strings = _utf8(imp.request_id, v.embedding, v.dense, imp.arm)
        self._fixed = (imp.ts, v.delta_seq, rows.schema_hash)
        self._scores = imp.scores.tolist()
        self._shape = (len(rows.flags), rows.dense.shape[1], len(rows.context_dense))
        self._lens = tuple(map(len, strings[:3]))
        self._arm = len(strings[3])
        self._strings = b"".join([*strings, rows.flags.tobytes()])
        self._lengths, self._signs = rows.lengths.astype("<u4").tobytes(), rows.signs.astype("<u8").tobytes()
        self._dense, self._ctx = (
            rows.dense.astype("<f4").tobytes(),
            rows.context_dense.astype("<f4").tobytes(),
        )
        self._starts = rows.starts.tolist()
        self.num_rows = rows.num_rows
        self._rows, self._score_array = rows, np.asarray(imp.scores, "<f4")
        self._head, self._before, self._after = self._layout()

    def _layout(self) -> tuple[NDArray[np.void], NDArray[np.uint8], NDArray[np.uint8]]:
        """For ``encode_many``: the header fields every sample of the impression shares, and per row
        the bytes between the header and its signs (strings, flags, lengths) and after them (dense,
        context dense)."""
        head = np.zeros(1, SAMPLE_HEAD)
        shared = {"magic": _SAM_MAGIC, "version": SAMPLE_VERSION, "l_arm": self._arm,
                  **dict(zip(("ts", "delta_seq", "schema_hash"), self._fixed, strict=True)),
                  **dict(zip(("slots", "f_row", "f_ctx"), self._shape, strict=True)),
                  **dict(zip(("l_rid", "l_emb", "l_dense"), self._lens, strict=True))}  # fmt: skip
        for name, value in shared.items():
            head[name] = value
        (s, f_row, f_ctx), n = self._shape, self.num_rows
        text = np.frombuffer(self._strings, np.uint8)
        lengths = np.frombuffer(self._lengths, np.uint8).reshape(n, 4 * s)
        dense = np.frombuffer(self._dense, np.uint8).reshape(n, 4 * f_row)
        ctx = np.frombuffer(self._ctx, np.uint8)
        before = np.hstack([np.broadcast_to(text, (n, len(text))), lengths])
        return head, before, np.hstack([dense, np.broadcast_to(ctx, (n, 4 * f_ctx))])

    def encode(self, item: int, label: float, kind: int = LABEL, elapsed: float = 0.0) -> bytes:
        s, f_row, _ = self._shape
        a, b = self._starts[item], self._starts[item + 1]
        head = _SAM.pack(_SAM_MAGIC, SAMPLE_VERSION, self._arm, *self._fixed, item, label, self._scores[item],
                         *self._shape, b - a, *self._lens, kind, 0, elapsed)  # fmt: skip
        return b"".join([head, self._strings, self._lengths[4 * s * item : 4 * s * (item + 1)],
                         self._signs[8 * a : 8 * b], self._dense[4 * f_row * item : 4 * f_row * (item + 1)],
                         self._ctx])  # fmt: skip

    def encode_many(self, items: NDArray[np.int64], labels: NDArray[np.float32],
                    elapsed: NDArray[np.float32] | float = 0.0) -> list[bytes]:  # fmt: skip
        """``[encode(i, l, LABEL, e) for i, l, e in zip(items, labels, elapsed)]``, laid out as one array: a row per
        record, (header, strings and flags, lengths) | signs | (dense, context dense), its signs
        padded to the longest record's and the padding dropped in one masked copy."""
        rows, k = self._rows, len(items)
        if not k:
            return []
        counts = rows.starts[items + 1] - rows.starts[items]
        widest = int(counts.max())
        lead, tail = _SAM.size + self._before.shape[1], self._after.shape[1]
        records = np.empty((k, lead + 8 * widest + tail), np.uint8)
        head = np.repeat(self._head, k)
        head["item"], head["label"], head["nsigns"], head["elapsed"] = items, labels, counts, elapsed
        head["score"] = self._score_array[items]
        records[:, : _SAM.size] = head.view(np.uint8).reshape(k, _SAM.size)
        records[:, _SAM.size : lead] = self._before[items]
        records[:, lead + 8 * widest :] = self._after[items]
        signs = records[:, lead : lead + 8 * widest].view("<u8")
        present = counts[:, None] > np.arange(widest)  # (k, widest): record i has a j-th sign
        first = np.cumsum(counts) - counts
        at = np.repeat(rows.starts[items] - first, counts) + np.arange(int(counts.sum()))
        if present.all():
            signs[:] = rows.signs[at].reshape(k, widest)
            data = records.tobytes()
        else:
            signs[present] = rows.signs[at]
            keep = np.ones(records.shape, bool)
            keep[:, lead : lead + 8 * widest] = np.repeat(present, 8, axis=1)
            data = records[keep].tobytes()
        ends = np.cumsum(lead + tail + 8 * counts).tolist()
        return [data[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]

    def labelled(self, ev: Event, kind: int = LABEL) -> bytes:
        """The sample of the item ``ev`` names, with what the event carries into it (its label,
        its delay): the join hands the whole event over, so a field an event adds for the trainer
        is this module's alone. ``kind`` CORRECTION: a click after the item's first horizon."""
        return self.encode(
            ev.item, ev.label, kind, max(ev.ts - self._fixed[0], 0.0)
        )  # a client's clock may be behind

    def closing(self, events: list[Event], negatives: NDArray[np.int64], horizon: float) -> list[bytes]:
        """The samples of a window that closed ``horizon`` seconds after the impression: those of
        ``events`` (as ``labelled``), in order, then a negative (label 0.0) of each item of
        ``negatives``."""
        n = len(events)
        items = np.fromiter((e.item for e in events), np.int64, n)
        labels = np.fromiter((e.label for e in events), np.float32, n)
        delays = np.maximum(np.fromiter((e.ts for e in events), np.float64, n) - self._fixed[0], 0.0)
        return self.encode_many(
            np.concatenate([items, negatives]).astype(np.int64),
            np.concatenate([labels, np.zeros(len(negatives), np.float32)]),
            np.concatenate([delays, np.full(len(negatives), horizon)]).astype(np.float32),
        )


def encode_sample(imp: Impression, rows: RowTable, item: int, label: float) -> bytes:
    return SampleWriter(imp, rows).encode(item, label)


def decode_sample(data: bytes) -> Sample:
    head = _header(data, _SAM, _SAM_MAGIC, "a sample", (SAMPLE_VERSION,))
    l_arm, (ts, seq, shash, item, label, score, s, f_row, f_ctx, nsigns, *lens, kind, _, elapsed) = (
        head[2],
        head[3:],
    )
    lens.append(l_arm)
    if kind not in (LABEL, CORRECTION):
        raise RecordError(f"sample kind must be {LABEL} (a label) or {CORRECTION} (a correction), got {kind}")
    size = _SAM.size + sum(lens) + s + 4 * s + 8 * nsigns + 4 * f_row + 4 * f_ctx
    if len(data) != size:
        raise RecordError(f"sample is {len(data)} bytes, its header says {size}")
    (rid, emb, dense_v, arm), at = _strings(data, _SAM.size, tuple(lens), "sample")
    flags = np.frombuffer(data, np.uint8, s, at)
    lengths = np.frombuffer(data, "<u4", s, at + s)
    at += 5 * s
    if int(lengths.sum()) != nsigns:
        raise RecordError(
            f"sample's slot lengths sum to {int(lengths.sum())}, its header says {nsigns} signs"
        )
    signs = np.frombuffer(data, "<u8", nsigns, at)
    dense = np.frombuffer(data, "<f4", f_row, at + 8 * nsigns)
    ctx = np.frombuffer(data, "<f4", f_ctx, at + 8 * nsigns + 4 * f_row)
    if not (
        math.isfinite(ts) and math.isfinite(label) and math.isfinite(score) and math.isfinite(elapsed)
        and np.isfinite(dense).all() and np.isfinite(ctx).all()
    ):  # fmt: skip
        raise RecordError("sample has a non-finite ts, label, score, elapsed or dense value")
    row = Row(shash, flags, lengths, signs, dense, ctx)
    return Sample(
        rid, item, float(label), ts, Versions(emb, seq, dense_v), row, float(score), arm, kind, float(elapsed)
    )
