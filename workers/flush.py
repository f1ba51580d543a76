"""The flush: queued mutation records -> main and back index changes -> one LevelDB WriteBatch.

Follows Couchbase's slice writer: per document, the back index gives the keys it is indexed
under now; an unchanged key is skipped, a changed one deletes the old main entry and writes the
new one, a delete removes both. Superseded mutations of a document inside the flushed range are
skipped: only its last one is written.

A failed write (a full disk) keeps its batch and is retried with backoff (`BatchWrites`).

The back index is read from memory (`BackIndexCache`), not from LevelDB per mutation: while the
whole back index fits in the cache, a miss means "not indexed"; beyond that, misses are read
from the store in key order in the flush thread.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain, islice
from pathlib import Path
from typing import Any

import trio

from indexer.changes import encode_group, history_key
from indexer.keys import entry_tail
from indexer.protocol import OP_DELETE, queued_layout
from indexer.recovery import UndoLog, encode_undo
from indexer.storage import IndexStore, StoredIndex, StoreWriteError, describe

Keys = tuple[bytes, ...]

log = logging.getLogger("indexer.flush")


class BackIndexCache:
    """docid -> the encoded key under every index, shared by all workers.

    `complete` is True while the cache holds the entire back index, so a miss means the document
    is in no index. Once it would exceed `capacity`, the oldest half is evicted and misses are
    looked up in the store.
    """

    def __init__(self, capacity: int, nindexes: int) -> None:
        self.capacity = capacity
        self.nindexes = nindexes
        self.entries: dict[bytes, Keys] = {}
        self.complete = True
        # The documents written while a `BuiltIndexMerge` is being prepared, or None.
        self.recording: set[bytes] | None = None

    def load(self, store: IndexStore, indexes: Sequence[StoredIndex]) -> None:
        """Fill from the store's back index; stays complete only if everything fits."""
        self.complete = True
        empty = (b"",) * self.nindexes
        entries: dict[bytes, list[bytes]] = {}
        for j, index in enumerate(indexes):
            for docid, key in store.back_entries(index):
                keys = entries.get(docid)
                if keys is None:
                    if len(entries) >= self.capacity:
                        self.complete = False
                        break
                    keys = entries[docid] = list(empty)
                keys[j] = key
        self.entries = {docid: tuple(keys) for docid, keys in entries.items()}

    def add_index(self) -> None:
        """A new last index: no document is in it yet."""
        self.nindexes += 1
        self.entries = {docid: (*keys, b"") for docid, keys in self.entries.items()}

    def add_built_index(self, built: BackIndexCache, merge: BuiltIndexMerge | None = None) -> None:
        """New last indexes that were built on their own (one build, one or more indexes):
        their keys come from the build's cache, a column per index.

        With a `merge` prepared beforehand (`BuiltIndexMerge`), only the documents either cache
        changed since it started are widened here, so the pipeline stops for as long as those
        take, not for the whole cache.
        """
        if merge is None or not merge.valid(self, built):
            if merge is not None:
                merge.abandon()
            merge = BuiltIndexMerge(self, built)
        merge.finish()

    def forget(self, docids: Iterable[bytes]) -> None:
        """Documents no index holds any more (their vbuckets left this node)."""
        entries = self.entries
        recording = self.recording
        for docid in docids:
            entries.pop(docid, None)
            if recording is not None:
                recording.add(docid)

    def remove_index(self, position: int) -> None:
        """Forget the keys of the index at `position`."""
        self.nindexes -= 1
        self.entries = {
            docid: keys[:position] + keys[position + 1 :] for docid, keys in self.entries.items()
        }

    def trim(self) -> None:
        """Evict the oldest half once over capacity."""
        if len(self.entries) <= self.capacity:
            return
        excess = len(self.entries) - self.capacity // 2
        for docid in list(islice(self.entries, excess)):
            del self.entries[docid]
        self.complete = False


