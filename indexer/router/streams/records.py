"""Documents to mutation records and records to frames (sans-IO, pure).

`RecordEncoder` evaluates a handshake reply's index keys and partial-index conditions for each
document (the daemon never parses documents); `Batcher` groups records per vbucket into
snapshots. Every stream of the router, the one-shot feed and the build encoder use them.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable, Sequence

from indexer import protocol as p
from indexer.expressions import PLAIN_PATH, ExpressionError, KeyExtractor
from indexer.keys import MISSING, KeyEncodingError, encode_value, index_key
from indexer.router.documents import Document
from indexer.router.streams.paths import LinePaths, Unreadable
from indexer.where import WhereError, matches, parse_where

BATCH_RECORDS = 512
SEND_BYTES = 256 * 1024
# A frame's header and a MUTATIONS frame's own header, with room to spare: one record of at
# most max_frame_bytes - FRAME_OVERHEAD always fits a frame.
FRAME_OVERHEAD = 64
MAX_REPORTED = 10_000  # documents an encoder remembers having logged
MAX_CACHED_SCALARS = 65_536  # encoded scalar values an encoder keeps (cleared when full)
_MISSING = encode_value(MISSING)

log = logging.getLogger("indexer.router")


def _path_key(paths: Sequence[str]) -> Callable[[object, str], bytes]:
    """The key of an index on plain field paths (the document's id is not needed)."""
    return lambda body, _docid: index_key(body, paths)


class FeedError(Exception):
    """The feed cannot go on; the message is one line for the user."""

    def __init__(self, message: str, code: p.ErrorCode | None = None) -> None:
        super().__init__(message)
        self.code = code


def default_vbuuid(vbucket: int) -> int:
    """The vbuuid of a vbucket's history for a router without failovers: stable across runs."""
    return zlib.crc32(b"vbuuid:%d" % vbucket) | 1 << 32


class RecordEncoder:
    """Documents in, mutation records out (pure): the index keys of a handshake reply's indexes,
    an empty key where a partial index's condition is not TRUE or the leading field is missing.

    A record never exceeds `max_record_bytes` (what one frame of the node carries) and a
    document never stops a stream: a key that cannot be encoded (a version stored before the
    input checks, NaN say) or that does not fit a frame is left out of its index, as GSI skips
    a key over its size limit, and the document is logged once (`left_out` counts them).
    """

    def __init__(
        self,
        indexes: Sequence[p.IndexDefinition],
        max_frame_bytes: int = p.DEFAULT_MAX_FRAME_BYTES,
    ) -> None:
        self.paths = [index.keys for index in indexes]
        self.names = [index.name for index in indexes]
        self.nkeys = len(self.paths)
        self.max_frame_bytes = max_frame_bytes
        self.max_record_bytes = max_frame_bytes - FRAME_OVERHEAD
        try:
            self.wheres = [
                None if index.where is None else parse_where(index.where) for index in indexes
            ]
        except WhereError as exc:
            raise FeedError(f"the indexer sent a bad where: {exc}") from None
        self.partial = any(where is not None for where in self.wheres)
        # Indexes on plain field paths take the fast path below; an expression or array key
        # (indexer/expressions.py) is evaluated by its index's extractor.
        plain = [all(PLAIN_PATH.match(k) for k in index.keys) for index in indexes]
        try:
            self.extractors: list[Callable[[object, str], bytes]] = [
                _path_key(index.keys) if paths else KeyExtractor(index.keys)
                for index, paths in zip(indexes, plain, strict=True)
            ]
        except ExpressionError as exc:
            raise FeedError(f"the indexer sent a bad index key: {exc}") from None
        self.plain = all(plain)
        self.left_out = 0
        self._reported: set[str] = set()
        # Each distinct field path is read and encoded once per document, whatever number of
        # indexes holds it (by_city and by_age both hold `age`); keys are their concatenations.
        distinct = list(dict.fromkeys(path for paths in self.paths for path in paths))
        self._steps = [tuple(path.split(".")) for path in distinct]
        self._columns = [tuple(distinct.index(path) for path in paths) for paths in self.paths]
        self._scalars: dict[tuple[type, object], bytes] = {}
        # A document still in its line has only these paths decoded (no dict held per field).
        self._line_paths = LinePaths(self._steps) if self.plain and not self.partial else None

    def keys(self, document: Document, seqno: int = 0) -> tuple[bytes, ...]:
        """The document's key in every index (b"" = not in that index)."""
        if document.deleted:
            return (b"",) * self.nkeys
        try:
            if self._line_paths is not None:
                line = document.unparsed_line
                if line is not None:
                    try:
                        return self._keys_of(self._line_paths.read(line))
                    except Unreadable:
                        pass  # a path through a value that is not an object: parse it all
                body = document.body
                assert body is not None
                return self._plain_keys(body)
            body = document.body
            assert body is not None
            # A document a partial index's condition is not TRUE for gets the empty key,
            # which removes its entry there, like a missing leading field.
            docid = document.docid
            return tuple(
                key(body, docid) if matches(where, body) else b""
                for key, where in zip(self.extractors, self.wheres, strict=True)
            )
        except (KeyEncodingError, RecursionError):
            return self._keys_one_by_one(document, seqno)

    def _plain_keys(self, body: dict[str, object]) -> tuple[bytes, ...]:
        """`keys` without partial indexes, from a parsed body."""
        values: list[object] = []
        for steps in self._steps:
            value: object = body
            for step in steps:
                value = value.get(step, MISSING) if type(value) is dict else MISSING
            values.append(value)
        return self._keys_of(values)

    def _keys_of(self, values: list[object]) -> tuple[bytes, ...]:
        """The keys of plain indexes from each distinct path's value: each encoded once,
        scalars that come again (ages, cities) from a small cache."""
        scalars = self._scalars
        encoded: list[bytes | None] = []
        for value in values:
            if value is MISSING:
                encoded.append(None)
                continue
            kind = type(value)
            if kind is str or kind is int or kind is bool or value is None:
                cached = scalars.get((kind, value))
                if cached is None:
                    if len(scalars) >= MAX_CACHED_SCALARS:
                        scalars.clear()
                    cached = scalars[(kind, value)] = encode_value(value)
                encoded.append(cached)
            else:
                encoded.append(encode_value(value))
        keys = []
        for columns in self._columns:
            first = encoded[columns[0]]
            if first is None:  # N1QL leaves out a document whose leading key is missing
                keys.append(b"")
            elif len(columns) == 1:
                keys.append(first)
            else:
                keys.append(b"".join(_MISSING if (e := encoded[c]) is None else e for c in columns))
        return tuple(keys)

    def _keys_one_by_one(self, document: Document, seqno: int) -> tuple[bytes, ...]:
        """The slow path of `keys`: each index on its own, the failing ones left out."""
        body = document.body
        assert body is not None
        keys = []
        for name, extract, where in zip(self.names, self.extractors, self.wheres, strict=True):
            try:
                key = extract(body, document.docid) if matches(where, body) else b""
            except (KeyEncodingError, RecursionError) as exc:
                why = "a value is nested too deeply" if isinstance(exc, RecursionError) else exc
                self._report(document.docid, seqno, name, str(why))
                key = b""
            keys.append(key)
        return tuple(keys)

    def stored_records(self, items: Sequence[tuple[int, bytes, bytes | None]]) -> list[bytes]:
        """The records of Mutation Manager items, (seqno, docid, payload): a delete has no
        payload, an upsert's is its line in the JSONL shape. Keys are read from the line
        without a document where they can be; anything else takes `record`'s way."""
        paths = self._line_paths
        deleted = (b"",) * self.nkeys
        limit = self.max_record_bytes
        out: list[bytes] = []
        for seqno, docid, payload in items:
            if payload is None:
                out.append(p.encode_record_of(seqno, docid, deleted, True))
                continue
            if paths is not None:
                try:
                    keys = self._keys_of(paths.read(payload))
                except (Unreadable, KeyEncodingError, RecursionError):
                    pass  # a path through a non-object, a key beyond encoding: the full way
                else:
                    record = p.encode_record_of(seqno, docid, keys, False)
                    if len(record) <= limit:
                        out.append(record)
                        continue
            out.append(self.record(seqno, Document.from_line(docid.decode(), payload), docid))
        return out

    def record(self, seqno: int, document: Document, docid: bytes | None = None) -> bytes:
        """The MUTATIONS record of `document` at `seqno` (`docid`: its id, already encoded)."""
        docid = document.docid.encode() if docid is None else docid
        keys = self.keys(document, seqno)
        record = p.encode_record_of(seqno, docid, keys, document.deleted)
        if len(record) > self.max_record_bytes:
            return self._fit(seqno, document, docid, keys, len(record))
        return record

    def _fit(
        self, seqno: int, document: Document, docid: bytes, keys: tuple[bytes, ...], size: int
    ) -> bytes:
        """A record over a frame: its largest keys are left out until the rest fits."""
        fitted = list(keys)
        for i in sorted(range(self.nkeys), key=lambda i: len(keys[i]), reverse=True):
            if size <= self.max_record_bytes:
                break
            size -= len(keys[i])
            fitted[i] = b""
            self._report(
                document.docid,
                seqno,
                self.names[i],
                f"its key takes {len(keys[i]):,} bytes, more than a frame of this node carries "
                f"(server.max_frame_bytes = {self.max_frame_bytes:,})",
            )
        return p.encode_record_of(seqno, docid, tuple(fitted), document.deleted)

    def _report(self, docid: str, seqno: int, index: str, why: str) -> None:
        """One log line per document left out of an index (per encoder, bounded memory)."""
        self.left_out += 1
        if docid in self._reported:
            return
        if len(self._reported) >= MAX_REPORTED:
            self._reported.clear()
        self._reported.add(docid)
        log.warning(
            "document %r (seqno %d) left out of index %s: %s; a later version of it with a value "
            "an index key can hold replaces it",
            docid,
            seqno,
            index,
            why,
        )


def snapshot_frames(
    records: RecordEncoder,
    batch_bytes: int,
    batch_records: int,
    vb: int,
    start: int,
    end: int,
    versions: Sequence[tuple[int, Document]],
) -> list[tuple[list[bytes], int]]:
    """(frames, items): SNAPSHOT_MARKER(start, end), then the versions in MUTATIONS frames of at
    most `batch_records` records and `batch_bytes` bytes (pure; here so that its loop over the
    documents runs compiled)."""
    encoded = [records.record(seqno, document) for seqno, document in versions]
    return record_frames(records.nkeys, batch_bytes, batch_records, vb, start, end, encoded)


def record_frames(
    nkeys: int,
    batch_bytes: int,
    batch_records: int,
    vb: int,
    start: int,
    end: int,
    encoded: Sequence[bytes],
) -> list[tuple[list[bytes], int]]:
    """`snapshot_frames` of records already encoded, each within a frame."""
    pieces: list[tuple[list[bytes], int]] = []
    frames = [p.encode(p.SnapshotMarker(vb, start, end))]
    batch: list[bytes] = []
    size = 0
    for record in encoded:
        if batch and (len(batch) >= batch_records or size + len(record) > batch_bytes):
            frames.append(p.encode_mutations(vb, nkeys, batch))
            pieces.append((frames, len(batch)))
            frames, batch, size = [], [], 0
        batch.append(record)
        size += len(record)
    if batch:
        frames.append(p.encode_mutations(vb, nkeys, batch))
    pieces.append((frames, len(batch)))
    return pieces


class Batcher:
    """Records of each vbucket in, frames out (pure): a batch of up to `batch_records` records
    or `batch_bytes` bytes goes out as SNAPSHOT_MARKER(first, last) and one MUTATIONS frame,
    after STREAM_BEGIN (with `vbuuid(vb)`) for the vbucket's first batch.
    """

    def __init__(
        self,
        nkeys: int,
        batch_bytes: int,
        vbuuid: Callable[[int], int],
        batch_records: int = BATCH_RECORDS,
    ) -> None:
        self.nkeys = nkeys
        self.batch_bytes = batch_bytes
        self.batch_records = batch_records
        self.vbuuid = vbuuid
        self.pending: dict[int, list[bytes]] = {}
        self.pending_bytes: dict[int, int] = {}
        self.first: dict[int, int] = {}
        self.last: dict[int, int] = {}  # per vbucket begun, the last seqno batched
        self.begun: set[int] = set()

    def add(self, vb: int, seqno: int, record: bytes) -> list[bytes]:
        """Frames that are ready after this record (often none); seqnos must increase."""
        pending = self.pending.get(vb)
        frames: list[bytes] = []
        if pending is not None and self.pending_bytes[vb] + len(record) > self.batch_bytes:
            # The batch plus this record could outgrow a frame: it goes out first.
            frames = self.flush(vb)
            pending = None
        if pending is None:
            pending = self.pending[vb] = []
            self.pending_bytes[vb] = 0
            self.first[vb] = seqno
        pending.append(record)
        self.pending_bytes[vb] += len(record)
        self.last[vb] = seqno
        if len(pending) >= self.batch_records or self.pending_bytes[vb] >= self.batch_bytes:
            return frames + self.flush(vb)
        return frames

    def flush(self, vb: int) -> list[bytes]:
        """The frames of the vbucket's pending batch (none if nothing is pending)."""
        records = self.pending.pop(vb, None)
        if records is None:
            return []
        del self.pending_bytes[vb]
        first = self.first.pop(vb)
        frames = []
        if vb not in self.begun:
            self.begun.add(vb)
            frames.append(p.encode(p.StreamBegin(vb, self.vbuuid(vb))))
        frames.append(p.encode(p.SnapshotMarker(vb, first, self.last[vb])))
        frames.append(p.encode_mutations(vb, self.nkeys, records))
        return frames

    def finish(self) -> list[bytes]:
        """Frames of every batch still pending."""
        frames = []
        for vb in sorted(self.pending):
            frames.extend(self.flush(vb))
        return frames

    def targets(self) -> dict[int, int]:
        """Per vbucket streamed, the seqno an ack must reach for everything to be persisted."""
        return {vb: self.last[vb] for vb in self.begun}

    def ends(self) -> list[bytes]:
        """STREAM_END of every vbucket begun."""
        return [p.encode(p.StreamEnd(vb, self.vbuuid(vb))) for vb in sorted(self.begun)]


def batch_bytes(reply: p.HandshakeReply) -> int:
    """Bytes of records per batch: a whole frame stays under the indexer's maximum (a record
    bigger than this goes out alone in its frame)."""
    return min(reply.max_frame_bytes - FRAME_OVERHEAD, SEND_BYTES)
