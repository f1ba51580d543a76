"""The initial build of indexes created over data already streamed: their own stream and writer.

Like Couchbase's INIT_STREAM beside MAINT_STREAM. A router opens a build stream for the build
(HANDSHAKE with `build`, the build's name), which carries the keys of its indexes only, from
seqno 0 (the router reads its source log, then memory) and follows the router live. A build
holds one index (one created over data) or several (deferred indexes built together, as GSI's
`BUILD INDEX` does): one pass over the router's history fills them all. The build has its own
stream registry (what it has received), its own bounded channel, and its own writer and
back-index cache (a column per index), so the maintenance stream keeps the active indexes
current meanwhile and never waits for it. Every flush writes the entries and the build's
progress (under each of its indexes) in one WriteBatch: a daemon killed during a build resumes
from its progress. Once the build has caught up with what the maintenance stream has received,
the catalog merges it (`IndexCatalog.merge_build`) in band: maintenance records have carried
its indexes' keys since the build started, unwritten; maintenance's flushes stop at the
timestamp M written so far, the build goes on until it has completed a snapshot reaching M in
every vbucket, and maintenance writes the indexes' keys from the records after M. Nothing is
lost, and no router reconnects. What the build applied past M (the rest of those snapshots)
maintenance applies again, in seqno order, with the same keys, which ends in the same entries.

The build's queued records live in the daemon's slab pool like the maintenance stream's, within
a share of it (`BuildShare`) that all builds hold together: a build takes chunks only when the
pool has them free and never queues for them, so maintenance never waits behind a build.

Progress is measured by whole snapshots: the router de-duplicates a document's versions inside
a snapshot, so a given seqno may never arrive, but after a snapshot's last item the build holds
every document's latest version as of the snapshot's end.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import trio

from indexer import protocol as p
from indexer.storage import IndexStore, StoredIndex
from indexer.streams import StreamRegistry
from slab import SlabPool
from workers.flush import BackIndexCache, IndexWriter, entry_counts

log = logging.getLogger("indexer.build")

BUILD_CHANNEL_BATCHES = 8
"""Lists of frames queued between a build connection and its writer: TCP pushes back beyond."""

BUILD_POOL_SHARE = 0.25
"""The part of the slab pool that builds' queued records may hold together."""

SHARE_RETRY_S = 0.01
"""How often a build waiting for slab chunks looks again (it never queues in the pool)."""

FLUSH_RECORDS = 2_048
"""Records of one build flush at most: its WriteBatch is prepared on the event loop, and a
larger one would hold maintenance's flushes and acks back that much longer."""

CATCHUP_SLACK = 2_000
"""The build is in catch-up (and merged) once it trails maintenance by this many seqnos."""

CHECK_S = 0.1
"""How often an idle build looks whether maintenance moved ahead or it can merge."""

_PROGRESS = b"\x00build:"


def progress_key(index: StoredIndex) -> bytes:
    """The store key of an index's build progress (its seqno per vbucket)."""
    return _PROGRESS + struct.pack(">H", index.index_id)


def read_progress(store: IndexStore, index: StoredIndex, num_vbuckets: int) -> list[int]:
    """The build's persisted progress, or zeros when it has not written yet."""
    raw = store.get(progress_key(index))
    if raw is None or len(raw) != 8 * num_vbuckets:
        return [0] * num_vbuckets
    return list(struct.unpack(f">{num_vbuckets}Q", raw))


def forget_progress(store: IndexStore, indexes: Sequence[StoredIndex]) -> None:
    """The indexes' builds ended (merged or dropped): their progress records go (blocking)."""
    store.write((), [progress_key(index) for index in indexes])


def stream_name(names: Sequence[str]) -> str:
    """The name of the build stream carrying these indexes' keys (`Handshake.build`): their
    names joined by commas, which no index name holds."""
    return ",".join(names)


def resumed_builds(progress: Mapping[str, Sequence[int]]) -> list[list[str]]:
    """The builds to resume at start-up, as lists of index names, from each index's progress.

    A build writes the progress of all its indexes in every flush, so the indexes of one build
    have equal progress and are resumed as one build again, on one stream; indexes that had not
    written yet (all zeros) start together too. Other indexes resume on their own streams.
    """
    groups: dict[tuple[int, ...], list[str]] = {}
    for name, seqnos in progress.items():
        groups.setdefault(tuple(seqnos), []).append(name)
    return list(groups.values())


@dataclass(frozen=True)
class BuildStatus:
    """What `/stats` and `/indexes` show of a build; `indexes` are those built together."""

    state: str
    items: int
    percent: float
    received_seqno_sum: int
    target_seqno_sum: int
    queued_records: int
    slab_bytes: int
    indexes: tuple[str, ...] = ()


