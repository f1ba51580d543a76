"""The change history of the indexes: what each flush changed, kept between persisted snapshots.

Every flush writes, in the WriteBatch of the entries it describes, one history record per
vbucket it changed documents of, keyed by the highest seqno in it: per document, the mutation
that changed it last in that flush and its keys before and after, in the order of the ids:

    b"h" + vbucket (u16) + seqno (u64) -> marshal (index ids, seqnos, docids, olds, news)
    b"m" + mark (u64)                  -> persisted_at (f64) + zlib of the seqnos (u64 each)
    b"\\x00meta:marks"                  -> the last mark number given (u64): never given twice
    b"\\x00meta:changes"                -> JSON: the history's id, and the mark each index's
                                          history starts at

A mark is a persisted snapshot as the feed names it. Published snapshots always hold exactly
their timestamp (a flush never straddles one), so the changes between marks A and B are the
changes with A[vb] < seqno <= B[vb], in records keyed in that range, and they stay the same
across restarts (one record per flush and vbucket costs a put and a marshal call per vbucket,
not per document): start-up recovery and rollbacks delete the
records (and marks) past the timestamp they go back to, after reverting from them whatever the
store still held past it. The keys are the encoded index keys (back-index values): an array
index's record names the entries before and after as one value each. A record holds columns
(olds and news: per index, its value per document), so that a read takes one index's values
without a Python step per document; records of the row layout written before, (index ids,
[(seqno, docid, olds, news), ...]), still read.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import dataclasses
import json
import marshal
import os
import struct
import threading
import time
import zlib
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from indexer.recovery import set_document_key
from indexer.storage import IndexStore, StoredIndex
from indexer.timestamps import StabilityTimestamp

HISTORY_PREFIX = b"h"
MARK_PREFIX = b"m"
_META_MARKS = b"\x00meta:marks"
_META_CHANGES = b"\x00meta:changes"
HISTORY_FORMAT = 2  # 2: a record per flush and vbucket (1: per document)
_POSITION = struct.Struct(">HQ")
_MARK = struct.Struct(">Q")
_TIME = struct.Struct(">d")
DELETE_BATCH = 10_000


def history_key(vbucket: int, seqno: int) -> bytes:
    return HISTORY_PREFIX + _POSITION.pack(vbucket, seqno)


Change = tuple[int, bytes, tuple[bytes, ...], tuple[bytes, ...]]  # seqno, docid, olds, news


class HistoryGroup(NamedTuple):
    """A history record decoded: the documents' seqnos and docids, and per index (in the order
    of `ids`) its value of each document before (olds) and after (news) the flush."""

    ids: tuple[int, ...]
    seqnos: tuple[int, ...]
    docids: tuple[bytes, ...]
    olds: tuple[tuple[bytes, ...], ...]
    news: tuple[tuple[bytes, ...], ...]


def _by_index(values: Sequence[tuple[bytes, ...]]) -> tuple[tuple[bytes, ...], ...]:
    """Per document, its value of each index -> per index, its value of each document."""
    return tuple(zip(*values, strict=True))


def encode_group(ids: tuple[int, ...], changes: list[Change]) -> bytes:
    """The changes of one flush in one vbucket, in seqno order: the keys of every index the
    writer writes (ids), before and after, as the flush has them, turned into columns."""
    seqnos, docids, olds, news = zip(*changes, strict=True)
    # Version 2: no references between objects. Later versions look every value up in a table
    # (values a flush holds elsewhere too), which cost more than the columns save.
    return marshal.dumps((ids, seqnos, docids, _by_index(olds), _by_index(news)), 2)


def decode_group(value: bytes) -> HistoryGroup:
    decoded = marshal.loads(value)
    if len(decoded) == 5:
        return HistoryGroup(*decoded)
    ids, changes = decoded  # the row layout
    if not changes:
        return HistoryGroup(ids, (), (), (), ())
    seqnos, docids, olds, news = zip(*changes, strict=True)
    return HistoryGroup(ids, seqnos, docids, _by_index(olds), _by_index(news))


class ChangeTokenError(ValueError):
    """A token that is not one the feed gave (a 400)."""


class HistoryGoneError(Exception):
    """A token older than the history kept, or from a history that was rolled back (a 410)."""


@dataclass(frozen=True)
class ChangeToken:
    """Where a reader of the feed is: at mark `since`, or part way from `since` to `until`,
    having read every record up to (`vbucket`, `seqno`) of that interval; or inside the
    snapshot start at mark `since`, having read every entry up to `entry` (encoded key and
    tail, in index order)."""

    history: str
    since: int
    until: int | None = None
    vbucket: int = 0
    seqno: int = 0
    entry: bytes | None = None

    @property
    def at_mark(self) -> bool:
        """Whether the token is a mark's: every change up to it read, nothing part way."""
        return self.until is None and self.entry is None

    def encode(self) -> str:
        if self.entry is not None:
            text = base64.urlsafe_b64encode(self.entry).decode().rstrip("=")
            return f"{self.history}.{self.since}.{SNAPSHOT_PART}.{text}"
        if self.until is None:
            return f"{self.history}.{self.since}"
        return f"{self.history}.{self.since}.{self.until}.{self.vbucket}.{self.seqno}"

    @classmethod
    def decode(cls, text: str) -> ChangeToken:
        parts = text.strip().split(".")
        try:
            if len(parts) == 4 and parts[0] and parts[1].isdigit() and parts[2] == SNAPSHOT_PART:
                entry = base64.urlsafe_b64decode(parts[3] + "=" * (-len(parts[3]) % 4))
                if entry and base64.urlsafe_b64encode(entry).decode().rstrip("=") == parts[3]:
                    return cls(parts[0], int(parts[1]), entry=entry)
                raise ValueError
            if not parts[0] or any(not p.isdigit() for p in parts[1:]):
                raise ValueError
            if len(parts) == 2:
                return cls(parts[0], int(parts[1]))
            if len(parts) == 5:
                since, until, vb, seqno = (int(p) for p in parts[1:])
                if since > until or min(since, vb, seqno) < 0:
                    raise ValueError
                return cls(parts[0], since, until, vb, seqno)
        except (ValueError, binascii.Error):
            pass
        raise ChangeTokenError(f"{text!r} is not a token the change feed gave")


