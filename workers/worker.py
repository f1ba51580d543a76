"""A worker queue: copies mutations into slab chunks, orders them in a ring, flushes on demand.

Each worker owns the vbuckets v with v % workers == its number. Its intake task takes lists of
stream items from its channel in arrival order: a marker or a stream begin updates the vbucket's
high-water timestamp, a mutation batch is copied into the slab pool and pushed onto the ring and
then raises the HWT. The timekeeper later calls `flush(upto)`, which drains every queued entry at
or below `upto`, builds the WriteBatch straight from the slab and writes it in a thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import trio

from indexer.protocol import MutationBatch, SnapshotMarker, StreamBegin
from indexer.streams import IndexChange, StreamItem
from indexer.timestamps import HighWaterTimestamp
from slab import MutationRing, SlabPool
from workers.flush import BatchWrites, FlushResult, IndexWriter

log = logging.getLogger("indexer.worker")
STALL_LOG_INTERVAL_S = 10.0


@dataclass(frozen=True)
class WorkerStatistics:
    worker: int
    queued: int
    enqueued: int
    flushed: int
    flushes: int
    stalls: int
    blocked: bool
    write_errors: int  # failed store writes (a full disk), each retried
    write_failing: bool  # a flush's write is failing now: nothing more is acknowledged
    write_error: str | None  # the last write error


class Worker:
    """One worker queue: intake from a channel, a ring of slab chunks, flushes to the store."""

    def __init__(
        self,
        number: int,
        pool: SlabPool,
        ring: MutationRing,
        hwt: HighWaterTimestamp,
        writer: IndexWriter,
    ) -> None:
        self.number = number
        self.pool = pool
        self.ring = ring
        self.hwt = hwt
        self.writer = writer
        self.writes = BatchWrites(number)
        self.blocked = False
        self._enqueued = 0
        self._flushed = 0
        self._flushes = 0
        self._stalls = 0
        self._last_stall_log = -STALL_LOG_INTERVAL_S

    def _stalled(self, what: str) -> None:
        self.blocked = True
        self._stalls += 1
        now = time.monotonic()
        if now - self._last_stall_log >= STALL_LOG_INTERVAL_S:
            self._last_stall_log = now
            log.info("%s: worker %d waits, reads stall until a flush frees room", what, self.number)

    async def run(self, items: trio.MemoryReceiveChannel[list[StreamItem]]) -> None:
        """Take items until the channel closes (the dispatcher has drained)."""
        hwt = self.hwt
        async with items:
            async for batch in items:
                for item in batch:
                    if type(item) is MutationBatch:
                        await self._enqueue(item)
                    elif type(item) is SnapshotMarker:
                        hwt.record_marker(item.vbucket, item.start, item.end)
                    elif type(item) is StreamBegin:
                        hwt.record_begin(item.vbucket, item.vbuuid)
                    elif type(item) is IndexChange:
                        item.arrive()

    async def _enqueue(self, batch: MutationBatch) -> None:
        n = len(batch.seqnos)
        lengths = batch.lengths
        ring = self.ring
        if ring.free_slots() < n:
            self._stalled("queue ring full")
            await ring.wait_for_space(n)
        chunks = self.pool.try_alloc_many(lengths)
        if chunks is None:
            self._stalled("slab pool full")
            chunks = await self.pool.alloc_many(lengths)
        self.blocked = False
        self.pool.copy_in(chunks, batch.payload, batch.starts, lengths)
        ring.push_many(batch.vbucket, batch.seqnos, chunks, lengths)
        self.hwt.record_mutations(batch.vbucket, batch.seqnos[-1])
        self._enqueued += n

    async def flush(self, upto: Sequence[int]) -> FlushResult | None:
        """Write every queued mutation at or below `upto` to the store, then free its chunks."""
        vbuckets, _, chunks, lengths = self.ring.drain(upto)
        if not chunks:
            return None
        batch, result = self.writer.prepare(self.pool.records, chunks, vbuckets)
        await self.writes.write(self.writer.store, batch, len(chunks))
        self.pool.free_many(chunks, lengths)
        self._flushed += len(chunks)
        self._flushes += 1
        return result

    def statistics(self) -> WorkerStatistics:
        writes = self.writes.statistics()
        return WorkerStatistics(
            worker=self.number,
            queued=self.ring.queued,
            enqueued=self._enqueued,
            flushed=self._flushed,
            flushes=self._flushes,
            stalls=self._stalls,
            blocked=self.blocked,
            write_errors=writes.write_errors,
            write_failing=writes.write_failing,
            write_error=writes.write_error,
        )
