"""Recovery points and rollback: where a diverged history must restart, and going back there.

A router's history of a vbucket is a failover log: (vbuuid, seqno) entries, newest first, each
the start of a branch of history (UPR). When a source fails over, mutations past the branch point
of the new history are gone, and an indexer that applied them must roll back.

- `rollback_seqno` compares the failover log the indexer last persisted with the router's, as
  UPR describes: take the most recent common entry and the smaller of the seqnos where the two
  logs leave that branch.
- Every flush writes undo records (`UndoLog`): the keys a document had at the last recovery
  point, taken the first time the document changes after it, all of one flush in one value
  serialized by marshal (a put and a struct-packed record per document cost 15% of the ingest
  rate; this costs about 0.5 us per document). `restore` applies them
  newest first, which brings the store back to any recovery point still kept; `prune` drops the
  records no kept point needs. This is the ring buffer of the UPR client and Couchbase's
  rollback to a kept snapshot (storage_manager.go: handleRollback), over one LevelDB.
"""

from __future__ import annotations

import itertools
import marshal
import struct
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from indexer.keys import entry_tail
from indexer.storage import IndexStore, StoredIndex

UNDO_PREFIX = b"u"
_TAG = struct.Struct(">Q")
_BLOB_ID = struct.Struct(">HQ")  # writer, sequence: one undo value per flush of a writer
_UNDO_FORMAT = b"\x01"  # then marshal (version 4) of (index ids, [(docid, keys), ...])
Keys = tuple[bytes, ...]
RESTORE_BATCH = 10_000

FailoverLog = tuple[tuple[int, int], ...]
"""(vbuuid, seqno) entries of one vbucket, newest first; the seqno is where the branch starts."""


def rollback_seqno(local: FailoverLog, local_seqno: int, remote: FailoverLog) -> int | None:
    """The seqno an indexer holding `local_seqno` of history `local` must roll back to, or None.

    `remote` is the router's log. Without a common entry nothing of the local history is known
    to survive: roll back to 0.
    """
    if local_seqno == 0 or not local:
        return None
    starts = {entry: j for j, entry in enumerate(remote)}
    for i, entry in enumerate(local):
        j = starts.get(entry)
        if j is None:
            continue
        # The branch ends where the next newer entry of each log starts (or is still open).
        local_end = local[i - 1][1] if i > 0 else local_seqno
        remote_end = remote[j - 1][1] if j > 0 else local_seqno
        safe = min(local_end, remote_end, local_seqno)
        return safe if safe < local_seqno else None
    return 0


def encode_undo(indexes: Sequence[StoredIndex], records: list[tuple[bytes, Keys]]) -> bytes:
    """A flush's undo value: (docid, keys by index position) of each first-changed document."""
    ids = tuple(index.index_id for index in indexes)
    return _UNDO_FORMAT + marshal.dumps((ids, records), 4)


def undo_entries(blob: bytes) -> Iterator[tuple[bytes, dict[int, bytes]]]:
    """(docid, {index id: key}) of every record in a flush's undo value."""
    if blob[:1] != _UNDO_FORMAT:
        raise ValueError(f"undo record of unknown format {blob[:1]!r}")
    ids, records = marshal.loads(blob[1:])
    for docid, keys in records:
        yield docid, {i: key for i, key in zip(ids, keys, strict=True) if key}


@dataclass
class UndoLog:
    """The undo state of one writer: the current recovery point's tag, documents changed since.

    Documents are partitioned between writers by vbucket, so each writer keeps its own set.
    """

    tag: int
    enabled: bool = True
    writer: int = 0
    touched: set[bytes] = field(default_factory=set)
    # Keys written per tag, shared by the writers: pruning deletes them without a walk.
    written: dict[int, list[bytes]] = field(default_factory=dict)
    _seen_tag: int = -1
    # Unique across restarts too: records of an older run with this tag may still be stored.
    _sequence: Iterator[int] = field(default_factory=lambda: itertools.count(time.time_ns()))

    def key(self) -> bytes:
        """The store key of this flush's undo value."""
        key = UNDO_PREFIX + _TAG.pack(self.tag) + _BLOB_ID.pack(self.writer, next(self._sequence))
        self.written.setdefault(self.tag, []).append(key)
        return key

    def restart(self) -> None:
        self._seen_tag = -1

    def changed_since_point(self) -> set[bytes]:
        """The documents already recorded since the current recovery point (the writer adds)."""
        if self._seen_tag != self.tag:
            self.touched.clear()
            self._seen_tag = self.tag
        return self.touched


