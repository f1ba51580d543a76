"""Index scans over a store snapshot: bounds in collation order, rows, splits (no I/O of its own).

A range is given by JSON key prefixes (`low`, `high`, `eq`: a value or a list of up to as many
values as the index has keys) and turned into encoded byte bounds over the main index. Because
every encoded component is self-delimiting and docids are UTF-8 (never the byte 0xFF), `P + 0xFF`
is the first byte string after every entry whose key starts with prefix P.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain, compress, islice
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from indexer.expressions import column_name
from indexer.keys import (
    MISSING,
    KeyEncodingError,
    decode_key,
    encode_desc,
    encode_key,
    split_entry,
)
from indexer.storage import IndexStore, StoredIndex

AFTER_PREFIX = b"\xff"
INCLUSIONS = ("both", "low", "high", "neither")


class ScanRequestError(ValueError):
    """A scan's parameters are malformed; the message says which and why."""


@dataclass(frozen=True)
class KeyRange:
    """Encoded bounds over an index's entries: start inclusive, stop exclusive (None: open)."""

    start: bytes | None = None
    stop: bytes | None = None


# A scan's bounds: one range, or several disjoint ones in index order (several spans).
Bounds = KeyRange | tuple[KeyRange, ...]


@dataclass(frozen=True)
class VbucketFilter:
    """Only the entries of documents in `vbuckets` (of `num`): what a node of a cluster answers
    for when it holds other vbuckets too (replicas, or vbuckets moving to it)."""

    vbuckets: frozenset[int]
    num: int

    def entries(self, entries: Iterator[bytes]) -> Iterator[bytes]:
        while batch := list(islice(entries, FILTER_BATCH)):
            yield from self.kept(batch)

    def kept(self, batch: list[bytes]) -> list[bytes]:
        """The entries of `batch` in these vbuckets, hashed at once (`entry_vbuckets`)."""
        keep = np.zeros(self.num, np.bool_)
        keep[list(self.vbuckets)] = True
        return list(compress(batch, keep[entry_vbuckets(batch, self.num)].tolist()))


FILTER_BATCH = 4096  # entries a vbucket filter reads ahead and hashes at once


def _crc32_table() -> np.ndarray:
    """zlib's CRC-32 (reflected, polynomial 0xEDB88320) of each byte value."""
    table = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        table = np.where(table & 1, (table >> 1) ^ np.uint32(0xEDB88320), table >> 1)
    return table.astype(np.uint32)


CRC32_TABLE = _crc32_table()


def entry_vbuckets(entries: Sequence[bytes], num: int) -> np.ndarray:
    """The vbucket of each main-index entry's document, `zlib.crc32(docid) % num`, for a batch
    at once: the docid is found by the entry's tail (keys.entry_tail), and the CRC runs a byte
    position at a time over every entry still that long, so no Python runs per entry."""
    n = len(entries)
    whole = pa.array(entries, pa.binary())
    _, offsets_buffer, data_buffer = whole.buffers()
    offsets = np.frombuffer(offsets_buffer, np.int32, n + 1)
    data = np.frombuffer(data_buffer, np.uint8, int(offsets[-1])) if n else np.zeros(0, np.uint8)
    ends = offsets[1:]
    if n and (ends - offsets[:-1] < 2).any():
        raise KeyEncodingError("a main-index entry is shorter than its docid length")
    lengths = (data[ends - 2].astype(np.int32) << 8) | data[ends - 1]
    starts = ends - 2 - lengths
    if n and (starts < offsets[:-1]).any():
        raise KeyEncodingError("a main-index entry is shorter than its docid length says")
    crc = np.full(n, 0xFFFFFFFF, np.uint32)
    for at in range(int(lengths.max()) if n else 0):
        longer = lengths > at
        if longer.all():
            crc = CRC32_TABLE[(crc ^ data[starts + at]) & 0xFF] ^ (crc >> 8)
        else:
            rows = np.nonzero(longer)[0]
            part = crc[rows]
            crc[rows] = CRC32_TABLE[(part ^ data[starts[rows] + at]) & 0xFF] ^ (part >> 8)
    return (crc ^ np.uint32(0xFFFFFFFF)) % np.uint32(num)


