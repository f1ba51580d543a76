"""What a sharded router's parent and each of its shards say over the shard's stdin and stdout
(sans-IO: pure functions over bytes, framed by `pipe.py`).

    parent -> shard
      LINES  u16 key length, key, u64 start, u64 end, u64 start line, u64 end line, u32 n,
             n x u32 (line number - start line - 1, native order: both ends are one machine),
             then the n lines joined by newlines
             (the shard's lines of the piece [start, end) of the input, appended as one batch)
    shard -> parent
      HELLO  JSON {"http": URL, "position": POSITION or null, "pid": N}: ready, and how far
             its source log holds the input
      ACK    JSON {"appended": N, "bad": N}: the oldest LINES not yet acknowledged is appended

An `InputPosition` names the input (`key`: a file's path, inode and generation, or a generated
workload; its text up to the first "|" names it in messages) and how far into it a shard has
appended its lines (`offset`, `line`: the lines before). The shard stores it in the same synced
batch as the lines, so after any crash its log says exactly which pieces it holds. A message is
sent again whole (to a shard started again), and a parent started again cuts its pieces at
every shard's position, so a shard holds a piece entirely or not at all
(`InputPosition.holds`). Nothing is lost, nothing is doubled, and no line needs its own offset.
"""

from __future__ import annotations

import json
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from indexer.router.pipe import PipeError, encode_message

LINES, HELLO, ACK = 1, 2, 3
_KEY = struct.Struct(">H")
_PIECE = struct.Struct(">QQQQI")


@dataclass(frozen=True)
class InputPosition:
    """How far into one input a shard's source log holds its lines."""

    key: str
    offset: int  # the input's bytes (or generated documents) before the next line
    line: int  # the lines before it

    def encode(self) -> bytes:
        return json.dumps({"key": self.key, "offset": self.offset, "line": self.line}).encode()

    @classmethod
    def decode(cls, value: bytes | None) -> InputPosition | None:
        """The stored position; None for none (or one this version cannot read: start over)."""
        if value is None:
            return None
        try:
            item = json.loads(value)
            return cls(str(item["key"]), int(item["offset"]), int(item["line"]))
        except (ValueError, KeyError, TypeError):
            return None

    def holds(self, batch: LineBatch) -> bool:
        """Whether the log holds the batch's piece of the input already."""
        return batch.key == self.key and batch.end <= self.offset

    def overlaps(self, batch: LineBatch) -> bool:
        """Whether the log holds part of the piece only (the parent cut it wrong: a bug)."""
        return batch.key == self.key and batch.start < self.offset < batch.end


@dataclass(frozen=True)
class LineBatch:
    """One shard's lines of the piece [start, end) of the input (lines start_line + 1 to
    end_line); `indexes`: each line's number - start_line - 1."""

    key: str
    start: int
    end: int
    start_line: int
    end_line: int
    indexes: Sequence[int]
    lines: Sequence[bytes]

    @property
    def position(self) -> InputPosition:
        return InputPosition(self.key, self.end, self.end_line)

    def numbered(self) -> list[tuple[int, bytes]]:
        """(1-based line number, line) of each line."""
        first = self.start_line + 1
        return [(first + i, line) for i, line in zip(self.indexes, self.lines, strict=True)]


def encode_lines(batch: LineBatch) -> bytes:
    key = batch.key.encode()
    head = _PIECE.pack(batch.start, batch.end, batch.start_line, batch.end_line, len(batch.lines))
    indexes = array("I", batch.indexes).tobytes()
    body = b"".join((_KEY.pack(len(key)), key, head, indexes, b"\n".join(batch.lines)))
    return encode_message(LINES, body)


def decode_lines(body: bytes) -> LineBatch:
    try:
        (size,) = _KEY.unpack_from(body)
        at = _KEY.size
        key = body[at : at + size].decode()
        at += size
        start, end, start_line, end_line, count = _PIECE.unpack_from(body, at)
        at += _PIECE.size
    except (struct.error, UnicodeDecodeError) as exc:
        raise PipeError(f"a malformed LINES message: {exc}") from None
    indexes = array("I")
    size = count * indexes.itemsize
    if len(body) < at + size:
        raise PipeError("a LINES message shorter than its count")
    indexes.frombytes(body[at : at + size])
    at += size
    lines = body[at:].split(b"\n") if count else []
    if len(indexes) != count or len(lines) != count or (not count and at != len(body)):
        raise PipeError("a LINES message whose lines do not match its count")
    return LineBatch(key, start, end, start_line, end_line, indexes, lines)


def encode_json(kind: int, value: dict[str, Any]) -> bytes:
    return encode_message(kind, json.dumps(value).encode())


def decode_json(body: bytes) -> dict[str, Any]:
    try:
        value = json.loads(body)
    except ValueError as exc:
        raise PipeError(f"a malformed message: {exc}") from None
    if not isinstance(value, dict):
        raise PipeError("a message that is not a JSON object")
    return value


def encode_hello(http: str, position: InputPosition | None, pid: int) -> bytes:
    item = None if position is None else json.loads(position.encode())
    return encode_json(HELLO, {"http": http, "position": item, "pid": pid})


def decode_hello(body: bytes) -> tuple[str, InputPosition | None, int]:
    value = decode_json(body)
    position = value.get("position")
    try:
        stored = None if position is None else json.dumps(position).encode()
        return str(value["http"]), InputPosition.decode(stored), int(value["pid"])
    except (KeyError, TypeError, ValueError):
        raise PipeError(f"a malformed HELLO: {value}") from None
