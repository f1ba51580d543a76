"""The router's source: every version of every document, by vbucket and seqno, on disk.

One LevelDB database in the router's state directory (`STATE_DIR`):

    b"s" + vbucket (u16) + seqno (u64)  -> {"id": .., "doc": {..}} or {"id": .., "deleted": true}
    b"v" + vbucket (u16)                -> {"high": seqno, "failover": [[vbuuid, seqno], ...]}
    b"e" + expiry (u64) + docid          -> b"" (documents whose latest version expires then)
    b"y" + docid                         -> expiry (u64) of the document's latest version
    b"l" + docid                         -> seqno (u64) of its latest version, where tracked
    b"\\x00meta:num_vbuckets"            -> the number of vbuckets, fixed at creation
    b"\\x00meta:source"                  -> the log's identity (a UUID), made at creation
    b"\\x00meta:owned_vbuckets"          -> JSON list: the vbuckets of a peer router (else all)
    b"\\x00meta:input"                   -> how far a sharded router's input is appended (opaque)
    b"\\x00meta:latest_versions"         -> present: the b"l" keys are kept (PostgreSQL input)

The identity names this history, as a Couchbase bucket UUID does: every handshake carries it,
and a node indexes the history of one source only (another log, even one with the same
documents, numbers them differently). A log made before identities gets one when next opened.

A vbucket's failover log lists the branches of its history, newest first: (vbuuid, the seqno
where the branch starts), as a UPR producer keeps it. Its first use creates (random vbuuid, 0).
`failover` cuts the history back to a seqno and starts a new branch there, so the seqnos after
it are reused by different mutations: a consumer that holds them must roll back.
"""

from __future__ import annotations

import json
import secrets
import struct
import time
import uuid
from collections.abc import Generator, Iterable
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from indexer.protocol import MAX_FAILOVER_ENTRIES
from indexer.router.documents import Document, decode_document, encode_document, vbucket_of
from indexer.router.expiry import expiry_of, with_absolute_expiry
from indexer.storage import ClosedLogs, open_leveldb, start_compaction_thread

STATE_DIR = "source"
DEFAULT_NUM_VBUCKETS = 1024
_META_VBUCKETS = b"\x00meta:num_vbuckets"
_META_SOURCE = b"\x00meta:source"
_META_OWNED = b"\x00meta:owned_vbuckets"
_META_INPUT = b"\x00meta:input"
_META_LATEST = b"\x00meta:latest_versions"
_LATEST = b"l"
_SEQNO = struct.Struct(">Q")
_RECORD = b"s"
_VBUCKET = b"v"
_VB = struct.Struct(">H")
_EXPIRY = b"e"
_PENDING = b"y"
_TIME = struct.Struct(">Q")
_KEY = struct.Struct(">HQ")
_KEY_RECORD = struct.Struct(">BHQ")  # _RECORD, vbucket, seqno: `record_key` in one pack
_MAX_SEQNO = (1 << 64) - 1
# An append of up to 8 MiB of input fits LevelDB's memtable whole (its default is 4 MiB): fewer
# level-0 files, so fewer compactions rewriting the log as it grows.
SOURCE_WRITE_BUFFER = 32 << 20

FailoverLog = tuple[tuple[int, int], ...]
"""(vbuuid, seqno) entries of one vbucket, newest first."""


def describe_vbuckets(vbuckets: tuple[int, ...]) -> str:
    """Vbucket numbers as "first-last" ranges, for one line of a message."""
    parts: list[str] = []
    run: list[int] = []
    for vb in [*vbuckets, -2]:
        if run and vb == run[-1] + 1:
            run.append(vb)
            continue
        if run:
            parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [vb]
    return "vbuckets " + ",".join(parts)


class SourceError(Exception):
    """The source log cannot be opened or changed as asked; the message says why in one line."""


class SourceLockedError(SourceError):
    """Another process (another feed) holds the source log."""


def record_key(vbucket: int, seqno: int) -> bytes:
    """The key of one version of a document."""
    return _RECORD + _KEY.pack(vbucket, seqno)


