"""Index scans over a store snapshot: bounds in collation order, rows, splits (no I/O of its own).

A range is given by JSON key prefixes (`low`, `high`, `eq`: a value or a list of up to as many
values as the index has keys) and turned into encoded byte bounds over the main index. Because
every encoded component is self-delimiting and docids are UTF-8 (never the byte 0xFF), `P + 0xFF`
is the first byte string after every entry whose key starts with prefix P.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

from indexer.keys import MISSING, KeyEncodingError, decode_key, encode_key, split_entry
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


def _prefix(value: Any, nkeys: int, what: str) -> bytes:
    values = value if isinstance(value, list) else [value]
    if not 1 <= len(values) <= nkeys:
        raise ScanRequestError(f"{what}: give 1 to {nkeys} key values, not {len(values)}")
    try:
        return encode_key(values)
    except KeyEncodingError as exc:
        raise ScanRequestError(f"{what}: {exc}") from None


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
) -> KeyRange:
    """Byte bounds for an equality or a range on decoded key prefixes (JSON values)."""
    if inclusion not in INCLUSIONS:
        raise ScanRequestError(f"inclusion: one of {', '.join(INCLUSIONS)}, not {inclusion!r}")
    if has_eq:
        if has_low or has_high:
            raise ScanRequestError("give eq or a low/high range, not both")
        p = _prefix(eq, nkeys, "eq")
        return KeyRange(p, p + AFTER_PREFIX)
    start = stop = None
    if has_low:
        p = _prefix(low, nkeys, "low")
        start = p if inclusion in ("both", "low") else p + AFTER_PREFIX
    if has_high:
        p = _prefix(high, nkeys, "high")
        stop = p + AFTER_PREFIX if inclusion in ("both", "high") else p
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
    bounds: KeyRange,
    limit: int | None = None,
) -> Iterator[Row]:
    """Rows of `index` within `bounds` in index order, read from a LevelDB snapshot."""
    cut = len(index.main_prefix)
    count = len(index.definition.keys)
    for entry in _entries(store, index, snapshot, bounds, limit):
        values, docid = split_entry(entry[cut:], count)
        yield Row(values, docid.decode("utf-8", errors="replace"))


def count_entries(store: IndexStore, index: StoredIndex, snapshot: Any, bounds: KeyRange) -> int:
    return sum(1 for _ in _entries(store, index, snapshot, bounds))


def _entries(
    store: IndexStore,
    index: StoredIndex,
    snapshot: Any,
    bounds: KeyRange,
    limit: int | None = None,
) -> Iterator[bytes]:
    """Main-index entry keys (prefix included) within `bounds`, from a snapshot or the store."""
    prefix = index.main_prefix
    start = prefix + (bounds.start or b"")
    stop = prefix + bounds.stop if bounds.stop is not None else _after(prefix)
    source = snapshot if snapshot is not None else store.db
    entries: Iterator[bytes] = source.iterator(start=start, stop=stop, include_value=False)
    return entries if limit is None else islice(entries, limit)


def splits(
    store: IndexStore, index: StoredIndex, snapshot: Any, parts: int
) -> list[KeyRange]:
    """`parts` ranges covering the index with about as many entries each.

    Two walks over the keys, the first to count them, holding only the cut points in memory.
    """
    prefix = index.main_prefix
    cut = len(prefix)
    source = snapshot if snapshot is not None else store.db
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


Runs = list[tuple[list[Any], int]]


def entry_runs(
    store: IndexStore,
    index: StoredIndex,
    snapshot: Any,
    bounds: KeyRange,
    limit: int | None = None,
    chunk: int = 8192,
) -> Iterator[tuple[Runs, list[str]]]:
    """The rows of `iterate` in chunks of up to `chunk`, as (runs, docids).

    `runs` are (key values, row count) of consecutive rows with the same key, so each distinct
    key is decoded once per run rather than once per row. An entry that starts with the bytes of
    the previous key has that key: every encoded component is self-delimiting.
    """
    cut = len(index.main_prefix)
    count = len(index.definition.keys)
    entries = _entries(store, index, snapshot, bounds, limit)
    previous = AFTER_PREFIX  # never the first byte of a key
    values: list[Any] = []
    while True:
        runs: Runs = []
        docids: list[str] = []
        add = docids.append
        n = 0
        for entry in islice(entries, chunk):
            if entry.startswith(previous, cut):
                add(entry[cut + len(previous) :].decode("utf-8", errors="replace"))
                n += 1
                continue
            if n:
                runs.append((values, n))
            values, end = decode_key(entry, count, cut)
            previous = entry[cut:end]
            add(entry[end:].decode("utf-8", errors="replace"))
            n = 1
        if not docids:
            return
        runs.append((values, n))
        yield runs, docids


def column_names(paths: Sequence[str]) -> list[str]:
    """Spark-friendly column names of key paths: dots become underscores."""
    return [p.replace(".", "_") for p in paths]