class BuiltIndexMerge:
    """The maintenance cache widened by a build's columns (one per index it built), prepared a
    slice at a time while maintenance and the build go on writing, so that the merge itself only
    redoes the documents written meanwhile (a whole cache of 333k documents took 0.5 s of a
    stopped pipeline).

    Both caches record the documents their writers touch from the start; `finish` recomputes
    those from the caches as they are then, and swaps the widened entries in. A document the
    build's partial cache does not hold is left out (its keys are read from the store), and one
    only the build holds is added only while the maintenance cache is complete.
    """

    def __init__(self, main: BackIndexCache, built: BackIndexCache) -> None:
        self.main = main
        self.built = built
        self._base = main.entries
        self._nindexes = main.nindexes
        self._empty: Keys = (b"",) * main.nindexes
        self.widened: dict[bytes, Keys] = {}
        self.slice_docs = 2048  # between two looks at the clock
        self._recorded = main.recording = set()
        self._built_recorded = built.recording = set()
        main_entries = main.entries
        # Every document of the maintenance cache, then those only the build holds.
        self._todo: Iterator[bytes] = chain(
            list(main_entries), (d for d in list(built.entries) if d not in main_entries)
        )

    def valid(self, main: BackIndexCache, built: BackIndexCache) -> bool:
        """Whether it still describes these caches (a rollback reloads the maintenance one)."""
        return (
            main is self.main
            and built is self.built
            and main.entries is self._base
            and main.nindexes == self._nindexes
            and main.recording is self._recorded
            and built.recording is self._built_recorded
        )

    def _widen(self, docid: bytes) -> Keys | None:
        """The document's keys under every index and the built ones, or None if not to cache."""
        keys = self.main.entries.get(docid)
        built = self.built.entries.get(docid)
        if built is None and not self.built.complete:
            return None  # its keys in the built indexes are unknown: read from the store later
        if built is None:
            built = (b"",) * self.built.nindexes
        if keys is None:
            if not self.main.complete or not any(built):
                return None  # unknown to a partial cache, or in no index at all
            keys = self._empty
        return (*keys, *built)

    def step(self, budget_s: float | None) -> bool:
        """Widen documents for about `budget_s` seconds (None: all); whether any are left."""
        deadline = None if budget_s is None else time.perf_counter() + budget_s
        widened = self.widened
        widen = self._widen
        size = self.slice_docs
        while True:
            done = 0
            for docid in islice(self._todo, size):
                done += 1
                value = widen(docid)
                if value is not None:
                    widened[docid] = value
            if done < size:
                return False
            if deadline is not None and time.perf_counter() >= deadline:
                return True

    def finish(self) -> None:
        """Widen what was written meanwhile and make the merged entries the cache's."""
        self.step(None)
        main, built = self.main, self.built
        widened = self.widened
        for docid in self._recorded | self._built_recorded:
            value = self._widen(docid)
            if value is None:
                widened.pop(docid, None)
            else:
                widened[docid] = value
        main.entries = widened
        main.nindexes += built.nindexes
        main.complete = main.complete and built.complete
        main.recording = built.recording = None
        main.trim()

    def abandon(self) -> None:
        """Stop recording: the merge will not happen (given up, dropped, or stale)."""
        if self.main.recording is self._recorded:
            self.main.recording = None
        if self.built.recording is self._built_recorded:
            self.built.recording = None


def entry_counts(
    store: IndexStore, indexes: Sequence[StoredIndex], cache: BackIndexCache
) -> list[int]:
    """Entries per index: from a complete cache, else a walk of the main entries (blocking)."""
    if not cache.complete:
        return [store.count_main(index) for index in indexes]
    counts = [0] * len(indexes)
    for keys in cache.entries.values():
        for j, key in enumerate(keys):
            if key:
                counts[j] += 1
    for j, index in enumerate(indexes):
        if index.array:  # several entries per document
            counts[j] = sum(len(index.entry_keys(keys[j])) for keys in cache.entries.values())
    return counts