class BuildShare:
    """The builds' share of the slab pool: chunks taken only when free and within the share.

    A build waiting here holds back its connection's reader, and TCP pushes back on the
    router's build stream; the pool's own FIFO waiters (maintenance) are never overtaken by a
    waiting build, since it only ever tries.
    """

    def __init__(self, pool: SlabPool, share: float = BUILD_POOL_SHARE) -> None:
        self.pool = pool
        self.limit = max(int(pool.statistics().total_bytes * share), pool.max_record)
        self.used = 0  # payload bytes the builds' queued records hold
        self.waits = 0

    async def alloc(self, lengths: Sequence[int]) -> list[int]:
        """Chunks for records of these lengths, once the pool has them and the share allows."""
        need = sum(lengths)
        waited = False
        while True:
            if self.used == 0 or self.used + need <= self.limit:
                chunks = self.pool.try_alloc_many(lengths)
                if chunks is not None:
                    self.used += need
                    return chunks
            if not waited:
                self.waits += 1
                waited = True
            await trio.sleep(SHARE_RETRY_S)

    def free(self, chunks: Sequence[int], lengths: Sequence[int]) -> None:
        self.pool.free_many(chunks, lengths)
        self.used -= sum(lengths)


@dataclass(frozen=True, slots=True)
class QueuedBatch:
    """A build stream's mutation batch, its records copied into slab chunks."""

    vbucket: int
    chunks: list[int]
    lengths: list[int]
    last_seqno: int


