"""`indexer router --postgres` against a model: random transactions (hypothesis) over a table with
a TOASTed jsonb column and a boolean, followed by a real router into a real daemon. After each
example the indexes must equal a model computed from the table's rows, read back with psycopg2's
own types (not the router's conversions).

The transactions insert, update only the small columns (pgoutput then sends the TOASTed value as
unchanged, and the router must take it from the row's latest version, even one of the same
transaction), replace the TOASTed value, change primary keys, delete, roll back savepoints and
whole transactions, and TRUNCATE. Rows inserted before the router starts go through the initial
copy. The table carries over from one example to the next, so hypothesis does not shrink.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

import psycopg2
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from indexer.router.documents import Document
from tests.e2e.conftest import WAIT_S, Daemon, Router, free_port, model, write_config
from tests.e2e.test_postgres_source import dsn, pg, run  # noqa: F401 (pg: the fixture)
from tests.harness import Postgres, http

pytestmark = pytest.mark.e2e

# One client for the module's requests: a new one per call (httpx.get) builds its TLS
# context each time, which costs more than the request on a busy machine.
HTTP = http()  # the harness's client: no kept-alive connections

DATABASE = "t_postgres_model"
TABLE = "CREATE TABLE items (id text PRIMARY KEY, flag boolean, n integer, big jsonb)"
# Out of line and uncompressed: a large value of `big` is always TOASTed.
STORAGE = "ALTER TABLE items ALTER COLUMN big SET STORAGE EXTERNAL"
ID_SPACE = 30  # row ids i0..i29: rows are updated, deleted and inserted again
PAD_BYTES = 3_000  # random bytes of a large `big`, as 6,000 hex digits
INDEXES: dict[str, dict[str, Any]] = {
    "by_flag": {"keys": ["flag", "n"]},
    "by_k": {"keys": ["big.k", "flag"]},
    "flagged": {"keys": ["n"], "where": "flag = TRUE"},
}
SHOWN = 10  # differing ids quoted in a failure

Scans: TypeAlias = dict[str, list[dict[str, Any]]]


# ------------------------------------------------------------------------------------------------
# Transactions, abstractly


def row_id(row: int) -> str:
    return f"i{row}"


@dataclass(frozen=True)
class Big:
    """A value of `big`: {"k": k} and, with a seed, 6,000 random hex digits (TOASTed)."""

    k: int
    seed: int | None

    def text(self) -> str:
        value: dict[str, Any] = {"k": self.k}
        if self.seed is not None:
            value["pad"] = random.Random(self.seed).randbytes(PAD_BYTES).hex()
        return json.dumps(value)


def big_text(big: Big | None) -> str | None:
    return None if big is None else big.text()


Statement: TypeAlias = tuple[str, tuple[Any, ...]]


@dataclass(frozen=True)
class Insert:
    row: int
    flag: bool | None
    n: int | None
    big: Big | None

    def statements(self) -> list[Statement]:
        return [
            (
                "INSERT INTO items VALUES (%s, %s, %s, %s::jsonb) ON CONFLICT (id) DO NOTHING",
                (row_id(self.row), self.flag, self.n, big_text(self.big)),
            )
        ]


@dataclass(frozen=True)
class SetSmall:
    """An update of `flag` and/or `n` only: `big` is left out (unchanged)."""

    row: int
    values: tuple[tuple[str, Any], ...]  # (column, value)

    def statements(self) -> list[Statement]:
        assignments = ", ".join(f"{column} = %s" for column, _ in self.values)
        params = (*(value for _, value in self.values), row_id(self.row))
        return [(f"UPDATE items SET {assignments} WHERE id = %s", params)]


@dataclass(frozen=True)
class SetBig:
    row: int
    big: Big | None

    def statements(self) -> list[Statement]:
        return [
            (
                "UPDATE items SET big = %s::jsonb WHERE id = %s",
                (big_text(self.big), row_id(self.row)),
            )
        ]


@dataclass(frozen=True)
class Rekey:
    """The primary key changes (and `flag` with it, when given); `big` is left out."""

    old: int
    new: int
    flag: tuple[bool | None, ...]  # () or (the new flag,)

    def statements(self) -> list[Statement]:
        also = ", flag = %s" if self.flag else ""
        return [
            (
                f"UPDATE items SET id = %s{also} WHERE id = %s "
                "AND NOT EXISTS (SELECT 1 FROM items WHERE id = %s)",
                (row_id(self.new), *self.flag, row_id(self.old), row_id(self.new)),
            )
        ]


@dataclass(frozen=True)
class Delete:
    row: int

    def statements(self) -> list[Statement]:
        return [("DELETE FROM items WHERE id = %s", (row_id(self.row),))]


@dataclass(frozen=True)
class Flip:
    """Many rows' `flag` in one statement, `big` left out."""

    below: int

    def statements(self) -> list[Statement]:
        return [("UPDATE items SET flag = NOT flag WHERE n < %s", (self.below,))]


