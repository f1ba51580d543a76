"""A build stream's encoder in a process of its own, at a lower CPU priority.

A build reads the router's whole source log: parsing each version (JSON), keeping the latest of
each document in a chunk and computing the new index's key is most of a build's cost, and in
the router's process it shares one GIL with the input and the maintenance streams, so a build
slowed them whatever the daemon did (docs/performance.md). The router now only reads the log's
stored bytes (cheap, in C) and sends them here; this process, niced by `BUILD_NICENESS`, turns
them into the frames of the build stream, and takes what CPU the machine leaves.

The pipe between the two carries length-prefixed messages (`pipe.py`: sans-IO, testable without
a process):

    SETUP   JSON {"indexes": [{"name", "keys", "where"}], "batch_bytes", "batch_records"}
    CHUNKS  u32 n, n x chunk: u16 vbucket, u64 start, u64 end, u32 count,
                              count x (u64 seqno, u32 length, stored bytes)
    PIECES  u32 n, n x (u32 kept, u32 count, count x (u32 items, u32 length, frames))
            (the answer: each chunk's frames, in the order of the chunks)
    FAILED  UTF-8 text: why the chunks could not be encoded                 (the answer)

`BuildEncoder` is the router's side (trio), `main` the child's (blocking reads of stdin).
"""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from io import BufferedReader
from typing import BinaryIO

import trio

from indexer import protocol as p
from indexer.router.pipe import MessageReader, PipeError, encode_message
from indexer.router.streams.chunks import EncodedChunk, RawChunk, latest_documents, snapshot_frames
from indexer.router.streams.records import FeedError, RecordEncoder

BUILD_NICENESS = 10
"""How much lower than the router the encoder runs (os.nice): maintenance comes first."""

SETUP, CHUNKS, PIECES, FAILED = 1, 2, 3, 4
_CHUNK = struct.Struct(">HQQI")
_VERSION = struct.Struct(">QI")
_COUNT = struct.Struct(">I")
_PIECES = struct.Struct(">II")
_PIECE = struct.Struct(">II")


# A malformed message on the pipe (the name its users know).
EncoderError = PipeError


def encode_setup(
    indexes: Sequence[p.IndexDefinition],
    batch_bytes: int,
    batch_records: int,
    max_frame_bytes: int = p.DEFAULT_MAX_FRAME_BYTES,
) -> bytes:
    body = {
        "indexes": [{"name": i.name, "keys": list(i.keys), "where": i.where} for i in indexes],
        "batch_bytes": batch_bytes,
        "batch_records": batch_records,
        "max_frame_bytes": max_frame_bytes,
    }
    return encode_message(SETUP, json.dumps(body).encode())


def encode_chunks(chunks: Sequence[RawChunk]) -> bytes:
    parts = [_COUNT.pack(len(chunks))]
    for chunk in chunks:
        parts.append(_CHUNK.pack(chunk.vbucket, chunk.start, chunk.end, len(chunk.versions)))
        for seqno, value in chunk.versions:
            parts.append(_VERSION.pack(seqno, len(value)))
            parts.append(value)
    return encode_message(CHUNKS, b"".join(parts))


def decode_chunks(body: bytes) -> list[tuple[int, int, int, list[tuple[int, bytes]]]]:
    """(vbucket, start, end, [(seqno, stored bytes)]) of each chunk."""
    (n,) = _COUNT.unpack_from(body)
    at = _COUNT.size
    out = []
    for _ in range(n):
        vbucket, start, end, count = _CHUNK.unpack_from(body, at)
        at += _CHUNK.size
        versions = []
        for _ in range(count):
            seqno, length = _VERSION.unpack_from(body, at)
            at += _VERSION.size
            versions.append((seqno, body[at : at + length]))
            at += length
        out.append((vbucket, start, end, versions))
    if at != len(body):
        raise EncoderError("a CHUNKS message's chunks do not fill it")
    return out


Pieces = list[tuple[list[bytes], int]]
"""(frames, items) in the order to send them, as `chunks.snapshot_frames` gives them."""


def encode_pieces(encoded: Sequence[tuple[Pieces, int]]) -> bytes:
    parts = [_COUNT.pack(len(encoded))]
    for pieces, kept in encoded:
        parts.append(_PIECES.pack(kept, len(pieces)))
        for frames, items in pieces:
            blob = b"".join(frames)
            parts.append(_PIECE.pack(items, len(blob)))
            parts.append(blob)
    return encode_message(PIECES, b"".join(parts))