SNAPSHOT_PART = "s"  # the third part of a token inside a snapshot start


def encode_cluster_token(parts: dict[str, str]) -> str:
    """The position of a reader of a cluster's feed: each node's token, by node name
    (`a:3f9a01c2.41,b:77aa0011.40`). Each node keeps its own history and marks."""
    return ",".join(f"{node}:{token}" for node, token in parts.items())


def decode_cluster_token(text: str) -> dict[str, str]:
    """Node name -> that node's token; ChangeTokenError if `text` is not such a vector."""
    parts: dict[str, str] = {}
    for item in text.strip().split(","):
        node, sep, token = item.partition(":")
        if not sep or not node or node in parts:
            raise ChangeTokenError(
                f"{text!r} is not a cluster's token (NODE:TOKEN for each node, comma-separated)"
            )
        ChangeToken.decode(token)
        parts[node] = token
    return parts


@dataclass(frozen=True)
class Mark:
    """A persisted snapshot as the feed knows it."""

    number: int
    timestamp: tuple[int, ...]  # the seqnos
    persisted_at: float


def _encode_mark(seqnos: Sequence[int], persisted_at: float) -> bytes:
    return _TIME.pack(persisted_at) + zlib.compress(array("Q", seqnos).tobytes(), 1)


def _decode_mark(number: int, value: bytes) -> Mark:
    seqnos = array("Q")
    seqnos.frombytes(zlib.decompress(value[_TIME.size :]))
    return Mark(number, tuple(seqnos), _TIME.unpack_from(value)[0])


def _covered(seqnos: Sequence[int], by: Sequence[int]) -> bool:
    return all(a <= b for a, b in zip(seqnos, by, strict=True))


@dataclass(frozen=True)
class Lease:
    """A consumer's hold on the history from a mark on, until a wall-clock time."""

    name: str
    mark: int
    expires_at: float


class ChangeRow(NamedTuple):
    """One row of the feed: an entry inserted or deleted, and the mark it first shows in."""

    op: str
    key: bytes  # encoded, as in the main index
    docid: bytes
    snapshot: int


