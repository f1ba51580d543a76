"""The ingest benchmark's reference (bench/ingest.py): the LevelDB writes a flush makes, recorded
and replayed alone against a store, batched as the daemon does and one operation per mutation;
the stores compared with the daemon's, entry for entry."""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import plyvel

from indexer import protocol as p
from indexer.config import Config
from indexer.keys import entry_tail
from indexer.storage import IndexStore, StoredIndex
from workers.flush import BackIndexCache, IndexWriter

RAW_BATCH_OPS = 10_000
FLUSH_WINDOW = 50_000  # mutations per simulated flush: ~100 ms of the daemon's intake
RAW_METHOD = (
    f"the daemon's IndexWriter over flush windows of {FLUSH_WINDOW} mutations split by worker "
    f"(dedup as in the daemon); WriteBatches of {RAW_BATCH_OPS} ops + one sync"
)
RAW_PER_MUTATION_METHOD = (
    "every mutation in seqno order on its own, in-memory back index, no dedup; "
    f"WriteBatches of {RAW_BATCH_OPS} ops + one sync"
)
Keys = tuple[bytes, ...]
Op = tuple[bytes, bytes | None]  # (key, value); value None = delete

# --------------------------------------------------------------------------------------------
# Raw: the storage work alone


class RecordingStore:
    """Stands in for IndexStore under IndexWriter: its WriteBatches record operations."""

    def __init__(self) -> None:
        self.ops: list[Op] = []

    def write_batch(self) -> RecordingStore:
        return self

    def put(self, key: bytes, value: bytes) -> None:
        self.ops.append((key, value))

    def delete(self, key: bytes) -> None:
        self.ops.append((key, None))

    def write(self) -> None:
        return None

    def get(self, key: bytes) -> bytes | None:
        raise AssertionError("the back-index cache is complete: no lookups expected")


@dataclass
class RawOps:
    """The LevelDB operations of the workload, already cut into WriteBatches."""

    batches: list[list[Op]]
    puts: int
    deletes: int
    method: str

    @property
    def ops(self) -> int:
        return self.puts + self.deletes


def cut_batches(ops: list[Op], puts: int, deletes: int, method: str) -> RawOps:
    """`ops` in WriteBatches of RAW_BATCH_OPS."""
    batches = [ops[i : i + RAW_BATCH_OPS] for i in range(0, len(ops), RAW_BATCH_OPS)]
    return RawOps(batches, puts, deletes, method)


def flush_ops(
    config: Config,
    indexes: Sequence[StoredIndex],
    batches: Sequence[p.MutationBatch],
    key_space: int,
) -> RawOps:
    """What the daemon writes: its IndexWriter per worker, one flush per FLUSH_WINDOW mutations."""
    workers = config.pipeline.workers
    recorder = RecordingStore()
    # Large enough to stay complete, as the daemon's cache is for the default workload.
    cache = BackIndexCache(max(config.pipeline.back_index_cache, key_space), len(indexes))
    writers = [IndexWriter(cast(IndexStore, recorder), indexes, cache) for _ in range(workers)]
    queued: list[list[bytes]] = [[] for _ in range(workers)]
    puts = deletes = 0

    def flush() -> None:
        nonlocal puts, deletes
        for writer, records in zip(writers, queued, strict=True):
            if records:
                result = writer.apply(records)
                puts += result.puts
                deletes += result.deletes
                records.clear()

    window = 0
    for batch in batches:
        queued[batch.vbucket % workers].extend(batch.records())
        window += len(batch.seqnos)
        if window >= FLUSH_WINDOW:
            flush()
            window = 0
    flush()
    return cut_batches(recorder.ops, puts, deletes, RAW_METHOD)


def per_mutation_ops(indexes: Sequence[StoredIndex], batches: Sequence[p.MutationBatch]) -> RawOps:
    """IndexWriter's rules applied to every mutation on its own (no dedup), in seqno order."""
    main_prefixes = [i.main_prefix for i in indexes]
    back_prefixes = [i.back_prefix for i in indexes]
    nindexes = len(indexes)
    empty: Keys = (b"",) * nindexes
    back: dict[bytes, Keys] = {}
    ops: list[Op] = []
    add = ops.append
    puts = deletes = 0
    for batch in batches:
        for m in batch.mutations():
            docid = m.docid
            new = empty if m.deleted else m.keys
            old = back.get(docid, empty)
            if old == new:
                continue
            for j in range(nindexes):
                o = old[j]
                n = new[j]
                if o == n:
                    continue
                if o:
                    add((main_prefixes[j] + o + entry_tail(docid), None))
                    deletes += 1
                if n:
                    add((main_prefixes[j] + n + entry_tail(docid), b""))
                    add((back_prefixes[j] + docid, n))
                    puts += 2
                else:
                    add((back_prefixes[j] + docid, None))
                    deletes += 1
            if new == empty:
                back.pop(docid, None)
            else:
                back[docid] = new
    return cut_batches(ops, puts, deletes, RAW_PER_MUTATION_METHOD)


def write_raw(store: IndexStore, raw: RawOps) -> float:
    """Write the precomputed batches, then sync; the seconds it took."""
    db = store.db
    started = time.perf_counter()
    for ops in raw.batches:
        batch = db.write_batch()
        put = batch.put
        delete = batch.delete
        for key, value in ops:
            if value is None:
                delete(key)
            else:
                put(key, value)
        batch.write()
    store.sync()
    return time.perf_counter() - started


def measure_raw(
    config: Config, raw: RawOps, workdir: Path, repeats: int
) -> tuple[list[float], Path]:
    """Seconds of each write of `raw` into a fresh store; the last store is kept for checks."""
    times = []
    store_dir = workdir
    for attempt in range(repeats):
        store_dir = workdir / f"run{attempt}"
        with IndexStore(store_dir) as store:
            store.ensure_indexes(config.indexes)
            times.append(write_raw(store, raw))
        if attempt < repeats - 1:
            shutil.rmtree(store_dir)
    return times, store_dir / "store"


def compare_stores(a: Path, b: Path) -> tuple[bool, int]:
    """Whether two stores hold the same main and back entries, and how many rows there are."""
    da = plyvel.DB(str(a))
    db = plyvel.DB(str(b))
    rows = 0
    same = True
    try:
        for prefix in (b"i", b"r"):
            ia = da.iterator(prefix=prefix)
            ib = db.iterator(prefix=prefix)
            sentinel = (b"", b"")
            for x, y in zip(ia, ib, strict=False):
                if x != y:
                    same = False
                    break
                rows += 1
            if next(ia, sentinel) != sentinel or next(ib, sentinel) != sentinel:
                same = False
            if not same:
                break
    finally:
        da.close()
        db.close()
    return same, rows
