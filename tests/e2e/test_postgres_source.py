"""`indexer router --postgres`: a real PostgreSQL server (initdb in a temporary directory,
wal_level=logical), a real router and a real daemon. The indexes must equal a model computed from
the table's final contents, read back with psycopg2's own types, and the router's source log
must hold each change exactly once. One row in ten has a TOASTed column (`notes`, stored out of
line), so updates that leave it out take it from the row's latest version; half the rows are
`active`, so a boolean that read back wrong on one path shows in `by_active`."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg2
import psycopg2.extras
import pytest

from indexer.router.documents import Document, vbucket_of
from tests.e2e.conftest import WAIT_S, Daemon, Router, free_port, model, write_config
from tests.harness import Postgres, find_postgres, http, indexer_command

pytestmark = pytest.mark.e2e

# One client for the module's requests: a new one per call (httpx.get) builds its TLS
# context each time, which costs more than the request on a busy machine.
HTTP = http()  # the harness's client: no kept-alive connections

LOGICAL = {"wal_level": "logical", "max_wal_senders": "10", "max_replication_slots": "10"}
PARTIAL = {"indexes.adults": {"keys": ["age"], "where": "age >= 18"}}
ACTIVE = {"indexes.by_active": {"keys": ["active", "notes.k"]}}
INDEXES = {
    "by_city": ["address.city", "age"],
    "by_age": ["age"],
    "adults": ["age"],
    "by_active": ["active", "notes.k"],
}
TABLE = """
CREATE TABLE people (
    id text PRIMARY KEY,
    address jsonb,
    age integer,
    score numeric,
    seen timestamptz,
    tags text[],
    active boolean,
    notes jsonb
);
ALTER TABLE people ALTER COLUMN notes SET STORAGE EXTERNAL;
"""


@pytest.fixture(scope="module")
def pg() -> Iterator[Postgres]:
    bindir = find_postgres()
    assert bindir is not None, (
        "PostgreSQL's initdb and postgres are not installed: `make test` installs the Debian "
        "package postgresql"
    )
    server = Postgres(bindir, settings=LOGICAL)
    server.start()
    yield server
    server.stop()


def dsn(pg: Postgres, database: str) -> str:
    return f"host={pg.dir} port={pg.port} user=postgres dbname={database}"


@pytest.fixture
def db(pg: Postgres, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh database of its own for each test, with the table; its DSN."""
    name = "t_" + request.node.name.lower().replace("[", "_").replace("]", "")[:40]
    pg.query(f"DROP DATABASE IF EXISTS {name}")
    pg.query(f"CREATE DATABASE {name}")
    url = dsn(pg, name)
    run(url, TABLE)
    yield url
    # A test's slots must go before its database can be dropped.
    conn = psycopg2.connect(dsn(pg, "postgres"))
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
            "WHERE database = %s AND NOT active",
            (name,),
        )
    conn.close()


def run(url: str, sql: str, params: Any = None) -> None:
    """One statement in its own transaction."""
    conn = psycopg2.connect(url)
    with conn, conn.cursor() as cur:
        cur.execute(sql, params)
    conn.close()


def person(i: int, age: int | None = None) -> tuple[Any, ...]:
    cities = ["Oslo", "Rome", "Lima", "Kyiv", None]
    city = cities[i % len(cities)]
    address = json.dumps({"city": city, "zip": f"{i:05d}"}) if i % 7 else None
    return (
        f"p{i}",
        address,
        (i * 7) % 90 if age is None else age,
        f"{i}.25",
        "2026-01-02 03:04:05.5+00",
        ["a", f"t{i % 3}"],
        i % 2 == 0,
        json.dumps(notes(i)),
    )


def notes(i: int) -> dict[str, Any]:
    """One row in ten gets 6 KB of random text: TOASTed, out of line."""
    return {"k": i % 7, "pad": os.urandom(3_000).hex()} if i % 10 == 1 else {"k": i % 7}


