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
    converter,
    decode_message,
    format_lsn,
    parse_lsn,
)

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
    id_column: str
    doc_column: str | None


def _connect(dsn: str, replication: bool = False) -> Any:
    import psycopg2
    import psycopg2.extras

    try:
        if replication:
            return psycopg2.connect(
                dsn, connection_factory=psycopg2.extras.LogicalReplicationConnection
            )
        conn = psycopg2.connect(dsn)
        conn.autocommit = True
        return conn
    except psycopg2.Error as exc:
        raise PostgresUnreachable(f"cannot connect to PostgreSQL: {_one_line(exc)}") from None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def describe_table(conn: Any, options: PostgresOptions) -> Table:
    """The table's columns, id column and replica identity, checked (blocking)."""
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
            "SELECT attname, atttypid FROM pg_attribute WHERE attrelid = %s AND attnum > 0 "
            "AND NOT attisdropped ORDER BY attnum",
            (oid,),
        )
        columns = tuple((str(c), int(t)) for c, t in cur.fetchall())
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
    return Table(oid, columns, id_column, options.doc_column)


@dataclass(frozen=True)
class _Shape:
    """How a row's values become a document: each column's name and converter (chosen once per
    table or Relation message), and where the id and the --doc-column are."""

    names: tuple[str, ...]
    converters: tuple[Callable[[str], Any], ...]
    id_at: int
    doc_at: int | None