def merge_spans(ranges: Sequence[KeyRange]) -> tuple[KeyRange, ...]:
    """Ranges as disjoint ranges in index order, overlapping and touching ones merged: a scan
    of several spans reads each entry once, in index order."""
    low = b""
    ordered = sorted(ranges, key=lambda r: r.start or low)
    out: list[KeyRange] = []
    for r in ordered:
        if r.start is not None and r.stop is not None and r.start >= r.stop:
            continue  # empty
        if out and (out[-1].stop is None or (r.start or low) <= out[-1].stop):
            last = out[-1]
            stop = None if last.stop is None or r.stop is None else max(last.stop, r.stop)
            out[-1] = KeyRange(last.start, stop)
        else:
            out.append(r)
    return tuple(out)


def _prefix(value: Any, nkeys: int, what: str, desc: Sequence[bool] = ()) -> bytes:
    values = value if isinstance(value, list) else [value]
    if not 1 <= len(values) <= nkeys:
        raise ScanRequestError(f"{what}: give 1 to {nkeys} key values, not {len(values)}")
    try:
        return encode_key(values, desc)
    except KeyEncodingError as exc:
        raise ScanRequestError(f"{what}: {exc}") from None


def _successor(prefix: bytes) -> bytes:
    """The first byte string after every string that starts with `prefix`."""
    head = prefix.rstrip(b"\xff")
    if not head:
        raise ScanRequestError("prefix: no key follows it")
    return head[:-1] + bytes([head[-1] + 1])


def string_prefix_range(prefix: Any, desc: bool = False) -> KeyRange:
    """The entries whose leading key is a string that starts with `prefix` (ids of a primary
    index under `user::`, say)."""
    if not isinstance(prefix, str):
        raise ScanRequestError(f"prefix: a string, not {json.dumps(prefix)[:40]}")
    whole = encode_desc(prefix) if desc else encode_key([prefix])
    start = whole[:-2]  # the string's encoding without its terminator
    return KeyRange(start, _successor(start))


def key_range(
    nkeys: int,
    *,
    eq: Any = None,
    low: Any = None,
    high: Any = None,
    inclusion: str = "both",
    has_eq: bool = False,
    has_low: bool = False,
    has_high: bool = False,
    desc: Sequence[bool] = (),
) -> KeyRange:
    """Byte bounds for an equality or a range on decoded key prefixes (JSON values).

    `desc[i]`: key position i is stored descending. `low` and `high` bound the leading key's
    values either way: on a DESC leading key, `high` is where the range starts in index order.
    """
    if inclusion not in INCLUSIONS:
        raise ScanRequestError(f"inclusion: one of {', '.join(INCLUSIONS)}, not {inclusion!r}")
    if has_eq:
        if has_low or has_high:
            raise ScanRequestError("give eq or a low/high range, not both")
        p = _prefix(eq, nkeys, "eq", desc)
        return KeyRange(p, p + AFTER_PREFIX)
    low_included = inclusion in ("both", "low")
    high_included = inclusion in ("both", "high")
    if desc and desc[0]:  # the range's ends swap places in index order
        low, high, has_low, has_high = high, low, has_high, has_low
        low_included, high_included = high_included, low_included
    start = stop = None
    if has_low:
        p = _prefix(low, nkeys, "low" if not (desc and desc[0]) else "high", desc)
        start = p if low_included else p + AFTER_PREFIX
    if has_high:
        p = _prefix(high, nkeys, "high" if not (desc and desc[0]) else "low", desc)
        stop = p + AFTER_PREFIX if high_included else p
    return KeyRange(start, stop)


