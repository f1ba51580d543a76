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

import json
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeGuard

import orjson
import trio

from indexer.router.appender import Appender
from indexer.router.documents import Document
from indexer.router.pgoutput import (
    UNCHANGED,
    Begin,
    Commit,
    Delete,
    Insert,
    PgOutputError,
    Relation,
    Truncate,
    Update,
    Value,
    decode_message,
    format_lsn,
    parse_lsn,
)
from indexer.router.pgtypes import SESSION_OPTIONS, TYPE_QUERY, PgTypeError, TypeCatalog, converter

log = logging.getLogger("indexer.router")

BATCH_CHANGES = 5_000  # changes of one transaction before a cut inside it
MAX_PENDING = 50_000  # changes read ahead of a busy appender, at most
MIN_CUT = 10_000  # changes a cut waits for while the stream keeps coming (fewer, larger appends)
COPY_ROWS = 5_000  # rows fetched per round trip of the initial copy
FEEDBACK_S = 5.0  # how often the slot hears from the router when nothing else happens
COALESCE_S = 0.005  # how long an append waits for more of the stream to join it
YIELD_EVERY = 256  # messages read between two looks at the other tasks
STATS_S = 2.0  # how often the slot's confirmed LSN and the server's WAL end are read
RETRY_S = 2.0  # before connecting again after the server went away
VISIBLE_WAIT_S = 60.0  # at most, for a committed change to be visible to a read of its row
_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


class PostgresError(Exception):
    """The table cannot be followed; the message is one line for the user."""


class PostgresUnreachable(PostgresError):
    """No connection to the server: fatal at start, retried once the table was followed."""


@dataclass(frozen=True)
class PostgresOptions:
    """What `indexer router --postgres` follows."""

    dsn: str
    table: str  # schema.table (public when no schema is given)
    id_column: str | None = None  # default: the table's one-column primary key
    doc_column: str | None = None  # the document is this JSON column; default: every column
    slot: str | None = None  # default: indexer_SCHEMA_TABLE

    @property
    def schema_table(self) -> tuple[str, str]:
        schema, _, name = self.table.rpartition(".")
        return schema or "public", name

    @property
    def slot_name(self) -> str:
        if self.slot is not None:
            return self.slot
        schema, name = self.schema_table
        return re.sub(r"[^a-z0-9_]", "_", f"indexer_{schema}_{name}".lower())[:63]


@dataclass
class PostgresProgress:
    """What `GET /stats` shows of the table being followed."""

    table: str
    slot: str
    state: str = "starting"  # copying, streaming, reconnecting
    copied_rows: int = 0
    changes: int = 0  # row changes appended (a TRUNCATE counts its documents)
    skipped: int = 0  # changes read again after a restart, already in the log
    transactions: int = 0
    confirmed_lsn: str | None = None  # what this router confirmed to the slot
    server_lsn: str | None = None  # the server's WAL end, last read
    lag_bytes: int | None = None  # between the two
    lag_s: float = 0.0  # since the commit of the oldest change read and not yet appended
    changes_per_s: float = 0.0
    truncates: int = 0
    truncated_documents: int = 0  # live documents the TRUNCATEs deleted
    # Updates that left a TOASTed value out: the value taken from the old row (REPLICA IDENTITY
    # FULL), from the row's latest version in the log, or read from the row once visible.
    unchanged_from_old_row: int = 0
    unchanged_from_log: int = 0
    unchanged_rows_read: int = 0
    refused_rows: int = 0  # rows no document can hold (a value too deep): deleted, logged
    error: str | None = None
    _window: list[tuple[float, int]] = field(default_factory=list, repr=False)

    def counted(self, now: float) -> None:
        """Refresh `changes_per_s` over the last ten seconds or so."""
        self._window.append((now, self.changes))
        while len(self._window) > 2 and now - self._window[0][0] > 10:
            self._window.pop(0)
        first_t, first_n = self._window[0]
        elapsed = now - first_t
        self.changes_per_s = round((self.changes - first_n) / elapsed, 1) if elapsed else 0.0

    def as_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


@dataclass(frozen=True)
class Position:
    """How far the table is in the source log (stored with each append)."""

    lsn: int  # the commit LSN of the last transaction appended (or the copy's start)
    done: int | None = None  # of that transaction's changes, when it is not all appended
    copied: int | None = None  # rows of an initial copy not finished yet

    def encode(self) -> bytes:
        return json.dumps({"postgres": self.__dict__}).encode()

    @staticmethod
    def decode(raw: bytes | None) -> Position | None:
        if raw is None:
            return None
        try:
            item = json.loads(raw)["postgres"]
            return Position(int(item["lsn"]), item.get("done"), item.get("copied"))
        except (ValueError, KeyError, TypeError):
            raise PostgresError(
                "the --state log was written by another input than --postgres: "
                "use a new --state directory"
            ) from None