def _shape(columns: Sequence[tuple[str, int]], table: Table) -> _Shape:
    names = tuple(name for name, _ in columns)
    if table.id_column not in names:
        raise PgOutputError(f"the table's columns no longer include {table.id_column}")
    doc_at = None if table.doc_column is None else names.index(table.doc_column)
    return _Shape(
        names,
        tuple(converter(oid) for _, oid in columns),
        names.index(table.id_column),
        doc_at,
    )


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
        self._stats_conn: Any = None

    # -- the parts that block, run in threads

    def _prepare(self) -> tuple[Any, Table, bool]:
        """A normal connection, the table, and whether the slot exists; creates the
        publication."""
        conn = _connect(self.options.dsn)
        try:
            table = describe_table(conn, self.options)
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
        """Every column as text (converted like a streamed change's values)."""
        return ", ".join(f'"{c}"::text' for c, _ in table.columns)

    def _document(self, shape: _Shape, values: Sequence[Any]) -> Document:
        """A row (its values' text forms) as a document: all its columns, or --doc-column."""
        docid = values[shape.id_at]
        if docid is None:
            raise PgOutputError(f"a row of {self.qualified} with a NULL id")
        if shape.doc_at is None:
            body = {
                name: None if value is None else convert(value)
                for name, convert, value in zip(shape.names, shape.converters, values, strict=True)
            }
            return _with_line(str(docid), body)
        text = values[shape.doc_at]
        document = {} if text is None else shape.converters[shape.doc_at](text)
        if not isinstance(document, dict):
            raise PgOutputError(f"{self.qualified}: the document of {docid} is not a JSON object")
        return _with_line(str(docid), document)

    def _row(self, table: Table, docid: str) -> Document | None:
        """The row as the table holds it now (an update left a TOASTed value out)."""
        conn = self._stats_connection()
        with conn.cursor() as cur:
            cur.execute(
                f"SELECT {self._select(table)} FROM {self._quoted()} "
                f'WHERE "{table.id_column}"::text = %s',
                (docid,),
            )
            found = cur.fetchone()
        return None if found is None else self._document(_shape(table.columns, table), found)

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
            if self._stats_conn is not None:
                self._stats_conn.close()
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
            shape = _shape(table.columns, table)
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
            reader.appended(confirmed)


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
        self.in_flight = 0  # cuts handed over and not appended yet
        self._appended = trio.Event()
        self.idle = False  # the stream had nothing more when the last cut was handed over
        # The transaction being read: its commit LSN and time, its changes so far, and how many
        # of them the log already holds (-1: all).
        self.txn_lsn = 0
        self.txn_time: datetime | None = None
        self.txn_seen = 0
        self.txn_skip = 0

    def appended(self, confirmed: int) -> None:
        """The appender finished a cut."""
        self.in_flight -= 1
        self.confirmed = confirmed
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
        """Until everything read so far is in the log."""
        await self.hand_over(cuts, wait=True)
        while self.in_flight:
            await self._appended.wait()

    async def take(self, payload: bytes, cuts: trio.MemorySendChannel[_Cut]) -> None:
        """One message of the stream."""
        message = decode_message(payload)
        if isinstance(message, Begin):
            self.txn_lsn, self.txn_time, self.txn_seen = message.final_lsn, message.commit_time, 0
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
                self.shape = _shape([(c.name, c.type_oid) for c in message.columns], self.table)
        elif isinstance(message, Commit):
            if self.txn_skip != -1 and self.txn_seen > self.txn_skip:
                # Some of it is new: its position is recorded whole even when a large
                # transaction's changes were all handed over before this Commit.
                self.follower.progress.transactions += 1
                self.pending_position = Position(self.txn_lsn)
            elif self.pending_position is None:
                self.confirmed = max(self.confirmed, message.end_lsn)  # nothing of it to append
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
            if documents is None:  # a TRUNCATE, or a row to read again
                documents = await self._documents(message)
            self.pending += documents
            if len(self.pending) >= BATCH_CHANGES:
                # A large transaction: hand over what it has so far, and say how far.
                self.pending_position = Position(self.txn_lsn, done=self.txn_seen)
                await self.hand_over(cuts, wait=len(self.pending) >= MAX_PENDING)

    def _ours(self, message: Any) -> TypeGuard[Insert | Update | Delete | Truncate]:
        if isinstance(message, Truncate):
            return self.table.oid in message.relations
        return isinstance(message, Insert | Update | Delete) and message.relation == self.table.oid

    def _row_change(
        self, message: Insert | Update | Delete | Truncate, current: list[Document] | None = None
    ) -> list[Document] | None:
        """The documents of an insert, update or delete, without a coroutine (the common case);
        None for a TRUNCATE, or for an update that left a value out until `current` (the row
        as read again, `_documents`) is given."""
        shape = self.shape
        if shape is None or isinstance(message, Truncate):
            return None
        at = shape.id_at
        if isinstance(message, Delete):
            return [Document(str(message.old[at]), None)]
        new = message.new
        if current is None:
            if UNCHANGED in new:
                return None
            current = [self.follower._document(shape, new)]
        old = message.old if isinstance(message, Update) else None
        if old is not None and old[at] is not None and str(old[at]) != str(new[at]):
            return [Document(str(old[at]), None), *current]  # the key changed
        return current

    async def _documents(self, message: Insert | Update | Delete | Truncate) -> list[Document]:
        """The documents of a TRUNCATE, or of an update that left a large (TOASTed) value out:
        the row is read as it is now (a later change of it follows in the stream)."""
        if isinstance(message, Truncate):
            source = self.follower.appender.source
            survivors = await trio.to_thread.run_sync(source.surviving_documents)
            # This transaction's changes before the TRUNCATE are not in the log yet.
            live = set(survivors)
            for document in self.pending:
                if document.body is None:
                    live.discard(document.docid)
                else:
                    live.add(document.docid)
            self.follower.progress.truncates += 1
            log.warning(
                "TRUNCATE of %s: deleting its %d documents", self.follower.qualified, len(live)
            )
            return [Document(docid, None) for docid in sorted(live)]
        if self.shape is None:
            raise PgOutputError("a change of the table before its Relation message")
        assert not isinstance(message, Delete)
        docid = str(message.new[self.shape.id_at])
        row = await trio.to_thread.run_sync(self.follower._row, self.table, docid)
        documents = self._row_change(message, [] if row is None else [row])
        assert documents is not None
        return documents
