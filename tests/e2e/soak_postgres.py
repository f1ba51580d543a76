"""The PostgreSQL soak: `indexer router --postgres` following a table under random transactions,
with the router and the daemon killed (SIGKILL) at random moments, each on a machine of its own
under the power-loss layer (tests/powercut), so a `power_cuts` share of the kills also undo
every write the killed process had not fsynced. PostgreSQL runs on a third machine: never cut.

Some router kills are aimed right after its confirmed LSN advanced: the slot then forgets what
it confirmed, so the source log must hold it. After every restart the restarted process must
hold at least what it had acknowledged before the kill (the daemon's persisted seqno sum, the
router's appended one); at the end, request_plus scans and dumps of the stopped store must
equal a model of the table's final rows.

Used by tests/e2e/soak.py (`make soak`), and alone:

    python -m tests.e2e.soak --only postgres --faults 40   # 10 of them here
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psycopg2
import psycopg2.extras

from indexer.router.inputs.postgres.pgoutput import parse_lsn
from tests.e2e.conftest import Daemon, Router, dump, free_port, scan, write_config
from tests.e2e.crashloop import DAEMON_CONFIG, CrashLoopReport, differing_rows, persisted_sum
from tests.e2e.test_postgres_source import (
    ACTIVE,
    INDEXES,
    INSERT,
    LOGICAL,
    PARTIAL,
    TABLE,
    dsn,
    person,
    run,
    wanted,
)
from tests.harness import Postgres, find_postgres
from tests.powercut import PowerLoss, build_library

TABLE_NAME = "public.people"
STREAMING = r"following public\.people through slot"
GAP_S = (0.2, 2.0)  # between two faults, mostly
AIM_S = 5.0  # at most, waiting for the router's confirmed LSN to advance
LARGE_ROWS = 6_000  # a large transaction: more changes than the router appends at once (5,000)
PAD_BYTES = 3_000  # random bytes of a TOASTed `notes`, as 6,000 hex digits


class TableWriter:
    """Random transactions over `people` in a thread (seeded): inserts of new rows (one in ten
    with a TOASTed `notes`), updates of the small columns (which leave `notes` out: pgoutput
    sends it as unchanged), updates of `notes` and of the primary key, deletes, a rolled back
    transaction now and then, and every `large_every` transactions or when asked a large one
    (inserts while the table holds fewer than `rows` rows, else updates). Only committed
    changes are counted; the live ids are the writer's own, nothing else writes to the table."""

    def __init__(
        self,
        url: str,
        seed: int,
        rows: int = 5_000,
        pause_s: float = 0.03,
        large_every: int = 0,
        large_rows: int = LARGE_ROWS,
    ) -> None:
        self.url = url
        self.rng = random.Random(seed)
        self.rows = rows  # the table's size it keeps to, roughly
        self.pause_s = pause_s  # at most, between two transactions
        self.large_every = large_every
        self.large_rows = large_rows
        self.next_id = 0
        self.live: list[str] = []  # ids of the rows in the table
        self.changes = 0  # rows written by committed transactions
        self.transactions = 0  # committed
        self.large = 0  # large transactions committed
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._large = threading.Event()  # asked for
        self._thread = threading.Thread(target=self._run, name="table-writer", daemon=True)

    def insert_initial(self, count: int) -> None:
        """Rows before anything follows the table (the router's initial copy): one
        transaction."""
        rows = [self._new_row() for _ in range(count)]
        conn = psycopg2.connect(self.url)
        try:
            with conn, conn.cursor() as cur:
                psycopg2.extras.execute_batch(cur, INSERT, rows, page_size=1000)
        finally:
            conn.close()
        self.live += [row[0] for row in rows]
        self.changes += count

    def start(self) -> None:
        self._thread.start()

    def ask_large(self) -> None:
        """Make the next transaction a large one."""
        self._large.set()

    def halt(self) -> None:
        """Stop after the transaction under way."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def stop(self) -> None:
        """Stop after the transaction under way; raise what stopped it, if anything did."""
        self.halt()
        if self.error is not None:
            raise AssertionError(f"the table writer failed: {self.error!r}")

    def _new_row(self) -> tuple[Any, ...]:
        i = self.next_id
        self.next_id += 1
        row = list(person(i, age=self.rng.randrange(90)))
        row[7] = json.dumps(self._notes(toasted=i % 10 == 1))
        return tuple(row)

    def _notes(self, toasted: bool) -> dict[str, Any]:
        k = self.rng.randrange(7)
        return {"k": k, "pad": self.rng.randbytes(PAD_BYTES).hex()} if toasted else {"k": k}

    def _run(self) -> None:
        conn = psycopg2.connect(self.url)
        try:
            while not self._stop.wait(self.rng.uniform(0, self.pause_s)):
                every = self.large_every
                large = self._large.is_set() or (every > 0 and (self.transactions + 1) % every == 0)
                with conn, conn.cursor() as cur:
                    live, changes = self._transaction(cur, large)
                    commit = large or self.rng.random() >= 0.05
                    if not commit:
                        conn.rollback()  # `with conn` then commits nothing
                if commit:
                    self.live, self.changes = live, self.changes + changes
                    self.transactions += 1
                    self.large += large
                    if large:
                        self._large.clear()
        except BaseException as exc:  # shown by stop()
            self.error = exc
        finally:
            conn.close()

    def _transaction(self, cur: Any, large: bool) -> tuple[list[str], int]:
        """Run one transaction's statements; the live ids and the rows written, once it
        commits."""
        rng = self.rng
        live = list(self.live)
        changes = 0
        if large:
            if len(live) < self.rows:
                rows = [self._new_row() for _ in range(self.large_rows)]
                psycopg2.extras.execute_batch(cur, INSERT, rows, page_size=1000)
                live += [row[0] for row in rows]
                return live, len(rows)
            ids = rng.sample(live, min(len(live), self.large_rows))
            cur.execute(
                "UPDATE people SET active = NOT active, age = (age + 1) %% 90 WHERE id = ANY(%s)",
                (ids,),
            )
            return live, int(cur.rowcount)
        for _ in range(rng.randint(1, 6)):
            op = rng.random()
            if not live or op < (0.45 if len(live) < self.rows else 0.10):
                row = self._new_row()
                cur.execute(INSERT, row)
                live.append(row[0])
            elif op < 0.60:  # the small columns only: `notes` left out
                cur.execute(
                    "UPDATE people SET age = %s, active = NOT active WHERE id = %s",
                    (rng.randrange(90), rng.choice(live)),
                )
            elif op < 0.65:  # several rows in one statement, `notes` left out
                cur.execute(
                    "UPDATE people SET age = (age + 7) %% 90 WHERE id = ANY(%s)",
                    (rng.sample(live, min(len(live), 20)),),
                )
            elif op < 0.70:
                city = rng.choice(["Oslo", "Rome", "Bern", None])
                cur.execute(
                    "UPDATE people SET address = %s WHERE id = %s",
                    (json.dumps({"city": city}), rng.choice(live)),
                )
            elif op < 0.80:  # `notes` replaced: TOASTed or small
                cur.execute(
                    "UPDATE people SET notes = %s WHERE id = %s",
                    (json.dumps(self._notes(rng.random() < 0.3)), rng.choice(live)),
                )
            elif op < 0.83:  # the primary key changes, `notes` left out
                at = rng.randrange(len(live))
                new = f"r{self.next_id}"
                self.next_id += 1
                cur.execute("UPDATE people SET id = %s WHERE id = %s", (new, live[at]))
                live[at] = new
            else:
                at = rng.randrange(len(live))
                cur.execute("DELETE FROM people WHERE id = %s", (live[at],))
                live[at] = live[-1]
                live.pop()
            changes += max(0, int(cur.rowcount))
        return live, changes


# ------------------------------------------------------------------------------------------------
# The router's progress


def router_stats(router: Router) -> dict[str, Any] | None:
    """The router's `/stats`, or None if it does not answer."""
    try:
        answer = httpx.get(f"{router.url}/stats", timeout=2)
    except httpx.HTTPError:
        return None
    if answer.status_code != 200:
        return None
    stats: dict[str, Any] = answer.json()
    return stats