Simple: TypeAlias = Insert | SetSmall | SetBig | Rekey | Delete | Flip


@dataclass(frozen=True)
class Savepoint:
    """SAVEPOINT, some changes, then ROLLBACK TO SAVEPOINT or RELEASE SAVEPOINT."""

    ops: tuple[Simple, ...]
    rollback: bool

    def statements(self) -> list[Statement]:
        inner = [statement for op in self.ops for statement in op.statements()]
        end = "ROLLBACK TO SAVEPOINT s" if self.rollback else "RELEASE SAVEPOINT s"
        return [("SAVEPOINT s", ()), *inner, (end, ())]


Op: TypeAlias = Simple | Savepoint


@dataclass(frozen=True)
class Transaction:
    ops: tuple[Op, ...]
    commit: bool
    truncate: bool = False  # TRUNCATE first

    def statements(self) -> list[Statement]:
        body = [statement for op in self.ops for statement in op.statements()]
        first = [("TRUNCATE items", ())] if self.truncate else []
        return [("BEGIN", ()), *first, *body, ("COMMIT" if self.commit else "ROLLBACK", ())]


rows = st.integers(0, ID_SPACE - 1)
flags = st.sampled_from([True, True, False, False, None])
numbers = st.integers(-20, 24).map(lambda v: None if v > 20 else v)
bigs = st.tuples(st.integers(0, 9), st.integers(0, 7), st.integers(0, 2**32)).map(
    lambda t: None if t[1] == 0 else Big(t[0], None if t[1] == 1 else t[2])
)  # mostly TOASTed, sometimes small, sometimes NULL
small_values = st.one_of(
    st.tuples(st.tuples(st.just("flag"), flags)),
    st.tuples(st.tuples(st.just("n"), numbers)),
    st.tuples(st.tuples(st.just("flag"), flags), st.tuples(st.just("n"), numbers)),
)
inserts = st.builds(Insert, rows, flags, numbers, bigs)
sets = st.builds(SetSmall, rows, small_values)


@st.composite
def inserted_then_set(draw: st.DrawFn) -> list[Simple]:
    """An insert and an update of its `flag` in the same transaction: the router takes the
    TOASTed value from a version it has not appended yet."""
    insert = draw(inserts)
    return [insert, SetSmall(insert.row, (("flag", draw(flags)),))]


simple_ops: st.SearchStrategy[list[Simple]] = st.one_of(
    inserts.map(lambda op: [op]),
    sets.map(lambda op: [op]),
    sets.map(lambda op: [op]),
    inserted_then_set(),
    st.builds(SetBig, rows, bigs).map(lambda op: [op]),
    st.builds(Rekey, rows, rows, st.one_of(st.just(()), st.tuples(flags))).map(lambda op: [op]),
    st.builds(Delete, rows).map(lambda op: [op]),
    st.builds(Flip, st.integers(-20, 20)).map(lambda op: [op]),
)
savepoints: st.SearchStrategy[list[Op]] = st.builds(
    Savepoint,
    st.lists(simple_ops, min_size=1, max_size=3).map(
        lambda groups: tuple(op for group in groups for op in group)
    ),
    st.booleans(),
).map(lambda op: [op])


