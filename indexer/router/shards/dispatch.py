"""The parent's input: each line of a JSONL file or of the generated workload handed to the
shard of its document's vbucket, and where to resume the input after a restart (the earliest
shard's position)."""

from __future__ import annotations

import dataclasses
import logging
import os
import zlib
from collections.abc import Sequence
from itertools import islice
from pathlib import Path

import trio

from indexer.router.documents import LineSplitter, routing_id
from indexer.router.documents import encode_document as encode_line
from indexer.router.inputs.workload import Workload, generate, paced
from indexer.router.shards.layout import ShardLayout
from indexer.router.shards.messages import (
    InputPosition,
    LineBatch,
    encode_lines,
)
from indexer.router.shards.process import Shard
from indexer.router.source.appender import READ_BYTES

log = logging.getLogger("indexer.router")

POLL_S = 0.2


_ID_PREFIXES = (b'{"id":"', b'{"id": "')


def plain_ids(lines: Sequence[bytes]) -> list[bytes] | None:
    """The document ids of lines that all start the same way, {"id":"ID" or {"id": "ID", with
    no escape in ID and "id" once, found without a parse; None if any line does not (then
    each is read by `routing_id`)."""
    piece = b"\n".join(lines)
    n = len(lines)
    prefix = next((p for p in _ID_PREFIXES if piece.startswith(p)), None)
    if prefix is None or piece.count(b"\n" + prefix) != n - 1:
        return None
    if piece.count(b'"id"') != n:  # a second "id" in a line: JSON keeps the last one
        return None
    at = len(prefix)
    ids = [line[at : line.find(b'"', at)] for line in lines]
    if b"\\" in b"".join(ids):
        return None
    return ids


class LineRouter:
    """Lines of one input to their shards' messages: each piece of the input becomes one
    LINES message per shard (possibly empty: its position still moves)."""

    def __init__(self, layout: ShardLayout, shards: Sequence[Shard]) -> None:
        self.owners = layout.owners()
        self.num_vbuckets = layout.num_vbuckets
        self.shards = shards
        self._clear(InputPosition("", 0, 0))

    def _clear(self, start: InputPosition) -> None:
        self.start = start  # of the piece being gathered
        self.count = 0  # lines in it so far
        self.indexes: list[list[int]] = [[] for _ in self.shards]
        self.parts: list[list[bytes]] = [[] for _ in self.shards]

    def begin(self, key: str, offset: int, line: int) -> None:
        """Where the next piece starts (what comes before is sent or held)."""
        self._clear(InputPosition(key, offset, line))

    def add(self, lines: Sequence[bytes]) -> None:
        """Gather lines into the piece, each for the shard of its document (-1: blank)."""
        base = self.count
        indexes, parts = self.indexes, self.parts
        for j, shard in enumerate(self._shards_of(lines)):
            if shard >= 0:
                indexes[shard].append(base + j)
                parts[shard].append(lines[j])
        self.count += len(lines)

    def _shards_of(self, lines: Sequence[bytes]) -> list[int]:
        owners, n, crc32 = self.owners, self.num_vbuckets, zlib.crc32
        ids = plain_ids(lines) if lines else []
        if ids is not None:
            return [owners[crc32(docid) % n] for docid in ids]
        out = []
        for line in lines:
            if not line or line.isspace():
                out.append(-1)
                continue
            docid = routing_id(line)
            # A line without an id is bad: shard 0 parses it and reports why.
            out.append(0 if docid is None else owners[crc32(docid) % n])
        return out

    async def send(self, end: int, end_line: int) -> None:
        """Send every shard its lines of the piece, which ends at `end` after `end_line`."""
        start = self.start
        for shard, indexes, part in zip(self.shards, self.indexes, self.parts, strict=True):
            batch = LineBatch(start.key, start.offset, end, start.line, end_line, indexes, part)
            await shard.submit(encode_lines(batch))
        self._clear(InputPosition(start.key, end, end_line))

    async def drained(self) -> int:
        """Wait until every shard appended all it was sent; the documents they appended."""
        for shard in self.shards:
            await shard.drained()
        return sum(shard.appended for shard in self.shards)


