"""The one-shot feed's encoders (sans-IO): `StreamEncoder` numbers an input's documents per
vbucket (CRC32 of the id) in input order, so replaying the same input after a restart skips
exactly what the indexer reported as persisted; `LogEncoder` streams a router's source log with
its stored seqnos and vbuuids, and its failover logs in the handshake."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from indexer import protocol as p
from indexer.router.documents import Document, vbucket_of
from indexer.router.source.log import SourceLog
from indexer.router.streams.chunks import read_backfill_chunk, snapshot_frames
from indexer.router.streams.records import (
    BATCH_RECORDS,
    Batcher,
    FeedError,
    RecordEncoder,
    batch_bytes,
    default_vbuuid,
)

LOG_CHUNK_ITEMS = 2_048  # versions of one vbucket per snapshot of a log, as a router's backfill


class StreamEncoder:
    """Documents in, frames out (sans-IO): seqnos per vbucket in input order, those at or below
    the restart position skipped, batches per vbucket each after its snapshot marker.
    """

    def __init__(self, reply: p.HandshakeReply, batch_records: int = BATCH_RECORDS) -> None:
        self.num_vbuckets = reply.num_vbuckets
        self.records = RecordEncoder(reply.indexes, reply.max_frame_bytes)
        self.batches = Batcher(
            self.records.nkeys, batch_bytes(reply), default_vbuuid, batch_records
        )
        self.restart = [0] * reply.num_vbuckets
        for position in reply.restart:
            self.restart[position.vbucket] = position.seqno
        self.seqnos = [0] * reply.num_vbuckets
        self.sent = 0
        self.skipped = 0

    @property
    def begun(self) -> set[int]:
        return self.batches.begun

    def add(self, document: Document) -> list[bytes]:
        """Frames that are ready after this document (often none)."""
        docid = document.docid.encode()
        vb = vbucket_of(docid, self.num_vbuckets)
        seqno = self.seqnos[vb] + 1
        self.seqnos[vb] = seqno
        if seqno <= self.restart[vb]:
            self.skipped += 1
            return []
        record = self.records.record(seqno, document, docid)
        frames = self.batches.add(vb, seqno, record)
        self.sent += 1
        return frames

    def finish(self) -> list[bytes]:
        """Frames of every batch still pending."""
        return self.batches.finish()

    def frames(self, documents: Iterable[Document]) -> Iterator[tuple[list[bytes], int]]:
        """(frames ready, 1) per document, then (the pending batches, 0)."""
        add = self.add
        for document in documents:
            yield add(document), 1
        yield self.finish(), 0

    def targets(self) -> dict[int, int]:
        """Per vbucket streamed, the seqno an ack must reach for everything to be persisted."""
        return self.batches.targets()

    def ends(self) -> list[bytes]:
        return self.batches.ends()


class LogEncoder:
    """A source log's history after the restart positions in, frames out (no sockets).

    Each vbucket goes in snapshots of up to `chunk_items` versions read from the log, each
    document once at its latest version in the snapshot: the router's backfill path
    (`chunks.read_backfill_chunk`, `chunks.snapshot_frames`). Vbuckets take turns, one snapshot
    each, so the indexer's workers share the load. A restart position beyond the log's high
    seqno means the indexer holds history this log does not have (and did not roll back): an
    error.
    """

    def __init__(
        self,
        reply: p.HandshakeReply,
        log: SourceLog,
        batch_records: int = BATCH_RECORDS,
        chunk_items: int = LOG_CHUNK_ITEMS,
    ) -> None:
        self.log = log
        self.records = RecordEncoder(reply.indexes, reply.max_frame_bytes)
        self.batch_bytes = batch_bytes(reply)
        self.batch_records = batch_records
        self.chunk_items = chunk_items
        restart = {position.vbucket: position.seqno for position in reply.restart}
        self.restart = restart
        # Per vbucket with something to send: the last seqno taken so far, and the high seqno.
        self.positions: dict[int, int] = {}
        self.highs: dict[int, int] = {}
        self.last: dict[int, int] = {}  # per vbucket begun, the end of its last snapshot
        self.begun: set[int] = set()
        self.sent = 0  # versions the snapshots sent cover
        self.superseded = 0  # of them, left out for a later version in the same snapshot
        self.skipped = 0
        for vb in log.vbuckets_with_history():
            high = log.high_seqno(vb)
            seqno = restart.get(vb, 0)
            if seqno > high:
                raise FeedError(
                    f"vbucket {vb}: the indexer holds seqno {seqno} but the source log ends at"
                    f" {high}: it has history this log does not (and did not roll back)"
                )
            self.skipped += seqno
            if seqno < high:
                self.positions[vb] = seqno
                self.highs[vb] = high

    def frames(self) -> Iterator[tuple[list[bytes], int]]:
        """(frames, versions they cover) per snapshot, until every vbucket is sent."""
        while self.positions:
            for vb in list(self.positions):
                chunk = read_backfill_chunk(
                    self.log, vb, self.positions[vb], self.highs[vb], self.chunk_items
                )
                frames: list[bytes] = []
                if vb not in self.begun:
                    self.begun.add(vb)
                    frames.append(p.encode(p.StreamBegin(vb, self.log.vbuuid(vb))))
                for piece, _ in snapshot_frames(
                    self.records,
                    self.batch_bytes,
                    self.batch_records,
                    vb,
                    chunk.start,
                    chunk.end,
                    chunk.versions,
                ):
                    frames += piece
                self.positions[vb] = self.last[vb] = chunk.end
                if chunk.last or not chunk.read:
                    del self.positions[vb]
                self.sent += chunk.read
                self.superseded += chunk.read - len(chunk.versions)
                yield frames, chunk.read

    def pending(self) -> int:
        """Mutations still to send (as the log stood when last looked at)."""
        return sum(self.highs[vb] - seqno for vb, seqno in self.positions.items())

    def extend(self) -> None:
        """Queue what was appended to the log since: the next `frames()` send it (a live tail).

        A vbucket first used after the handshake, where the indexer holds a higher seqno than
        the log, is an error: a new handshake carries its failover log and settles it.
        """
        for vb in self.log.vbuckets_with_history():
            high = self.log.high_seqno(vb)
            done = self.positions.get(vb, self.last.get(vb, self.restart.get(vb, 0)))
            if done > high:
                raise FeedError(
                    f"vbucket {vb}: the indexer holds seqno {done} but the source log ends at"
                    f" {high}: reconnecting to compare histories"
                )
            if done < high:
                self.positions[vb] = done
                self.highs[vb] = high

    def targets(self) -> dict[int, int]:
        """Per vbucket streamed, the seqno an ack must reach for everything to be persisted."""
        return {vb: self.last[vb] for vb in self.begun}

    def ends(self) -> list[bytes]:
        """STREAM_END of every vbucket begun."""
        return [p.encode(p.StreamEnd(vb, self.log.vbuuid(vb))) for vb in sorted(self.begun)]
