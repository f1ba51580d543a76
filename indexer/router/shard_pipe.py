"""What a sharded router's parent and each of its shards say over the shard's stdin and stdout
(sans-IO: pure functions over bytes, framed by `pipe.py`).

    parent -> shard
      LINES  u16 key length, key, u64 end offset, u64 end line, u32 n,
             n x (u64 offset, u64 line number, u32 length), then the n lines
             (the shard's lines of one piece of the input: it appends them as one batch)
    shard -> parent
      HELLO  JSON {"http": URL, "position": POSITION or null, "pid": N}: ready, and how far
             its source log holds the input
      ACK    JSON {"appended": N, "bad": N}: the oldest LINES not yet acknowledged is appended

An `InputPosition` names the input (`key`: a file's path, inode and generation, or a generated
workload; its text up to the first "|" names it in messages) and how far into it a shard has
appended its lines (`offset`, `line`: the lines before). The shard stores it in the same synced
batch as the lines, so after any crash its log says exactly which lines it holds: the parent
resends from the earliest shard's position, and each shard skips what it has
(`InputPosition.skips`). Nothing is lost, nothing is doubled.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from indexer.router.pipe import PipeError, encode_message

LINES, HELLO, ACK = 1, 3, 4
_KEY = struct.Struct(">H")
_END = struct.Struct(">QQI")
_ENTRY = struct.Struct(">QQI")

Line = tuple[int, int, bytes]
"""(offset in the input, 1-based line number, the line without its newline)"""


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

    def skips(self, key: str, offset: int) -> bool:
        """Whether the line at `offset` of input `key` is already in the log."""
        return key == self.key and offset < self.offset


@dataclass(frozen=True)
class LineBatch:
    """One shard's lines of a piece of the input, and where that piece ends."""

    key: str
    end: int
    end_line: int
    lines: Sequence[Line]

    @property
    def position(self) -> InputPosition:
        return InputPosition(self.key, self.end, self.end_line)


def encode_lines(batch: LineBatch) -> bytes:
    key = batch.key.encode()
    pack = _ENTRY.pack
    parts = [_KEY.pack(len(key)), key, _END.pack(batch.end, batch.end_line, len(batch.lines))]
    parts += [pack(offset, number, len(line)) for offset, number, line in batch.lines]
    parts += [line for _, _, line in batch.lines]
    return encode_message(LINES, b"".join(parts))


def decode_lines(body: bytes) -> LineBatch:
    try:
        (size,) = _KEY.unpack_from(body)
        at = _KEY.size
        key = body[at : at + size].decode()
        at += size
        end, end_line, count = _END.unpack_from(body, at)
        at += _END.size
        heads = list(_ENTRY.iter_unpack(body[at : at + count * _ENTRY.size]))
        at += count * _ENTRY.size
    except (struct.error, UnicodeDecodeError) as exc:
        raise PipeError(f"a malformed LINES message: {exc}") from None
    if len(heads) != count:
        raise PipeError("a LINES message shorter than its count")
    lines = []
    for offset, number, length in heads:
        lines.append((offset, number, body[at : at + length]))
        at += length
    if at != len(body):
        raise PipeError("a LINES message whose lines do not fill it")
    return LineBatch(key, end, end_line, lines)


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


class LineSplitter:
    """Bytes of an input in, its complete lines out with their offsets and numbers; a partial
    last line waits for the rest. Starts at `offset`, after `line` lines."""

    def __init__(self, offset: int = 0, line: int = 0) -> None:
        self.partial = b""
        self.offset = offset  # of the first byte of `partial`
        self.line = line

    def feed(self, data: bytes) -> list[Line]:
        *lines, self.partial = (self.partial + data).split(b"\n")
        return self._place(lines, 1)

    def finish(self) -> list[Line]:
        """At the end of an input that is not followed: the last line, if it has no newline."""
        lines, self.partial = [self.partial] if self.partial else [], b""
        return self._place(lines, 0)

    def _place(self, lines: list[bytes], newline: int) -> list[Line]:
        out = []
        offset, number = self.offset, self.line
        for line in lines:
            number += 1
            out.append((offset, number, line))
            offset += len(line) + newline
        self.offset, self.line = offset, number
        return out
