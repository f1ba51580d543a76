"""A PostgreSQL table as the router sees it: the options of the input, its progress and its
position in the table (what the source log stores with each append), the table's description,
and a row turned into a document (one conversion for the copy, the stream and a read of a row).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from indexer.router.documents import Document
from indexer.router.inputs.postgres.pgoutput import (
    PgOutputError,
)
from indexer.router.inputs.postgres.pgtypes import (
    SESSION_OPTIONS,
    TYPE_QUERY,
    TypeCatalog,
    converter,
)

log = logging.getLogger("indexer.router")

NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


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
    appends: int = 0  # synced appends of those changes (fewer, larger ones cost less a change)
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


def connect(dsn: str, replication: bool = False) -> Any:
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
        raise PostgresUnreachable(f"cannot connect to PostgreSQL: {one_line(exc)}") from None


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def type_query(conn: Any) -> Callable[[list[int]], list[tuple[Any, ...]]]:
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
    types.resolve([t for _, t in columns], type_query(conn))
    return Table(oid, columns, outputs, id_column, options.doc_column)


@dataclass(frozen=True)
class Shape:
    """How a row's values become a document: each column's name and converter (chosen once per
    table or Relation message), where the id and the --doc-column are, and whether an update's
    old row is whole (REPLICA IDENTITY FULL)."""

    names: tuple[str, ...]
    converters: tuple[Callable[[str], Any], ...]
    id_at: int
    doc_at: int | None
    full_old_row: bool = False


def shape_of(
    columns: Sequence[tuple[str, int]], table: Table, types: TypeCatalog, identity: str = "d"
) -> Shape:
    names = tuple(name for name, _ in columns)
    if table.id_column not in names:
        raise PgOutputError(f"the table's columns no longer include {table.id_column}")
    doc_at = None if table.doc_column is None else names.index(table.doc_column)
    return Shape(
        names,
        tuple(converter(types.get(oid)) for _, oid in columns),
        names.index(table.id_column),
        doc_at,
        identity == "f",
    )


def identifier(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def with_line(docid: str, body: dict[str, Any]) -> Document:
    """A document with the line the source log stores (the JSONL input's shape), made with
    orjson: the log would otherwise encode it again with the standard library. The body is
    dropped: the streams read the index paths from the line, as the log holds it."""
    try:
        line = orjson.dumps({"id": docid, "doc": body})
    except TypeError:  # an integer beyond 64 bits: the log encodes it
        return Document(docid, body)
    return Document.from_line(docid, line, expires="_exp" in body)


def drop_slot(dsn: str, slot: str) -> bool:
    """Drop a replication slot, and the publication of the same name (blocking); whether the
    slot existed."""
    conn = connect(dsn)
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
        raise PostgresError(f"cannot drop slot {slot}: {one_line(exc)}") from None
    finally:
        conn.close()
