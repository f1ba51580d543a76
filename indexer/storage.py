"""The LevelDB store: the one module that touches plyvel.

One LevelDB database holds every index, so one WriteBatch applies a flush to all of them at once:

    b"i" + id (u16) + encoded key + docid + len(docid) (u16) -> b""   main index, in key order
    b"r" + id (u16) + docid                                  -> key   back index
    b"\\x00meta:indexes"                                      -> JSON  names, ids, keys, wheres
    b"\\x00meta:format"                                       -> "2"   layout of main entries
    b"\\x00meta:source"                                       -> the source indexed (its identity)

The docid's length at the end of a main entry lets a scan split a batch of entries into keys and
docids with array operations (see `scans.entry_batches`).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import plyvel

from indexer.keys import entry_tail, split_entries
from indexer.protocol import IndexDefinition

STORE_DIR = "store"
_META_INDEXES = b"\x00meta:indexes"
_META_SYNC = b"\x00meta:sync"
_META_FORMAT = b"\x00meta:format"
_META_SOURCE = b"\x00meta:source"
# 2: main entries end with the docid's length (keys.entry_tail); 1 (no marker): they do not.
ENTRY_FORMAT = 2
_ID = struct.Struct(">H")
# What a failed write raises: plyvel.IOError (an OSError), "IO error: FILE: No space left on
# device" when the disk is full.
StoreWriteError = plyvel.IOError
# A key range no entry is in: compacting it only writes the memtable out and starts a new log.
_LOG_SWITCH = (b"\xff\xfflog-switch", b"\xff\xfflog-switch\xff")
_ABOVE_EVERY_KEY = b"\xff" * 64  # every key of the store sorts below it (_LOG_SWITCH's the highest)
_LOG_SWITCH_MARGIN = 1 << 20

COMPACTION_NICE = 10
"""The nice value of LevelDB's compaction thread in the daemon and the router (0..19, 0 = as
the rest of the process). Compaction can wait a little; the event loop that carries
maintenance cannot: an initial build triples the time a store spends compacting, and at the
same priority those compactions were behind most of the slowest maintenance writes on 2 cores
(docs/performance.md)."""


def describe(exc: BaseException) -> str:
    """An error as one line of text (plyvel gives its messages as bytes)."""
    if exc.args and isinstance(exc.args[0], bytes):
        return exc.args[0].decode(errors="replace")
    return str(exc) or type(exc).__name__


class StoreError(Exception):
    """The store cannot be opened or used; the message says why."""


class StoreLockedError(StoreError):
    """Another process (a running daemon) holds the store."""


@dataclass(frozen=True)
class StoredIndex:
    """An index as the store knows it: its definition and the prefixes of its entries.

    `state` is "active" for an index the stream maintains, "building" for one created over
    data already streamed, while its initial build runs (indexer/build.py), and "deferred" for
    one created with `defer_build`: defined, holding nothing and carried by no stream until a
    build is asked for (GSI's `BUILD INDEX`). Stores of earlier versions may hold "incremental":
    an index created at run time before builds existed, which holds only what was streamed
    after its creation.
    """

    definition: IndexDefinition
    index_id: int
    state: str = "active"

    @property
    def main_prefix(self) -> bytes:
        return b"i" + _ID.pack(self.index_id)

    @property
    def back_prefix(self) -> bytes:
        return b"r" + _ID.pack(self.index_id)

    @cached_property
    def array(self) -> bool:
        """Whether a document may have several entries (an array key)."""
        return self.definition.array_key is not None

    def entry_keys(self, back: bytes) -> list[bytes]:
        """The keys of the main entries a back-index value stands for: none for b"", the value
        itself, or for an array index each distinct key it joins (`keys.join_entries`)."""
        if not back:
            return []
        if not self.array:
            return [back]
        return list(dict.fromkeys(split_entries(back)))


def open_leveldb(
    path: Path,
    create: bool,
    what: str = "the store",
    holder: str = "a running daemon?",
    locked: type[Exception] = StoreLockedError,
    failed: type[Exception] = StoreError,
    write_buffer_size: int | None = None,
    compression: str | None = "snappy",
) -> Any:
    """A plyvel database, with lock and corruption errors turned into one clear line.
    `compression` applies to the table files written from now on (None: none); a table records
    its own, so files written either way read back."""
    options: dict[str, Any] = {"compression": compression}
    if write_buffer_size is not None:
        options["write_buffer_size"] = write_buffer_size
    try:
        return plyvel.DB(str(path), create_if_missing=create, **options)
    except plyvel.IOError as exc:
        if "lock" in str(exc).lower():
            raise locked(f"{what} in {path} is held by another process ({holder})") from None
        raise failed(f"cannot open {what} in {path}: {exc}") from None
    except plyvel.Error as exc:
        raise failed(f"cannot open {what} in {path}: {exc}") from None


class ClosedLogs:
    """Makes a LevelDB database's closed write-ahead logs durable.

    A synchronous write syncs the current log only. When a memtable fills, LevelDB opens a new
    log and closes the old one without fsync (DBImpl::MakeRoomForWrite); its memtable reaches a
    synced table file later, in the background. Until then a power cut can take writes that a
    later synchronous write seemed to make durable. After its synchronous write, a caller that
    acknowledges everything before it calls `sync`: every log but the newest (which that write
    synced) is fsynced once (a closed log never changes), and the directory when its logs
    changed, so a new log's entry survives too. Blocking; a few system calls when nothing is
    new.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._synced: set[str] = set()  # closed logs fsynced already
        self._listed: frozenset[str] = frozenset()  # the logs at the last directory fsync

    def sync(self) -> int:
        """Fsync what is not durable yet; how many files (the directory included)."""
        logs = sorted(
            (name for name in os.listdir(self.path) if name.endswith(".log")),
            key=lambda name: int(name[:-4]) if name[:-4].isdigit() else -1,
        )
        count = 0
        for name in logs[:-1]:
            if name in self._synced:
                continue
            try:
                fd = os.open(self.path / name, os.O_RDONLY)
            except FileNotFoundError:  # compacted meanwhile: in a synced table file now
                continue
            try:
                os.fsync(fd)  # on Linux, a read-only descriptor flushes the file's pages
            finally:
                os.close(fd)
            self._synced.add(name)
            count += 1
        listed = frozenset(logs)
        if listed != self._listed:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            self._listed = listed
            count += 1
        self._synced &= listed
        return count


def start_compaction_thread(db: Any, nice: int) -> int | None:
    """Start LevelDB's compaction thread at `nice`; its thread id, or None if it was running.

    LevelDB runs the compactions of every database of a process in one background thread,
    started the first time a database schedules work, and on Linux a thread inherits the nice
    value of the thread that creates it. So a short-lived thread raises its own nice value and
    has the database write its (empty) memtable out, which schedules that work. Elsewhere than
    Linux nice values are per process: nothing is done; nor for a nice value of 0.
    """
    if not sys.platform.startswith("linux") or not 0 < nice < 20:
        return None
    # Threads that are not LevelDB's: those running now, and the helper below.
    others = set(os.listdir("/proc/self/task"))
    found: list[int] = []

    def schedule() -> None:
        others.add(str(threading.get_native_id()))
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
            db.compact_range(start=_LOG_SWITCH[0], stop=_LOG_SWITCH[1])
        except (OSError, plyvel.Error):
            return  # a full disk, say: LevelDB starts the thread later, at the usual priority
        # Looked for while this thread lives: a listing of a process's threads stops early at
        # a thread that is exiting, and would miss the ones after it.
        found.extend(_new_threads_at(others, nice))

    helper = threading.Thread(target=schedule, name="leveldb-compaction-start")
    helper.start()
    helper.join()
    for _ in range(3):
        if found:
            return found[0]
        time.sleep(0.002)  # another thread exiting may have cut the listing short
        found.extend(_new_threads_at(others, nice))
    return None


def _new_threads_at(others: set[str], nice: int) -> list[int]:
    """Threads of this process not among `others` whose nice value is `nice`."""
    tids = (int(tid) for tid in set(os.listdir("/proc/self/task")) - others)
    return [tid for tid in tids if thread_nice(tid) == nice]


def thread_nice(tid: int) -> int | None:
    """The nice value of a thread of this process (Linux), or None if it has ended."""
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            # Fields after the command's closing parenthesis; nice is the 19th field overall.
            return int(f.read().rsplit(")", 1)[1].split()[16])
    except (OSError, IndexError, ValueError):
        return None


class IndexStore:
    """Main and back index of every index in one LevelDB database."""

    def __init__(
        self,
        data_dir: Path,
        create: bool = True,
        compaction_nice: int = 0,
        compression: str | None = None,
    ) -> None:
        """`compression`: of the table files LevelDB writes (None or "snappy"; the daemon's
        `compaction.compression`)."""
        path = data_dir / STORE_DIR
        if not create and not path.is_dir():
            raise StoreError(f"no store in {data_dir}")
        if create:
            path.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.db = open_leveldb(path, create, compression=compression)
        self._closed_logs = ClosedLogs(path)
        # The id of LevelDB's compaction thread if this store started it at `compaction_nice`.
        self.compaction_thread = start_compaction_thread(self.db, compaction_nice)
        # Failed writes so far, and how many of them a log switch has left behind (see commit).
        self._write_lock = threading.Lock()
        self._switch_lock = threading.Lock()
        self._failed_writes = 0
        self._switched_writes = 0
        self._indexes: dict[str, StoredIndex] = {}
        raw = self.db.get(_META_INDEXES)
        if raw is not None:
            for name, item in json.loads(raw).items():
                definition = IndexDefinition(name, tuple(item["keys"]), item.get("where"))
                state = item.get("state", "active")
                self._indexes[name] = StoredIndex(definition, int(item["id"]), state)
        self._upgrade_entries()

    def _upgrade_entries(self) -> None:
        """Bring main entries of an older store to `ENTRY_FORMAT`, rebuilt from the back index."""
        found = self.db.get(_META_FORMAT)
        if found is not None:
            if int(found) > ENTRY_FORMAT:
                raise StoreError(
                    f"the store in {self.path} has entry format {int(found)}; "
                    f"this version reads format {ENTRY_FORMAT}: upgrade the indexer"
                )
            if int(found) == ENTRY_FORMAT:
                return
        for index in self._indexes.values():
            stale = list(self.db.iterator(prefix=index.main_prefix, include_value=False))
            fresh = [
                (index.main_prefix + key + entry_tail(docid), b"")
                for docid, back in self.back_entries(index)
                for key in index.entry_keys(back)
            ]
            self.write(fresh, stale)
        self._put_durably(_META_FORMAT, str(ENTRY_FORMAT).encode())

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> IndexStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def indexes(self) -> dict[str, StoredIndex]:
        return dict(self._indexes)

    def index(self, name: str) -> StoredIndex:
        try:
            return self._indexes[name]
        except KeyError:
            known = ", ".join(sorted(self._indexes)) or "none"
            raise StoreError(f"no index named {name!r} in the store (indexes: {known})") from None

    def ensure_indexes(
        self, definitions: Sequence[IndexDefinition], deferred: Collection[str] = ()
    ) -> list[StoredIndex]:
        """Every stored index, after registering the given definitions that are new: "active",
        or "deferred" for those named in `deferred` (a configuration's `defer_build`).

        Indexes created at run time stay until dropped. An index whose key paths or `where`
        differ from the stored ones is an error: its entries would mix two definitions.
        """
        for definition in definitions:
            stored = self._indexes.get(definition.name)
            if stored is None:
                self._register(definition, "deferred" if definition.name in deferred else "active")
            elif stored.definition.keys != definition.keys:
                raise StoreError(
                    f"index {definition.name!r} is stored with keys "
                    f"{list(stored.definition.keys)}, not {list(definition.keys)}; "
                    "use a new index name, drop the index, or use a new data directory"
                )
            elif stored.definition.where != definition.where:
                raise StoreError(
                    f"index {definition.name!r} is stored with where "
                    f"{stored.definition.where!r}, not {definition.where!r}; "
                    "use a new index name, drop the index, or use a new data directory"
                )
        return self.all_indexes()

    def all_indexes(self) -> list[StoredIndex]:
        """The indexes in the order of their ids: the order of keys in every record."""
        return sorted(self._indexes.values(), key=lambda s: s.index_id)

    def _register(self, definition: IndexDefinition, state: str) -> StoredIndex:
        next_id = max((s.index_id for s in self._indexes.values()), default=0) + 1
        if next_id > 0xFFFF:
            raise StoreError("index ids are exhausted; compact into a new data directory")
        stored = StoredIndex(definition, next_id, state)
        self._indexes[definition.name] = stored
        self._save_meta()
        return stored

    def _save_meta(self) -> None:
        meta: dict[str, dict[str, Any]] = {}
        for s in self._indexes.values():
            item: dict[str, Any] = {"id": s.index_id, "keys": list(s.definition.keys)}
            if s.definition.where is not None:
                item["where"] = s.definition.where
            item["state"] = s.state
            meta[s.definition.name] = item
        self._put_durably(_META_INDEXES, json.dumps(meta).encode())

    def create_index(self, definition: IndexDefinition, state: str = "active") -> StoredIndex:
        """Register an index created at run time: "active", or "building" (initial build)."""
        if definition.name in self._indexes:
            raise StoreError(f"an index named {definition.name!r} exists")
        return self._register(definition, state)

    def activate(self, name: str) -> StoredIndex:
        """A built index becomes active (maintained by the stream like the others)."""
        return self.set_states([name], "active")[0]

    def set_states(self, names: Sequence[str], state: str) -> list[StoredIndex]:
        """Give these indexes a new state in one synced write (a deferred build starting, a
        build merged); the indexes as now stored, in the order of `names`."""
        changed = [self.index(name) for name in names]
        changed = [StoredIndex(s.definition, s.index_id, state) for s in changed]
        for stored in changed:
            self._indexes[stored.definition.name] = stored
        self._save_meta()
        return changed

    def drop_index(self, name: str) -> StoredIndex:
        """Forget an index; its entries stay until `delete_entries` (run it in a thread)."""
        stored = self.index(name)
        del self._indexes[name]
        self._save_meta()
        return stored

    def delete_entries(self, index: StoredIndex, batch_size: int = 10_000) -> int:
        """Delete every main and back entry of a dropped index (blocking); how many."""
        deleted = 0
        for prefix in (index.main_prefix, index.back_prefix):
            keys: list[bytes] = []
            for key in self.db.iterator(prefix=prefix, include_value=False):
                keys.append(key)
                if len(keys) >= batch_size:
                    self.write((), keys)
                    deleted += len(keys)
                    keys = []
            self.write((), keys)
            deleted += len(keys)
        return deleted

    def write(self, puts: Sequence[tuple[bytes, bytes]], deletes: Sequence[bytes]) -> None:
        """Apply deletes then puts as one WriteBatch (blocking: call it from a worker thread)."""
        batch = self.db.write_batch()
        for key in deletes:
            batch.delete(key)
        for key, value in puts:
            batch.put(key, value)
        self.commit(batch)

    def commit(self, batch: Any) -> None:
        """Write a WriteBatch of `write_batch()` (blocking).

        A failed write (a full disk) may leave a torn record at the end of LevelDB's log, and
        records appended after it are unreadable at recovery: the first write after a failure
        moves LevelDB to a new log (the memtable is written out), so nothing synced is lost.
        """
        self._guarded(batch.write)

    def _guarded(self, write: Callable[[], None]) -> None:
        try:
            if self._failed_writes > self._switched_writes:
                self._switch_log()
            write()
        except StoreWriteError:
            with self._write_lock:
                self._failed_writes += 1
            raise

    def _switch_log(self) -> None:
        """Write the memtable out to a table and start a new log (blocking).

        LevelDB keeps a failed compaction's error until it is reopened, so this is tried only
        with room for the memtable's table; a failure shows in the write that follows.
        """
        with self._switch_lock:
            seen = self._failed_writes
            if seen <= self._switched_writes:
                return  # another thread switched after these failures
            logs = sum(f.stat().st_size for f in self.path.glob("*.log"))
            free = shutil.disk_usage(self.path).free
            if free < logs + _LOG_SWITCH_MARGIN:
                raise StoreWriteError(
                    f"IO error: {self.path}: No space left on device ({free} bytes free, "
                    f"{logs + _LOG_SWITCH_MARGIN} needed to start a new log)".encode()
                )
            self.db.compact_range(start=_LOG_SWITCH[0], stop=_LOG_SWITCH[1])
            self._switched_writes = seen

    def write_batch(self) -> Any:
        """A plyvel WriteBatch; `write()` on it releases the GIL."""
        return self.db.write_batch()

    def compact(self) -> None:
        """Compact every level of the store (blocking: LevelDB rewrites what is live).

        The range is named: plyvel's `compact_range()` without bounds hands LevelDB an empty
        range, which flushes the memtable and frees nothing."""
        self.db.compact_range(start=b"", stop=_ABOVE_EVERY_KEY)

    @property
    def source(self) -> str | None:
        """The identity of the source whose history this store indexes; None: none yet."""
        raw: bytes | None = self.db.get(_META_SOURCE)
        return None if raw is None else raw.decode()

    def record_source(self, identity: str) -> None:
        """The store indexes this source from now on (synced before any of its data lands)."""
        self._guarded(lambda: self._put_durably(_META_SOURCE, identity.encode()))

    def sync(self) -> None:
        """Make every earlier write durable: a synchronous write syncs LevelDB's current log,
        and the logs it closed before are synced too (`ClosedLogs`)."""

        self._guarded(lambda: self._put_durably(_META_SYNC, b""))

    def _put_durably(self, key: bytes, value: bytes) -> None:
        """A synchronous put, and the logs LevelDB closed before it synced too: the put and
        every write before it survive a power cut (`ClosedLogs`)."""
        self.db.put(key, value, sync=True)
        try:
            self._closed_logs.sync()
        except OSError as exc:
            raise StoreWriteError(f"cannot sync the store's logs: {exc.strerror}") from None

    def get(self, key: bytes) -> bytes | None:
        value: bytes | None = self.db.get(key)
        return value

    def level0_files(self) -> int:
        """Files in LevelDB's level 0: above 4 its compaction is behind the writes, and from 8
        on LevelDB slows every write down (a measure of how much more the store can take)."""
        value = self.db.get_property(b"leveldb.num-files-at-level0")
        return int(value) if value is not None else 0

    def approximate_bytes(self, indexes: Sequence[StoredIndex]) -> list[int]:
        """Per index, LevelDB's estimate of the bytes its main and back entries take in the
        table files (blocking, but cheap: it reads table indexes, not entries). What is only in
        the write-ahead log and the memtable yet, a few MiB at most, is not counted."""
        ranges = []
        for index in indexes:
            for prefix in (index.main_prefix, index.back_prefix):
                ranges.append((prefix, _after_prefix(prefix)))
        sizes = self.db.approximate_sizes(*ranges) if ranges else []
        return [int(sizes[2 * j] + sizes[2 * j + 1]) for j in range(len(indexes))]

    def snapshot(self) -> Any:
        return self.db.snapshot()

    def back_entries(self, index: StoredIndex) -> Iterator[tuple[bytes, bytes]]:
        """(docid, encoded key) of every back-index entry of one index."""
        prefix = index.back_prefix
        cut = len(prefix)
        for key, value in self.db.iterator(prefix=prefix):
            yield key[cut:], value

    def count_main(self, index: StoredIndex) -> int:
        """How many main-index entries an index has (a walk over its keys; blocking)."""
        return sum(1 for _ in self.main_entries(index))

    def main_entries(self, index: StoredIndex, snapshot: Any = None) -> Iterator[bytes]:
        """Main-index entries (encoded key + `entry_tail`, prefix stripped) in index order."""
        prefix = index.main_prefix
        cut = len(prefix)
        source = snapshot if snapshot is not None else self.db
        for key in source.iterator(prefix=prefix, include_value=False):
            yield key[cut:]

    def main_range(
        self,
        index: StoredIndex,
        snapshot: Any,
        after: bytes | None = None,
        through: bytes | None = None,
    ) -> Iterator[bytes]:
        """`main_entries` of `snapshot` after entry `after` (excluded) up to `through`
        (included); None: from the first, to the last."""
        prefix = index.main_prefix
        cut = len(prefix)
        start = prefix + after if after is not None else prefix
        stop = prefix + through if through is not None else _after_prefix(prefix)
        keys = snapshot.iterator(
            start=start,
            stop=stop,
            include_start=after is None,
            include_stop=through is not None,
            include_value=False,
        )
        for key in keys:
            yield key[cut:]


def _after_prefix(prefix: bytes) -> bytes:
    """The first key after every key that starts with `prefix` (a prefix of 0xff bytes only
    has none: the end of the key space stands in for it)."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\xff" * (len(prefix) + 1)
    return stripped[:-1] + bytes([stripped[-1] + 1])