class IndexBuild:
    """The initial build of one or more indexes: one stream registry, channel, writer and
    back-index cache with a column per index (see module doc)."""

    def __init__(
        self,
        store: IndexStore,
        indexes: Sequence[StoredIndex],
        owned: Sequence[int],
        maintenance: StreamRegistry,
        cache_capacity: int,
        share: BuildShare,
        defer: Callable[[], bool] | None = None,
        cache: BackIndexCache | None = None,
    ) -> None:
        """`cache`, when given, holds the store's back index of `indexes` already (what a build
        that lost one of its indexes leaves to the rest); else it is loaded (blocking)."""
        self.store = store
        self.share = share
        # True while the maintenance stream has a backlog: the build waits (it never comes
        # first); its channel fills and TCP pushes back on the router's build stream.
        self.defer = defer
        self.indexes = tuple(indexes)
        self.names = tuple(i.definition.name for i in self.indexes)
        self.maintenance = maintenance
        n = len(maintenance.received)
        # Equal for the indexes of one build; the lowest is safe whatever happened before,
        # since applying a document's later versions again converges.
        found = [read_progress(store, index, n) for index in self.indexes]
        self.progress = [min(seqnos) for seqnos in zip(*found, strict=True)]
        self.registry = StreamRegistry(owned, self.progress)
        if cache is None:
            cache = BackIndexCache(cache_capacity, len(self.indexes))
            cache.load(store, self.indexes)
        self.cache = cache
        self.writer = IndexWriter(store, self.indexes, self.cache)
        self._send, self._receive = trio.open_memory_channel[list[QueuedBatch | p.SnapshotMarker]](
            BUILD_CHANNEL_BATCHES
        )
        self.queued_records = 0
        self.slab_bytes = 0
        self.closed = False
        # Per vbucket: the end of the snapshot being received, and the end of the last one
        # received whole and written (what the build covers).
        self._snapshot_end = [0] * n
        self.covered = list(self.progress)
        self.state = "building"
        self.items = 0
        self.entries = entry_counts(store, self.indexes, self.cache)  # per index
        self._moved = trio.Event()
        self._reported = False
        self.stopped = trio.Event()  # set when its writer task has ended (catalog._run_build)

    @property
    def name(self) -> str:
        """The build stream's name: its indexes' names (`stream_name`)."""
        return stream_name(self.names)

    def index(self, name: str) -> StoredIndex:
        """The index of this build named `name`."""
        return self.indexes[self.names.index(name)]

    def status(self) -> BuildStatus:
        received = sum(self.progress)
        target = sum(self.maintenance.received)
        percent = 100.0 if target <= 0 else min(100.0, 100.0 * received / target)
        return BuildStatus(
            self.state,
            self.items,
            round(percent, 1),
            received,
            target,
            self.queued_records,
            self.slab_bytes,
            self.names,
        )

    async def accept(self, items: Sequence[p.MutationBatch | p.SnapshotMarker]) -> None:
        """Queue what the build stream delivered: records into the builds' slab share."""
        queued: list[QueuedBatch | p.SnapshotMarker] = []
        try:
            for item in items:
                if type(item) is p.SnapshotMarker:
                    queued.append(item)
                    continue
                assert type(item) is p.MutationBatch
                lengths = list(item.lengths)
                chunks = await self.share.alloc(lengths)
                queued.append(QueuedBatch(item.vbucket, chunks, lengths, item.seqnos[-1]))
                self.share.pool.copy_in(chunks, item.payload, item.starts, lengths)
                self._count(lengths, 1)
            if not self.closed:
                await self._send.send(queued)
                return
        except BaseException:
            self._free(queued)
            raise
        self._free(queued)  # the build ended meanwhile

    def _count(self, lengths: Sequence[int], sign: int) -> None:
        self.queued_records += sign * len(lengths)
        self.slab_bytes += sign * sum(lengths)

    def _free(self, items: Sequence[QueuedBatch | p.SnapshotMarker]) -> None:
        for item in items:
            if type(item) is QueuedBatch:
                self.share.free(item.chunks, item.lengths)
                self._count(item.lengths, -1)

    def release(self) -> None:
        """The build ended (merged, dropped or restarted): free the chunks still queued."""
        self.closed = True
        while True:
            try:
                self._free(self._receive.receive_nowait())
            except trio.WouldBlock:
                return

    def behind(self) -> int:
        """Seqnos the build trails maintenance by, over the owned vbuckets."""
        owned = self.maintenance.owned
        return sum(
            max(m - b, 0)
            for vb, (m, b) in enumerate(zip(self.maintenance.received, self.progress, strict=True))
            if owned[vb]
        )

    def reached(self, upto: Sequence[int]) -> bool:
        """Whether the build holds every document's latest version as of `upto` (or later)."""
        owned = self.maintenance.owned
        pairs = enumerate(zip(self.covered, upto, strict=True))
        return all(b >= u for vb, (b, u) in pairs if owned[vb])

    async def wait_moved(self) -> None:
        await self._moved.wait()

    def rearm(self) -> None:
        """A merge was given up: report catching up again when it next does."""
        self.state = "building"
        self._reported = False

    async def run(self, on_caught_up: trio.MemorySendChannel[IndexBuild]) -> None:
        """Write what the build stream delivers until cancelled; report catching up (once until
        `rearm`)."""
        self._reported = False
        while True:
            items: list[QueuedBatch | p.SnapshotMarker] = []
            with trio.move_on_after(CHECK_S):
                items.extend(await self._receive.receive())
            start = 0
            try:
                while start < len(items):
                    stop = _piece_end(items, start, FLUSH_RECORDS)
                    piece, start = items[start:stop], stop
                    await self._flush(piece)  # it frees the piece, written or not
            except BaseException:
                self._free(items[start:])  # stopped: what was not flushed leaves the pool
                raise
            if not self._reported and self.behind() <= CATCHUP_SLACK:
                self.state = "catchup"
                self._reported = True
                await on_caught_up.send(self)

    async def _flush(self, items: list[QueuedBatch | p.SnapshotMarker]) -> None:
        """Write the items (after maintenance's backlog is gone) and free their chunks."""
        try:
            while self.defer is not None and self.defer():
                await trio.sleep(CHECK_S / 10)
            chunks: list[int] = []
            progress = list(self.progress)
            ends = self._snapshot_end
            for item in items:
                vb = item.vbucket
                if type(item) is p.SnapshotMarker:
                    ends[vb] = item.end
                    continue
                assert type(item) is QueuedBatch
                chunks.extend(item.chunks)
                progress[vb] = max(progress[vb], item.last_seqno)
            if chunks:
                write, result = self.writer.prepare(self.share.pool.records, chunks)
                packed = struct.pack(f">{len(progress)}Q", *progress)
                for index in self.indexes:
                    write.put(progress_key(index), packed)
                # The cache already holds these keys: the batch must land once prepared, or a
                # merge would hand maintenance a back index naming entries never written.
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(write.write)
                self.items += result.mutations
                for j, delta in enumerate(result.entry_deltas):
                    self.entries[j] += delta
        finally:
            self._free(items)  # written, or the build was stopped
        self.progress[:] = progress
        for vb, end in enumerate(ends):
            if progress[vb] >= end > self.covered[vb]:  # the snapshot's last item is written
                self.covered[vb] = end
        self._moved.set()
        self._moved = trio.Event()

    def forget(self) -> None:
        """The build ended (merged or dropped): its progress records go (blocking)."""
        forget_progress(self.store, self.indexes)


def _piece_end(items: Sequence[QueuedBatch | p.SnapshotMarker], start: int, records: int) -> int:
    """The end of the piece of `items` from `start` holding about `records` records: whole
    batches, at least one."""
    count = 0
    for i in range(start, len(items)):
        item = items[i]
        if type(item) is QueuedBatch:
            if count and count + len(item.chunks) > records:
                return i
            count += len(item.chunks)
    return len(items)