def parse_json_param(name: str, text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise ScanRequestError(f"{name}: not JSON: {text[:80]!r}") from None


@dataclass(frozen=True)
class Row:
    """One index entry: its key values (MISSING possible) and its document id."""

    key: list[Any]
    docid: str

    def as_json(self) -> dict[str, Any]:
        """As `indexer dump` prints it: MISSING as null, positions listed in "missing"."""
        out: dict[str, Any] = {
            "key": [None if v is MISSING else v for v in self.key],
            "id": self.docid,
        }
        missing = [i for i, v in enumerate(self.key) if v is MISSING]
        if missing:
            out["missing"] = missing
        return out


def iterate(
    store: IndexStore,
    index: StoredIndex,
    snapshot: Any,
    bounds: Bounds,
    limit: int | None = None,
    reverse: bool = False,
) -> Iterator[Row]:
    """Rows of `index` within `bounds` in index order (`reverse`: the other way), read from a
    LevelDB snapshot."""
    cut = len(index.main_prefix)
    count = len(index.definition.keys)
    desc = index.definition.desc
    for entry in _entries(store, index, snapshot, bounds, limit, reverse):
        values, docid = split_entry(entry[cut:], count, desc)
        yield Row(values, docid.decode("utf-8", errors="replace"))


def page(
    store: IndexStore,
    index: StoredIndex,
    snapshot: Any,
    bounds: Bounds,
    offset: int,
    limit: int,
    reverse: bool = False,
    only: VbucketFilter | None = None,
) -> list[bytes]:
    """The entries of one page (blocking): `limit` after skipping `offset`, in index order or
    with `reverse` in the other; held in memory, so that its last entry is known first."""
    entries = _entries(store, index, snapshot, bounds, None, reverse, only)
    return list(islice(entries, offset, offset + limit))


def page_batches(
    index: StoredIndex, entries: list[bytes], chunk: int = 8192
) -> Iterator[EntryBatch]:
    """The entries of a page as `entry_batches` gives a scan's."""
    cut = len(index.main_prefix)
    count = len(index.definition.keys)
    desc = index.definition.desc
    for start in range(0, len(entries), chunk):
        yield _split_batch(entries[start : start + chunk], cut, count, True, desc)


def after(bounds: Bounds, entry: bytes, reverse: bool) -> Bounds:
    """`bounds` less everything up to `entry` (an entry's bytes after the index prefix) in the
    order read: what the page after the one that ended at `entry` reads."""
    if isinstance(bounds, tuple):
        cut = (after(b, entry, reverse) for b in bounds)
        return tuple(
            r
            for r in cut
            if isinstance(r, KeyRange) and (r.start is None or r.stop is None or r.start < r.stop)
        )
    if reverse:
        stop = entry if bounds.stop is None else min(bounds.stop, entry)
        return KeyRange(bounds.start, stop)
    start = entry + b"\x00"  # the first byte string after the entry
    return KeyRange(start if bounds.start is None else max(bounds.start, start), bounds.stop)


def lookup(store: IndexStore, index: StoredIndex, snapshot: Any, docid: str) -> list[Row]:
    """The entries a document has in the index, read from the back index (none when it is
    not in the index, deleted or left out)."""
    source = snapshot if snapshot is not None else store.db
    key = source.get(index.back_prefix + docid.encode())
    if key is None:
        return []
    definition = index.definition
    rows = []
    for entry in sorted(index.entry_keys(key)):  # in index order
        values, end = decode_key(entry, len(definition.keys), 0, definition.desc)
        if end != len(entry):
            raise KeyEncodingError(f"{len(entry) - end} stray bytes after a back-index key")
        rows.append(Row(values, docid))
    return rows


def count_entries(
    store: IndexStore,
    index: StoredIndex,
    snapshot: Any,
    bounds: Bounds,
    only: VbucketFilter | None = None,
) -> int:
    return sum(1 for _ in _entries(store, index, snapshot, bounds, only=only))


def more_than(
    store: IndexStore,
    index: StoredIndex,
    snapshot: Any,
    bounds: Bounds,
    most: int,
    only: VbucketFilter | None = None,
) -> bool:
    """Whether `bounds` holds more than `most` entries: reads at most most + 1 keys (blocking)."""
    return sum(1 for _ in _entries(store, index, snapshot, bounds, most + 1, only=only)) > most


def _entries(
    store: IndexStore,
    index: StoredIndex,
    snapshot: Any,
    bounds: Bounds,
    limit: int | None = None,
    reverse: bool = False,
    only: VbucketFilter | None = None,
) -> Iterator[bytes]:
    """Main-index entry keys (prefix included) within `bounds`, from a snapshot or the store;
    in index order, or with `reverse` in the opposite order; with `only`, of its vbuckets."""
    entries: Iterator[bytes]
    if isinstance(bounds, tuple):  # several spans, disjoint and in index order
        ordered = reversed(bounds) if reverse else bounds
        entries = chain.from_iterable(
            _entries(store, index, snapshot, b, None, reverse) for b in ordered
        )
    else:
        prefix = index.main_prefix
        start = prefix + (bounds.start or b"")
        stop = prefix + bounds.stop if bounds.stop is not None else _after(prefix)
        source = snapshot if snapshot is not None else store.db
        entries = source.iterator(start=start, stop=stop, include_value=False, reverse=reverse)
    if only is not None:
        entries = only.entries(entries)
    return entries if limit is None else islice(entries, limit)


def splits(
    store: IndexStore, index: StoredIndex, snapshot: Any, parts: int, total: int | None = None
) -> list[KeyRange]:
    """`parts` ranges covering the index with about as many entries each.

    A walk over the keys up to the last cut point, holding only the cut points in memory; a
    first walk counts them unless `total` (the snapshot's entry count) is given.
    """
    prefix = index.main_prefix
    cut = len(prefix)
    source = snapshot if snapshot is not None else store.db
    if total is None:
        total = sum(1 for _ in source.iterator(prefix=prefix, include_value=False))
    if parts <= 1 or total < parts:
        return [KeyRange()]
    step = total / parts
    wanted = iter(int(i * step) for i in range(1, parts))
    target = next(wanted)
    cuts: list[bytes] = []
    for position, key in enumerate(source.iterator(prefix=prefix, include_value=False)):
        if position == target:
            if not cuts or cuts[-1] != key[cut:]:
                cuts.append(key[cut:])
            target = next(wanted, -1)
            if target < 0:
                break
    bounds: list[bytes | None] = [None, *cuts, None]
    return [KeyRange(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def _after(prefix: bytes) -> bytes:
    """The first byte string after every string starting with `prefix`."""
    return prefix[:-1] + bytes([prefix[-1] + 1]) if prefix[-1] < 0xFF else prefix + b"\xff" * 8


# json.dumps with any argument builds a JSONEncoder per call (+0.5 us); reuse one.
json_encode = json.JSONEncoder(ensure_ascii=False).encode


def json_text(value: Any) -> str | None:
    """A key value as scans give it in Arrow and Spark columns: JSON text, None for MISSING."""
    return None if value is MISSING else json_encode(value)


@dataclass(frozen=True)
class EntryBatch:
    """A run of consecutive index rows: docids, and for each row the position of its key.

    Row i has docid `docids[i]` and key `keys[codes[i]]`; `keys` holds each distinct key of the
    batch once, decoded, so JSON texts and columns are built per key rather than per row.
    `collations[codes[i]]` is row i's key as the index orders it, encoded (empty for runs).
    """

    docids: pa.StringArray
    codes: pa.Int32Array
    keys: list[list[Any]]
    collations: list[bytes] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.codes)


def entry_batches(
    store: IndexStore,
    index: StoredIndex,
    snapshot: Any,
    bounds: Bounds,
    limit: int | None = None,
    chunk: int = 8192,
    reverse: bool = False,
    offset: int = 0,
    docids: bool = True,
    decode: int | None = None,
    only: VbucketFilter | None = None,
) -> Iterator[EntryBatch]:
    """The rows of `iterate` in batches of up to `chunk` (blocking: run it in a thread).

    The entries of a batch are split with array operations, not row by row: every entry ends
    with its docid and the docid's length (`keys.entry_tail`), so the key's bytes are found
    without decoding them, and only distinct keys are decoded. `decode` (with `docids`
    off): only that many leading key values, once per run of entries that share them (an
    aggregate's groups and the values it reads; `_runs`).
    """
    cut = len(index.main_prefix)
    count = len(index.definition.keys)
    # A whole scan filters each batch read at once; one with a limit or an offset counts the
    # entries of its vbuckets one by one.
    whole = only is not None and limit is None and not offset
    entries = _entries(store, index, snapshot, bounds, limit, reverse, None if whole else only)
    if offset:
        entries = islice(entries, offset, None)
    desc = index.definition.desc
    if decode is not None and docids:
        raise ValueError("entry_batches: decode= gives runs without docids (docids=False)")
    while entries_of_batch := list(islice(entries, chunk)):
        if whole and only is not None:
            entries_of_batch = only.kept(entries_of_batch)
            if not entries_of_batch:
                continue
        if decode is not None:
            yield _runs(entries_of_batch, cut, min(decode, count), desc)
        else:
            yield _split_batch(entries_of_batch, cut, count, docids, desc)


def _split_batch(
    entries: list[bytes], cut: int, count: int, docids: bool = True, desc: Sequence[bool] = ()
) -> EntryBatch:
    """A batch of entries split into docids (`docids`: else left empty) and distinct keys with
    each row's code (`desc`: the key positions stored descending)."""
    n = len(entries)
    whole = pa.array(entries, pa.binary())
    _, offsets_buffer, data_buffer = whole.buffers()
    offsets = np.frombuffer(offsets_buffer, np.int32, n + 1)
    data = np.frombuffer(data_buffer, np.uint8, int(offsets[-1]))
    ends = offsets[1:]
    id_lengths = (data[ends - 2].astype(np.int32) << 8) | data[ends - 1]
    id_starts = ends - 2 - id_lengths
    key_starts = offsets[:-1] + cut
    if n and (id_starts < key_starts).any():
        raise KeyEncodingError("a main-index entry is shorter than its docid length says")
    encoded = pc.dictionary_encode(_gather(pa.binary(), key_starts, id_starts - key_starts, data))
    keys = []
    collations = encoded.dictionary.to_pylist()
    for key in collations:
        values, end = decode_key(key, count, 0, desc)
        if end != len(key):
            raise KeyEncodingError(f"{len(key) - end} stray bytes after a key of {count} values")
        keys.append(values)
    if not docids:
        return EntryBatch(pa.array([], pa.string()), encoded.indices, keys, collations)
    ids = _gather(pa.string(), id_starts, id_lengths, data)
    try:
        ids.validate(full=True)
    except pa.ArrowInvalid:  # docids are bytes on the wire; show invalid UTF-8 as U+FFFD
        ids = pa.array(
            [
                e[s : s + m].decode("utf-8", errors="replace")
                for e, s, m in _slices(entries, id_starts - offsets[:-1], id_lengths)
            ],
            pa.string(),
        )
    return EntryBatch(ids, encoded.indices, keys, collations)


def _runs(entries: list[bytes], cut: int, prefix: int, desc: Sequence[bool]) -> EntryBatch:
    """A batch of entries as runs of equal leading `prefix` values (no docids): entries come in
    index order, and one that starts with the previous run's leading values' bytes has those
    values (encoded values are self-delimiting), so a run is decoded once."""
    keys: list[list[Any]] = []
    lengths: list[int] = []
    head = b"\xff"  # no key starts with it
    run = 0
    values: list[Any] = []
    for entry in entries:
        if entry.startswith(head, cut):
            run += 1
            continue
        if run:
            keys.append(values)
            lengths.append(run)
        values, end = decode_key(entry, prefix, cut, desc)
        head = entry[cut:end]
        run = 1
    if run:
        keys.append(values)
        lengths.append(run)
    codes = np.repeat(np.arange(len(keys), dtype=np.int32), lengths)
    return EntryBatch(pa.array([], pa.string()), pa.array(codes), keys)


def _gather(kind: pa.DataType, starts: Any, lengths: Any, data: Any) -> pa.Array:
    """An Arrow array of `kind` whose value i is data[starts[i] : starts[i] + lengths[i]]."""
    offsets = np.zeros(len(lengths) + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    positions = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1], dtype=np.int32)
    return pa.Array.from_buffers(
        kind, len(lengths), [None, pa.py_buffer(offsets), pa.py_buffer(data[positions])]
    )


def _slices(entries: list[bytes], starts: Any, lengths: Any) -> Iterator[tuple[bytes, int, int]]:
    return zip(entries, starts.tolist(), lengths.tolist(), strict=True)


def column_names(keys: Sequence[str]) -> list[str]:
    """Spark-friendly column names of an index's keys (`expressions.column_name`)."""
    return [column_name(key) for key in keys]


_DIRECTION = re.compile(r"\s+(?:ASC|DESC)\s*$", re.IGNORECASE)


def key_names(keys: Sequence[str]) -> dict[str, int]:
    """Every name a key answers to, with its position: its text (`age DESC`), its text without
    the direction (`age`), and its column name (`LOWER_name`). The first key wins a name that
    two share."""
    names: dict[str, int] = {}
    for position, key in reversed(list(enumerate(keys))):
        names[column_name(key)] = position
        names[_DIRECTION.sub("", key)] = position
    for position, key in reversed(list(enumerate(keys))):
        names[key] = position  # a key's own text before any other key's other names
    return names


# --------------------------------------------------------------------------------------------
# Typed columns: what JSON types an index holds per key position, and values as typed columns

# The kinds a scan's Arrow columns can be: JSON text (any value), or a typed column.
COLUMN_KINDS = {
    "json": pa.string(),
    "string": pa.string(),
    "boolean": pa.bool_(),
    "long": pa.int64(),
    "double": pa.float64(),
}
INT64 = (-(1 << 63), (1 << 63) - 1)


def type_name(value: Any) -> str:
    """The JSON type of a key value: missing, null, boolean, integer (a whole number that fits
    64 bits), number, string, array or object."""
    if value is MISSING:
        return "missing"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer" if INT64[0] <= value <= INT64[1] else "number"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def column_kind(types: Sequence[str] | set[str]) -> str:
    """The column kind for the types a key position holds: typed when one type (or integers
    and numbers) is all there is besides missing and null, else JSON text."""
    present = set(types) - {"missing", "null"}
    if present == {"integer"}:
        return "long"
    if present and present <= {"integer", "number"}:
        return "double"
    if present == {"string"}:
        return "string"
    if present == {"boolean"}:
        return "boolean"
    return "json"


def key_types(
    store: IndexStore, index: StoredIndex, snapshot: Any, chunk: int = 8192
) -> list[set[str]]:
    """The JSON types that occur at each key position of the index (blocking: a thread).

    One walk over the entries; each batch's distinct keys are decoded once (`entry_batches`).
    """
    count = len(index.definition.keys)
    found: list[set[str]] = [set() for _ in range(count)]
    for batch in entry_batches(store, index, snapshot, KeyRange(), chunk=chunk):
        for values in batch.keys:
            for j, value in enumerate(values):
                found[j].add(type_name(value))
    return found


def column_value(kind: str, value: Any) -> Any:
    """A key value in a column of `kind` (None: MISSING, null, or a value of another type)."""
    if value is MISSING:
        return None
    if kind == "json":
        return json_text(value)
    if value is None:
        return None
    if kind == "string":
        return value if isinstance(value, str) else None
    if kind == "boolean":
        return value if isinstance(value, bool) else None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if kind == "long":
        return value if isinstance(value, int) and INT64[0] <= value <= INT64[1] else None
    return float(value)


def typed_columns(
    batch: EntryBatch, kinds: Sequence[str], positions: Sequence[int] | None = None
) -> list[pa.Array]:
    """The key columns of a batch (those at `positions`, default all), position j as a column
    of kinds[j]: values are converted once per distinct key, then taken row by row in Arrow."""
    columns = []
    for j in range(len(kinds)) if positions is None else positions:
        kind = kinds[j]
        values = pa.array([column_value(kind, key[j]) for key in batch.keys], COLUMN_KINDS[kind])
        columns.append(values.take(batch.codes))
    return columns
