"""PostgreSQL's logical replication messages (the built-in `pgoutput` plugin, protocol 1)
(sans-IO, pure).

A replication stream carries, per transaction, Begin, then Relation messages describing each
table before its first change, Insert, Update, Delete and Truncate, then Commit. Column values
come in their types' text output form (`pgtypes` turns them into JSON), NULL, or
UNCHANGED: a TOASTed value an update did not change, which pgoutput leaves out.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Final, TypeAlias, final

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
    "decode_message",
    "format_lsn",
    "parse_lsn",
]

POSTGRES_EPOCH: Final = datetime(2000, 1, 1, tzinfo=UTC)


class PgOutputError(ValueError):
    """A replication message that does not parse; the message says where."""


@final
class Unchanged:
    """A TOASTed value an update did not change: pgoutput leaves it out. There is one,
    UNCHANGED, and values are compared with it by identity."""

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
    for _ in range(count):
        if pos >= end:
            raise PgOutputError(f"message {data[:1]!r} ends at byte {end}")
        kind = data[pos]
        pos += 1
        if kind == _T:
            if pos + 4 > end:
                raise PgOutputError(f"message {data[:1]!r} ends at byte {end}")
            # Four byte reads: native code when compiled, where a struct call is not.
            length = (
                (data[pos] << 24) | (data[pos + 1] << 16) | (data[pos + 2] << 8) | data[pos + 3]
            )
            if length >= 0x80000000:
                length -= 0x100000000
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
