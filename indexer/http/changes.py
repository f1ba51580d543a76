"""GET /indexes/NAME/changes: the change feed of an index between persisted snapshots."""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator, Iterator, Sequence
from itertools import islice
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import trio

from indexer.changefeed.start import PAGES_LEASE_S, SnapshotStart, pages_lease, pages_pin
from indexer.changes import (
    ChangeBlock,
    ChangeHistory,
    ChangeToken,
    ChangeTokenError,
    HistoryGoneError,
    Mark,
    document_changes,
)
from indexer.client import NDJSON, NEXT_HEADER, RETRY_AFTER, SNAPSHOT_HEADER
from indexer.http.scans import ScanRoutes, _arrow_bodies, _column_kinds, _stream, vbucket_filter
from indexer.http.wire import (
    ARROW,
    DEFAULT_CONSUMER_LEASE_S,
    LEASE_NAME,
    SCAN_CHUNK,
    ApiError,
    Send,
    _json,
    _number,
    _respond,
)
from indexer.keys import decode_key, split_tail
from indexer.scans import COLUMN_KINDS, Row, VbucketFilter, column_value, json_encode
from indexer.snapshots import StabilitySnapshot
from indexer.storage import StoredIndex

CHANGE_STARTS = ("snapshot", "0", "latest")
"""`since` values that are no token: the whole index at the latest persisted snapshot, then
its changes ("snapshot", or "0"); or nothing but the token of that snapshot ("latest")."""

MAX_WAIT_S = 300.0


def change_schema(index: StoredIndex, kinds: Sequence[str]) -> pa.Schema:
    """The Arrow columns of the feed: op, the key columns (of `kinds`), id, snapshot."""
    paths = index.definition.keys
    fields = [pa.field("op", pa.string())]
    fields += [pa.field(paths[j], COLUMN_KINDS[kinds[j]]) for j in range(len(paths))]
    fields += [pa.field("id", pa.string()), pa.field("snapshot", pa.string())]
    return pa.schema(fields)


OPS = pa.array(["delete", "insert"], pa.string())  # taken by 0 or 1: a row's op
DECODED_KEYS_KEPT = 65_536  # distinct keys whose column values an answer keeps between chunks


class _Chunk(NamedTuple):
    """Rows of a feed answer as columns: insert (else delete), encoded key, docid, and the
    token of the snapshot each row first shows in."""

    inserts: np.ndarray
    keys: pa.BinaryArray
    docids: pa.BinaryArray
    snapshots: pa.StringArray


def _document_rows(
    docids: list[bytes], olds: list[bytes], news: list[bytes], snapshots: list[str]
) -> _Chunk:
    """The rows of documents of an index of one entry at most per document, in array
    operations: per document whose value changed, the delete of the old entry then the insert
    of the new (either may be none)."""
    n = len(docids)
    before = pa.array(olds, pa.binary())
    after = pa.array(news, pa.binary())
    changed = pc.not_equal(before, after).to_numpy(zero_copy_only=False)
    # Row 2i is document i's delete, row 2i + 1 its insert: kept where there is an entry.
    kept = np.empty(2 * n, dtype=bool)
    kept[0::2] = changed & (pc.binary_length(before).to_numpy() > 0)
    kept[1::2] = changed & (pc.binary_length(after).to_numpy() > 0)
    rows = np.flatnonzero(kept)
    documents = rows >> 1
    inserts = (rows & 1).astype(bool)
    keys = pa.concat_arrays([before, after]).take(np.where(inserts, documents + n, documents))
    return _Chunk(
        inserts,
        keys,
        pa.array(docids, pa.binary()).take(documents),
        pa.array(snapshots, pa.string()).take(documents),
    )