@dataclass(frozen=True)
class FlushResult:
    """What one flush did: mutations taken, documents written, LevelDB operations."""

    mutations: int
    documents: int
    puts: int
    deletes: int
    entry_deltas: tuple[int, ...]


class IndexWriter:
    """Turns a list of queued records into one WriteBatch; one writer per worker."""

    def __init__(
        self,
        store: IndexStore,
        indexes: Sequence[StoredIndex],
        cache: BackIndexCache,
        undo: UndoLog | None = None,
        record_indexes: Sequence[str] | None = None,
        history: bool = False,
    ):
        """`record_indexes` names the indexes whose keys records carry, in order (by default
        `indexes`): records also carry the keys of indexes still being built, which this
        writer skips (indexer/build.py). With `history`, the documents changed in each vbucket
        also get a change-history record in the same batch (indexer/changes.py): maintenance writers
        only, never a build's (its records would take the keys of maintenance's)."""
        self.store = store
        self.history = history
        self.indexes = tuple(indexes)
        # Without an undo log (tests, tools) nothing can be rolled back past the store's state.
        self.undo = undo if undo is not None else UndoLog(0, enabled=False)
        self.nindexes = len(indexes)
        self.main_prefixes = [i.main_prefix for i in indexes]
        self.arrays = [i.array for i in indexes]
        self.back_prefixes = [i.back_prefix for i in indexes]
        self.cache = cache
        names = [i.definition.name for i in indexes]
        carried = names if record_indexes is None else list(record_indexes)
        self.layout = queued_layout(len(carried))
        # Where each written index's key sits in a record; None when they are the same list.
        positions = tuple(carried.index(name) for name in names)
        self.positions = None if positions == tuple(range(len(carried))) else positions

    def _old_keys(self, docids: list[bytes]) -> dict[bytes, Keys]:
        """Back-index entries of documents the cache does not hold, read in key order."""
        found: dict[bytes, Keys] = {}
        get = self.store.get
        for docid in sorted(docids):
            found[docid] = tuple(get(p + docid) or b"" for p in self.back_prefixes)
        return found

    def prepare(
        self, records: memoryview, chunks: Sequence[int], vbuckets: Sequence[int] = ()
    ) -> tuple[Any, FlushResult]:
        """The WriteBatch applying the queued records at offsets `chunks` of `records`, of
        `vbuckets` (parallel to `chunks`; needed for the change history).

        Call it on the event loop and only `write()` the batch in a thread: plyvel releases the
        GIL on every WriteBatch.put, so a batch built in a thread while the loop runs Python
        waits for the GIL at every put (measured: 50k puts 7 ms alone, 0.9 s beside a busy
        thread).
        """
        layout = self.layout
        unpack = layout.unpack_from
        head = layout.size
        # docid -> (offset, head) of its last record; a document's records come in seqno order.
        latest: dict[bytes, tuple[int, tuple[int, ...]]] = {}
        for c in chunks:
            fields = unpack(records, c)
            latest[records[c + head : c + head + fields[2]].tobytes()] = (c, fields)
        history = self.history
        vbucket_of: dict[int, int] = {}
        if history:
            if len(vbuckets) != len(chunks):
                raise ValueError("the change history needs the vbucket of every record")
            vbucket_of = dict(zip(chunks, vbuckets, strict=True))
        changes_by_vbucket: dict[int, list[Any]] = {}
        ids = tuple(index.index_id for index in self.indexes)
        cache = self.cache
        if cache.recording is not None:
            cache.recording.update(latest)
        entries = cache.entries
        empty: Keys = (b"",) * self.nindexes
        looked_up: dict[bytes, Keys] = {}
        if not cache.complete:
            looked_up = self._old_keys([d for d in latest if d not in entries])
        deltas = [0] * self.nindexes
        puts = deletes = 0
        main_prefixes = self.main_prefixes
        back_prefixes = self.back_prefixes
        arrays = self.arrays
        indexes = range(self.nindexes)
        positions = self.positions
        undo = self.undo
        record_undo = undo.enabled
        touched = undo.changed_since_point()
        undo_records: list[tuple[bytes, Keys]] = []
        batch = self.store.write_batch()
        put = batch.put
        delete = batch.delete
        for docid, (c, fields) in latest.items():
            if fields[1] == OP_DELETE:
                new = empty
            else:
                pos = c + head + fields[2]
                keys = []
                for klen in fields[3:]:
                    keys.append(records[pos : pos + klen].tobytes())
                    pos += klen
                new = tuple(keys) if positions is None else tuple(keys[k] for k in positions)
            old = entries.get(docid) or looked_up.get(docid) or empty
            if old == new:
                continue
            tail = entry_tail(docid)
            if record_undo and docid not in touched:
                touched.add(docid)
                undo_records.append((docid, old))
            if history:
                vbucket = vbucket_of[c]
                group = changes_by_vbucket.get(vbucket)
                if group is None:
                    group = changes_by_vbucket[vbucket] = []
                group.append((fields[0], docid, old, new))
            for j in indexes:
                o = old[j]
                n = new[j]
                if o == n:
                    continue
                if arrays[j]:
                    # Several entries per document: only those that changed are written.
                    index = self.indexes[j]
                    olds = set(index.entry_keys(o))
                    news = set(index.entry_keys(n))
                    for k in olds - news:
                        delete(main_prefixes[j] + k + tail)
                    for k in news - olds:
                        put(main_prefixes[j] + k + tail, b"")
                    if n:
                        put(back_prefixes[j] + docid, n)
                    else:
                        delete(back_prefixes[j] + docid)
                    puts += len(news - olds) + bool(n)
                    deletes += len(olds - news) + (not n)
                    deltas[j] += len(news) - len(olds)
                    continue
                if o:
                    delete(main_prefixes[j] + o + tail)
                    deletes += 1
                    deltas[j] -= 1
                if n:
                    put(main_prefixes[j] + n + tail, b"")
                    put(back_prefixes[j] + docid, n)
                    puts += 2
                    deltas[j] += 1
                else:
                    delete(back_prefixes[j] + docid)
                    deletes += 1
            if new == empty:
                if cache.complete:
                    entries.pop(docid, None)
                else:
                    entries[docid] = empty  # remember "in no index" to skip a lookup later
            else:
                entries[docid] = new
        if undo_records:
            put(undo.key(), encode_undo(self.indexes, undo_records))
        for vbucket, group in changes_by_vbucket.items():
            group.sort()  # seqno order; one document per seqno
            put(history_key(vbucket, group[-1][0]), encode_group(ids, group))
        cache.trim()
        result = FlushResult(len(chunks), len(latest), puts, deletes, tuple(deltas))
        return batch, result

    def apply(self, records: Sequence[bytes], vbuckets: Sequence[int] = ()) -> FlushResult:
        """Write the effect of `records` given as bytes (for tools and tests; blocking)."""
        blob = bytearray()
        offsets = []
        for record in records:
            offsets.append(len(blob))
            blob += record
        batch, result = self.prepare(memoryview(blob), offsets, vbuckets)
        batch.write()
        return result