@st.composite
def transactions(draw: st.DrawFn) -> Transaction:
    """1-6 changes (a savepoint's counts as one), committed, or rolled back about once in
    seven; about one in twenty is a TRUNCATE followed by 0-3 changes. (Ranges in the middle
    of 0-99: hypothesis draws the bounds often.)"""
    truncate = 40 <= draw(st.integers(0, 99)) < 45
    groups = draw(
        st.lists(
            st.one_of(simple_ops, simple_ops, savepoints),
            min_size=0 if truncate else 1,
            max_size=3 if truncate else 6,
        )
    )
    commit = not 40 <= draw(st.integers(0, 99)) < 55
    return Transaction(tuple(op for group in groups for op in group), commit, truncate)


# ------------------------------------------------------------------------------------------------
# The server, the table, the processes


@pytest.fixture
def items(pg: Postgres) -> Iterator[str]:  # noqa: F811 (the fixture)
    """A fresh database with the table `items`; its DSN."""
    pg.query(f"DROP DATABASE IF EXISTS {DATABASE}")
    pg.query(f"CREATE DATABASE {DATABASE}")
    url = dsn(pg, DATABASE)
    run(url, TABLE)
    run(url, STORAGE)
    yield url
    conn = psycopg2.connect(dsn(pg, "postgres"))
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
            "WHERE database = %s AND NOT active",
            (DATABASE,),
        )
    conn.close()


def start_daemon(tmp: Path) -> Daemon:
    port = free_port()
    sections = {f"indexes.{name}": table for name, table in INDEXES.items()}
    config = write_config(tmp / "indexer.toml", tmp / "data", port, **sections)
    return Daemon(config, tmp / "daemon.log", port).start()


def start_router(tmp: Path, daemon: Daemon, url: str) -> Router:
    router = Router(
        tmp / "router.log",
        "--state", str(tmp / "state"), "--to", daemon.address, "--http", "127.0.0.1:0",
        "--postgres", url, "--table", "public.items",
    )  # fmt: skip
    router.wait_url()
    return router


def execute(conn: Any, transaction: Transaction) -> None:
    """The transaction's statements on an autocommit connection (BEGIN ... COMMIT/ROLLBACK)."""
    with conn.cursor() as cur:
        try:
            for sql, params in transaction.statements():
                cur.execute(sql, params)
        except psycopg2.Error:
            cur.execute("ROLLBACK")
            raise


# ------------------------------------------------------------------------------------------------
# The model and the comparison


def table_documents(conn: Any) -> list[Document]:
    """The table's rows as documents, with psycopg2's conversions (bool, int, jsonb as dict)."""
    with conn.cursor() as cur:
        cur.execute("SELECT id, flag, n, big FROM items")
        found = cur.fetchall()
    return [Document(i, {"id": i, "flag": f, "n": n, "big": b}) for i, f, n, b in found]


def wanted(conn: Any) -> Scans:
    documents = table_documents(conn)
    return {
        name: model(documents, table["keys"], table.get("where")) for name, table in INDEXES.items()
    }


def scans(daemon: Daemon) -> Scans:
    out = {}
    for name in INDEXES:
        answer = HTTP.get(f"{daemon.url}/indexes/{name}/scan", timeout=60)
        assert answer.status_code == 200, answer.text
        out[name] = [json.loads(line) for line in answer.text.splitlines() if line]
    return out


def by_id(found: Scans) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Each document id's entries, by index (without the id)."""
    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for name, entries in found.items():
        for entry in entries:
            rest = {k: v for k, v in entry.items() if k != "id"}
            out.setdefault(entry["id"], {}).setdefault(name, []).append(rest)
    return out