class ChangeRows:
    """The rows of a feed answer, a chunk at a time: decoded keys, as NDJSON or Arrow. The rows
    come as blocks of history records (a change read) or one by one (a snapshot's entries)."""

    def __init__(
        self,
        index: StoredIndex,
        history_id: str,
        rows: Iterator[tuple[str, bytes, bytes, int]] | None = None,
        records: Iterator[ChangeBlock] | None = None,
    ) -> None:
        self.index = index
        self.count = len(index.definition.keys)
        self.desc = index.definition.desc
        self.history_id = history_id
        self.rows = rows  # (op, encoded key, docid, mark), sent before the records
        self.records = records if records is not None else iter(())
        self.sent = 0
        # Keys repeat across chunks (cities, ages): each is decoded and converted once.
        self._decoded: dict[bytes, list[Any]] = {}
        self._converted: dict[bytes, list[Any]] = {}

    def _next(self) -> _Chunk | None:
        """The next chunk of rows (about SCAN_CHUNK), None at the end: the one-by-one rows
        first (a snapshot start's), then the records' (the changes after it)."""
        if self.rows is not None:
            chunk = self._next_rows()
            if chunk is not None:
                return chunk
            self.rows = None
        return self._next_records()

    def _next_rows(self) -> _Chunk | None:
        assert self.rows is not None
        inserts: list[bool] = []
        keys: list[bytes] = []
        ids: list[bytes] = []
        names: list[str] = []
        last_mark, name = -1, ""
        for op, key, docid, mark in islice(self.rows, SCAN_CHUNK):
            if mark != last_mark:
                last_mark, name = mark, f"{self.history_id}.{mark}"
            inserts.append(op == "insert")
            keys.append(key)
            ids.append(docid)
            names.append(name)
        if not keys:
            return None
        return _Chunk(
            np.array(inserts, dtype=bool),
            pa.array(keys, pa.binary()),
            pa.array(ids, pa.binary()),
            pa.array(names, pa.string()),
        )

    def _next_records(self) -> _Chunk | None:
        """The rows of the next records (whole records, about SCAN_CHUNK documents)."""
        docids: list[bytes] = []
        olds: list[bytes] = []
        news: list[bytes] = []
        snapshots: list[str] = []
        last_mark, name = -1, ""
        for block in self.records:
            if block.mark != last_mark:
                last_mark, name = block.mark, f"{self.history_id}.{block.mark}"
            docids += block.docids
            olds += block.olds
            news += block.news
            snapshots += [name] * len(block.docids)
            if len(docids) >= SCAN_CHUNK:
                break
        if not docids:
            return None
        if not self.index.array:
            return _document_rows(docids, olds, news, snapshots)
        # An array index: entries per document differ by set.
        inserts: list[bool] = []
        keys: list[bytes] = []
        ids: list[bytes] = []
        names: list[str] = []
        documents = ChangeBlock(0, 0, range(len(docids)), docids, olds, news)
        for at, docid, gone, came in document_changes(self.index, documents):
            for key in gone:
                inserts.append(False)
                keys.append(key)
                ids.append(docid)
                names.append(snapshots[at])
            for key in came:
                inserts.append(True)
                keys.append(key)
                ids.append(docid)
                names.append(snapshots[at])
        return _Chunk(
            np.array(inserts, dtype=bool),
            pa.array(keys, pa.binary()),
            pa.array(ids, pa.binary()),
            pa.array(names, pa.string()),
        )

    def _values(self, key: bytes) -> list[Any]:
        """The decoded values of an encoded key (kept for the next chunks, up to a bound)."""
        values = self._decoded.get(key)
        if values is None:
            if len(self._decoded) >= DECODED_KEYS_KEPT:
                self._decoded.clear()
            values = self._decoded[key] = decode_key(key, self.count, desc=self.desc)[0]
        return values

    def ndjson(self) -> bytes | None:
        chunk = self._next()
        while chunk is not None and not len(chunk.keys):
            chunk = self._next()  # records of documents whose entries did not change
        if chunk is None:
            return None
        self.sent += len(chunk.keys)
        lines = []
        for insert, key, docid, mark in zip(
            chunk.inserts.tolist(),
            chunk.keys.to_pylist(),
            _docid_texts(chunk.docids).to_pylist(),
            chunk.snapshots.to_pylist(),
            strict=True,
        ):
            op = "insert" if insert else "delete"
            row = {"op": op, **Row(self._values(key), docid).as_json(), "snapshot": mark}
            lines.append(json_encode(row) + "\n")
        return "".join(lines).encode()

    def arrow(self, schema: pa.Schema, kinds: Sequence[str], writer: Any) -> bool:
        chunk = self._next()
        while chunk is not None and not len(chunk.keys):
            chunk = self._next()
        if chunk is None:
            return False
        self.sent += len(chunk.keys)
        # Each distinct key's column values, converted once per answer; then taken per row.
        encoded = chunk.keys.dictionary_encode()
        converted = self._converted
        if len(converted) >= DECODED_KEYS_KEPT:
            converted.clear()
        distinct = []
        for key in encoded.dictionary.to_pylist():
            values = converted.get(key)
            if values is None:  # an answer is Arrow or NDJSON: `_decoded` stays unused here
                found = decode_key(key, self.count, desc=self.desc)[0]
                values = converted[key] = [
                    column_value(kind, v) for kind, v in zip(kinds, found, strict=True)
                ]
            distinct.append(values)
        columns = [OPS.take(pa.array(chunk.inserts.astype(np.int8)))]
        for j, kind in enumerate(kinds):
            values = pa.array([found[j] for found in distinct], COLUMN_KINDS[kind])
            columns.append(values.take(encoded.indices))
        columns.append(_docid_texts(chunk.docids))
        columns.append(chunk.snapshots)
        writer.write_batch(pa.RecordBatch.from_arrays(columns, schema=schema))
        return True