@dataclass(frozen=True)
class Table:
    """The followed table as the catalog describes it."""

    oid: int
    columns: tuple[tuple[str, int], ...]  # (name, type oid) in order
    outputs: tuple[str, ...]  # each column's output function (what pgoutput prints with)
    id_column: str
    doc_column: str | None


def _connect(dsn: str, replication: bool = False) -> Any:
    """A connection with the session settings that fix every value's text form (the copy, the
    stream and row reads must print values alike), after any `options` of the DSN."""
    import psycopg2
    import psycopg2.extensions
    import psycopg2.extras

    try:
        given = psycopg2.extensions.parse_dsn(dsn).get("options", "")
        options = f"{given} {SESSION_OPTIONS}".strip()
        if replication:
            return psycopg2.connect(
                dsn,
                connection_factory=psycopg2.extras.LogicalReplicationConnection,
                options=options,
            )
        conn = psycopg2.connect(dsn, options=options)
        conn.autocommit = True
        return conn
    except psycopg2.Error as exc:
        raise PostgresUnreachable(f"cannot connect to PostgreSQL: {_one_line(exc)}") from None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _query(conn: Any) -> Callable[[list[int]], list[tuple[Any, ...]]]:
    """TYPE_QUERY on `conn`, for TypeCatalog.resolve (blocking)."""

    def run(oids: list[int]) -> list[tuple[Any, ...]]:
        with conn.cursor() as cur:
            cur.execute(TYPE_QUERY, (oids,))
            return list(cur.fetchall())

    return run


def describe_table(conn: Any, options: PostgresOptions, types: TypeCatalog) -> Table:
    """The table's columns, id column and replica identity, checked; the columns' types read
    into `types` (blocking)."""
    schema, name = options.schema_table
    qualified = f"{schema}.{name}"
    with conn.cursor() as cur:
        cur.execute(
            "SELECT c.oid, c.relreplident FROM pg_class c JOIN pg_namespace n "
            "ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relname = %s AND "
            "c.relkind IN ('r', 'p')",
            (schema, name),
        )
        found = cur.fetchone()
        if found is None:
            raise PostgresError(f"--table: no table {qualified} in the database")
        oid, identity = int(found[0]), str(found[1])
        cur.execute(
            "SELECT a.attname, a.atttypid, t.typoutput::regproc::text FROM pg_attribute a "
            "JOIN pg_type t ON t.oid = a.atttypid WHERE a.attrelid = %s AND a.attnum > 0 "
            "AND NOT a.attisdropped ORDER BY a.attnum",
            (oid,),
        )
        described = cur.fetchall()
        columns = tuple((str(c), int(t)) for c, t, _ in described)
        outputs = tuple(str(output) for _, _, output in described)
        cur.execute(
            "SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid "
            "AND a.attnum = ANY(i.indkey) WHERE i.indrelid = %s AND i.indisprimary",
            (oid,),
        )
        primary = [str(r[0]) for r in cur.fetchall()]
    names = [c for c, _ in columns]
    if identity == "n" or (identity == "d" and not primary):
        raise PostgresError(
            f"table {qualified} has no primary key and no replica identity, so its updates and "
            f"deletes cannot be followed: add a primary key, or run ALTER TABLE {qualified} "
            "REPLICA IDENTITY FULL and give --id-column"
        )
    id_column = options.id_column
    if id_column is None:
        if len(primary) != 1:
            raise PostgresError(
                f"table {qualified} has a primary key of {len(primary)} columns: give the "
                "document id's column with --id-column"
            )
        id_column = primary[0]
    if id_column not in names:
        raise PostgresError(f"--id-column: table {qualified} has no column {id_column!r}")
    if identity == "d" and id_column not in primary:
        raise PostgresError(
            f"--id-column {id_column} is not the primary key of {qualified}, so deletes would "
            f"not say which document: use the primary key, or ALTER TABLE {qualified} "
            "REPLICA IDENTITY FULL"
        )
    if options.doc_column is not None and options.doc_column not in names:
        raise PostgresError(f"--doc-column: table {qualified} has no column {options.doc_column!r}")
    types.resolve([t for _, t in columns], _query(conn))
    return Table(oid, columns, outputs, id_column, options.doc_column)


