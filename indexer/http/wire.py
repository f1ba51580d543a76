"""The HTTP API's wire: routes and their parameters, errors as answers, and the helpers that
read a request and write an answer."""

from __future__ import annotations

import io
import json
import math
import re
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from indexer.client import ARROW_STREAM, JSON
from indexer.scans import EntryBatch, Row, json_encode, key_names, typed_columns

ARROW = ARROW_STREAM  # the media types and header names are the clients' too

SCAN_CHUNK = 8192

DEFAULT_TIMEOUT_S = 120.0

DEFAULT_LEASE_S = 600.0

MAX_LEASE_S = 86400.0

CONSISTENCIES = ("any", "request_plus", "at_plus")

INDEX_ACTIONS = ("scan", "count", "splits", "types", "docs", "aggregate", "changes")

READ_METHODS = ("GET", "HEAD")

# The query parameters each route takes; any other is a 400 (ROUTE_PARAMS: none).
SNAPSHOT_PARAMS = ("consistency", "at_plus", "timeout", "pin")

COUNT_PARAMS = (
    "eq",
    "low",
    "high",
    "inclusion",
    "prefix",
    "start",
    "stop",
    "spans",
    *SNAPSHOT_PARAMS,
)

ACTION_PARAMS = {
    "scan": (
        *COUNT_PARAMS,
        "limit",
        "columns",
        "order",
        "offset",
        "next",
        "fields",
        "vbuckets",
        "collation",
    ),
    "count": (*COUNT_PARAMS, "vbuckets"),
    "splits": ("parts", *SNAPSHOT_PARAMS),
    "types": SNAPSHOT_PARAMS,
    "docs": SNAPSHOT_PARAMS,
    "aggregate": (*COUNT_PARAMS, "group_by", "aggregates", "vbuckets"),
    "changes": ("since", "until", "limit", "columns", "wait", "only", "vbuckets"),
}

ROUTE_PARAMS: tuple[str, ...] = ()

BUILD_ROUTE = "/indexes/_build"  # POST: build deferred indexes together

ROUTES = (
    "/health",
    "/stats",
    "/metrics",
    "/indexes",
    BUILD_ROUTE,
    "/compact",
    "/snapshots",
    "/snapshots/pin",
)

NO_SPACE = "No space left on device"  # in what a write to a full disk raises

PIN_ROUTE = re.compile(r"^/snapshots/(p\d+)(/renew)?$")

LEASE_ROUTE = re.compile(r"^/changes/leases/([^/]*)$")  # a consumer's hold on the history
LEASE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")

DEFAULT_CONSUMER_LEASE_S = 86400.0  # a consumer's lease on the change history

Scope = dict[str, Any]

Receive = Callable[[], Awaitable[dict[str, Any]]]

Send = Callable[[dict[str, Any]], Awaitable[None]]