INSERT = "INSERT INTO people VALUES (%s, %s, %s, %s, %s, %s, %s, %s)"


def insert_many(url: str, rows: list[tuple[Any, ...]]) -> None:
    """One transaction."""
    conn = psycopg2.connect(url)
    with conn, conn.cursor() as cur:
        psycopg2.extras.execute_batch(cur, INSERT, rows, page_size=1000)
    conn.close()


def table_documents(url: str) -> list[Document]:
    """The table's final contents as documents, with psycopg2's own conversions."""
    conn = psycopg2.connect(url)
    with conn, conn.cursor() as cur:
        cur.execute("SELECT id, address, age, active, notes FROM people")
        rows = cur.fetchall()
    conn.close()
    return [
        Document(i, {"id": i, "address": a, "age": age, "active": active, "notes": n})
        for i, a, age, active, n in rows
    ]


def scans(daemon: Daemon) -> dict[str, list[dict[str, Any]]]:
    out = {}
    for name in INDEXES:
        answer = HTTP.get(f"{daemon.url}/indexes/{name}/scan", timeout=60)
        assert answer.status_code == 200, answer.text
        out[name] = [json.loads(line) for line in answer.text.splitlines() if line]
    return out


def wanted(url: str) -> dict[str, list[dict[str, Any]]]:
    documents = table_documents(url)
    out = {name: model(documents, paths) for name, paths in INDEXES.items() if name != "adults"}
    out["adults"] = model(documents, ["age"], "age >= 18")
    return out


def wait_model(daemon: Daemon, url: str, router: Router, timeout: float = WAIT_S) -> None:
    want = wanted(url)
    deadline = time.monotonic() + timeout
    while True:
        got = scans(daemon)
        if got == want:
            return
        router.check_alive()
        assert time.monotonic() < deadline, {
            name: (len(got[name]), len(want[name])) for name in INDEXES
        }
        time.sleep(0.2)


def _count(url: str) -> int:
    conn = psycopg2.connect(url)
    with conn, conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM people")
        (count,) = cur.fetchone()
    conn.close()
    return int(count)


def start_router(tmp: Path, daemon: Daemon, url: str, *extra: str) -> Router:
    """A router following the table, its log in a file of its own (a restart gets a new one)."""
    router = Router(
        tmp / f"router{len(list(tmp.glob('router*.log')))}.log",
        "--state", str(tmp / "state"), "--to", daemon.address, "--http", "127.0.0.1:0",
        "--postgres", url, "--table", "public.people", *extra,
    )  # fmt: skip
    router.wait_url()
    return router


def start_daemon(tmp: Path) -> Daemon:
    port = free_port()
    config = write_config(tmp / "indexer.toml", tmp / "data", port, **PARTIAL, **ACTIVE)
    return Daemon(config, tmp / "daemon.log", port).start()