def expiry_key(when: int, docid: str) -> bytes:
    return _EXPIRY + _TIME.pack(when) + docid.encode()


def _move_expiry(
    batch: Any, docid: str, old: int | None, new: int | None, pending: dict[str, int | None]
) -> None:
    """Point the expiry index at a document's new expiry (in `batch`; noted in `pending`)."""
    if old == new:
        return
    if old is not None:
        batch.delete(expiry_key(old, docid))
        batch.delete(_PENDING + docid.encode())
    if new is not None:
        batch.put(expiry_key(new, docid), b"")
        batch.put(_PENDING + docid.encode(), _TIME.pack(new))
    pending[docid] = new


@dataclass
class _Vbucket:
    """What the log knows of one vbucket: its high seqno and failover log (newest first)."""

    high: int
    failover: list[tuple[int, int]] = field(default_factory=list)

    def encode(self) -> bytes:
        body = {"high": self.high, "failover": [list(entry) for entry in self.failover]}
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, value: bytes) -> _Vbucket:
        body = json.loads(value)
        return cls(int(body["high"]), [(int(u), int(s)) for u, s in body["failover"]])


def _open(path: Path, create: bool) -> Any:
    return open_leveldb(
        path,
        create,
        "the source log",
        "another feed?",
        SourceLockedError,
        SourceError,
        write_buffer_size=SOURCE_WRITE_BUFFER,
    )