def confirmed_lsn(stats: dict[str, Any] | None) -> int | None:
    """The LSN the router last confirmed to the slot, once it streams."""
    postgres = (stats or {}).get("postgres") or {}
    text = postgres.get("confirmed_lsn")
    return None if text is None or postgres.get("state") != "streaming" else parse_lsn(text)


def appended_sum(stats: dict[str, Any] | None) -> int | None:
    """The seqno sum of the router's source log: each append shows once it is synced."""
    return None if stats is None else int(stats["source"]["high_seqno_sum"])


def aim_at_confirm(router: Router, timeout: float = AIM_S) -> dict[str, Any] | None:
    """As soon as the router's confirmed LSN advances, the `/stats` that shows it; None if it
    did not within `timeout`."""
    before = confirmed_lsn(router_stats(router))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = router_stats(router)
        now = confirmed_lsn(stats)
        if now is not None and (before is None or now > before):
            if before is not None:
                return stats
            before = now  # streaming only now: wait for the next confirmation
        time.sleep(0.002)
    return None


def start_router(
    log: Path, state: Path, daemon: Daemon, url: str, env: dict[str, str] | None
) -> Router:
    """`indexer router --postgres` with its source log in `state` (not waited for)."""
    return Router(
        log,
        "--state", str(state), "--to", daemon.address, "--http", "127.0.0.1:0",
        "--postgres", url, "--table", TABLE_NAME,
        env=env,
    )  # fmt: skip


def wait_scans(
    daemon: Daemon, want: dict[str, list[dict[str, Any]]], router: Router, timeout: float
) -> dict[str, list[dict[str, Any]]]:
    """Poll the indexes' scans until they equal `want`, or `timeout` passes: the last scans."""
    deadline = time.monotonic() + timeout
    while True:
        got = {name: scan(daemon, name) for name in INDEXES}  # request_plus
        if got == want or time.monotonic() > deadline:
            return got
        router.check_alive()
        time.sleep(0.3)