def test_rows_then_changes_of_every_kind_equal_the_table(db: str, tmp_path: Path) -> None:
    insert_many(db, [person(i) for i in range(1_000)])  # before the slot: the initial copy
    daemon = start_daemon(tmp_path)
    router = start_router(tmp_path, daemon, db)
    wait_model(daemon, db, router)
    stats = router.stats(HTTP)["postgres"]
    assert stats["copied_rows"] == 1_000 and stats["slot"] == "indexer_public_people"
    # Inserts, updates (a key, an age out of the partial index, a city), deletes.
    insert_many(db, [person(i) for i in range(1_000, 1_500)])
    run(db, "UPDATE people SET age = 10 WHERE id = 'p20'")  # p20 was 50: leaves `adults`
    run(db, "UPDATE people SET id = 'moved' WHERE id = 'p21'")  # the id of a TOASTed row
    run(db, "UPDATE people SET address = '{\"city\": \"Bern\"}' WHERE id LIKE 'p3%'")
    run(db, "DELETE FROM people WHERE id LIKE 'p4%'")
    # Updates that leave the TOASTed `notes` out, one in a transaction with the row's insert.
    run(db, "UPDATE people SET active = NOT active WHERE id LIKE 'p1%'")
    conn = psycopg2.connect(db)
    with conn, conn.cursor() as cur:
        cur.execute(INSERT, person(2_001))
        cur.execute("UPDATE people SET active = NOT active, age = 3 WHERE id = 'p2001'")
    conn.close()
    wait_model(daemon, db, router)
    stats = router.stats(HTTP)["postgres"]
    assert stats["unchanged_from_log"] >= 16
    # Every change in a synced append, which holds one or more whole transactions (none here
    # is large enough to be cut inside).
    assert 1 <= stats["appends"] <= stats["transactions"] <= stats["changes"]
    body = HTTP.get(f"{daemon.url}/indexes/by_age/docs/moved").json()
    assert body["entries"] and body["entries"][0]["id"] == "moved"
    assert HTTP.get(f"{daemon.url}/indexes/by_age/docs/p21").json()["entries"] == []
    # TRUNCATE deletes every live document, once each; rows inserted after it are there.
    live = _count(db)
    run(db, "TRUNCATE people")
    insert_many(db, [person(i) for i in range(5_000, 5_010)])
    wait_model(daemon, db, router)
    assert len(scans(daemon)["by_age"]) == 10
    (said,) = router.wait_log(r"TRUNCATE of public\.people: deleting its (\d+) documents")
    assert int(said) == live  # not the ids deleted before it
    run(db, "TRUNCATE people")
    wait_model(daemon, db, router)
    both = router.wait_log(r"TRUNCATE of public\.people: deleting its (\d+) documents", 2)
    assert both[1] == "10"
    # Changes before a TRUNCATE in its own transaction are deleted with the rest.
    conn = psycopg2.connect(db)
    with conn, conn.cursor() as cur:
        cur.execute(INSERT, person(9_001))
        cur.execute("UPDATE people SET active = NOT active WHERE id = 'p9001'")
        cur.execute("TRUNCATE people")
        cur.execute(INSERT, person(9_002))
    conn.close()
    wait_model(daemon, db, router)
    assert [e["id"] for e in scans(daemon)["by_age"]] == ["p9002"]
    stats = router.stats(HTTP)["postgres"]
    assert stats["state"] == "streaming" and stats["truncates"] == 3
    assert stats["truncated_documents"] == live + 10 + 1
    assert stats["confirmed_lsn"] is not None
    for key in ("lag_bytes", "lag_s", "changes_per_s", "server_lsn"):
        assert key in stats, key
    assert router.stop() == 0
    assert daemon.stop() == 0