def _docid_texts(docids: pa.BinaryArray) -> pa.StringArray:
    """Docids as text (bytes that are not UTF-8 replaced, as a JSON answer must)."""
    try:
        return docids.cast(pa.string())
    except pa.ArrowInvalid:
        texts = [d.decode("utf-8", errors="replace") for d in docids.to_pylist()]
        return pa.array(texts, pa.string())


def _token_only(query: dict[str, str]) -> bool:
    """`only=token`: answer the token a read would end at (X-Indexer-Next), without its rows
    (how a reader finds where a limited micro-batch ends without reading it)."""
    only = query.get("only")
    if only not in (None, "token"):
        raise ApiError(400, f"only: token (the answer's X-Indexer-Next alone), not {only!r}")
    return only == "token"


class _StartEnds(NamedTuple):
    """Where a read of a snapshot start ends, as `until` says: at an entry inside the start
    (`entry`, of `token`), or at a mark (`until`: its changes follow the start's end); the
    start's mark, when `until` names it."""

    token: ChangeToken | None = None
    entry: bytes | None = None
    until: int | None = None
    mark: int | None = None


def _start_ends(text: str | None, start: ChangeToken | None) -> _StartEnds:
    """The `until` of a read of a snapshot start, checked against where it starts."""
    if text is None:
        return _StartEnds()
    try:
        end = ChangeToken.decode(text)
        if end.until is not None:
            raise ChangeTokenError(
                "until: a snapshot's token, or one inside a snapshot start, with since=snapshot"
            )
    except ChangeTokenError as exc:
        raise ApiError(400, str(exc)) from None
    if end.entry is not None:
        if start is not None and (
            end.since != start.since or (start.entry is not None and end.entry < start.entry)
        ):
            raise ApiError(400, "until: a token after since, inside the same snapshot start")
        return _StartEnds(end, end.entry, None, end.since)
    if start is not None:
        if end.since < start.since:
            raise ApiError(400, "until: a token at or after the snapshot start's")
        return _StartEnds(end, None, end.since, None)
    return _StartEnds(end, None, end.since, end.since)


