"""A PostgreSQL table as the router's input: its rows copied once, then its changes followed
through logical replication (the built-in `pgoutput` plugin, via psycopg2's replication
connection), each row a document in the source log.

Exactly once: how far the table is applied is stored in the source log in the same synced batch
as the documents (`SourceLog.append`'s input position): the commit LSN of the last transaction
appended, and, inside a large transaction, how many of its changes. The slot's confirmed LSN
moves only after that batch is synced. A router killed at any moment restarts from the slot,
which sends again what it had not confirmed; what the log already holds is recognised by its
LSN and skipped. The initial copy reads the snapshot exported with the slot, as PostgreSQL's
own logical replication does; a copy cut short is made again from a new slot, and the
documents it no longer finds are deleted.

Blocking client calls run in threads; the stream is read on the event loop whenever its socket
is readable (read_message never blocks).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import trio

from indexer.router.documents import Document
from indexer.router.inputs.postgres.pgoutput import (
    UNCHANGED,
    PgOutputError,
    Value,
    format_lsn,
    parse_lsn,
)
from indexer.router.inputs.postgres.pgtypes import (
    PgTypeError,
    TypeCatalog,
)
from indexer.router.inputs.postgres.stream import Cut, StreamReader
from indexer.router.inputs.postgres.table import (
    NAME,
    Position,
    PostgresError,
    PostgresOptions,
    PostgresProgress,
    PostgresUnreachable,
    Shape,
    Table,
    connect,
    describe_table,
    drop_slot,
    identifier,
    one_line,
    shape_of,
    type_query,
    with_line,
)
from indexer.router.source.appender import Appender

log = logging.getLogger("indexer.router")

COPY_ROWS = 5_000  # rows fetched per round trip of the initial copy
STATS_S = 2.0  # how often the slot's confirmed LSN and the server's WAL end are read
RETRY_S = 2.0  # before connecting again after the server went away
VISIBLE_WAIT_S = 60.0  # at most, for a committed change to be visible to a read of its row


class TableFollower:
    """Copies, then follows, one table into the appender (see module doc)."""

    def __init__(self, options: PostgresOptions, appender: Appender) -> None:
        if not NAME.match(options.slot_name):
            raise PostgresError(
                f"slot name {options.slot_name!r}: lowercase letters, digits and _, at most 63"
            )
        self.options = options
        self.appender = appender
        schema, name = options.schema_table
        self.qualified = f"{schema}.{name}"
        self.progress = PostgresProgress(self.qualified, options.slot_name)
        self.table: Table | None = None
        self.types = TypeCatalog()
        self._stats_conn: Any = None
        self._rows_conn: Any = None  # reads rows and types (not the lag's: it may wait)

    # -- the parts that block, run in threads

    def _prepare(self) -> tuple[Any, Table, bool]:
        """A normal connection, the table, and whether the slot exists; creates the
        publication."""
        conn = connect(self.options.dsn)
        try:
            table = describe_table(conn, self.options, self.types)
            slot = self.options.slot_name
            with conn.cursor() as cur:
                cur.execute("SHOW wal_level")
                (level,) = cur.fetchone()
                if level != "logical":
                    raise PostgresError(
                        f"the server's wal_level is {level}: set wal_level = logical in "
                        "postgresql.conf and restart it"
                    )
                cur.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (slot,))
                if cur.fetchone() is None:
                    cur.execute(f'CREATE PUBLICATION "{slot}" FOR TABLE {self._quoted()}')
                cur.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (slot,))
                exists = cur.fetchone() is not None
        except PostgresError:
            conn.close()
            raise
        except Exception as exc:
            conn.close()
            raise PostgresError(f"PostgreSQL: {one_line(exc)}") from None
        return conn, table, exists

    def _quoted(self) -> str:
        schema, name = self.options.schema_table
        return f'"{schema}"."{name}"'

    def _select(self, table: Table) -> str:
        """Every column in its text output form, as pgoutput prints it: through the type's own
        output function (a cast to text differs: `true` for `t`, char(n) without its padding)."""
        return ", ".join(
            f"{output}({identifier(name)})::text"
            for (name, _), output in zip(table.columns, table.outputs, strict=True)
        )

    def document(
        self, shape: Shape, values: Sequence[Value], previous: dict[str, Any] | None = None
    ) -> Document:
        """A row (its values' text forms) as a document: all its columns, or --doc-column; an
        UNCHANGED value is the `previous` version's (`_fills` said it holds it). A row no
        document can hold (a JSON value nested too deep) is a delete, logged."""
        docid = values[shape.id_at]
        if not isinstance(docid, str):
            raise PgOutputError(f"a row of {self.qualified} without its id")
        document: Any
        try:
            if shape.doc_at is not None:
                text = values[shape.doc_at]
                if text is UNCHANGED:
                    document = previous
                else:
                    document = {} if text is None else shape.converters[shape.doc_at](text)  # type: ignore[arg-type]
            elif previous is None:
                body = {
                    name: None if value is None else convert(value)  # type: ignore[arg-type]
                    for name, convert, value in zip(
                        shape.names, shape.converters, values, strict=True
                    )
                }
                return with_line(docid, body)
            else:
                document = {
                    name: None
                    if value is None
                    else previous[name]
                    if value is UNCHANGED
                    else convert(value)  # type: ignore[arg-type]
                    for name, convert, value in zip(
                        shape.names, shape.converters, values, strict=True
                    )
                }
        except PgTypeError as exc:
            self.progress.refused_rows += 1
            log.error("row %r of %s left out of the indexes: %s", docid, self.qualified, exc)
            return Document(docid, None)
        if not isinstance(document, dict):
            raise PgOutputError(f"{self.qualified}: the document of {docid} is not a JSON object")
        return with_line(docid, document)

    def row(self, table: Table, docid: str, xid: int) -> Document | None:
        """The row as a snapshot that sees transaction `xid` holds it (blocking): an update
        left a TOASTed value out and the log holds no version of the row to take it from.

        A commit reaches the stream before every session sees it, so the read waits until its
        snapshot has `xid` (32 bits, as Begin gives it) committed: what it reads is this change
        or a later one (which follows in the stream)."""
        conn = self._rows_connection()
        deadline = time.monotonic() + VISIBLE_WAIT_S
        with conn.cursor() as cur:
            while True:
                cur.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
                cur.execute(
                    "SELECT txid_visible_in_snapshot(CASE WHEN x >= txid_snapshot_xmax(s) "
                    "THEN x - 4294967296 ELSE x END, s) FROM (SELECT s, "
                    "(txid_snapshot_xmax(s) >> 32 << 32) + %s AS x FROM "
                    "(SELECT txid_current_snapshot() AS s) a) b",
                    (xid,),
                )
                (visible,) = cur.fetchone()
                if visible:
                    break
                cur.execute("ROLLBACK")
                if time.monotonic() > deadline:
                    raise PostgresError(
                        f"transaction {xid} of {self.qualified} never became visible"
                    )
                time.sleep(0.005)
            try:
                cur.execute(
                    f"SELECT {self._select(table)} FROM {self._quoted()} "
                    f"WHERE {identifier(table.id_column)}::text = %s",
                    (docid,),
                )
                found = cur.fetchone()
            finally:
                cur.execute("ROLLBACK")
        if found is None:
            return None
        return self.document(shape_of(table.columns, table, self.types), found)

    def _rows_connection(self) -> Any:
        if self._rows_conn is None or self._rows_conn.closed:
            self._rows_conn = connect(self.options.dsn)
        return self._rows_conn

    def resolve_types(self, oids: list[int]) -> None:
        """Read the catalog rows of types a Relation message names for the first time."""
        self.types.resolve(oids, type_query(self._rows_connection()))

    def _stats_connection(self) -> Any:
        if self._stats_conn is None or self._stats_conn.closed:
            self._stats_conn = connect(self.options.dsn)
        return self._stats_conn

    def _server_lsns(self) -> tuple[int, int | None]:
        """The server's WAL end, and the slot's confirmed LSN."""
        conn = self._stats_connection()
        with conn.cursor() as cur:
            cur.execute(
                "SELECT pg_current_wal_lsn()::text, (SELECT confirmed_flush_lsn::text FROM "
                "pg_replication_slots WHERE slot_name = %s)",
                (self.options.slot_name,),
            )
            end, confirmed = cur.fetchone()
        return parse_lsn(end), None if confirmed is None else parse_lsn(confirmed)

    # -- the run

    async def run(self) -> None:
        """Follow the table until cancelled; reconnect when the server goes away. A table that
        cannot be followed raises PostgresError (one line)."""
        failed: list[PostgresError] = []
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_lag)
                while True:
                    try:
                        await self._follow()
                    except PostgresUnreachable as exc:
                        if self.progress.state == "starting":
                            failed.append(exc)
                            nursery.cancel_scope.cancel()
                            break
                        self.progress.state = "reconnecting"
                        self.progress.error = str(exc)
                        log.warning("%s; connecting again in %g s", exc, RETRY_S)
                        await trio.sleep(RETRY_S)
                    except PostgresError as exc:
                        failed.append(exc)  # raised below: out of the nursery, not in a group
                        nursery.cancel_scope.cancel()
                        break
                    except Exception as exc:  # the server went away, a network error
                        self.progress.state = "reconnecting"
                        self.progress.error = one_line(exc)
                        log.warning(
                            "PostgreSQL: %s; connecting again in %g s", self.progress.error, RETRY_S
                        )
                        await trio.sleep(RETRY_S)
        finally:
            for conn in (self._stats_conn, self._rows_conn):
                if conn is not None:
                    conn.close()
        if failed:
            raise failed[0]

    async def _watch_lag(self) -> None:
        while True:
            try:
                end, confirmed = await trio.to_thread.run_sync(self._server_lsns)
            except Exception:  # shown as unknown until the next look
                self.progress.lag_bytes = None
            else:
                self.progress.server_lsn = format_lsn(end)
                if confirmed is not None:
                    self.progress.lag_bytes = max(0, end - confirmed)
            self.progress.counted(time.monotonic())
            await trio.sleep(STATS_S)

    async def _follow(self) -> None:
        conn, table, exists = await trio.to_thread.run_sync(self._prepare)
        conn.close()
        self.table = table
        source = self.appender.source
        async with self.appender.lock:  # no other input appends while the log is indexed
            indexed = await trio.to_thread.run_sync(source.track_latest_versions)
        if indexed:
            log.info("indexed the latest version of %d documents of the log", indexed)
        position = Position.decode(self.appender.source.input_position)
        stream = await trio.to_thread.run_sync(connect, self.options.dsn, True)
        try:
            if not exists or position is None or position.copied is not None:
                if exists:
                    log.warning(
                        "slot %s exists but %s: dropping it and copying %s again",
                        self.options.slot_name,
                        "the initial copy was cut short"
                        if position is not None
                        else "this --state has never copied the table",
                        self.qualified,
                    )
                    await trio.to_thread.run_sync(
                        drop_slot, self.options.dsn, self.options.slot_name
                    )
                    conn, _, _ = await trio.to_thread.run_sync(self._prepare)
                    conn.close()
                position = await self._copy(stream, table)
            await self._stream(stream, table, position)
        finally:
            stream.close()

    async def _copy(self, stream: Any, table: Table) -> Position:
        """Create the slot with an exported snapshot, and copy the table as of it."""
        slot = self.options.slot_name

        def create() -> tuple[int, str]:
            with stream.cursor() as cur:
                cur.execute(f'CREATE_REPLICATION_SLOT "{slot}" LOGICAL pgoutput EXPORT_SNAPSHOT')
                _, consistent, snapshot, _ = cur.fetchone()
            return parse_lsn(consistent), str(snapshot)

        start, snapshot = await trio.to_thread.run_sync(create)
        log.info(
            "slot %s created at %s: copying %s as of it",
            slot,
            format_lsn(start),
            self.qualified,
        )
        self.progress.state = "copying"
        copier = await trio.to_thread.run_sync(connect, self.options.dsn)
        copier.autocommit = False
        seen: set[str] = set()
        had = bool(self.appender.source.vbuckets_with_history())
        try:

            def begin() -> Any:
                cur = copier.cursor()
                cur.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
                cur.execute("SET TRANSACTION SNAPSHOT %s", (snapshot,))
                named = copier.cursor(name="indexer_copy")
                named.itersize = COPY_ROWS
                named.execute(f"SELECT {self._select(table)} FROM {self._quoted()}")
                return named

            rows = await trio.to_thread.run_sync(begin)
            shape = shape_of(table.columns, table, self.types)
            copied = 0
            while True:
                batch = await trio.to_thread.run_sync(rows.fetchmany, COPY_ROWS)
                if not batch:
                    break
                documents = [self.document(shape, row) for row in batch]
                seen.update(d.docid for d in documents)
                copied += len(documents)
                await self.appender.append(documents, Position(start, copied=copied).encode())
                self.progress.copied_rows = copied
            await trio.to_thread.run_sync(copier.rollback)
        finally:
            copier.close()
        gone: list[Document] = []
        if had:  # a copy made again: documents of the log the table no longer holds
            survivors = await trio.to_thread.run_sync(self.appender.source.surviving_documents)
            gone = [Document(d, None) for d in survivors if d not in seen]
        position = Position(start)
        await self.appender.append(gone, position.encode())
        log.info(
            "copied %d rows of %s%s; following its changes from %s",
            copied,
            self.qualified,
            f" ({len(gone)} documents of an earlier copy deleted)" if gone else "",
            format_lsn(start),
        )
        return position

    async def _stream(self, stream: Any, table: Table, position: Position) -> None:
        """Read the slot's changes and append them, confirming what is synced: a reader that
        decodes while an appender writes (two tasks joined by an unbuffered channel)."""
        slot = self.options.slot_name
        cur = stream.cursor()
        await trio.to_thread.run_sync(
            lambda: cur.start_replication(
                slot_name=slot,
                decode=False,
                options={"proto_version": "1", "publication_names": slot},
            )
        )
        self.progress.state = "streaming"
        self.progress.error = None
        self.progress.confirmed_lsn = format_lsn(position.lsn)
        log.info("following %s through slot %s", self.qualified, slot)
        reader = StreamReader(self, table, position)
        async with trio.open_nursery() as nursery:
            send, receive = trio.open_memory_channel[Cut](0)
            nursery.start_soon(self._append_cuts, receive, cur, position.lsn, reader)
            await reader.run(stream, cur, send)

    async def _append_cuts(
        self,
        cuts: trio.MemoryReceiveChannel[Cut],
        cur: Any,
        confirmed: int,
        reader: StreamReader,
    ) -> None:
        """Append each cut (one synced batch with its position), then confirm to the slot the
        whole transactions it ends."""
        progress = self.progress
        async for cut in cuts:
            await self.appender.append(cut.documents, cut.position.encode())
            progress.changes += len(cut.documents)
            progress.appends += 1
            progress.lag_s = (
                0.0
                if cut.oldest_commit is None or reader.idle
                else round((datetime.now(UTC) - cut.oldest_commit).total_seconds(), 3)
            )
            if cut.confirm is not None and cut.confirm > confirmed:
                confirmed = cut.confirm
                cur.send_feedback(flush_lsn=confirmed, force=True)
                progress.confirmed_lsn = format_lsn(confirmed)
            reader.appended(confirmed, cut.documents)