def difference(got: Scans, want: Scans) -> str:
    """The ids whose entries differ (at most SHOWN of them): the index's, then the table's."""
    have, should = by_id(got), by_id(want)
    ids = sorted(i for i in have.keys() | should.keys() if have.get(i) != should.get(i))
    if not ids:
        return "the same entries in another order"
    lines = [f"{len(ids)} ids differ (index != table):"]
    lines += [f"  {i}: {have.get(i, {})} != {should.get(i, {})}" for i in ids[:SHOWN]]
    return "\n".join(lines)


def wait_model(daemon: Daemon, router: Router, conn: Any, what: str) -> None:
    """Until the daemon's indexes equal the model of the table as it is now."""
    want = wanted(conn)
    deadline = time.monotonic() + WAIT_S
    while True:
        got = scans(daemon)
        if got == want:
            return
        router.check_alive()
        daemon.check_alive()
        if time.monotonic() > deadline:
            raise AssertionError(
                f"after {what}, the indexes differ from the table for {WAIT_S} s:\n"
                + difference(got, want)
            )
        time.sleep(0.1)


# ------------------------------------------------------------------------------------------------
# The test


def test_random_transactions_keep_the_index_equal_to_the_table(items: str, tmp_path: Path) -> None:
    conn = psycopg2.connect(items)
    conn.autocommit = True
    # Rows before the slot: the initial copy, true flags and TOASTed values among them.
    execute(
        conn,
        Transaction(
            tuple(
                Insert(row, [True, False, None][row % 3], row - 5, Big(row % 4, row))
                for row in range(12)
            ),
            commit=True,
        ),
    )
    with conn.cursor() as cur:
        cur.execute(
            "SELECT reltoastrelid::regclass::text FROM pg_class WHERE oid = 'items'::regclass"
        )
        (toast,) = cur.fetchone()
        cur.execute(f"SELECT count(DISTINCT chunk_id) FROM {toast}")
        assert cur.fetchone() == (12,), "the large values are not TOASTed out of line"
    daemon = start_daemon(tmp_path)
    router = start_router(tmp_path, daemon, items)
    history = tmp_path / "transactions.txt"  # every transaction run, for a failure's replay
    truncated = 0
    failed: list[str] = []
    try:
        wait_model(daemon, router, conn, "the initial copy")

        @settings(
            max_examples=50,
            deadline=None,
            derandomize=True,
            database=None,
            phases=(Phase.explicit, Phase.generate),  # the table carries over: no shrinking
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(st.lists(transactions(), min_size=1, max_size=4))
        def example(batch: list[Transaction]) -> None:
            nonlocal truncated
            if not failed:  # else hypothesis replays the failing example: the same failure
                with history.open("a") as f:
                    f.write("".join(f"{transaction!r}\n" for transaction in batch) + "--\n")
                for transaction in batch:
                    execute(conn, transaction)
                    if transaction.truncate and transaction.commit:
                        truncated += 1
                try:
                    wait_model(daemon, router, conn, f"these transactions (all in {history})")
                except AssertionError as exc:
                    failed.append(str(exc))
            if failed:
                raise AssertionError(failed[0])

        example()
        if not truncated:  # hypothesis drew none: one TRUNCATE, rows again, one updated
            execute(
                conn,
                Transaction(
                    (
                        Insert(0, True, 1, Big(1, 1)),
                        Insert(1, True, 2, Big(2, 2)),
                        SetSmall(0, (("flag", False),)),
                    ),
                    commit=True,
                    truncate=True,
                ),
            )
            truncated += 1
            wait_model(daemon, router, conn, "a TRUNCATE")
        stats = router.stats(HTTP)["postgres"]
        assert stats["truncates"] == truncated, stats
        assert stats["unchanged_from_log"] > 0, stats  # TOASTed values taken from the log
        assert router.stop() == 0
        assert daemon.stop() == 0
    finally:
        router.kill()
        daemon.kill()
        conn.close()
