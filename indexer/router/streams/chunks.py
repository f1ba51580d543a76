"""Chunks of the router's source log for a stream, and the frames of a snapshot (pure).

A chunk is one vbucket's versions after a seqno, read in a worker thread: parsed
(`BackfillChunk`, for streams encoded in the router) or as stored (`RawChunk`, for a build's
encoder process, indexer/router/streams/build_encoder.py). Either is sent as one snapshot with each
document once, at its latest version in the chunk's range.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import closing
from dataclasses import dataclass
from itertools import islice, takewhile
from typing import TypeVar

from indexer.router.documents import Document, decode_document
from indexer.router.source.log import SourceLog
from indexer.router.source.mutations import Backfill
from indexer.router.streams.records import snapshot_frames as snapshot_frames


@dataclass(frozen=True, slots=True)
class BackfillChunk:
    """Source-log versions of one vbucket, as one snapshot start..end: the latest version of
    each docid written in that range (the one at `end` among them), in seqno order.

    `read`: the versions read from the log, superseded ones included.
    `last`: the backfill reached the seqno it was asked to reach.
    """

    vbucket: int
    start: int
    end: int
    versions: list[tuple[int, Document]]
    last: bool
    read: int


def latest_versions(versions: list[tuple[int, Document]]) -> list[tuple[int, Document]]:
    """Each docid's latest of `versions` (in seqno order), in seqno order.

    A snapshot is consistent only at its end, so a version superseded inside it need not be
    sent: as a disk backfill of DCP sends each key once, a build over a log that rewrote its
    documents many times carries each document once per chunk.
    """
    latest = {document.docid: i for i, (_, document) in enumerate(versions)}
    if len(latest) == len(versions):
        return versions
    return [versions[i] for i in sorted(latest.values())]


@dataclass(frozen=True, slots=True)
class RawChunk:
    """Like `BackfillChunk`, with every version read as the log stores it (unparsed, so
    superseded ones are still there: the encoder process leaves them out)."""

    vbucket: int
    start: int
    end: int
    versions: list[tuple[int, bytes]]
    last: bool
    read: int


def read_raw_chunk(
    source: SourceLog, vbucket: int, after: int, until: int, max_items: int
) -> RawChunk:
    """The log's versions of `vbucket` after `after` as stored, at most `max_items`, none above
    `until` (blocking: run it in a worker thread)."""
    with closing(source.read_stored(vbucket, after)) as versions:
        taken = list(islice(takewhile(lambda v: v[0] <= until, versions), max_items))
    # Fewer than asked for: the log has nothing more up to `until`.
    end = taken[-1][0] if len(taken) == max_items else until
    return RawChunk(vbucket, after + 1, end, taken, end >= until, len(taken))


def latest_documents(stored: Sequence[tuple[int, bytes]]) -> list[tuple[int, Document]]:
    """Stored versions (in seqno order) parsed, each docid's latest only (`latest_versions`)."""
    return latest_versions([(seqno, decode_document(value)) for seqno, value in stored])


def read_backfill_chunk(
    source: SourceLog, vbucket: int, after: int, until: int, max_items: int
) -> BackfillChunk:
    """`read_raw_chunk`'s versions parsed, superseded ones left out (blocking: run it in a
    worker thread)."""
    raw = read_raw_chunk(source, vbucket, after, until, max_items)
    return BackfillChunk(
        vbucket, raw.start, raw.end, latest_documents(raw.versions), raw.last, raw.read
    )


@dataclass(frozen=True, slots=True)
class EncodedChunk:
    """A `RawChunk` as its encoder process sent it back: the snapshot's (frames, items), in
    order, carrying `kept` of the `read` versions."""

    vbucket: int
    start: int
    end: int
    pieces: list[tuple[list[bytes], int]]
    last: bool
    read: int
    kept: int


ChunkT = TypeVar("ChunkT", BackfillChunk, RawChunk)


def read_chunks(
    read_one: Callable[[SourceLog, int, int, int, int], ChunkT],
    source: SourceLog,
    wanted: Sequence[tuple[Backfill, int]],
    max_items: int,
) -> list[ChunkT]:
    """One chunk for each (backfill, reached so far), in order, until `max_items` versions are
    read in all (blocking: one worker-thread call serves many vbuckets)."""
    out = []
    budget = max_items
    for backfill, after in wanted:
        if budget <= 0:
            break
        chunk = read_one(source, backfill.vbucket, after, backfill.until, budget)
        out.append(chunk)
        budget -= max(chunk.read, 1)
    return out


def read_backfill_chunks(
    source: SourceLog, wanted: Sequence[tuple[Backfill, int]], max_items: int
) -> list[BackfillChunk]:
    """`read_chunks` of parsed versions."""
    return read_chunks(read_backfill_chunk, source, wanted, max_items)