@pytest.mark.parametrize(
    "rows", [pytest.param(20_000), pytest.param(30_000, marks=pytest.mark.soak)]
)
def test_router_killed_in_a_large_transaction_resumes_exactly_once(
    db: str, tmp_path: Path, rows: int
) -> None:
    daemon = start_daemon(tmp_path)
    router = start_router(tmp_path, daemon, db)
    router.wait_log(r"following public\.people through slot")
    # One transaction of `rows` inserts, several cuts of at most 10,000 changes: the router
    # appends it in pieces as it reads it.
    insert_many(db, [person(i) for i in range(rows)])
    deadline = time.monotonic() + WAIT_S
    while router.stats(HTTP)["postgres"]["changes"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    appended = router.appended(HTTP)
    router.stop(signal.SIGKILL)
    assert appended < rows, "the transaction was all appended before the kill: not a test"
    # Updates that leave the TOASTed `notes` out, of rows appended before the kill or not.
    run(db, "UPDATE people SET age = age + 1 WHERE id LIKE 'p1%'")
    router = start_router(tmp_path, daemon, db)
    wait_model(daemon, db, router)
    assert router.stats(HTTP)["postgres"]["unchanged_from_log"] > 0
    updated = len([i for i in range(rows) if str(i).startswith("1")])
    # Each change once in the source log: no insert appended twice after the restart; and
    # the daemon holds exactly those seqnos (a seqno sent twice would be refused, and counted).
    assert router.appended(HTTP) == rows + updated
    deadline = time.monotonic() + WAIT_S
    while daemon.stats(HTTP)["persisted"]["seqno_sum"] != rows + updated:
        assert time.monotonic() < deadline, daemon.stats(HTTP)["persisted"]
        time.sleep(0.1)
    assert "SEQNO_BACKWARDS" not in daemon.log()
    assert router.stats(HTTP)["postgres"]["skipped"] > 0  # read again, recognised, skipped
    assert daemon.stop() == 0
    assert router.stop() == 0


def test_daemon_killed_and_restarted_during_the_stream(db: str, tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path)
    router = start_router(tmp_path, daemon, db)
    for start in range(0, 6_000, 1_000):
        insert_many(db, [person(i) for i in range(start, start + 1_000)])
        if start == 3_000:
            daemon.kill()
            daemon.start()
            run(db, "UPDATE people SET active = NOT active WHERE id LIKE '%1'")  # TOASTed notes
    run(db, "DELETE FROM people WHERE age > 80")
    wait_model(daemon, db, router)
    assert daemon.stop() == 0
    assert router.stop() == 0


# Rows of the large-table cases: several of the copy's round trips of 5,000 rows.
LARGE = [pytest.param(20_000), pytest.param(100_000, marks=pytest.mark.soak)]


@pytest.mark.parametrize("rows", LARGE)
def test_a_large_table_is_copied_while_changes_go_on(db: str, tmp_path: Path, rows: int) -> None:
    conn = psycopg2.connect(db)
    with conn, conn.cursor() as cur:
        cur.execute(
            "INSERT INTO people SELECT 'p' || i, jsonb_build_object('city', 'C' || (i %% 50)), "
            "i %% 90, i, now(), ARRAY['x'], true FROM generate_series(1, %s) AS i",
            (rows,),
        )
    conn.close()
    daemon = start_daemon(tmp_path)
    router = start_router(tmp_path, daemon, db)
    # Changes while the copy runs: after the slot's snapshot, they come through the stream.
    conn = psycopg2.connect(db)
    conn.autocommit = True  # each update a transaction of its own
    with conn.cursor() as cur:
        for i in range(1, 2_000, 10):
            cur.execute("UPDATE people SET age = 99 WHERE id = %s", (f"p{i}",))
        cur.execute("DELETE FROM people WHERE id IN ('p2', 'p4')")
    conn.close()
    wait_model(daemon, db, router, timeout=300)
    assert router.stats(HTTP)["postgres"]["copied_rows"] >= rows - 2
    assert daemon.stop() == 0
    assert router.stop() == 0


def test_clear_errors_and_dropping_the_slot(db: str, pg: Postgres, tmp_path: Path) -> None:
    run(db, "CREATE TABLE loose (a int, b text)")
    daemon = start_daemon(tmp_path)
    refused = Router(
        tmp_path / "loose.log",
        "--state", str(tmp_path / "s1"), "--to", daemon.address,
        "--postgres", db, "--table", "loose",
    )  # fmt: skip
    assert refused.proc.wait(timeout=60) == 1
    line = refused.log().strip().splitlines()[-1]
    assert "no primary key and no replica identity" in line and "REPLICA IDENTITY FULL" in line
    router = start_router(tmp_path, daemon, db)
    router.wait_log(r"following public\.people through slot")
    assert router.stop() == 0
    dropped = subprocess_run("--postgres", db, "--drop-slot", "indexer_public_people")
    assert dropped.returncode == 0 and "slot indexer_public_people dropped" in dropped.stdout
    again = subprocess_run("--postgres", db, "--drop-slot", "indexer_public_people")
    assert again.returncode == 0 and "no slot named" in again.stdout
    assert pg.query("SELECT count(*) FROM pg_replication_slots") == "0"
    assert daemon.stop() == 0


def subprocess_run(*args: str) -> Any:
    import subprocess

    return subprocess.run(
        indexer_command("router", *args), capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    "rows", [pytest.param(30_000), pytest.param(150_000, marks=pytest.mark.soak)]
)
def test_a_copy_cut_short_is_made_again_and_rows_gone_meanwhile_are_deleted(
    db: str, tmp_path: Path, rows: int
) -> None:
    run(
        db,
        "INSERT INTO people SELECT 'p' || i, jsonb_build_object('city', 'C' || (i %% 50)), "
        "i %% 90, i, now(), ARRAY['x'], true FROM generate_series(1, %s) AS i",
        (rows,),
    )
    daemon = start_daemon(tmp_path)
    router = start_router(tmp_path, daemon, db)
    deadline = time.monotonic() + WAIT_S
    while router.stats(HTTP)["postgres"]["copied_rows"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    router.stop(signal.SIGKILL)
    copied = router.log().count("copied ")
    assert copied == 0, "the copy finished before the kill: not a test"
    run(db, "DELETE FROM people WHERE id LIKE 'p1%'")  # some of them were copied already
    router = start_router(tmp_path, daemon, db)
    router.wait_log(r"copying public\.people")
    wait_model(daemon, db, router, timeout=300)
    assert "the initial copy was cut short" in router.log()
    # Rows the first copy had appended, deleted before the second: their documents go.
    gone = re.search(r"\((\d+) documents of an earlier copy deleted\)", router.log())
    assert gone is not None and int(gone.group(1)) > 0, router.log()[-2000:]
    assert daemon.stop() == 0
    assert router.stop() == 0


def test_unchanged_toasted_values_from_the_old_row_or_from_a_read_of_the_row(
    db: str, tmp_path: Path
) -> None:
    """The two other ways to an unchanged TOASTed value: the old row under REPLICA IDENTITY
    FULL, and, where the log holds no version of the row (its history cut by a failover),
    the row read in a snapshot that sees the update."""
    rows = [i for i in range(1, 200, 10)]  # all TOASTed (i % 10 == 1)
    vb = vbucket_of(b"p1", 1024)
    rows = [i for i in rows if i == 1 or vbucket_of(f"p{i}".encode(), 1024) != vb]
    insert_many(db, [person(i) for i in rows])
    daemon = start_daemon(tmp_path)
    router = start_router(tmp_path, daemon, db)
    wait_model(daemon, db, router)
    run(db, "ALTER TABLE people REPLICA IDENTITY FULL")
    run(db, "UPDATE people SET active = NOT active WHERE id = 'p11'")
    wait_model(daemon, db, router)
    stats = router.stats(HTTP)["postgres"]
    assert stats["unchanged_from_old_row"] == 1 and stats["unchanged_from_log"] == 0
    run(db, "ALTER TABLE people REPLICA IDENTITY DEFAULT")
    # p1's vbucket loses its whole history, and p1 leaves the index with it.
    answer = HTTP.post(f"{router.url}/failover/{vb}", json={"seqno": 0}, timeout=30)
    assert answer.status_code == 200, answer.text
    deadline = time.monotonic() + WAIT_S
    while HTTP.get(f"{daemon.url}/indexes/by_active/docs/p1").json()["entries"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    run(db, "UPDATE people SET active = NOT active, age = 77 WHERE id = 'p1'")
    wait_model(daemon, db, router)
    stats = router.stats(HTTP)["postgres"]
    assert stats["unchanged_rows_read"] == 1, stats
    line = router.wait_log(r"WARNING .*left a TOASTed value out.*")[0]
    assert "'p1'" in line and "REPLICA IDENTITY FULL" in line
    # The row read is now its latest version: the next such update takes it from the log.
    run(db, "UPDATE people SET active = NOT active WHERE id = 'p1'")
    wait_model(daemon, db, router)
    assert router.stats(HTTP)["postgres"]["unchanged_from_log"] == 1
    assert router.stop() == 0
    assert daemon.stop() == 0