class SourceLog:
    """The by-seqno history of a router's documents, with a failover log per vbucket.

    `num_vbuckets` is fixed when the log is created; None on reopening takes the stored count.
    With `create=False` a state directory without a log is an error.
    """

    def __init__(
        self,
        state_dir: Path,
        num_vbuckets: int | None = None,
        create: bool = True,
        compaction_nice: int = 0,
        identity: str | None = None,
        vbuckets: tuple[int, ...] | None = None,
    ) -> None:
        path = state_dir / STATE_DIR
        if not path.is_dir():
            if not create:
                raise SourceError(f"no source log in {state_dir}")
            try:
                path.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise SourceError(f"cannot create {path}: {exc.strerror}") from None
        self.path = path
        self.db = _open(path, create)
        self._closed_logs = ClosedLogs(path)
        start_compaction_thread(self.db, compaction_nice)  # the log compacts as it grows
        try:
            self.num_vbuckets = self._check_vbuckets(num_vbuckets)
            self._vbuckets = self._load_vbuckets()
            self.identity = self._identity(identity)
            self.vbuckets = self._owned(vbuckets)
            self._owns = None if self.vbuckets is None else frozenset(self.vbuckets)
            self.input_position: bytes | None = self.db.get(_META_INPUT)
            self.tracks_latest = self.db.get(_META_LATEST) is not None
            # docid -> expiry of its latest version, for the documents that have one.
            self._pending = {
                key[1:].decode(): _TIME.unpack(value)[0]
                for key, value in self.db.iterator(prefix=_PENDING)
            }
        except BaseException:
            self.db.close()
            raise

    def _check_vbuckets(self, wanted: int | None) -> int:
        stored = self.db.get(_META_VBUCKETS)
        if stored is None:
            count = DEFAULT_NUM_VBUCKETS if wanted is None else wanted
            if not 1 <= count <= 1 << 16:
                raise SourceError(f"{count} vbuckets: the count must be in 1..65536")
            self.db.put(_META_VBUCKETS, str(count).encode(), sync=True)
            return count
        try:
            count = int(stored)
        except ValueError:
            raise SourceError(f"the source log in {self.path} is corrupt (vbucket count)") from None
        if wanted is not None and wanted != count:
            raise SourceError(f"the source log in {self.path} has {count} vbuckets, not {wanted}")
        return count

    def _identity(self, wanted: str | None) -> str:
        """The log's source identity: `wanted` (the one its peers share) or a random UUID,
        fixed the first time it is asked for."""
        stored = self.db.get(_META_SOURCE)
        if stored is not None:
            identity = str(stored.decode())
            if wanted is not None and wanted != identity:
                raise SourceError(
                    f"the source log in {self.path} has source id {identity}, not {wanted}"
                )
            return identity
        identity = wanted or uuid.uuid4().hex
        self.db.put(_META_SOURCE, identity.encode(), sync=True)
        return identity

    def _owned(self, wanted: tuple[int, ...] | None) -> tuple[int, ...] | None:
        """The vbuckets this log's router owns (None: all), fixed when the log is made: peers
        (`indexer router --vbuckets`) each own a range of one source."""
        stored = self.db.get(_META_OWNED)
        if stored is None:
            if wanted is not None:
                if any(not 0 <= vb < self.num_vbuckets for vb in wanted):
                    raise SourceError(f"vbuckets must be in 0..{self.num_vbuckets - 1}")
                if self._vbuckets and any(vb not in wanted for vb in self._vbuckets):
                    raise SourceError(
                        f"the source log in {self.path} has history outside those vbuckets"
                    )
                self.db.put(_META_OWNED, json.dumps(list(wanted)).encode(), sync=True)
            return wanted
        owned = tuple(json.loads(stored))
        if wanted is not None and wanted != owned:
            raise SourceError(
                f"the source log in {self.path} owns {describe_vbuckets(owned)}, "
                f"not {describe_vbuckets(wanted)}"
            )
        return owned

    def owns(self, vbucket: int) -> bool:
        """Whether documents of this vbucket are this router's (all are without a range)."""
        return self._owns is None or vbucket in self._owns

    def streamed_vbuckets(self) -> tuple[int, ...]:
        """The vbuckets this router asks its nodes for: its range, or all."""
        return tuple(range(self.num_vbuckets)) if self.vbuckets is None else self.vbuckets

    def _load_vbuckets(self) -> dict[int, _Vbucket]:
        out = {}
        try:
            for key, value in self.db.iterator(prefix=_VBUCKET):
                (vb,) = _VB.unpack(key[1:])
                out[vb] = _Vbucket.decode(value)
        except (ValueError, KeyError, TypeError, struct.error):
            raise SourceError(
                f"the source log in {self.path} is corrupt (vbucket states)"
            ) from None
        return out

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> SourceLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------------------
    # Reading

    def vbuckets_with_history(self) -> list[int]:
        """The vbuckets in use (appended to at least once), ascending."""
        return sorted(self._vbuckets)

    def high_seqno(self, vbucket: int) -> int:
        """The seqno of the vbucket's latest surviving version; 0 if none."""
        state = self._vbuckets.get(vbucket)
        return 0 if state is None else state.high

    def failover_log(self, vbucket: int) -> FailoverLog:
        """(vbuuid, seqno) entries, newest first; empty for a vbucket never used."""
        state = self._vbuckets.get(vbucket)
        return () if state is None else tuple(state.failover)

    def vbuuid(self, vbucket: int) -> int:
        """The vbuuid of the vbucket's current history (its newest failover entry)."""
        state = self._vbuckets.get(vbucket)
        if state is None:
            raise SourceError(f"vbucket {vbucket} has no history")
        return state.failover[0][0]

    def read(self, vbucket: int, after: int = 0) -> Generator[tuple[int, Document], None, None]:
        """(seqno, document) of the vbucket's versions with seqnos above `after`, in order."""
        with closing(self.read_stored(vbucket, after)) as stored:
            for seqno, value in stored:
                yield seqno, decode_document(value)

    def read_stored(self, vbucket: int, after: int = 0) -> Generator[tuple[int, bytes], None, None]:
        """(seqno, stored bytes) of the vbucket's versions above `after`, in order, unparsed
        (`decode_document` parses them): reading them holds the GIL only briefly."""
        if after >= self.high_seqno(vbucket):
            return
        with self.db.iterator(
            start=record_key(vbucket, after + 1),
            stop=record_key(vbucket, _MAX_SEQNO),
            include_stop=True,
        ) as records:
            for key, value in records:
                yield _KEY.unpack_from(key, 1)[1], value

    def latest_version(self, docid: str) -> Document | None:
        """The document's latest version (a delete too); None where the log holds none or does
        not track latest versions (`track_latest_versions`)."""
        if not self.tracks_latest:
            return None
        seqno = self.db.get(_LATEST + docid.encode())
        if seqno is None:
            return None
        vb = vbucket_of(docid.encode(), self.num_vbuckets)
        value = self.db.get(record_key(vb, _SEQNO.unpack(seqno)[0]))
        if value is None:
            return None
        document = decode_document(value)
        return document if document.docid == docid else None

    def track_latest_versions(self) -> int:
        """From now on, keep where each document's latest version is, in the batch that appends
        it (the PostgreSQL input reads a row's unchanged TOASTed values there); the first call
        indexes what the log holds (blocking). Returns how many documents that indexed."""
        if self.tracks_latest:
            return 0
        latest: dict[bytes, int] = {}
        for key, value in self.db.iterator(prefix=_RECORD):
            latest[decode_document(value).docid.encode()] = _KEY.unpack_from(key, 1)[1]
        with self.db.write_batch(sync=True) as batch:
            for docid, seqno in latest.items():
                batch.put(_LATEST + docid, _SEQNO.pack(seqno))
            batch.put(_META_LATEST, b"1")
        self._sync_closed_logs()
        self.tracks_latest = True
        return len(latest)

    def surviving_documents(self) -> dict[str, Document]:
        """The latest surviving version of each document id (deletes included)."""
        out: dict[str, Document] = {}
        for value in self.db.iterator(prefix=_RECORD, include_key=False):
            document = decode_document(value)
            out[document.docid] = document
        return out

    # ----------------------------------------------------------------------------------------
    # Changing

    def _state(self, vbucket: int) -> _Vbucket:
        state = self._vbuckets.get(vbucket)
        if state is None:
            state = _Vbucket(0, [(self._new_vbuuid(()), 0)])
        return state

    @staticmethod
    def _new_vbuuid(taken: Iterable[tuple[int, int]]) -> int:
        used = {vbuuid for vbuuid, _ in taken}
        while True:
            vbuuid = secrets.randbits(64)
            if vbuuid and vbuuid not in used:
                return vbuuid

    def append(
        self,
        documents: Iterable[Document],
        now: float | None = None,
        encoded: list[bytes] | None = None,
        input_position: bytes | None = None,
        positions: list[tuple[int, int]] | None = None,
    ) -> int:
        """Give each document the next seqno of its vbucket and store it; one synced batch.

        An `_exp` is stored as an absolute unix time (relative to `now`, default the clock), and
        the expiry index follows each document's latest version. `encoded`, if given, receives
        each document's stored bytes, and `positions` its (vbucket, seqno). `input_position`, if
        given, is stored in the same batch (a router shard's place in its parent's input: what
        it appended, and nothing more). Returns how many documents were appended.
        """
        changed: dict[int, _Vbucket] = {}
        pending: dict[str, int | None] = {}  # docid -> its new expiry (None: none any more)
        expiring = self._pending  # docid -> expiry of the documents whose latest version has one
        count = 0
        n = self.num_vbuckets
        clock = time.time() if now is None else now
        tracks_latest = self.tracks_latest
        # transaction: a document source failing half way (a bad input line) writes nothing.
        with self.db.write_batch(transaction=True, sync=True) as batch:
            put = batch.put
            for document in documents:
                timed = document.has_expiry
                if timed:
                    document = with_absolute_expiry(document, clock)
                docid = document.docid
                key = docid.encode()
                vb = vbucket_of(key, n)
                state = changed.get(vb)
                if state is None:
                    state = changed[vb] = self._copy(self._state(vb))
                state.high = seqno = state.high + 1
                # An input line holds the document in the shape the log stores: kept as it is.
                value = document.line if document.line is not None else encode_document(document)
                put(_KEY_RECORD.pack(ord(_RECORD), vb, seqno), value)
                if tracks_latest:
                    put(_LATEST + key, _SEQNO.pack(seqno))
                if encoded is not None:
                    encoded.append(value)
                if positions is not None:
                    positions.append((vb, seqno))
                # Only a document with an expiry, now or in its previous version, moves the index.
                if timed or docid in pending or docid in expiring:
                    self._track_expiry(batch, document, pending)
                count += 1
            for vb, state in changed.items():
                put(_VBUCKET + _VB.pack(vb), state.encode())
            if input_position is not None:
                put(_META_INPUT, input_position)
        self._sync_closed_logs()
        self._vbuckets.update(changed)
        if input_position is not None:
            self.input_position = input_position
        self._apply_pending(pending)
        return count

    def _sync_closed_logs(self) -> None:
        """After a synced batch: the logs LevelDB closed before it are durable too (a power
        cut could otherwise take what that batch's sync seemed to cover; `ClosedLogs`)."""
        try:
            self._closed_logs.sync()
        except OSError as exc:
            raise SourceError(
                f"cannot sync the source log in {self.path}: {exc.strerror}"
            ) from None

    def _track_expiry(self, batch: Any, document: Document, pending: dict[str, int | None]) -> None:
        """Point the expiry index at the document's new version (in the append's batch)."""
        docid = document.docid
        old = pending[docid] if docid in pending else self._pending.get(docid)
        _move_expiry(batch, docid, old, expiry_of(document), pending)

    def _apply_pending(self, pending: dict[str, int | None]) -> None:
        for docid, when in pending.items():
            if when is None:
                self._pending.pop(docid, None)
            else:
                self._pending[docid] = when

    def due_expiries(self, now: float, limit: int = 10_000) -> list[str]:
        """Documents whose latest version expired at or before `now`, earliest first."""
        stop = _EXPIRY + _TIME.pack(int(now) + 1)
        due = []
        for key in self.db.iterator(start=_EXPIRY, stop=stop, include_value=False):
            due.append(key[1 + _TIME.size :].decode())
            if len(due) >= limit:
                break
        return due

    @property
    def pending_expiries(self) -> int:
        """Documents whose latest version has an expiry still to come (or just due)."""
        return len(self._pending)

    @staticmethod
    def _copy(state: _Vbucket) -> _Vbucket:
        return _Vbucket(state.high, list(state.failover))

    def failover(self, vbucket: int, to_seqno: int | None = None) -> tuple[int, int]:
        """Start a new branch of the vbucket's history at `to_seqno` (default: the high seqno,
        a clean failover that loses nothing); returns (new vbuuid, seqno).

        Versions above `to_seqno` are deleted, failover entries starting above it dropped, and
        (fresh vbuuid, to_seqno) put first; at most `MAX_FAILOVER_ENTRIES` are kept.
        """
        if not 0 <= vbucket < self.num_vbuckets:
            raise SourceError(f"vbucket {vbucket} is not in 0..{self.num_vbuckets - 1}")
        state = self._vbuckets.get(vbucket)
        if state is None:
            raise SourceError(f"vbucket {vbucket} has no history to fail over")
        seqno = state.high if to_seqno is None else to_seqno
        if not 0 <= seqno <= state.high:
            raise SourceError(
                f"vbucket {vbucket}: seqno {seqno} is not in 0..{state.high} (its high seqno)"
            )
        kept = [entry for entry in state.failover if entry[1] <= seqno]
        vbuuid = self._new_vbuuid(state.failover)
        new = _Vbucket(seqno, [(vbuuid, seqno), *kept][:MAX_FAILOVER_ENTRIES])
        pending: dict[str, int | None] = {}
        with self.db.write_batch(transaction=True, sync=True) as batch:
            if seqno < state.high:
                for key in self.db.iterator(
                    start=record_key(vbucket, seqno + 1),
                    stop=record_key(vbucket, _MAX_SEQNO),
                    include_stop=True,
                    include_value=False,
                ):
                    batch.delete(key)
                self._rebuild_expiries(batch, vbucket, seqno, pending)
                if self.tracks_latest:
                    self._rebuild_latest(batch, vbucket, seqno)
            batch.put(_VBUCKET + _VB.pack(vbucket), new.encode())
        self._sync_closed_logs()
        self._vbuckets[vbucket] = new
        self._apply_pending(pending)
        return vbuuid, seqno

    def _rebuild_latest(self, batch: Any, vbucket: int, seqno: int) -> None:
        """After history above `seqno` is cut: the latest versions of the documents that had
        versions above it are the surviving ones, or none (blocking: reads the vbucket's log)."""
        latest: dict[str, int] = {}
        cut: set[str] = set()
        for at, document in self.read(vbucket):
            if at > seqno:
                cut.add(document.docid)
            else:
                latest[document.docid] = at
        for docid in cut:
            if docid in latest:
                batch.put(_LATEST + docid.encode(), _SEQNO.pack(latest[docid]))
            else:
                batch.delete(_LATEST + docid.encode())

    def _rebuild_expiries(
        self, batch: Any, vbucket: int, seqno: int, pending: dict[str, int | None]
    ) -> None:
        """After history above `seqno` is cut: the vbucket's expiries follow the surviving
        latest versions (blocking: reads the vbucket's log)."""
        latest: dict[str, Document] = {}
        for at, document in self.read(vbucket):
            if at > seqno:
                break
            latest[document.docid] = document
        n = self.num_vbuckets
        affected = {d for d in self._pending if vbucket_of(d.encode(), n) == vbucket}
        for docid in affected | set(latest):
            new = expiry_of(latest[docid]) if docid in latest else None
            _move_expiry(batch, docid, self._pending.get(docid), new, pending)


