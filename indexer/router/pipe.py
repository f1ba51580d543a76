"""Length-prefixed messages over a pipe between a router and a process it starts (sans-IO).

A message is u32 length (of what follows it), u8 kind, body. The build encoder
(`build_encoder.py`) and the router's shards (`shards/messages.py`) each define their kinds.
"""

from __future__ import annotations

import struct

_HEAD = struct.Struct(">IB")  # length of what follows the length, kind


class PipeError(Exception):
    """The pipe carried something malformed (a bug on one side: both are this package)."""


def encode_message(kind: int, body: bytes) -> bytes:
    return _HEAD.pack(len(body) + 1, kind) + body


class MessageReader:
    """Bytes of the pipe in, (kind, body) out."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes | bytearray) -> None:
        self._buffer += data

    def next(self) -> tuple[int, bytes] | None:
        buffer = self._buffer
        if len(buffer) < _HEAD.size:
            return None
        length, kind = _HEAD.unpack_from(buffer)
        if length < 1:
            raise PipeError(f"a message of length {length}")
        end = 4 + length
        if len(buffer) < end:
            return None
        body = bytes(buffer[_HEAD.size : end])
        del buffer[:end]
        return kind, body