# ------------------------------------------------------------------------------------------------
# Writing a flush's batch, through write errors

RETRY_FIRST_S = 0.05
RETRY_MAX_S = 2.0
FAILURE_LOG_INTERVAL_S = 10.0

# Fault injection for the fault tests (docs/testing.md), read from the environment at start;
# never set in production. Every flush write sleeps INDEXER_FAULT_SLOW_WRITE_MS first (slow
# storage), and fails as LevelDB does on a full disk while INDEXER_FAULT_ENOSPC_FILE exists.
FAULT_SLOW_WRITE_MS = "INDEXER_FAULT_SLOW_WRITE_MS"
FAULT_ENOSPC_FILE = "INDEXER_FAULT_ENOSPC_FILE"


@dataclass(frozen=True)
class InjectedFaults:
    """The fault-injection settings (test only): a delay per write, a file meaning "disk full"."""

    slow_write_s: float = 0.0
    enospc_file: Path | None = None

    @classmethod
    def from_environment(cls) -> InjectedFaults:
        """The settings the daemon's environment asks for (none, normally)."""
        slow = os.environ.get(FAULT_SLOW_WRITE_MS, "")
        enospc = os.environ.get(FAULT_ENOSPC_FILE, "")
        return cls(float(slow) / 1000 if slow else 0.0, Path(enospc) if enospc else None)

    @property
    def active(self) -> bool:
        """Whether any fault is injected (the daemon then says so in its log)."""
        return bool(self.slow_write_s or self.enospc_file)

    def before_write(self, store: IndexStore) -> None:
        """Sleep, or fail with the error plyvel raises on ENOSPC (blocking: in the write thread)."""
        if self.slow_write_s:
            time.sleep(self.slow_write_s)
        if self.enospc_file is not None and self.enospc_file.exists():
            raise StoreWriteError(
                f"IO error: {store.path}/000000.log: No space left on device (injected)".encode()
            )