class ApiError(Exception):
    """An answer other than success: HTTP status, message, extra headers."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


class _Chunks(io.RawIOBase):
    """A write-only file collecting what pyarrow writes, handed out chunk by chunk."""

    def __init__(self) -> None:
        super().__init__()
        self._parts: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out = b"".join(self._parts)
        self._parts.clear()
        return out


class _RowCount:
    """Entry batches passed through, counting their rows (in the scan's worker thread)."""

    def __init__(self, batches: Iterator[EntryBatch]) -> None:
        self.batches = batches
        self.rows = 0

    def __iter__(self) -> _RowCount:
        return self

    def __next__(self) -> EntryBatch:
        batch = next(self.batches)
        self.rows += len(batch)
        return batch


@dataclass(frozen=True)
class Projection:
    """What a scan's rows hold (`fields=`): these key positions, in this order, and the id;
    with `collation` (`collation=hex`), a string that sorts as the row's entry: its whole key
    as the index orders it, encoded, in hex, a space and its docid. A merge of several nodes'
    rows compares these, without encoding keys itself."""

    positions: tuple[int, ...]
    with_id: bool = True
    id_at: int = 0  # where the id column goes among an Arrow batch's columns
    collation: bool = False


def _projection(query: dict[str, str], paths: Sequence[str]) -> Projection:
    """The `fields` parameter: key paths and `id`, comma-separated (default: all, then id); and
    `collation`."""
    collation = query.get("collation")
    if collation not in (None, "hex"):
        raise ApiError(400, f"collation: hex (each row's encoded key, in hex); not {collation!r}")
    if "fields" not in query:
        return Projection(tuple(range(len(paths))), collation=collation is not None)
    names = [n.strip() for n in query["fields"].split(",")]
    known = key_names(paths)
    unknown = [n for n in names if n != "id" and n not in known]
    positions = tuple(known[n] for n in names if n != "id" and n in known)
    if not names or unknown or len(set(positions)) != len(positions) or names.count("id") > 1:
        raise ApiError(
            400,
            f"fields: keys of the index ({', '.join(paths)}) and id, each once, "
            f"comma-separated; not {query['fields']!r}",
        )
    at = names.index("id") if "id" in names else 0
    return Projection(positions, "id" in names, at, collation is not None)


def _ndjson_chunk(batches: Iterator[EntryBatch], projection: Projection) -> bytes | None:
    """The next batch of rows as NDJSON lines. The JSON of a key is built once per batch, and
    the lines are joined by Arrow (each row's key text taken by its code, then its docid), not
    row by row; a batch with a docid that JSON must escape is built row by row instead."""
    batch = next(batches, None)
    if batch is None:
        return None
    heads = []
    tails = []
    positions = projection.positions
    for values in batch.keys:
        row = Row([values[j] for j in positions], "").as_json()
        heads.append('{"key": ' + json_encode(row["key"]))
        tails.append(
            ', "missing": ' + json_encode(row["missing"]) + "}\n" if "missing" in row else "}\n"
        )
    codes = batch.codes
    hexes = [c.hex() for c in batch.collations] if projection.collation else []
    n = len(batch)
    if n and pc.any(pc.match_substring_regex(batch.docids, ESCAPED)).as_py():
        lines = []
        for c, docid in zip(codes.to_pylist(), batch.docids.to_pylist(), strict=True):
            line = heads[c]
            if hexes:
                line += ', "collation": ' + json_encode(hexes[c] + " " + docid)
            if projection.with_id:
                line += ', "id": ' + json_encode(docid)
            lines.append(line + tails[c])
        return "".join(lines).encode()
    # Each line: its key's head, then (collation) `, "collation": "HEX ` DOCID `"`, then (id)
    # `, "id": "` DOCID `"`, then its key's tail.
    parts: list[Any] = []
    docid = batch.docids
    if hexes:
        parts += [[h + ', "collation": "' + x + " " for h, x in zip(heads, hexes, strict=True)]]
        parts += [docid, ['"' for _ in heads]]
    else:
        parts += [heads]
    if projection.with_id:
        parts[-1] = [p + ', "id": "' for p in parts[-1]]
        parts += [docid, ['"' + t for t in tails]]
    else:
        parts[-1] = [p + t for p, t in zip(parts[-1], tails, strict=True)]
    columns = [
        p if isinstance(p, pa.Array) else pa.array(p, pa.string()).take(codes) for p in parts
    ]
    return _joined(*columns)


# What JSON escapes in a string (ensure_ascii off): a docid holding one is encoded by json.
ESCAPED = r'["\\\x00-\x1f]'


def _joined(*columns: pa.Array) -> bytes:
    """The rows' texts, each the columns' strings joined, as one run of UTF-8 bytes."""
    if not len(columns[0]):
        return b""
    joined = pc.binary_join_element_wise(*columns, "")
    _, offsets, data = joined.buffers()
    first, last = np.frombuffer(offsets, np.int32, len(joined) + 1, joined.offset * 4)[[0, -1]]
    text: bytes = data.slice(int(first), int(last - first)).to_pybytes()
    return text


def _arrow_chunk(
    batches: Iterator[EntryBatch],
    writer: Any,
    schema: pa.Schema,
    kinds: Sequence[str],
    projection: Projection,
) -> bool:
    """Write the next batch of rows as one record batch (the id and the key columns of the
    projection, of `kinds`, and with `collation` a binary column of each row's encoded key);
    False at the end."""
    batch = next(batches, None)
    if batch is None:
        return False
    columns = typed_columns(batch, kinds, projection.positions)
    if projection.with_id:
        columns.insert(projection.id_at, batch.docids)
    if projection.collation:  # last: each row's key as the index orders it, its bytes
        columns.append(pa.array(batch.collations, pa.binary()).take(batch.codes))
    writer.write_batch(pa.RecordBatch.from_arrays(columns, schema=schema))
    return True


def _only(method: str, *allowed: str) -> None:
    if method not in allowed:
        methods = ", ".join(allowed)
        raise ApiError(405, f"{method} not allowed here; use {methods}", {"allow": methods})


def _query(raw: bytes) -> dict[str, str]:
    """The query string's parameters (blank ones too); one given twice is a 400."""
    query: dict[str, str] = {}
    for name, value in parse_qsl(raw.decode(errors="replace"), keep_blank_values=True):
        if name in query:
            raise ApiError(400, f"{name}: given more than once")
        query[name] = value
    return query


def _params(query: dict[str, str], allowed: tuple[str, ...], route: str) -> None:
    """400 naming the parameters `route` does not take, rather than ignoring them."""
    unknown = sorted(set(query) - set(allowed))
    if unknown:
        takes = f"it takes {', '.join(allowed)}" if allowed else "it takes none"
        names = ", ".join(repr(name) for name in unknown)
        plural = "s" if len(unknown) > 1 else ""
        raise ApiError(400, f"unknown query parameter{plural} {names} for {route}: {takes}")


def _plain(number: float) -> str:
    """A bound as a person writes it: whole numbers in full, not as 4.61169e+18."""
    return str(int(number)) if float(number).is_integer() else f"{number:g}"


def _number(value: Any, name: str, low: float, high: float) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ApiError(400, f"{name}: a number, not {value!r}") from None
    if math.isnan(number) or not low <= number <= high:
        raise ApiError(400, f"{name}: from {_plain(low)} to {_plain(high)}, not {value!r}")
    return number


def _hex(query: dict[str, str], name: str) -> bytes | None:
    if name not in query or query[name] == "":
        return None
    try:
        return bytes.fromhex(query[name])
    except ValueError:
        raise ApiError(400, f"{name}: hexadecimal encoded key bytes") from None


def _vector(value: Any, num_vbuckets: int) -> list[tuple[int, int]]:
    """An at_plus vector: {"vbucket": seqno, ...} or a list of seqnos, one per vbucket."""
    if isinstance(value, list):
        items = list(enumerate(value))
    elif isinstance(value, dict):
        try:
            items = [(int(k), v) for k, v in value.items()]
        except ValueError:
            raise ApiError(400, "at_plus: keys are vbucket numbers") from None
    else:
        raise ApiError(400, "at_plus: {vbucket: seqno, ...} or a list of seqnos")
    for vb, seqno in items:
        if not 0 <= vb < num_vbuckets:
            raise ApiError(400, f"at_plus: vbucket {vb} is outside 0-{num_vbuckets - 1}")
        if not isinstance(seqno, int) or isinstance(seqno, bool) or seqno < 0:
            raise ApiError(400, f"at_plus: seqno of vbucket {vb} must be a whole number >= 0")
    return items


async def _body_json(receive: Receive) -> dict[str, Any]:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if len(body) > 1 << 20:
            raise ApiError(413, "request body over 1 MiB")
        if not message.get("more_body"):
            break
    if not body:
        return {}
    try:
        value = json.loads(body)
    except ValueError:
        raise ApiError(400, "the body is not JSON") from None
    if not isinstance(value, dict):
        raise ApiError(400, "the body must be a JSON object")
    return value


def _headers_only(send: Send) -> Send:
    """The `send` of a HEAD request: the status and headers GET would give, no body."""

    async def send_head(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            message = {**message, "body": b""}
        await send(message)

    return send_head


async def _start(send: Send, status: int, content_type: str, extra: dict[str, str]) -> None:
    headers = [(b"content-type", content_type.encode())]
    headers += [(k.encode(), v.encode()) for k, v in extra.items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})


async def _respond(
    send: Send, status: int, body: bytes, content_type: str, extra: dict[str, str] | None = None
) -> None:
    await _start(send, status, content_type, extra or {})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _json(send: Send, status: int, value: Any, extra: dict[str, str] | None = None) -> None:
    await _respond(send, status, json.dumps(value).encode() + b"\n", JSON, extra)