@dataclass
class RecoveryPoints:
    """The tag every writer's undo records get now; bumped when a recovery point is made."""

    tag: int
    enabled: bool = True
    logs: list[UndoLog] = field(default_factory=list)
    written: dict[int, list[bytes]] = field(default_factory=dict)

    def log(self) -> UndoLog:
        undo = UndoLog(self.tag, self.enabled, len(self.logs), written=self.written)
        self.logs.append(undo)
        return undo

    def take_below(self, tag: int) -> list[bytes]:
        """Forget and return the keys this process wrote under tags below `tag`."""
        old = [t for t in self.written if t < tag]
        return [key for t in old for key in self.written.pop(t)]

    def advance(self, tag: int) -> None:
        """Undo records are tagged `tag` from now on; every document's first change counts anew."""
        self.tag = tag
        for undo in self.logs:
            undo.tag = tag
            undo.restart()


def undo_tags(store: IndexStore) -> list[int]:
    """The tags of the undo records in the store, ascending (blocking)."""
    tags: list[int] = []
    db = store.db
    start = UNDO_PREFIX
    while True:
        key = next(db.iterator(start=start, stop=b"v", include_value=False), None)
        if key is None:
            return tags
        (tag,) = _TAG.unpack_from(key, 1)
        tags.append(tag)
        start = UNDO_PREFIX + _TAG.pack(tag + 1)


def restore(store: IndexStore, indexes: Sequence[StoredIndex], tag: int) -> int:
    """Bring the store back to recovery point `tag`: apply undo records of tags >= it (blocking).

    Newest tag first, so the oldest record of a document (its keys at `tag`) is applied last.
    Each record is applied and deleted in one batch, and applying it again changes nothing, so
    a restore stopped half way (a crash) is finished by running it again. Returns how many
    documents were reverted.
    """
    reverted = 0
    for t in reversed([t for t in undo_tags(store) if t >= tag]):
        # Each value holds a flush's documents, each once per tag: any order within a tag.
        for key, blob in store.db.iterator(prefix=UNDO_PREFIX + _TAG.pack(t)):
            with store.write_batch() as batch:
                for docid, wanted in undo_entries(blob):
                    _revert(store, batch, indexes, docid, wanted)
                    reverted += 1
                batch.delete(key)
    return reverted


def _revert(
    store: IndexStore,
    batch: Any,
    indexes: Sequence[StoredIndex],
    docid: bytes,
    wanted: dict[int, bytes],
) -> None:
    for index in indexes:
        set_document_key(store, batch, index, docid, wanted.get(index.index_id, b""))


def set_document_key(
    store: IndexStore, batch: Any, index: StoredIndex, docid: bytes, key: bytes
) -> bool:
    """Add to `batch` what gives the document `key` in `index` (b"": no entry), from the keys
    its back index holds now; whether anything changes."""
    back = index.back_prefix + docid
    current = store.get(back) or b""
    if current == key:
        return False
    tail = entry_tail(docid)
    for entry in index.entry_keys(current):
        batch.delete(index.main_prefix + entry + tail)
    for entry in index.entry_keys(key):
        batch.put(index.main_prefix + entry + tail, b"")
    if key:
        batch.put(back, key)
    else:
        batch.delete(back)
    return True


def prune(store: IndexStore, below: int) -> int:
    """Delete the undo records of tags below `below`: no kept recovery point needs them.

    A walk over the records: at start-up, or for records an earlier run wrote. While the daemon
    runs, `RecoveryPoints.take_below` gives the keys to delete without walking (a walk in a
    thread beside the busy event loop waits for the GIL at every step).
    """
    stop = UNDO_PREFIX + _TAG.pack(below)
    deleted = 0
    while keys := list(
        islice(store.db.iterator(start=UNDO_PREFIX, stop=stop, include_value=False), RESTORE_BATCH)
    ):
        store.write((), keys)
        deleted += len(keys)
    return deleted


def clear(store: IndexStore, indexes: Sequence[StoredIndex]) -> None:
    """Roll back to zero: delete every entry of every index and every undo record (blocking)."""
    for index in indexes:
        store.delete_entries(index)
    prune(store, (1 << 64) - 1)