def decode_pieces(body: bytes) -> list[tuple[Pieces, int]]:
    """(pieces, kept) of each chunk."""
    (n,) = _COUNT.unpack_from(body)
    at = _COUNT.size
    out = []
    for _ in range(n):
        kept, count = _PIECES.unpack_from(body, at)
        at += _PIECES.size
        pieces: Pieces = []
        for _ in range(count):
            items, length = _PIECE.unpack_from(body, at)
            at += _PIECE.size
            pieces.append(([body[at : at + length]], items))
            at += length
        out.append((pieces, kept))
    if at != len(body):
        raise EncoderError("a PIECES message's frames do not fill it")
    return out


class ChunkEncoder:
    """The child's work (pure): stored versions in, the build stream's frames out."""

    def __init__(self, setup: bytes) -> None:
        body = json.loads(setup)
        indexes = [
            p.IndexDefinition(i["name"], tuple(i["keys"]), i["where"]) for i in body["indexes"]
        ]
        self.records = RecordEncoder(
            indexes, int(body.get("max_frame_bytes", p.DEFAULT_MAX_FRAME_BYTES))
        )
        self.batch_bytes = int(body["batch_bytes"])
        self.batch_records = int(body["batch_records"])

    def encode(self, body: bytes) -> bytes:
        """The PIECES answer to a CHUNKS message, or FAILED with the reason."""
        encoded = []
        try:
            for vbucket, start, end, stored in decode_chunks(body):
                kept = latest_documents(stored)
                pieces = snapshot_frames(
                    self.records, self.batch_bytes, self.batch_records, vbucket, start, end, kept
                )
                encoded.append((list(pieces), len(kept)))
        except FeedError as exc:
            return encode_message(FAILED, str(exc).encode())
        return encode_pieces(encoded)


def main(stdin: BufferedReader, stdout: BinaryIO) -> int:
    """The child: SETUP, then a PIECES or FAILED answer to each CHUNK, until stdin closes."""
    os.nice(BUILD_NICENESS)
    reader = MessageReader()
    encoder: ChunkEncoder | None = None
    while True:
        message = reader.next()
        if message is None:
            data = stdin.read1(1 << 20)
            if not data:
                return 0
            reader.feed(data)
            continue
        kind, body = message
        if kind == SETUP:
            encoder = ChunkEncoder(body)
        elif kind == CHUNKS and encoder is not None:
            stdout.write(encoder.encode(body))
            stdout.flush()
        else:
            raise EncoderError(f"message kind {kind} {'before SETUP' if encoder is None else ''}")


class BuildEncoder:
    """The router's side: a CHUNKS message out, its answer back, one exchange at a time."""

    def __init__(self, process: trio.Process) -> None:
        assert process.stdin is not None and process.stdout is not None
        self._stdin = process.stdin
        self._stdout = process.stdout
        self._reader = MessageReader()
        # The backfill task and the memory turns share the process: one exchange at a time.
        self._lock = trio.Lock()

    async def send(self, message: bytes) -> None:
        await self._stdin.send_all(message)

    async def encode(self, chunks: Sequence[RawChunk]) -> list[EncodedChunk]:
        """The chunks' frames, each document at its latest version in its chunk."""
        if not chunks:
            return []
        async with self._lock:
            await self._stdin.send_all(encode_chunks(chunks))
            while (message := self._reader.next()) is None:
                data = await self._stdout.receive_some(1 << 20)
                if not data:
                    raise FeedError("the build encoder process exited")
                self._reader.feed(data)
        kind, body = message
        if kind == FAILED:
            raise FeedError(body.decode())
        if kind != PIECES:
            raise EncoderError(f"the build encoder answered with message kind {kind}")
        return [
            EncodedChunk(c.vbucket, c.start, c.end, pieces, c.last, c.read, kept)
            for c, (pieces, kept) in zip(chunks, decode_pieces(body), strict=True)
        ]


@asynccontextmanager
async def build_encoder(
    indexes: Sequence[p.IndexDefinition],
    batch_bytes: int,
    batch_records: int,
    max_frame_bytes: int = p.DEFAULT_MAX_FRAME_BYTES,
) -> AsyncIterator[BuildEncoder]:
    """A running encoder process for a build stream's indexes, killed on leaving."""
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "indexer.router.streams.build_encoder"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        encoder = BuildEncoder(process)
        await encoder.send(encode_setup(indexes, batch_bytes, batch_records, max_frame_bytes))
        yield encoder
    finally:
        process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()


if __name__ == "__main__":
    # Documents left out of an index are logged here, on the router's stderr, in its format.
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    stdin = sys.stdin.buffer
    assert isinstance(stdin, BufferedReader)
    raise SystemExit(main(stdin, sys.stdout.buffer))