@dataclass(frozen=True)
class _Span:
    """The records a read covers: the changes after mark `since` up to mark `until`, from
    position `first` (vbucket, seqno read up to) to `last` (inclusive; None: to the end)."""

    since: Mark
    until: int
    numbers: list[int]  # the marks after since, up to until
    stamps: Any  # their timestamps (numpy, a row per mark)
    first: tuple[int, int]
    last: tuple[int, int] | None
    stopped: bool  # `last` is where the reader asked to stop (its token ends the read)
    only: frozenset[int] | None = None  # the vbuckets read (None: all)

    def ended_at(self, vbucket: int, seqno: int) -> _Span:
        return dataclasses.replace(self, last=(vbucket, seqno), stopped=True)


DocumentChange = tuple[int, bytes, list[bytes], list[bytes]]  # seqno, docid, keys lost, gained


class ChangeBlock(NamedTuple):
    """The documents of one history record, as columns in seqno order, all of one mark: each
    one's seqno, docid and the index's value before and after (b"": no entry; for an array
    index, its entries together, as the back index holds them). A document whose value did not
    change is in it too: the readers skip it (`document_changes`, or in columns)."""

    vbucket: int
    mark: int
    seqnos: Sequence[int]
    docids: Sequence[bytes]
    olds: Sequence[bytes]
    news: Sequence[bytes]


def document_changes(index: StoredIndex, block: ChangeBlock) -> Iterator[DocumentChange]:
    """Per document of `block` whose entries of `index` changed: its seqno, docid, and the
    entry keys it lost and gained."""
    documents = zip(block.seqnos, block.docids, block.olds, block.news, strict=True)
    if not index.array:  # one entry at most, before and after
        for seqno, docid, old, new in documents:
            if old != new:
                yield seqno, docid, [old] if old else [], [new] if new else []
        return
    entry_keys = index.entry_keys
    for seqno, docid, old, new in documents:
        if old == new:
            continue
        olds = entry_keys(old)
        news = entry_keys(new)
        gone = [k for k in olds if k not in news]
        came = [k for k in news if k not in olds]
        if gone or came:
            yield seqno, docid, gone, came


def _rows(index: StoredIndex, blocks: Iterator[ChangeBlock]) -> Iterator[ChangeRow]:
    """The feed's rows of history records: per document, its deletes, then its inserts."""
    for block in blocks:
        for _, docid, gone, came in document_changes(index, block):
            for k in gone:
                yield ChangeRow("delete", k, docid, block.mark)
            for k in came:
                yield ChangeRow("insert", k, docid, block.mark)