@dataclass(frozen=True)
class _Shape:
    """How a row's values become a document: each column's name and converter (chosen once per
    table or Relation message), where the id and the --doc-column are, and whether an update's
    old row is whole (REPLICA IDENTITY FULL)."""

    names: tuple[str, ...]
    converters: tuple[Callable[[str], Any], ...]
    id_at: int
    doc_at: int | None
    full_old_row: bool = False


def _shape(
    columns: Sequence[tuple[str, int]], table: Table, types: TypeCatalog, identity: str = "d"
) -> _Shape:
    names = tuple(name for name, _ in columns)
    if table.id_column not in names:
        raise PgOutputError(f"the table's columns no longer include {table.id_column}")
    doc_at = None if table.doc_column is None else names.index(table.doc_column)
    return _Shape(
        names,
        tuple(converter(types.get(oid)) for _, oid in columns),
        names.index(table.id_column),
        doc_at,
        identity == "f",
    )


def _identifier(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _with_line(docid: str, body: dict[str, Any]) -> Document:
    """A document with the line the source log stores (the JSONL input's shape), made with
    orjson: the log would otherwise encode it again with the standard library."""
    try:
        line = orjson.dumps({"id": docid, "doc": body})
    except TypeError:  # an integer beyond 64 bits: the log encodes it
        return Document(docid, body)
    return Document(docid, body, line)


def drop_slot(dsn: str, slot: str) -> bool:
    """Drop a replication slot, and the publication of the same name (blocking); whether the
    slot existed."""
    conn = _connect(dsn)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (slot,))
            existed = cur.fetchone() is not None
            if existed:
                cur.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
            cur.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (slot,))
            if cur.fetchone() is not None:
                cur.execute(f'DROP PUBLICATION "{slot}"')
        return existed
    except Exception as exc:
        raise PostgresError(f"cannot drop slot {slot}: {_one_line(exc)}") from None
    finally:
        conn.close()


class TableFollower:
    """Copies, then follows, one table into the appender (see module doc)."""

    def __init__(self, options: PostgresOptions, appender: Appender) -> None:
        if not _NAME.match(options.slot_name):
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
        conn = _connect(self.options.dsn)
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
            raise PostgresError(f"PostgreSQL: {_one_line(exc)}") from None
        return conn, table, exists

    def _quoted(self) -> str:
        schema, name = self.options.schema_table
        return f'"{schema}"."{name}"'

    def _select(self, table: Table) -> str:
        """Every column in its text output form, as pgoutput prints it: through the type's own
        output function (a cast to text differs: `true` for `t`, char(n) without its padding)."""
        return ", ".join(
            f"{output}({_identifier(name)})::text"
            for (name, _), output in zip(table.columns, table.outputs, strict=True)
        )

    def _document(
        self, shape: _Shape, values: Sequence[Value], previous: dict[str, Any] | None = None
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
                return _with_line(docid, body)
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
        return _with_line(docid, document)

    def _row(self, table: Table, docid: str, xid: int) -> Document | None:
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
                    f"WHERE {_identifier(table.id_column)}::text = %s",
                    (docid,),
                )
                found = cur.fetchone()
            finally:
                cur.execute("ROLLBACK")
        if found is None:
            return None
        return self._document(_shape(table.columns, table, self.types), found)

    def _rows_connection(self) -> Any:
        if self._rows_conn is None or self._rows_conn.closed:
            self._rows_conn = _connect(self.options.dsn)
        return self._rows_conn

    def _resolve_types(self, oids: list[int]) -> None:
        """Read the catalog rows of types a Relation message names for the first time."""
        self.types.resolve(oids, _query(self._rows_connection()))

    def _stats_connection(self) -> Any:
        if self._stats_conn is None or self._stats_conn.closed:
            self._stats_conn = _connect(self.options.dsn)
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
                        self.progress.error = _one_line(exc)
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
        stream = await trio.to_thread.run_sync(_connect, self.options.dsn, True)
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
        copier = await trio.to_thread.run_sync(_connect, self.options.dsn)
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
            shape = _shape(table.columns, table, self.types)
            copied = 0
            while True:
                batch = await trio.to_thread.run_sync(rows.fetchmany, COPY_ROWS)
                if not batch:
                    break
                documents = [self._document(shape, row) for row in batch]
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
        reader = _StreamReader(self, table, position)
        async with trio.open_nursery() as nursery:
            send, receive = trio.open_memory_channel[_Cut](0)
            nursery.start_soon(self._append_cuts, receive, cur, position.lsn, reader)
            await reader.run(stream, cur, send)

    async def _append_cuts(
        self,
        cuts: trio.MemoryReceiveChannel[_Cut],
        cur: Any,
        confirmed: int,
        reader: _StreamReader,
    ) -> None:
        """Append each cut (one synced batch with its position), then confirm to the slot the
        whole transactions it ends."""
        progress = self.progress
        async for cut in cuts:
            await self.appender.append(cut.documents, cut.position.encode())
            progress.changes += len(cut.documents)
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


