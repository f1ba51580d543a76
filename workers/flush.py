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
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import trio

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

    def add_built_index(self, built: BackIndexCache) -> None:
        """A new last index that was built on its own: its keys come from the build's cache."""
        empty = (b"",) * self.nindexes
        self.nindexes += 1
        entries = {docid: (*keys, b"") for docid, keys in self.entries.items()}
        for docid, (key,) in built.entries.items():
            if key:
                entries[docid] = (*entries.get(docid, (*empty, b""))[:-1], key)
        self.entries = entries
        if not built.complete:
            self.complete = False  # misses are read from the store, this index's entries too
        self.trim()

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
    ):
        self.store = store
        self.indexes = tuple(indexes)
        # Without an undo log (tests, tools) nothing can be rolled back past the store's state.
        self.undo = undo if undo is not None else UndoLog(0, enabled=False)
        self.nindexes = len(indexes)
        self.main_prefixes = [i.main_prefix for i in indexes]
        self.back_prefixes = [i.back_prefix for i in indexes]
        self.cache = cache
        self.layout = queued_layout(len(indexes))

    def _old_keys(self, docids: list[bytes]) -> dict[bytes, Keys]:
        """Back-index entries of documents the cache does not hold, read in key order."""
        found: dict[bytes, Keys] = {}
        get = self.store.get
        for docid in sorted(docids):
            found[docid] = tuple(get(p + docid) or b"" for p in self.back_prefixes)
        return found

    def prepare(self, records: memoryview, chunks: Sequence[int]) -> tuple[Any, FlushResult]:
        """The WriteBatch applying the queued records at offsets `chunks` of `records`.

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
        cache = self.cache
        entries = cache.entries
        empty: Keys = (b"",) * self.nindexes
        looked_up: dict[bytes, Keys] = {}
        if not cache.complete:
            looked_up = self._old_keys([d for d in latest if d not in entries])
        deltas = [0] * self.nindexes
        puts = deletes = 0
        main_prefixes = self.main_prefixes
        back_prefixes = self.back_prefixes
        indexes = range(self.nindexes)
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
                new = tuple(keys)
            old = entries.get(docid) or looked_up.get(docid) or empty
            if old == new:
                continue
            tail = entry_tail(docid)
            if record_undo and docid not in touched:
                touched.add(docid)
                undo_records.append((docid, old))
            for j in indexes:
                o = old[j]
                n = new[j]
                if o == n:
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
        cache.trim()
        result = FlushResult(len(chunks), len(latest), puts, deletes, tuple(deltas))
        return batch, result

    def apply(self, records: Sequence[bytes]) -> FlushResult:
        """Write the effect of `records` given as bytes (for tools and tests; blocking)."""
        blob = bytearray()
        offsets = []
        for record in records:
            offsets.append(len(blob))
            blob += record
        batch, result = self.prepare(memoryview(blob), offsets)
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
