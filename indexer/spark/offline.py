"""Reading a stopped node's store: its persisted snapshot and the store opened for a read."""

from __future__ import annotations

import json
import random
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from indexer.spark.options import IndexerSourceError
from indexer.storage import IndexStore, StoredIndex, StoreError, StoreLockedError

OFFLINE_CHUNK_ROWS = 100_000  # rows read per hold of an offline store's lock
BATCH_ROWS = 16_384  # rows per Arrow record batch built offline
PLANNING_LOCK_WAIT_S = 3.0  # how long planning waits for an offline store held by another reader


@dataclass(frozen=True)
class PersistedSnapshot:
    """The persisted snapshot recorded in a data directory's snapshot file."""

    seqno_sum: int
    persisted_at: float
    checksum: str  # of the file's bytes: a read fails if the file changes under it


def offline_snapshot(path: str | Path) -> PersistedSnapshot | None:
    """The data directory's persisted snapshot, or None if it never persisted one."""
    from indexer.snapshots import SNAPSHOT_FILE, SnapshotFileError, read_snapshot_file

    data_dir = Path(path)
    try:
        raw = (data_dir / SNAPSHOT_FILE).read_bytes()
        count = len(json.loads(raw)["seqnos"])  # the file says how many vbuckets it holds
        found = read_snapshot_file(data_dir, count)
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, SnapshotFileError) as exc:
        raise IndexerSourceError(f"{data_dir}: unreadable snapshot file: {exc}") from None
    if found is None:
        return None
    ts, when = found
    return PersistedSnapshot(ts.total, when, f"{zlib.crc32(raw):08x}")


def _open_store(path: str, wait_s: float, planning: bool = False) -> IndexStore:
    """Open the store, waiting up to `wait_s` while another reader process holds its lock.

    LevelDB lets one process open a database at a time, so Python workers reading partitions
    of the same store take turns: each holds it only while it reads a chunk of rows.
    """
    deadline = time.monotonic() + wait_s
    delay = 0.005
    while True:
        try:
            return IndexStore(Path(path), create=False)
        except StoreLockedError:
            if time.monotonic() >= deadline:
                if planning:
                    raise IndexerSourceError(
                        f"the store in {path} is held by another process (a running daemon?): "
                        'read through the daemon with .option("url", "http://HOST:HTTP_PORT") '
                        'instead of .option("path", ...)'
                    ) from None
                raise IndexerSourceError(
                    f"the store in {path} stayed held by another process for {wait_s:g} s "
                    "(a daemon started on it, or other readers are slow): raise the timeout "
                    "option or use the url option"
                ) from None
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 0.1)
        except StoreError as exc:
            raise IndexerSourceError(str(exc)) from None


def _offline_keys(path: str, index: str) -> list[str]:
    store = _open_store(path, PLANNING_LOCK_WAIT_S, planning=True)
    try:
        return list(_stored_index(store, index).definition.keys)
    finally:
        store.close()


def offline_types(path: str, index: str) -> list[set[str]]:
    """The JSON types each key position of a stopped node's index holds (one walk)."""
    from indexer.scans import key_types

    store = _open_store(path, PLANNING_LOCK_WAIT_S, planning=True)
    try:
        return key_types(store, _stored_index(store, index), None)
    finally:
        store.close()


def _stored_index(store: IndexStore, index: str) -> StoredIndex:
    try:
        return store.index(index)
    except StoreError as exc:
        raise IndexerSourceError(str(exc)) from None