def split_log(state_dir: Path, targets: list[tuple[Path, tuple[int, ...]]]) -> int:
    """Copy the source log in `state_dir` into one new log per (state directory, vbuckets) of
    `targets` (a sharded router's), with its history as it is: each vbucket's versions, seqnos
    and failover log, the expiry index and the identity, so its nodes go on without a rollback.
    The old log is left as it was. Returns how many records were copied."""
    with SourceLog(state_dir, create=False) as old:
        if old.vbuckets is not None:
            raise SourceError(f"the source log in {state_dir} is a peer's (a range): not split")
        n = old.num_vbuckets
        owner: dict[int, int] = {}
        for i, (_, vbuckets) in enumerate(targets):
            owner.update(dict.fromkeys(vbuckets, i))
        if sorted(owner) != list(range(n)):
            raise SourceError("the ranges must cover every vbucket once")
        dbs = []
        try:
            for path, vbuckets in targets:
                if (path / STATE_DIR).exists():
                    raise SourceError(f"{path} holds a source log already")
                (path / STATE_DIR).mkdir(parents=True)
                db = _open(path / STATE_DIR, True)
                dbs.append(db)
                db.put(_META_VBUCKETS, str(n).encode())
                db.put(_META_SOURCE, old.identity.encode())
                db.put(_META_OWNED, json.dumps(list(vbuckets)).encode())
                if old.tracks_latest:
                    db.put(_META_LATEST, b"1")
            copied = 0
            batches = [db.write_batch() for db in dbs]
            sizes = [0] * len(dbs)
            for key, value in old.db.iterator():
                tag = key[:1]
                if tag in (_RECORD, _VBUCKET):
                    (vb,) = _VB.unpack_from(key, 1)
                elif tag == _EXPIRY:
                    vb = vbucket_of(key[1 + _TIME.size :], n)
                elif tag in (_PENDING, _LATEST):
                    vb = vbucket_of(key[1:], n)
                else:
                    continue  # the old log's own meta keys
                i = owner[vb]
                batches[i].put(key, value)
                sizes[i] += len(key) + len(value)
                copied += 1
                if sizes[i] >= SOURCE_WRITE_BUFFER:
                    batches[i].write()
                    batches[i], sizes[i] = dbs[i].write_batch(), 0
            for batch in batches:
                batch.write()
            for db, (path, _) in zip(dbs, targets, strict=True):
                db.put(_META_VBUCKETS, str(n).encode(), sync=True)  # all of it on disk:
                ClosedLogs(path / STATE_DIR).sync()  # the logs closed before that put too
        finally:
            for db in dbs:
                db.close()
    return copied