@dataclass(frozen=True)
class WriteStatistics:
    """Failed writes of one worker: how many in all, whether one is being retried, the last."""

    write_errors: int
    write_failing: bool
    write_error: str | None


class BatchWrites:
    """Writes one worker's flushes to the store, keeping a batch through write errors.

    A failed write (a full disk) is retried with backoff until it succeeds, never dropped: its
    chunks stay queued, so the persisted snapshot (and every ACK) waits for it, the slab pool
    fills, reads stall and routers keep what they sent. The log says why; `/stats` shows it.
    """

    def __init__(self, worker: int, faults: InjectedFaults | None = None) -> None:
        self.worker = worker
        self.faults = InjectedFaults.from_environment() if faults is None else faults
        self.errors = 0
        self.failing = False
        self.last_error: str | None = None
        if self.faults.active and worker == 0:
            log.warning("fault injection on (tests only): %s", self.faults)

    def _write(self, store: IndexStore, batch: Any) -> None:
        """One attempt (blocking: in a worker thread)."""
        self.faults.before_write(store)
        store.commit(batch)

    async def write(self, store: IndexStore, batch: Any, mutations: int) -> None:
        """Write `batch` (of `mutations` queued mutations), retrying until it is written."""
        delay = RETRY_FIRST_S
        failed_at = logged_at = 0.0
        attempts = 0
        while True:
            try:
                await trio.to_thread.run_sync(self._write, store, batch)
            except StoreWriteError as exc:
                now = time.monotonic()
                attempts += 1
                self.errors += 1
                self.last_error = describe(exc)
                if not self.failing:
                    self.failing = True
                    failed_at = logged_at = now
                    log.error(
                        "store write failed: %s; worker %d keeps its batch of %d mutations and "
                        "retries (nothing more is acknowledged, reads stall as queues fill)",
                        self.last_error,
                        self.worker,
                        mutations,
                    )
                elif now - logged_at >= FAILURE_LOG_INTERVAL_S:
                    logged_at = now
                    log.error(
                        "store write still failing after %d attempts in %.0f s: %s (worker %d)",
                        attempts,
                        now - failed_at,
                        self.last_error,
                        self.worker,
                    )
                await trio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)
                continue
            if self.failing:
                self.failing = False
                log.warning(
                    "store write succeeded after %d failed attempts in %.1f s: worker %d resumes",
                    attempts,
                    time.monotonic() - failed_at,
                    self.worker,
                )
            return

    def statistics(self) -> WriteStatistics:
        """Failed writes so far, for /stats."""
        return WriteStatistics(self.errors, self.failing, self.last_error)
