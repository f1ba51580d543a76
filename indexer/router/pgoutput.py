"""PostgreSQL's logical replication messages (the built-in `pgoutput` plugin, protocol 1) and a
table's rows as JSON documents (sans-IO, pure).

A replication stream carries, per transaction, Begin, then Relation messages describing each
table before its first change, Insert, Update, Delete and Truncate, then Commit. Column values
come in PostgreSQL's text form; `row_document` turns a row into a JSON object: JSON and JSONB
columns nested, numbers as numbers, booleans as booleans, timestamps as ISO-8601 strings, and
every other type as its text.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Final, TypeAlias, final

import orjson

__all__ = [
    "UNCHANGED",
    "Begin",
    "Column",
    "Commit",
    "Delete",
    "Insert",
    "Other",
    "PgOutputError",
    "Relation",
    "Truncate",
    "Update",
    "convert_value",
    "converter",
    "decode_message",
    "format_lsn",
    "parse_lsn",
    "row_document",
]

POSTGRES_EPOCH: Final = datetime(2000, 1, 1, tzinfo=UTC)


class PgOutputError(ValueError):
    """A replication message that does not parse; the message says where."""


@final
class Unchanged:
    """A TOASTed value an update did not change: pgoutput leaves it out."""

    _instance: Unchanged | None = None

    def __new__(cls) -> Unchanged:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNCHANGED"


UNCHANGED: Final = Unchanged()

Value: TypeAlias = str | Unchanged | None
"""A column's value in a change: its text form, None for NULL, or UNCHANGED."""
TupleData: TypeAlias = tuple[Value, ...]


@dataclass(frozen=True, slots=True)
class Begin:
    final_lsn: int  # the LSN of the transaction's commit
    commit_time: datetime
    xid: int


@dataclass(frozen=True, slots=True)
class Commit:
    commit_lsn: int
    end_lsn: int  # where the next transaction's changes start: what to confirm
    commit_time: datetime


@dataclass(frozen=True, slots=True)
class Column:
    key: bool  # part of the replica identity (the primary key, by default)
    name: str
    type_oid: int


@dataclass(frozen=True, slots=True)
class Relation:
    oid: int
    namespace: str
    name: str
    replica_identity: str  # d default (primary key), n nothing, f full, i an index
    columns: tuple[Column, ...]

    @property
    def qualified(self) -> str:
        return f"{self.namespace}.{self.name}"


@dataclass(frozen=True, slots=True)
class Insert:
    relation: int
    new: TupleData


@dataclass(frozen=True, slots=True)
class Update:
    relation: int
    new: TupleData
    old: TupleData | None = None  # the old row's key ("K") or whole row ("O"), when sent


@dataclass(frozen=True, slots=True)
class Delete:
    relation: int
    old: TupleData  # the key columns (others None), or the whole row with REPLICA IDENTITY FULL


@dataclass(frozen=True, slots=True)
class Truncate:
    relations: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Other:
    """A message the source has no use for (Origin, Type, a logical decoding message)."""

    kind: str


Message: TypeAlias = Begin | Commit | Relation | Insert | Update | Delete | Truncate | Other


def parse_lsn(text: str) -> int:
    """`16/B374D848` as an integer."""
    high, _, low = text.partition("/")
    try:
        return (int(high, 16) << 32) | int(low, 16)
    except ValueError:
        raise PgOutputError(f"not an LSN: {text!r}") from None


def format_lsn(lsn: int) -> str:
    """An LSN as PostgreSQL writes it (`16/B374D848`)."""
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


_U8 = struct.Struct(">B")
_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")
_U32 = struct.Struct(">I")
_I64 = struct.Struct(">q")
_U64 = struct.Struct(">Q")