def resume_point(
    shards: Sequence[Shard], base: str, size: int | None
) -> tuple[InputPosition, list[int]]:
    """Where to start reading the input `base`: the key to use (`base` and a generation) and
    the earliest position of any shard on that key (offset 0 for the start), and the later
    positions of the others, where pieces must be cut so each shard holds a piece whole.

    A generation counts the times a followed file was truncated; a position beyond the file's
    `size` means it was truncated while no router ran: a new generation, from the start.
    """
    generations = []
    for shard in shards:
        held = shard.position
        if held is not None and held.key.rsplit("|", 1)[0] == base:
            generations.append(int(held.key.rsplit("|", 1)[1]))
    generation = max(generations, default=0)
    key = f"{base}|{generation}"
    start = InputPosition(key, 0, 0)
    held_here = [s.position for s in shards if s.position is not None and s.position.key == key]
    if len(held_here) < len(shards):
        return start, sorted({p.offset for p in held_here if p.offset > 0})
    if size is not None and max(p.offset for p in held_here) > size:
        log.warning("%s is shorter than the shards hold: reading it from the start", base)
        return InputPosition(f"{base}|{generation + 1}", 0, 0), []
    earliest = min(held_here, key=lambda p: p.offset)
    return earliest, sorted({p.offset for p in held_here if p.offset > earliest.offset})


async def read_jsonl(path: Path, follow: bool, router: LineRouter, batch_bytes: int) -> None:
    """Hand the file's lines to the shards; with `follow`, keep reading what is appended."""
    info = await trio.to_thread.run_sync(os.stat, path)
    base = f"{path.resolve()}|{info.st_ino}"
    start, cuts = resume_point(router.shards, base, info.st_size)
    key = start.key
    generation = int(key.rsplit("|", 1)[1])
    splitter = LineSplitter(start.offset, start.line)
    router.begin(key, start.offset, start.line)
    if start.offset:
        log.info("%s: resuming at line %d (byte %d)", path, start.line + 1, start.offset)
    async with await trio.open_file(path, "rb") as f:
        await f.seek(start.offset)
        taken = 0
        while True:
            # A piece ends at the next shard's position, if any: that shard holds it up to
            # there and skips the piece whole.
            read_to = splitter.offset + len(splitter.partial)
            while cuts and cuts[0] <= read_to:  # inside a line (one without its newline yet)
                cuts.pop(0)
            data = await f.read(READ_BYTES if not cuts else min(READ_BYTES, cuts[0] - read_to))
            lines = splitter.feed(data) if data else ([] if follow else splitter.finish())
            router.add(lines)
            taken += len(data)
            at_cut = bool(cuts) and splitter.offset >= cuts[0]
            if at_cut:
                cuts.pop(0)
            if data and taken < batch_bytes and not at_cut:
                await trio.lowlevel.checkpoint()
                continue
            if taken or lines:
                await router.send(splitter.offset, splitter.line)
            taken = 0
            if data:
                continue
            if not follow:
                appended = await router.drained()
                log.info("read %d documents from %s", appended, path)
                return
            await trio.sleep(POLL_S)
            size = (await trio.to_thread.run_sync(os.stat, path)).st_size
            if size < splitter.offset:
                log.warning("%s was truncated: reading it again from the start", path)
                generation += 1
                key = f"{base}|{generation}"
                await f.seek(0)
                splitter = LineSplitter()
                router.begin(key, 0, 0)
                cuts = []


async def generate_lines(workload: Workload, rate: float | None, router: LineRouter) -> None:
    """Hand the workload's documents to the shards as input lines (numbered by document)."""
    base = "generated|" + ",".join(str(v) for v in dataclasses.astuple(workload))
    start, cuts = resume_point(router.shards, base, None)
    done = start.offset
    router.begin(start.key, done, done)
    async for batch in paced(islice(generate(workload), done, None), rate):
        while batch:
            # Pieces end where the shards stand too (see read_jsonl).
            size = len(batch) if not cuts else min(len(batch), cuts[0] - done)
            if cuts and done + size >= cuts[0]:
                cuts.pop(0)
            router.add([encode_line(d) for d in batch[:size]])
            done += size
            await router.send(done, done)
            batch = batch[size:]
    log.info("generated %d documents", await router.drained())


# ------------------------------------------------------------------------------------------
# The HTTP API: the shards' APIs behind one address
