"""Recovery points and rollback: where a diverged history must restart, and going back there.

A router's history of a vbucket is a failover log: (vbuuid, seqno) entries, newest first, each
the start of a branch of history (UPR). When a source fails over, mutations past the branch point
of the new history are gone, and an indexer that applied them must roll back.

- `rollback_seqno` compares the failover log the indexer last persisted with the router's, as
  UPR describes: take the most recent common entry and the smaller of the seqnos where the two
  logs leave that branch.
- Every flush writes undo records (`UndoLog`): the keys a document had at the last recovery
  point, written the first time the document changes after it. `restore` applies them newest
  first, which brings the store back to any recovery point still kept; `prune` drops the records
  no kept point needs. This is the ring buffer of the UPR client and Couchbase's rollback to a
  kept snapshot (storage_manager.go: handleRollback), over one LevelDB.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from indexer.keys import entry_tail
from indexer.storage import IndexStore, StoredIndex

UNDO_PREFIX = b"u"
_TAG = struct.Struct(">Q")
_KEY_HEAD = struct.Struct(">HI")  # index id, key length
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


def encode_undo(indexes: Sequence[StoredIndex], keys: Sequence[bytes]) -> bytes:
    """The value of an undo record: (index id, key) of each index the document was in."""
    out = bytearray()
    for index, key in zip(indexes, keys, strict=True):
        if key:
            out += _KEY_HEAD.pack(index.index_id, len(key))
            out += key
    return bytes(out)


def decode_undo(value: bytes) -> dict[int, bytes]:
    keys = {}
    pos = 0
    while pos < len(value):
        index_id, length = _KEY_HEAD.unpack_from(value, pos)
        pos += _KEY_HEAD.size
        keys[index_id] = value[pos : pos + length]
        pos += length
    return keys


def undo_key(tag: int, docid: bytes) -> bytes:
    return UNDO_PREFIX + _TAG.pack(tag) + docid


@dataclass
class UndoLog:
    """The undo state of one writer: the current recovery point's tag, documents changed since.

    Documents are partitioned between writers by vbucket, so each writer keeps its own set.
    """

    tag: int
    enabled: bool = True
    touched: set[bytes] = field(default_factory=set)
    _seen_tag: int = -1

    def restart(self) -> None:
        self._seen_tag = -1

    def first_change(self, docid: bytes) -> bool:
        """True the first time `docid` changes after the current recovery point."""
        if self._seen_tag != self.tag:
            self.touched.clear()
            self._seen_tag = self.tag
        if docid in self.touched:
            return False
        self.touched.add(docid)
        return True


@dataclass
class RecoveryPoints:
    """The tag every writer's undo records get now; bumped when a recovery point is made."""

    tag: int
    enabled: bool = True
    logs: list[UndoLog] = field(default_factory=list)

    def log(self) -> UndoLog:
        undo = UndoLog(self.tag, self.enabled)
        self.logs.append(undo)
        return undo

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
        prefix = UNDO_PREFIX + _TAG.pack(t)
        while True:
            records = list(islice(store.db.iterator(prefix=prefix), RESTORE_BATCH))
            if not records:
                break
            with store.write_batch() as batch:
                for key, value in records:
                    _revert(store, batch, indexes, key[len(prefix) :], decode_undo(value))
                    batch.delete(key)
            reverted += len(records)
    return reverted


def _revert(
    store: IndexStore,
    batch: Any,
    indexes: Sequence[StoredIndex],
    docid: bytes,
    wanted: dict[int, bytes],
) -> None:
    tail = entry_tail(docid)
    for index in indexes:
        back = index.back_prefix + docid
        current = store.get(back) or b""
        key = wanted.get(index.index_id, b"")
        if current == key:
            continue
        if current:
            batch.delete(index.main_prefix + current + tail)
        if key:
            batch.put(index.main_prefix + key + tail, b"")
            batch.put(back, key)
        else:
            batch.delete(back)


def prune(store: IndexStore, below: int) -> int:
    """Delete the undo records of tags below `below`: no kept recovery point needs them."""
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