class _Reader:
    """Big-endian fields of one message, in order; PgOutputError when one runs past the end."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 1  # after the message's kind byte

    def _take(self, layout: struct.Struct) -> Any:
        if self.pos + layout.size > len(self.data):
            raise PgOutputError(f"message {self.data[:1]!r} ends at byte {len(self.data)}")
        (value,) = layout.unpack_from(self.data, self.pos)
        self.pos += layout.size
        return value

    def u8(self) -> int:
        return int(self._take(_U8))

    def i16(self) -> int:
        return int(self._take(_I16))

    def i32(self) -> int:
        return int(self._take(_I32))

    def u32(self) -> int:
        return int(self._take(_U32))

    def u64(self) -> int:
        return int(self._take(_U64))

    def time(self) -> datetime:
        return POSTGRES_EPOCH + timedelta(microseconds=int(self._take(_I64)))

    def string(self) -> str:
        end = self.data.find(b"\x00", self.pos)
        if end < 0:
            raise PgOutputError(f"message {self.data[:1]!r}: a string without its end")
        text = self.data[self.pos : end].decode("utf-8", "replace")
        self.pos = end + 1
        return text

    def tuple_data(self) -> TupleData:
        values, self.pos = _tuple_data(self.data, self.pos)
        return values


_T, _N, _UNCH, _B = ord("t"), ord("n"), ord("u"), ord("b")


def _tuple_data(data: bytes, pos: int) -> tuple[TupleData, int]:
    """A row's values from `pos`, and where they end (the hot path: a few byte operations per
    column, no method calls)."""
    end = len(data)
    if pos + 2 > end:
        raise PgOutputError(f"message {data[:1]!r} ends at byte {end}")
    (count,) = _I16.unpack_from(data, pos)
    pos += 2
    values: list[Value] = []
    append = values.append
    unpack = _I32.unpack_from
    for _ in range(count):
        if pos >= end:
            raise PgOutputError(f"message {data[:1]!r} ends at byte {end}")
        kind = data[pos]
        pos += 1
        if kind == _T:
            if pos + 4 > end:
                raise PgOutputError(f"message {data[:1]!r} ends at byte {end}")
            (length,) = unpack(data, pos)
            pos += 4
            if length < 0 or pos + length > end:
                raise PgOutputError(f"a column value of {length} bytes runs past the message")
            append(data[pos : pos + length].decode("utf-8", "replace"))
            pos += length
        elif kind == _N:
            append(None)
        elif kind == _UNCH:
            append(UNCHANGED)
        elif kind == _B:
            raise PgOutputError("a binary column value: the stream must use text")
        else:
            raise PgOutputError(f"unknown column value kind {chr(kind)!r}")
    return tuple(values), pos


def decode_message(payload: bytes) -> Message:
    """One pgoutput message (protocol version 1)."""
    if not payload:
        raise PgOutputError("an empty message")
    kind = chr(payload[0])
    r = _Reader(payload)
    if kind == "B":
        return Begin(r.u64(), r.time(), r.u32())
    if kind == "C":
        r.u8()  # flags, unused
        return Commit(r.u64(), r.u64(), r.time())
    if kind == "R":
        oid, namespace, name, identity = r.u32(), r.string(), r.string(), chr(r.u8())
        columns = []
        for _ in range(r.i16()):
            flags, column, type_oid = r.u8(), r.string(), r.u32()
            r.i32()  # the type modifier
            columns.append(Column(bool(flags & 1), column, type_oid))
        return Relation(oid, namespace or "pg_catalog", name, identity, tuple(columns))
    if kind == "I":
        oid = r.u32()
        if chr(r.u8()) != "N":
            raise PgOutputError("an Insert without its new row")
        values, _ = _tuple_data(payload, r.pos)
        return Insert(oid, values)
    if kind == "U":
        oid = r.u32()
        marker = chr(r.u8())
        old = None
        if marker in "KO":
            old = r.tuple_data()
            marker = chr(r.u8())
        if marker != "N":
            raise PgOutputError("an Update without its new row")
        return Update(oid, r.tuple_data(), old)
    if kind == "D":
        oid = r.u32()
        if chr(r.u8()) not in "KO":
            raise PgOutputError("a Delete without the deleted row's key")
        return Delete(oid, r.tuple_data())
    if kind == "T":
        count = r.u32()
        r.u8()  # options: CASCADE, RESTART IDENTITY
        return Truncate(tuple(r.u32() for _ in range(count)))
    if kind in "OYM":
        return Other(kind)
    raise PgOutputError(f"unknown message kind {kind!r}")


# ---------------------------------------------------------------------------------------------
# Rows as documents

_BOOL: Final = 16
_INTEGERS: Final = frozenset({20, 21, 23, 26})  # int8, int2, int4, oid
_FLOATS: Final = frozenset({700, 701})  # float4, float8
_NUMERIC: Final = 1700
_JSON: Final = frozenset({114, 3802})  # json, jsonb
_TIMESTAMP: Final = 1114
_TIMESTAMPTZ: Final = 1184
_DATE: Final = 1082
# Arrays of the types above: element type by array type.
_ARRAYS: Final = {
    1000: _BOOL, 1005: 21, 1007: 23, 1016: 20, 1021: 700, 1022: 701, 1231: _NUMERIC,
    1009: 25, 1015: 25, 1014: 25, 2951: 25, 1115: _TIMESTAMP, 1185: _TIMESTAMPTZ, 1182: _DATE,
}  # fmt: skip


def _number(text: str) -> int | float | None:
    """A numeric's text as a JSON number: an int when integral and written so, else a float;
    NaN and the infinities have no JSON form: null."""
    if "." not in text and "e" not in text.lower() and text.lstrip("-").isdigit():
        return int(text)
    value = float(text)
    return value if math.isfinite(value) else None


def _timestamp(text: str, zoned: bool) -> str:
    """`2024-05-01 10:00:00.5+02` as ISO-8601: `2024-05-01T10:00:00.5+02:00`."""
    if text in ("infinity", "-infinity"):
        return text
    date, _, rest = text.partition(" ")
    if not zoned or not rest:
        return f"{date}T{rest}" if rest else date
    for sign in ("+", "-"):
        at = rest.rfind(sign)
        if at > 0:
            clock, offset = rest[:at], rest[at + 1 :]
            parts = [*offset.split(":"), "00"]
            return f"{date}T{clock}{sign}{parts[0].zfill(2)}:{parts[1].zfill(2)}"
    return f"{date}T{rest}"


def _json(text: str) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:  # what orjson does not take (integers beyond 64 bits)
        return json.loads(text)


def _text(text: str) -> str:
    return text


def converter(type_oid: int) -> Callable[[str], Any]:
    """The function turning a column of this type's text form into a JSON value (chosen once
    per column, not per value)."""
    if type_oid in _JSON:
        return _json
    if type_oid in _INTEGERS:
        return int
    if type_oid in _FLOATS or type_oid == _NUMERIC:
        return _number
    if type_oid in (_BOOL, _TIMESTAMPTZ, _TIMESTAMP) or type_oid in _ARRAYS:
        return lambda text: convert_value(type_oid, text)
    return _text


def convert_value(type_oid: int, text: str) -> Any:
    """A column's text form as a JSON value, by the column's type."""
    if type_oid in _JSON:
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError:  # what orjson does not take (integers beyond 64 bits)
            return json.loads(text)
    if type_oid in _INTEGERS:
        return int(text)
    if type_oid in _FLOATS or type_oid == _NUMERIC:
        return _number(text)
    if type_oid == _BOOL:
        return text == "t"
    if type_oid == _TIMESTAMPTZ:
        return _timestamp(text, True)
    if type_oid == _TIMESTAMP:
        return _timestamp(text, False)
    element = _ARRAYS.get(type_oid)
    if element is not None:
        return [None if item is None else convert_value(element, item) for item in _array(text)]
    return text


def _array(text: str) -> list[str | None]:
    """The elements of a one-dimensional array literal (`{a,"b c",NULL}`), as text."""
    if not (text.startswith("{") and text.endswith("}")):
        raise PgOutputError(f"not an array literal: {text[:40]!r}")
    body = text[1:-1]
    out: list[str | None] = []
    i = 0
    while i < len(body):
        if body[i] == '"':
            i += 1
            chars = []
            while body[i] != '"':
                if body[i] == "\\":
                    i += 1
                chars.append(body[i])
                i += 1
            out.append("".join(chars))
            i += 1
        else:
            end = body.find(",", i)
            end = len(body) if end < 0 else end
            item = body[i:end]
            if item.startswith("{"):
                raise PgOutputError("arrays of more than one dimension are not supported")
            out.append(None if item == "NULL" else item)
            i = end
        i += 1  # the comma
    return out


def row_document(
    relation: Relation, values: TupleData, previous: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A row as a JSON object of its columns; an UNCHANGED value is taken from `previous` (the
    document's last version), and left out without one."""
    if len(values) != len(relation.columns):
        raise PgOutputError(
            f"a row of {len(values)} values for {relation.qualified}, which has "
            f"{len(relation.columns)} columns"
        )
    out: dict[str, Any] = {}
    for column, value in zip(relation.columns, values, strict=True):
        if value is UNCHANGED:
            if previous is not None and column.name in previous:
                out[column.name] = previous[column.name]
        elif value is None:
            out[column.name] = None
        else:
            assert isinstance(value, str)
            out[column.name] = convert_value(column.type_oid, value)
    return out