class ChangeHistory:
    """The marks and history records of one store (blocking calls: run them in a thread)."""

    def __init__(self, store: IndexStore, num_vbuckets: int, enabled: bool = True) -> None:
        self.store = store
        self.num_vbuckets = num_vbuckets
        self.enabled = enabled
        raw = store.get(_META_CHANGES)
        meta: dict[str, Any] = json.loads(raw) if raw else {}
        # History of another format is dropped at `recover`, and its tokens with it.
        self.stale = raw is not None and meta.get("format", 1) != HISTORY_FORMAT
        if self.stale:
            meta = {}
        self.history_id: str = meta.get("id") or os.urandom(4).hex()
        # index id -> (index name, the mark its history starts at)
        self.starts: dict[int, tuple[str, int]] = {
            int(i): (str(item[0]), int(item[1])) for i, item in meta.get("starts", {}).items()
        }
        # Consumer name -> Lease: history from its mark is kept while the lease holds. Leases
        # change from request threads and prunes: under the lock.
        self._lease_lock = threading.Lock()
        self.leases: dict[str, Lease] = {
            str(name): Lease(str(name), int(item[0]), float(item[1]))
            for name, item in meta.get("leases", {}).items()
        }
        found = store.get(_META_MARKS)
        self.last_number = _MARK.unpack(found)[0] if found else 0
        self.latest: Mark | None = None  # the mark of the persisted snapshot

    # -- what the store keeps -----------------------------------------------------------------

    def _meta(self) -> bytes:
        starts = {str(i): [name, mark] for i, (name, mark) in self.starts.items()}
        # A copy first: the copy is atomic where a walk of a dict another thread changes is not.
        leases = {
            lease.name: [lease.mark, lease.expires_at] for lease in list(self.leases.values())
        }
        body = {"format": HISTORY_FORMAT, "id": self.history_id, "starts": starts}
        body["leases"] = leases
        return json.dumps(body).encode()

    def hold(self, name: str, token: ChangeToken, lease_s: float) -> Lease:
        """Keep the history from `token` on for `lease_s` seconds for consumer `name` (a new
        lease, or one moved forward: a consumer's commit). Raises HistoryGoneError if that
        history is gone already."""
        if token.history != self.history_id:
            raise HistoryGoneError(f"the token is of another change history ({token.history})")
        if self.mark(token.since) is None:
            raise HistoryGoneError(
                f"snapshot {token.encode()} is no longer kept: a lease cannot bring it back"
            )
        lease = Lease(name, token.since, time.time() + lease_s)
        with self._lease_lock:
            self.leases[name] = lease
            self.store.write([(_META_CHANGES, self._meta())], ())
        return lease

    def release(self, name: str) -> bool:
        """End a consumer's lease; whether there was one."""
        with self._lease_lock:
            if self.leases.pop(name, None) is None:
                return False
            self.store.write([(_META_CHANGES, self._meta())], ())
        return True

    def marks(self, source: Any = None, start: int = 0) -> Iterator[Mark]:
        """The marks kept, oldest first, from number `start` on."""
        db = source if source is not None else self.store.db
        cut = len(MARK_PREFIX)
        for key, value in db.iterator(start=MARK_PREFIX + _MARK.pack(start), stop=b"n"):
            yield _decode_mark(_MARK.unpack_from(key, cut)[0], value)

    def mark(self, number: int, source: Any = None) -> Mark | None:
        db = source if source is not None else self.store.db
        value = db.get(MARK_PREFIX + _MARK.pack(number))
        return None if value is None else _decode_mark(number, value)

    def write_mark(self, timestamp: StabilityTimestamp, indexes: Sequence[StoredIndex]) -> Mark:
        """Record a snapshot about to be persisted as the next mark; the indexes whose history
        has no start yet start at it. Not synced: the persist's sync that follows does it."""
        self.last_number += 1
        mark = Mark(self.last_number, timestamp.seqnos, time.time())
        active = {index.index_id for index in indexes}
        self.starts = {i: start for i, start in self.starts.items() if i in active}
        for index in indexes:
            start = self.starts.get(index.index_id)
            if start is None or start[0] != index.definition.name:
                self.starts[index.index_id] = (index.definition.name, mark.number)
        key = MARK_PREFIX + _MARK.pack(mark.number)
        self.store.write(
            [
                (key, _encode_mark(mark.timestamp, mark.persisted_at)),
                (_META_MARKS, _MARK.pack(mark.number)),
                (_META_CHANGES, self._meta()),
            ],
            (),
        )
        return mark

    def forget_index(self, index_id: int) -> None:
        """An index dropped, or merged after its build: its history starts at the next mark."""
        self.starts.pop(index_id, None)

    def restart(self, vbuckets: set[int]) -> int:
        """`vbuckets` left this node and their entries were deleted, without history records:
        their records go (their seqnos start again from 0) and every index's history starts
        again at the next mark, so older tokens answer 410 rather than miss those deletes.
        Returns the records deleted. Durable when it returns."""
        deleted = sum(
            self._delete_range(history_key(vb, 0), history_key(vb + 1, 0)) for vb in vbuckets
        )
        self.starts.clear()
        self.store.write([(_META_CHANGES, self._meta())], ())
        self.store.sync()
        return deleted

    # -- going back ----------------------------------------------------------------------------

    def recover(
        self,
        timestamp: StabilityTimestamp,
        indexes: Sequence[StoredIndex],
        cleared: bool = False,
    ) -> int:
        """Make the store and the history hold exactly `timestamp` (start-up, rollback):
        documents changed past it go back to their keys at it, read from the records past it,
        which are deleted with the marks past it. `cleared`: the store was emptied, so is the
        history. Returns the documents reverted. Durable when it returns."""
        if cleared or self.stale:
            self.stale = False
            reverted = 0
            self._delete_range(HISTORY_PREFIX, b"i")
            self._delete_range(MARK_PREFIX, b"n")
            self.starts.clear()
        else:
            reverted = self._revert_past(timestamp.seqnos, indexes)
            dead = [m.number for m in self.marks() if not _covered(m.timestamp, timestamp.seqnos)]
            self.store.write((), [MARK_PREFIX + _MARK.pack(n) for n in dead])
            if dead:
                first = min(dead)
                self.starts = {i: s for i, s in self.starts.items() if s[1] < first}
        self.store.write([(_META_CHANGES, self._meta())], ())
        self.store.sync()
        return reverted

    def open(self, timestamp: StabilityTimestamp, indexes: Sequence[StoredIndex]) -> Mark:
        """After `recover`: the mark of the persisted snapshot, written if it has none."""
        latest = None
        for mark in self.marks():
            latest = mark
        if latest is None or latest.timestamp != timestamp.seqnos:
            latest = self.write_mark(timestamp, indexes)
            self.store.sync()
        self.latest = latest
        return latest

    def _revert_past(self, seqnos: Sequence[int], indexes: Sequence[StoredIndex]) -> int:
        # Per document, the old keys of its earliest record past the timestamp: its keys there.
        oldest: dict[bytes, dict[int, bytes]] = {}
        doomed: list[bytes] = []
        db = self.store.db
        for vb in range(self.num_vbuckets):
            start = history_key(vb, seqnos[vb] + 1)
            stop = history_key(vb + 1, 0)
            for key, value in db.iterator(start=start, stop=stop):
                doomed.append(key)
                group = decode_group(value)
                for i, index_id in enumerate(group.ids):
                    for docid, old in zip(group.docids, group.olds[i], strict=True):
                        # Seqno order: the first is the oldest.
                        oldest.setdefault(docid, {}).setdefault(index_id, old)
        # Records of one vbucket come in seqno order, and a document lives in one vbucket.
        by_id = {index.index_id: index for index in indexes}
        reverted = 0
        batch = self.store.write_batch()
        for docid, wanted in oldest.items():
            changed = False
            for index_id, key in wanted.items():
                index = by_id.get(index_id)
                if index is not None:  # else dropped since
                    changed |= set_document_key(self.store, batch, index, docid, key)
            reverted += changed
        for key in doomed:
            batch.delete(key)
        self.store.commit(batch)
        return reverted

    def _delete_range(self, start: bytes, stop: bytes) -> int:
        deleted = 0
        while True:
            keys = []
            for key in self.store.db.iterator(start=start, stop=stop, include_value=False):
                keys.append(key)
                if len(keys) >= DELETE_BATCH:
                    break
            if not keys:
                return deleted
            self.store.write((), keys)
            deleted += len(keys)

    # -- retention -----------------------------------------------------------------------------

    def prune(
        self,
        keep_s: float,
        keep_marks: int,
        now: float | None = None,
        keep_bytes: int | None = None,
    ) -> int:
        """Forget the history older than `keep_s` seconds, and the oldest beyond `keep_bytes`
        of store (approximate: what LevelDB's tables hold), keeping at least `keep_marks` marks
        and the latest, and what a lease holds: the oldest mark kept is where tokens may start.
        Returns the records deleted."""
        marks = list(self.marks())
        now = time.time() if now is None else now
        with self._lease_lock:
            expired = [name for name, lease in self.leases.items() if lease.expires_at <= now]
            for name in expired:
                del self.leases[name]
            if expired:
                self.store.write([(_META_CHANGES, self._meta())], ())
            held = min((lease.mark for lease in self.leases.values()), default=None)
        keep = max(keep_marks, 1)
        # The marks that may go, oldest first: not the last `keep`, none a lease holds.
        may_go = [m for m in marks[:-keep] if held is None or m.number < held]
        dropped = 0
        while dropped < len(may_go) and now - may_go[dropped].persisted_at > keep_s:
            dropped += 1
        if keep_bytes is not None:
            total = int(self.store.db.approximate_sizes((HISTORY_PREFIX, b"i"))[0])
            while dropped < len(may_go) and total - self._bytes_to(may_go[dropped]) > keep_bytes:
                dropped += 1
        if not dropped:
            return 0
        doomed = may_go[:dropped]
        floor = marks[dropped]  # the oldest mark kept
        deleted = 0
        for vb in range(self.num_vbuckets):
            stop = history_key(vb, floor.timestamp[vb] + 1)
            deleted += self._delete_range(history_key(vb, 0), stop)
        self.store.write((), [MARK_PREFIX + _MARK.pack(m.number) for m in doomed])
        return deleted

    def _bytes_to(self, mark: Mark) -> int:
        """The approximate bytes of the history records up to `mark` (what dropping the marks
        before the next would free)."""
        ranges = [
            (history_key(vb, 0), history_key(vb, s + 1)) for vb, s in enumerate(mark.timestamp)
        ]
        return int(sum(self.store.db.approximate_sizes(*ranges)))

    # -- reading -------------------------------------------------------------------------------

    def check_start(self, index: StoredIndex, mark: int) -> None:
        """Raise HistoryGoneError unless the history of `index` is kept from `mark` on."""
        start = self.starts.get(index.index_id)
        if start is None or start[0] != index.definition.name:
            raise HistoryGoneError(
                f"index {index.definition.name!r} has no change history yet (it starts at the "
                "next persisted snapshot): read it from a snapshot"
            )
        if mark < start[1]:
            raise HistoryGoneError(
                f"the change history of index {index.definition.name!r} starts at snapshot "
                f"{self.history_id}.{start[1]}, after {self.history_id}.{mark}: start again from "
                "a snapshot (since=snapshot)"
            )

    def read(
        self,
        index: StoredIndex,
        token: ChangeToken,
        until: int,
        source: Any,
        limit: int | None = None,
        stop: ChangeToken | None = None,
        only: frozenset[int] | None = None,
    ) -> tuple[Iterator[ChangeRow], ChangeToken]:
        """The rows of `index` from `token` up to mark `until` (at most `limit`, whole
        documents' changes), read lazily from `source` (a LevelDB snapshot, open while they are
        read), and the token to read on from.

        `stop`, a token part way through an interval (one a limited read gave), ends the read
        there instead: the interval must be the one `token` starts or is in, so that reads
        bounded by tokens (Spark's micro-batches) always answer the same rows. A limited read
        first finds where it ends (counting, no rows kept), so memory never holds the answer."""
        blocks, after = self.read_records(index, token, until, source, limit, stop, only)
        return _rows(index, blocks), after

    def read_records(
        self,
        index: StoredIndex,
        token: ChangeToken,
        until: int,
        source: Any,
        limit: int | None = None,
        stop: ChangeToken | None = None,
        only: frozenset[int] | None = None,
    ) -> tuple[Iterator[ChangeBlock], ChangeToken]:
        """`read`, as the history records hold its rows: their documents in columns, a block
        per record and mark (what the HTTP answer turns into Arrow columns a chunk at a time,
        without an object per row). With `only`, the changes of those vbuckets alone (a
        cluster's node answering for its active ones)."""
        span = self._span(index, token, until, source, stop)
        if span is None:
            return iter(()), ChangeToken(self.history_id, token.since)
        if only is not None:
            span = dataclasses.replace(span, only=only)
        after = self._end_of(index, span, source, limit)
        if after.until is not None:
            span = span.ended_at(after.vbucket, after.seqno)
        return self._changed(index, span, source), after

    def locate(
        self,
        index: StoredIndex,
        token: ChangeToken,
        until: int,
        source: Any,
        limit: int | None = None,
        stop: ChangeToken | None = None,
        only: frozenset[int] | None = None,
    ) -> ChangeToken:
        """Where `read` with the same arguments ends: its token alone, no rows built (the
        records are a generator, left unread)."""
        return self.read_records(index, token, until, source, limit, stop, only)[1]

    def _span(
        self,
        index: StoredIndex,
        token: ChangeToken,
        until: int,
        source: Any,
        stop: ChangeToken | None,
    ) -> _Span | None:
        """The records a read covers, checked (None: nothing to read)."""
        if stop is not None:
            if stop.until is None:
                raise ValueError("stop: a token part way through an interval")
            if (stop.history, stop.since) != (token.history, token.since) or (
                token.until is not None
                and (
                    token.until != stop.until
                    or (token.vbucket, token.seqno) > (stop.vbucket, stop.seqno)
                )
            ):
                raise ChangeTokenError("until: a token of the interval since is in, after it")
            until = stop.until
        if token.history != self.history_id:
            raise HistoryGoneError(
                f"the token is of another change history ({token.history}, this daemon keeps "
                f"{self.history_id}: a new data directory, or another node): start again from "
                "a snapshot (since=snapshot)"
            )
        if token.until is not None:
            until = token.until  # the interval a partial token is in is finished first
        since = self._mark_or_gone(token.since, source)
        self.check_start(index, since.number)
        if until < since.number:
            raise ChangeTokenError(f"until {until} is before the token's snapshot {since.number}")
        between = [m for m in self.marks(source, since.number + 1) if m.number <= until]
        if not between or between[-1].number != until:
            if until == since.number:
                return None
            self._mark_or_gone(until, source)
        partial = token.until is not None
        return _Span(
            since=since,
            until=until,
            numbers=[m.number for m in between],
            stamps=np.array([m.timestamp for m in between], dtype=np.uint64),
            first=(token.vbucket, token.seqno) if partial else (0, 0),
            last=(stop.vbucket, stop.seqno) if stop is not None else None,
            stopped=stop is not None,
        )

    def _changed(self, index: StoredIndex, span: _Span, source: Any) -> Iterator[ChangeBlock]:
        """The history records of `span` that `index` was written with, in order, as blocks
        of documents in one mark each (one flush never straddles a snapshot: a record is one
        block). Per record: one unmarshal, the documents' columns sliced to the span, and the
        index's values picked by position (no work per document in Python beyond that)."""
        index_id = index.index_id
        end = span.stamps[-1]
        numbers = span.numbers
        first_vb, first_seqno = span.first
        last_vb, last_seqno = span.last if span.last is not None else (self.num_vbuckets - 1, -1)
        for vb in range(first_vb, last_vb + 1):
            if span.only is not None and vb not in span.only:
                continue
            low = span.since.timestamp[vb]
            if vb == first_vb:
                low = max(low, first_seqno)
            high = int(end[vb])
            if span.last is not None and vb == last_vb:
                high = min(high, last_seqno)
            if high <= low:
                continue
            reached = span.stamps[:, vb].tolist()  # the seqno of vb each mark reached
            # Records are keyed by their highest seqno: those of the flushes up to end[vb].
            iterator = source.iterator(
                start=history_key(vb, low + 1),
                stop=history_key(vb, int(end[vb]) + 1),
                include_key=False,
            )
            try:
                for value in iterator:
                    ids, seqnos, docids, olds_by_index, news_by_index = decode_group(value)
                    if index_id not in ids or not seqnos:
                        continue  # written before the index was active
                    position = ids.index(index_id)
                    olds, news = olds_by_index[position], news_by_index[position]
                    start = bisect.bisect_right(seqnos, low) if seqnos[0] <= low else 0
                    stop = bisect.bisect_right(seqnos, high) if seqnos[-1] > high else len(seqnos)
                    if start >= stop:
                        continue
                    if start or stop < len(seqnos):
                        seqnos, docids = seqnos[start:stop], docids[start:stop]
                        olds, news = olds[start:stop], news[start:stop]
                    # The mark of a change: the first whose timestamp reaches its seqno.
                    at = bisect.bisect_left(reached, seqnos[0])
                    if reached[at] >= seqnos[-1]:
                        yield ChangeBlock(vb, numbers[at], seqnos, docids, olds, news)
                        continue
                    # Not written by a flush of this daemon's: a block per mark it straddles.
                    i = 0
                    while i < len(seqnos):
                        at = bisect.bisect_left(reached, seqnos[i])
                        j = bisect.bisect_right(seqnos, reached[at], i)
                        yield ChangeBlock(
                            vb, numbers[at], seqnos[i:j], docids[i:j], olds[i:j], news[i:j]
                        )
                        i = j
            finally:
                iterator.close()

    def _end_of(
        self, index: StoredIndex, span: _Span, source: Any, limit: int | None
    ) -> ChangeToken:
        """The token after the first `limit` rows of `span` (whole documents' changes), or
        after all of it."""
        if limit is not None:
            count = 0
            for block in self._changed(index, span, source):
                vb = block.vbucket
                for seqno, _, gone, came in document_changes(index, block):
                    size = len(gone) + len(came)
                    if count and count + size > limit:  # this change is the next page's first
                        return ChangeToken(
                            self.history_id, span.since.number, span.until, vb, seqno - 1
                        )
                    count += size
                    if count >= limit:
                        return ChangeToken(
                            self.history_id, span.since.number, span.until, vb, seqno
                        )
        if span.stopped:
            assert span.last is not None
            return ChangeToken(self.history_id, span.since.number, span.until, *span.last)
        return ChangeToken(self.history_id, span.until)

    def _mark_or_gone(self, number: int, source: Any) -> Mark:
        mark = self.mark(number, source)
        if mark is not None:
            return mark
        if number > self.last_number:
            raise HistoryGoneError(
                f"snapshot {self.history_id}.{number} was never persisted here: start again "
                "from a snapshot (since=snapshot)"
            )
        raise HistoryGoneError(
            f"snapshot {self.history_id}.{number} is no longer kept (older than the change "
            "history kept, or rolled back): start again from a snapshot (since=snapshot)"
        )

    def statistics(
        self, keep_s: float | None = None, keep_marks: int = 1, keep_bytes: int | None = None
    ) -> dict[str, Any]:
        """The history kept, for /stats: its marks (the oldest is where tokens may start), the
        start of each index's history, and with the retention's bounds what each holds now.
        Reads the first and last mark and counts keys."""
        db = self.store.db
        count = sum(1 for _ in db.iterator(start=MARK_PREFIX, stop=b"n", include_value=False))
        first = next(db.iterator(start=MARK_PREFIX, stop=b"n"), None)
        last = next(db.iterator(start=MARK_PREFIX, stop=b"n", reverse=True), None)
        cut = len(MARK_PREFIX)
        oldest = (
            None if first is None else _decode_mark(_MARK.unpack_from(first[0], cut)[0], first[1])
        )
        latest = None if last is None else _MARK.unpack_from(last[0], cut)[0]
        sizes = db.approximate_sizes((HISTORY_PREFIX, b"i"))
        answer = {
            "id": self.history_id,
            "marks": count,
            "oldest": None if oldest is None else f"{self.history_id}.{oldest.number}",
            "latest": None if latest is None else f"{self.history_id}.{latest}",
            "oldest_age_s": None if oldest is None else round(time.time() - oldest.persisted_at, 3),
            "approximate_bytes": int(sizes[0]),
            "starts": {name: f"{self.history_id}.{mark}" for name, mark in self.starts.values()},
            "leases": {
                lease.name: {
                    "token": f"{self.history_id}.{lease.mark}",
                    "expires_in_s": round(lease.expires_at - time.time(), 3),
                }
                for lease in list(self.leases.values())
            },
        }
        if keep_s is not None:
            answer["retention"] = self._holding(keep_s, keep_marks, keep_bytes, int(sizes[0]))
        return answer

    def _holding(
        self, keep_s: float, keep_marks: int, keep_bytes: int | None, size: int
    ) -> dict[str, Any]:
        """Each retention bound, and what keeps the oldest mark now (the next prune drops
        what none of them keeps)."""
        marks = list(self.marks())
        now = time.time()
        oldest = marks[0] if marks else None
        held_by = []
        if oldest is not None:
            if now - oldest.persisted_at <= keep_s:
                held_by.append("age")
            if len(marks) <= max(keep_marks, 1):
                held_by.append("snapshots")
            held_by += [
                f"lease {lease.name}"
                for lease in list(self.leases.values())
                if lease.mark <= oldest.number and lease.expires_at > now
            ]
        live = [lease.mark for lease in list(self.leases.values()) if lease.expires_at > now]
        return {
            "age": {
                "bound_s": keep_s,
                "marks": sum(1 for m in marks if now - m.persisted_at <= keep_s),
            },
            "snapshots": {
                "bound": max(keep_marks, 1),
                "marks": min(len(marks), max(keep_marks, 1)),
            },
            "size": {"bound_bytes": keep_bytes, "history_bytes": size},
            "leases": {"marks": sum(1 for m in marks if live and m.number >= min(live))},
            "oldest_kept_by": held_by,
        }