@dataclass
class _Cut:
    """Changes to append in one synced batch, where they leave the table, and the end LSN of
    the last whole transaction among them (what the slot may forget once they are synced)."""

    documents: list[Document]
    position: Position
    confirm: int | None
    oldest_commit: datetime | None


class _StreamReader:
    """Turns the stream's messages into documents and hands them to the appender in cuts: as
    soon as it is free, or, past MAX_PENDING changes, waiting for it. A cut ends at a whole
    transaction, or inside a large one with how many of its changes it holds."""

    def __init__(self, follower: TableFollower, table: Table, position: Position):
        self.follower = follower
        self.table = table
        self.shape: _Shape | None = None  # of the table's last Relation message
        self.held = position  # what the log held when streaming started: skipped
        self.pending: list[Document] = []
        self.pending_position: Position | None = None
        self.pending_confirm: int | None = None
        self.oldest_commit: datetime | None = None
        self.confirmed = position.lsn  # what the appender confirmed so far
        # The latest version of each document read and not yet in the log (pending, or in a
        # cut being appended): where an unchanged TOASTed value is taken from first.
        self.unsynced: dict[str, Document] = {}
        self.in_flight = 0  # cuts handed over and not appended yet
        # The end of the last transaction with nothing to append read while cuts were in flight.
        self.confirm_when_appended = position.lsn
        self._appended = trio.Event()
        self.idle = False  # the stream had nothing more when the last cut was handed over
        # The transaction being read: its commit LSN and time, its changes so far, and how many
        # of them the log already holds (-1: all).
        self.txn_lsn = 0
        self.txn_xid = 0
        self.txn_time: datetime | None = None
        self.txn_seen = 0
        self.txn_skip = 0

    def appended(self, confirmed: int, documents: list[Document]) -> None:
        """The appender finished a cut: its documents are the log's now."""
        unsynced = self.unsynced
        for document in documents:
            if unsynced.get(document.docid) is document:
                del unsynced[document.docid]
        self.in_flight -= 1
        self.confirmed = max(self.confirmed, confirmed)
        if not self.in_flight:
            self.confirmed = max(self.confirmed, self.confirm_when_appended)
        self._appended.set()
        self._appended = trio.Event()

    async def run(self, stream: Any, cur: Any, cuts: trio.MemorySendChannel[_Cut]) -> None:
        fd = stream.fileno()
        last_feedback = time.monotonic()
        taken = 0
        while True:
            message = cur.read_message()
            if message is not None:
                self.idle = False
                await self.take(bytes(message.payload), cuts)
                taken += 1
                if taken % YIELD_EVERY == 0:
                    await trio.lowlevel.checkpoint()  # the node streams send meanwhile
                continue
            if self.pending_position is not None:
                # Nothing more for now; if more comes at once it joins the cut, else what is
                # whole goes to the appender (waiting for it if it is busy).
                with trio.move_on_after(COALESCE_S) as waited:
                    await trio.lowlevel.wait_readable(fd)
                if not waited.cancelled_caught:
                    continue
                self.idle = True
                await self.hand_over(cuts, wait=True)
            now = time.monotonic()
            if now - last_feedback >= FEEDBACK_S:
                cur.send_feedback(flush_lsn=self.confirmed, force=True)
                last_feedback = now
            with trio.move_on_after(FEEDBACK_S):
                await trio.lowlevel.wait_readable(fd)

    async def hand_over(self, cuts: trio.MemorySendChannel[_Cut], wait: bool) -> bool:
        """Give what is pending to the appender: at once if it is free, else only with `wait`
        (then when it is). Whether it was given."""
        if self.pending_position is None:
            return True
        cut = _Cut(self.pending, self.pending_position, self.pending_confirm, self.oldest_commit)
        try:
            cuts.send_nowait(cut)
        except trio.WouldBlock:
            if not wait:
                return False
            await cuts.send(cut)
        self.in_flight += 1
        self.pending, self.pending_position, self.pending_confirm = [], None, None
        if cut.position.done is None:
            self.oldest_commit = None
        return True

    async def drain(self, cuts: trio.MemorySendChannel[_Cut]) -> None:
        """Until every cut handed over is in the log (changes of the open transaction not
        yet positioned stay pending: a TRUNCATE counts them itself)."""
        await self.hand_over(cuts, wait=True)
        while self.in_flight:
            await self._appended.wait()

    async def take(self, payload: bytes, cuts: trio.MemorySendChannel[_Cut]) -> None:
        """One message of the stream."""
        message = decode_message(payload)
        if isinstance(message, Begin):
            self.txn_lsn, self.txn_time, self.txn_seen = message.final_lsn, message.commit_time, 0
            self.txn_xid = message.xid
            held = self.held
            if message.final_lsn < held.lsn or (
                message.final_lsn == held.lsn and held.done is None
            ):
                self.txn_skip = -1
            elif message.final_lsn == held.lsn:
                self.txn_skip = held.done or 0
            else:
                self.txn_skip = 0
        elif isinstance(message, Relation):
            if message.oid == self.table.oid:
                columns = [(c.name, c.type_oid) for c in message.columns]
                types = self.follower.types
                missing = types.missing(oid for _, oid in columns)
                if missing:  # a column of a type not seen yet (ALTER TABLE)
                    await trio.to_thread.run_sync(self.follower._resolve_types, missing)
                self.shape = _shape(columns, self.table, types, message.replica_identity)
        elif isinstance(message, Commit):
            if self.txn_skip != -1 and self.txn_seen > self.txn_skip:
                # Some of it is new: its position is recorded whole even when a large
                # transaction's changes were all handed over before this Commit.
                self.follower.progress.transactions += 1
                self.pending_position = Position(self.txn_lsn)
            elif self.pending_position is None:
                # Nothing of it to append (held already, or no change of the table: before
                # PostgreSQL 15 every transaction comes, empty ones too). It may be confirmed
                # once every earlier cut is in the log, not while one is being appended.
                if self.in_flight:
                    self.confirm_when_appended = max(self.confirm_when_appended, message.end_lsn)
                else:
                    self.confirmed = max(self.confirmed, message.end_lsn)
                return
            self.pending_confirm = message.end_lsn
            if len(self.pending) >= MAX_PENDING:
                await self.hand_over(cuts, wait=True)
            elif len(self.pending) >= MIN_CUT:
                await self.hand_over(cuts, wait=False)
        elif self._ours(message):
            # Changes are counted by message: one appends all its documents at once, so a
            # restart in the middle of a transaction skips whole messages.
            self.txn_seen += 1
            if self.txn_skip == -1 or self.txn_seen <= self.txn_skip:
                self.follower.progress.skipped += 1
                return
            if self.oldest_commit is None:
                self.oldest_commit = self.txn_time
            if isinstance(message, Truncate):
                await self.drain(cuts)  # every earlier change in the log first
            documents = self._row_change(message)
            if documents is None:  # a TRUNCATE, or a value to find
                documents = await self._documents(message)
            self.pending += documents
            unsynced = self.unsynced
            for document in documents:
                unsynced[document.docid] = document
            if len(self.pending) >= BATCH_CHANGES:
                # A large transaction: hand over what it has so far, and say how far; only
                # once the appender is free (trying each change costs more than it reads).
                self.pending_position = Position(self.txn_lsn, done=self.txn_seen)
                full = len(self.pending) >= MAX_PENDING
                if full or not self.in_flight:
                    await self.hand_over(cuts, wait=full)

    def _ours(self, message: Any) -> TypeGuard[Insert | Update | Delete | Truncate]:
        if isinstance(message, Truncate):
            return self.table.oid in message.relations
        return isinstance(message, Insert | Update | Delete) and message.relation == self.table.oid

    def _row_change(self, message: Insert | Update | Delete | Truncate) -> list[Document] | None:
        """The documents of an insert, update or delete, without a coroutine (the common case);
        None for a TRUNCATE, or for an update that left a TOASTed value out which neither its
        old row nor a version not yet in the log gives (`_documents` looks further)."""
        shape = self.shape
        if shape is None or isinstance(message, Truncate):
            return None
        if isinstance(message, Delete):
            return [Document(str(message.old[shape.id_at]), None)]
        new = message.new
        if UNCHANGED not in new or (
            shape.doc_at is not None
            and new[shape.doc_at] is not UNCHANGED
            and new[shape.id_at] is not UNCHANGED
        ):  # with --doc-column, only that column and the id matter
            return self._keyed(message, self.follower._document(shape, new))
        assert isinstance(message, Update)
        progress = self.follower.progress
        old = message.old
        if shape.full_old_row and old is not None:  # REPLICA IDENTITY FULL: the old row, whole
            new = tuple(o if v is UNCHANGED else v for v, o in zip(new, old, strict=True))
            if UNCHANGED not in new:
                progress.unchanged_from_old_row += 1
                return self._keyed(message, self.follower._document(shape, new))
        previous = self.unsynced.get(self._previous_id(message))
        if previous is not None and _fills(shape, new, previous):
            progress.unchanged_from_log += 1
            return self._keyed(message, self.follower._document(shape, new, previous.body))
        return None

    def _previous_id(self, message: Update) -> str:
        """The id under which the row's previous version is: the old key's, if it changed."""
        assert self.shape is not None
        at = self.shape.id_at
        old = message.old
        if old is not None and isinstance(old[at], str):
            return str(old[at])
        if not isinstance(message.new[at], str):
            raise PgOutputError(f"an update of {self.follower.qualified} without the row's id")
        return str(message.new[at])

    def _keyed(self, message: Insert | Update, document: Document | None) -> list[Document]:
        """The update's documents: a delete of the old id first when the key changed."""
        current = [] if document is None else [document]
        old = message.old if isinstance(message, Update) else None
        if old is None or not isinstance(old[self.shape.id_at], str):  # type: ignore[union-attr]
            return current
        old_id = str(old[self.shape.id_at])  # type: ignore[union-attr]
        new_id = message.new[self.shape.id_at]  # type: ignore[union-attr]
        if old_id != new_id:
            return [Document(old_id, None), *current]  # the key changed
        return current

    async def _documents(self, message: Insert | Update | Delete | Truncate) -> list[Document]:
        """The documents of a TRUNCATE, or of an update that left a TOASTed value out: taken
        from the row's latest version in the log, else from the row read once this change is
        visible (what it reads is this change or a later one, which follows in the stream)."""
        follower = self.follower
        source = follower.appender.source
        if isinstance(message, Truncate):
            survivors = await trio.to_thread.run_sync(source.surviving_documents)
            live = {docid for docid, document in survivors.items() if document.body is not None}
            # This transaction's changes before the TRUNCATE are not in the log yet.
            for document in self.pending:
                if document.body is None:
                    live.discard(document.docid)
                else:
                    live.add(document.docid)
            follower.progress.truncates += 1
            follower.progress.truncated_documents += len(live)
            log.warning("TRUNCATE of %s: deleting its %d documents", follower.qualified, len(live))
            return [Document(docid, None) for docid in sorted(live)]
        shape = self.shape
        if shape is None:
            raise PgOutputError("a change of the table before its Relation message")
        assert isinstance(message, Update)
        new = message.new
        if shape.full_old_row and message.old is not None:
            new = tuple(o if v is UNCHANGED else v for v, o in zip(new, message.old, strict=True))
        previous = await trio.to_thread.run_sync(source.latest_version, self._previous_id(message))
        if previous is not None and _fills(shape, new, previous):
            follower.progress.unchanged_from_log += 1
            return self._keyed(message, follower._document(shape, new, previous.body))
        docid = new[shape.id_at]
        if not isinstance(docid, str):
            raise PgOutputError(f"an update of {follower.qualified} without the row's id")
        if follower.progress.unchanged_rows_read == 0:
            log.warning(
                "an update of row %r of %s left a TOASTed value out, and the log holds no "
                "version of the row to take it from: the row is read again once the update is "
                "visible (ALTER TABLE %s REPLICA IDENTITY FULL sends the old row instead)",
                docid,
                follower.qualified,
                follower.qualified,
            )
        follower.progress.unchanged_rows_read += 1
        row = await trio.to_thread.run_sync(follower._row, self.table, docid, self.txn_xid)
        return self._keyed(message, Document(docid, None) if row is None else row)


def _fills(shape: _Shape, values: Sequence[Value], previous: Document) -> bool:
    """Whether the previous version holds every value an update left out."""
    body = previous.body
    if body is None:
        return False
    if shape.doc_at is not None:
        return True  # the document is the one column: unchanged, it is the previous body
    return all(
        name in body for name, value in zip(shape.names, values, strict=True) if value is UNCHANGED
    )