# ------------------------------------------------------------------------------------------------
# The loop


def run_postgres_loop(
    workdir: Path,
    kills: int,
    seed: int = 1,
    power_cuts: float = 0.5,
    say: Callable[[str], None] = lambda line: None,
    catch_up_s: float = 180.0,
) -> CrashLoopReport:
    """`kills` faults, each a SIGKILL of the router or of the daemon at random (counted in
    `report.router_kills` and `report.kills`), a `power_cuts` share of them power cuts, under
    random transactions of a table; its own PostgreSQL server, started and stopped here."""
    rng = random.Random(seed)
    report = CrashLoopReport(seed, scenario="postgres")
    started = time.monotonic()
    bindir = find_postgres()
    if bindir is None:
        report.failure = "PostgreSQL's initdb and postgres are not installed"
        return report
    workdir.mkdir(parents=True, exist_ok=True)
    library = build_library(workdir / "powercut-lib")
    daemon_layer = PowerLoss(library, workdir / "daemon-disk", workdir / "daemon-powercut")
    router_layer = PowerLoss(library, workdir / "router-disk", workdir / "router-powercut")
    state = router_layer.root / "router"
    port = free_port()
    config = write_config(
        workdir / "indexer.toml", daemon_layer.root / "data", port,
        **DAEMON_CONFIG, **PARTIAL, **ACTIVE,
    )  # fmt: skip
    daemon = Daemon(config, workdir / "daemon.log", port)
    daemon.env = daemon_layer.env()
    server = Postgres(bindir, settings=LOGICAL)
    url = dsn(server, "soak")
    writer: TableWriter | None = None
    routers: list[Router] = []

    def new_router() -> Router:
        router = start_router(
            workdir / f"router{len(routers)}.log", state, daemon, url, router_layer.env()
        )
        routers.append(router)
        router.wait_url()
        return router

    try:
        server.start()
        server.query("CREATE DATABASE soak")
        run(url, TABLE)
        writer = TableWriter(url, rng.getrandbits(32), rows=20_000, large_every=300)
        writer.insert_initial(2_000)
        daemon.start()
        router = new_router()
        router.wait_log(STREAMING)
        writer.start()
        while report.kills + report.router_kills < kills:
            fault = report.kills + report.router_kills + 1
            victim = rng.choice(["router", "daemon"])
            persisted = persisted_sum(daemon) or 0
            appended = appended_sum(router_stats(router)) or 0
            confirmed = None
            if victim == "router" and rng.random() < 0.5:
                confirmed = aim_at_confirm(router)  # killed as soon as it confirmed
                appended = max(appended, appended_sum(confirmed) or 0)
            if confirmed is None:
                gap = rng.uniform(*GAP_S) if rng.random() < 0.8 else rng.uniform(0, GAP_S[0])
                until = time.monotonic() + gap
                while time.monotonic() < until:
                    persisted = max(persisted, persisted_sum(daemon) or 0)
                    appended = max(appended, appended_sum(router_stats(router)) or 0)
                    time.sleep(0.05)
            cut = rng.random() < power_cuts
            if victim == "router":
                router.kill()
                lost = router_layer.cut().bytes_lost if cut else 0
                report.router_kills += 1
                router = new_router()
                now = appended_sum(router_stats(router))
                if now is None or now < appended:
                    report.lost_acknowledged.append(
                        f"fault {fault} (router): source log seqno sum {appended} before, "
                        f"{now} after"
                    )
            else:
                daemon.kill()
                lost = daemon_layer.cut().bytes_lost if cut else 0
                report.kills += 1
                daemon.start()
                now = persisted_sum(daemon)
                if now is None or now < persisted:
                    report.lost_acknowledged.append(
                        f"fault {fault} (daemon): persisted seqno sum {persisted} before, "
                        f"{now} after"
                    )
            report.power_cuts += cut
            what = "power cut" if cut else "killed"
            aim = " right after a confirm" if confirmed is not None else ""
            took = f" ({lost} bytes lost)" if cut else ""
            sums = "source log" if victim == "router" else "persisted"
            say(f"fault {fault}: {victim} {what}{aim}{took}; restarted, {sums} seqno sum {now}")
        writer.stop()
        report.documents = writer.changes
        want = wanted(url)
        got = wait_scans(daemon, want, router, catch_up_s)
        report.scan_mismatches = {name: differing_rows(got[name], want[name]) for name in want}
        code = router.stop()
        if code != 0:
            report.failure = f"the router exited {code} on SIGTERM"
        code = daemon.stop()
        if code != 0:
            report.failure = f"the daemon exited {code} on SIGTERM"
        dumped = {name: dump(daemon, name) for name in INDEXES}
        report.dump_mismatches = {
            name: differing_rows(dumped[name], want[name]) for name in INDEXES
        }
        report.compare(dumped, want)
    except AssertionError as exc:  # a process that did not start, a scan that failed
        report.failure = str(exc)[-4000:]
    finally:
        if writer is not None:
            writer.halt()
        for each in routers:
            each.kill()
        daemon.kill()
        server.stop()
        report.seconds = time.monotonic() - started
    return report