class ChangeRoutes(ScanRoutes):
    """The change feed of an index (indexer/changes.py), as NDJSON or Arrow."""

    def _history(self) -> ChangeHistory:
        retention = self.view.timekeeper.retention
        if retention is None:
            raise ApiError(
                409,
                "this daemon keeps no change history (changes.history = false in its "
                "configuration): read the index with /scan",
            )
        return retention.history

    async def changes(
        self, index: StoredIndex, query: dict[str, str], headers: dict[str, str], send: Send
    ) -> int:
        """Answer GET /indexes/NAME/changes; the rows sent."""
        history = self._history()
        since = query.get("since")
        if since is None:
            raise ApiError(
                400, "since: a token the feed gave, or snapshot (the whole index, then changes)"
            )
        limit = None
        if "limit" in query:
            limit = int(_number(query["limit"], "limit", 1, 2**62))
            if str(limit) != query["limit"].strip():
                raise ApiError(400, "limit: a whole number")
        wait = _number(query.get("wait", "0"), "wait", 0, MAX_WAIT_S)
        latest = history.latest
        if latest is None:
            raise ApiError(503, "no persisted snapshot yet", {RETRY_AFTER: "1"})
        kinds = _column_kinds(query.get("columns"), len(index.definition.keys))
        arrow = ARROW in headers.get("accept", "")
        if not arrow and "columns" in query:
            raise ApiError(400, "columns: for Arrow answers (Accept: " + ARROW + ")")
        token_only = _token_only(query)
        only = vbucket_filter(query, len(self.view.registry.owned))
        vbuckets = None if only is None else only.vbuckets
        if since == "latest":
            if token_only or "until" in query:
                raise ApiError(
                    400,
                    f"{'only=token' if token_only else 'until'}: not taken with since=latest "
                    "(which answers the latest snapshot's token alone)",
                )
            return await self._latest(history, send)
        start: ChangeToken | None = None
        if since not in CHANGE_STARTS:
            try:
                start = ChangeToken.decode(since)
            except ChangeTokenError as exc:
                raise ApiError(400, str(exc)) from None
        if start is None or start.entry is not None:
            ends = _start_ends(query.get("until"), start)
            return await self._from_snapshot(
                history, index, start, ends, limit, kinds, arrow, send, token_only, only
            )
        stop: ChangeToken | None = None
        try:
            token = ChangeToken.decode(since)
            until = latest.number
            if "until" in query:
                end = ChangeToken.decode(query["until"])
                if end.entry is not None:
                    raise ChangeTokenError(
                        "until: a token inside a snapshot start ends a read from that start "
                        "(since=snapshot, or a token inside it)"
                    )
                if end.history != token.history:
                    raise ChangeTokenError("until: a token of the same history as since")
                if end.until is None:
                    until = min(end.since, until)
                else:
                    stop = end  # part way through an interval: read to there
        except ChangeTokenError as exc:
            raise ApiError(400, str(exc)) from None
        if wait and token.until is None and token.since >= latest.number:
            latest = await self._wait_for_mark(history, latest, wait)
            if "until" not in query:
                until = latest.number
        source = self.view.store.snapshot()
        records: Iterator[ChangeBlock] = iter(())
        try:
            try:
                if token_only:
                    after = await trio.to_thread.run_sync(
                        history.locate, index, token, until, source, limit, stop, vbuckets
                    )
                else:
                    records, after = await trio.to_thread.run_sync(
                        history.read_records, index, token, until, source, limit, stop, vbuckets
                    )
            except HistoryGoneError as exc:
                raise ApiError(410, str(exc)) from None
            except ChangeTokenError as exc:
                raise ApiError(400, str(exc)) from None
            end_mark = stop.until if stop is not None else until
            meta = {
                NEXT_HEADER: after.encode(),
                SNAPSHOT_HEADER: f"{history.history_id}.{end_mark}",
            }
            # The rows are read from `source` as they are sent, a chunk at a time.
            answer = ChangeRows(index, history.history_id, records=records)
            await self._send_rows(index, answer, kinds, arrow, meta, send)
        finally:
            if isinstance(records, Generator):
                records.close()  # its LevelDB iterator, before the snapshot it reads
            source.close()
        return answer.sent

    async def hold_changes(self, name: str, body: dict[str, Any], send: Send) -> None:
        """PUT /changes/leases/NAME {"token": T, "lease_s": S}: keep the history from T on
        for consumer NAME for S seconds (again: move it forward, renew it)."""
        history = self._history()
        if not LEASE_NAME.match(name):
            raise ApiError(400, "a consumer's name: 1 to 128 letters, digits, _ . or -")
        text = body.get("token")
        if not isinstance(text, str):
            raise ApiError(400, "token: the token the consumer has read up to, as a string")
        lease_s = _number(
            body.get("lease_s", DEFAULT_CONSUMER_LEASE_S),
            "lease_s",
            1,
            366 * DEFAULT_CONSUMER_LEASE_S,
        )
        try:
            token = ChangeToken.decode(text)
            lease = await trio.to_thread.run_sync(history.hold, name, token, lease_s)
        except ChangeTokenError as exc:
            raise ApiError(400, str(exc)) from None
        except HistoryGoneError as exc:
            raise ApiError(410, str(exc)) from None
        answer = {
            "consumer": name,
            "token": f"{history.history_id}.{lease.mark}",
            "lease_s": lease_s,
        }
        await _json(send, 200, answer)

    async def release_changes(self, name: str, send: Send) -> None:
        """DELETE /changes/leases/NAME: the consumer's lease ends."""
        history = self._history()
        if not await trio.to_thread.run_sync(history.release, name):
            raise ApiError(404, f"no lease of consumer {name!r} (released or expired)")
        await _respond(send, 204, b"", "text/plain")

    async def _wait_for_mark(self, history: ChangeHistory, latest: Mark, wait: float) -> Mark:
        """The next mark after `latest`, or `latest` if none comes within `wait` seconds."""
        with trio.move_on_after(wait):
            while history.latest is None or history.latest.number <= latest.number:
                await self.view.snapshots.wait_changed()
        return history.latest if history.latest is not None else latest

    def _persisted(self, history: ChangeHistory) -> tuple[StabilitySnapshot, Mark]:
        """The persisted snapshot and its mark; 503 while the mark of a new one is written."""
        snap = self.view.snapshots.persisted_snapshot
        latest = history.latest
        if snap is None or latest is None or snap.timestamp.seqnos != latest.timestamp:
            raise ApiError(503, "a snapshot is being persisted: retry", {RETRY_AFTER: "1"})
        return snap, latest

    async def _latest(self, history: ChangeHistory, send: Send) -> int:
        """since=latest: the token of the latest persisted snapshot, and no rows."""
        _, latest = self._persisted(history)
        token = f"{history.history_id}.{latest.number}"
        await _respond(send, 200, b"", NDJSON, {NEXT_HEADER: token, SNAPSHOT_HEADER: token})
        return 0

    async def _from_snapshot(
        self,
        history: ChangeHistory,
        index: StoredIndex,
        start: ChangeToken | None,
        ends: _StartEnds,
        limit: int | None,
        kinds: Sequence[str],
        arrow: bool,
        send: Send,
        token_only: bool,
        only: VbucketFilter | None = None,
    ) -> int:
        """A snapshot start: every entry of the index at a mark, as inserts, from its first
        (`start` None) or after the entry of a token inside it; at most `limit` of them (a page
        never goes past the start's end), or up to `ends`, then the changes after the mark up
        to `ends.until` when the read goes that far. The mark is the latest persisted
        snapshot's, or that of the token or of `until`."""
        persisted, latest = self._persisted(history)
        if start is not None:
            mark = start.since
        elif ends.mark is not None:
            mark = ends.mark
        else:
            mark = latest.number
        for token in (start, ends.token):
            if token is not None and token.history != history.history_id:
                raise ApiError(
                    410,
                    f"{token.encode()} is of another change history ({token.history}): start "
                    "again from a snapshot (since=snapshot)",
                )
        if mark > latest.number:
            raise ApiError(400, f"until: {history.history_id}.{mark} is not persisted yet")
        until = mark if ends.until is None else min(ends.until, latest.number)
        if ends.token is None and limit is None:
            until = latest.number  # the start's rest, then the changes to the latest snapshot
        if until < mark:
            raise ApiError(400, "until: a token at or after the snapshot start's")
        try:
            history.check_start(index, min(mark, latest.number))
        except HistoryGoneError as exc:
            raise ApiError(503, str(exc), {RETRY_AFTER: "2"}) from None
        paged = limit is not None or start is not None or ends.entry is not None
        found = self._start_snapshot(history, mark, persisted, paged)
        found.acquire()
        source = self.view.store.snapshot()
        records: Iterator[ChangeBlock] = iter(())
        try:
            if not found.is_open:
                raise ApiError(503, "the snapshot was released: retry", {RETRY_AFTER: "1"})
            try:
                part, end, after = await trio.to_thread.run_sync(
                    self._plan_start,
                    history,
                    index,
                    found,
                    latest.number,
                    mark,
                    start,
                    ends,
                    limit,
                    until,
                    paged,
                    source,
                    only,
                )
            except HistoryGoneError as exc:
                raise ApiError(410, str(exc)) from None
            meta = {NEXT_HEADER: after, SNAPSHOT_HEADER: f"{history.history_id}.{mark}"}
            if token_only:
                await _respond(send, 200, b"", NDJSON, meta)
                return 0
            rows = (
                ("insert", *split_tail(entry), mark)
                for entry in part.entries(None if start is None else start.entry, end)
            )
            if limit is None and ends.entry is None and until > mark:
                records, _ = await trio.to_thread.run_sync(
                    history.read_records,
                    index,
                    ChangeToken(history.history_id, mark),
                    until,
                    source,
                    None,
                    None,
                    None if only is None else only.vbuckets,
                )
            answer = ChangeRows(index, history.history_id, rows, records)
            await self._send_rows(index, answer, kinds, arrow, meta, send)
        finally:
            if isinstance(records, Generator):
                records.close()  # its LevelDB iterator, before the snapshot it reads
            source.close()
            found.release()
        return answer.sent

    def _start_snapshot(
        self, history: ChangeHistory, mark: int, persisted: StabilitySnapshot, paged: bool
    ) -> StabilitySnapshot:
        """The snapshot a start at `mark` reads: the feed's pin of that mark while it holds,
        else the persisted one (pinned for the next pages when the start is paged and at
        it). Whether the one returned is at `mark` is `_plan_start`'s to check."""
        snaps = self.view.snapshots
        pin_id = pages_pin(history.history_id, mark)
        pin = snaps.renew(pin_id, PAGES_LEASE_S)
        if pin is not None and pin.snapshot.is_open:
            return pin.snapshot
        latest = history.latest
        if paged and pin is None and latest is not None and latest.number == mark:
            return snaps.pin(persisted, PAGES_LEASE_S, pin_id).snapshot
        return persisted

    def _plan_start(
        self,
        history: ChangeHistory,
        index: StoredIndex,
        found: StabilitySnapshot,
        latest: int,
        mark: int,
        start: ChangeToken | None,
        ends: _StartEnds,
        limit: int | None,
        until: int,
        paged: bool,
        source: Any,
        only: VbucketFilter | None = None,
    ) -> tuple[SnapshotStart, bytes | None, str]:
        """The entries at `mark` (read from `found` if it is at the mark, else rebuilt from it),
        the last entry the read sends (None: to the start's end), and the token after it.
        Blocking: in a thread."""
        at = history.mark(mark, source)
        if at is None:
            raise HistoryGoneError(
                f"the snapshot start at {history.history_id}.{mark} is no longer kept (its "
                "pin and the history from it are gone): start again from a snapshot "
                "(since=snapshot)"
            )
        if paged:  # the history from the mark stays while pages come (and after a restart)
            history.hold(pages_lease(mark), ChangeToken(history.history_id, mark), PAGES_LEASE_S)
        if found.timestamp.seqnos == at.timestamp:
            part = SnapshotStart(self.view.store, index, exact=found.store_snapshot, only=only)
        elif history.latest is None or found.timestamp.seqnos != history.latest.timestamp:
            raise HistoryGoneError(
                f"the snapshot start at {history.history_id}.{mark} changed under its reader "
                "(a rollback): start again from a snapshot (since=snapshot)"
            )
        else:
            part = SnapshotStart(
                self.view.store,
                index,
                later=found.store_snapshot,
                history=history,
                mark=mark,
                until=latest,
                source=source,
                only=only,
            )
        end = ends.entry
        if limit is not None:
            page_end = part.page_end(None if start is None else start.entry, limit)
            if page_end is not None and (end is None or page_end < end):
                end = page_end
        if end is not None:
            return part, end, ChangeToken(history.history_id, mark, entry=end).encode()
        return part, None, f"{history.history_id}.{until if limit is None else mark}"

    async def _send_rows(
        self,
        index: StoredIndex,
        answer: ChangeRows,
        kinds: Sequence[str],
        arrow: bool,
        meta: dict[str, str],
        send: Send,
    ) -> None:
        if arrow:
            schema = change_schema(index, kinds)
            write: Callable[[Any], bool] = functools.partial(answer.arrow, schema, kinds)
            await _stream(send, ARROW, meta, _arrow_bodies(schema, write))
        else:
            await _stream(send, NDJSON, meta, answer.ndjson)
