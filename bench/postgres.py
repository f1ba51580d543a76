"""PostgreSQL source benchmark: changes/s from a table's commits through `indexer router
--postgres` to a daemon's persisted snapshot, beside the router's JSONL rate for the same
documents.

    python bench/postgres.py [--rows N] [--batch N] [--rounds R] [--seed S] [--timeout S]
                             [--quick] [--keep]

Everything runs as subprocesses on 127.0.0.1, in a temporary directory removed at the end unless
--keep is given (PostgreSQL's own directory too).

Input: N rows (default 200,000; 20,000 with --quick) of `docs (id text primary key, address
jsonb, age integer, name text)`, seeded, built once, untimed; and the JSONL file of the same
documents as the router makes them of those rows (every column, the id too).

One PostgreSQL server (the harness's initdb in a temporary directory, wal_level=logical, fsync
on). Per round (default 2), in this order, each on a fresh daemon with the default indexes and a
fresh router state directory:

1. postgres: the table dropped and created empty, a CHECKPOINT; the router follows it
   (`--postgres DSN --table public.docs --http 127.0.0.1:0`) and, once it logs that it follows
   the table through the slot and is connected to the daemon, this process inserts the rows
   with psycopg2's execute_values, BATCH rows a transaction (default 1,000), as fast as the
   server takes them, noting each commit's wall time. A thread polls the daemon's
   `GET /stats` every 20 ms. changes/s = N / (the first poll whose persisted seqno sum is N,
   minus the first commit). Lag of transaction i: the first poll whose persisted sum reaches
   (i + 1) x BATCH, minus its commit (the router numbers each vbucket's documents 1, 2, ..., so
   after N inserts the sum is N; the sum reaching a count does not prove those very rows are
   in, since vbuckets move separately, but the rows are inserted in order and the router
   appends them in commit order). The slot is dropped afterwards with `indexer router
   --postgres DSN --drop-slot NAME`.
2. jsonl: `indexer router --state NEW --jsonl FILE --to DAEMON`, the same poll; docs/s = N /
   (persisted, minus the router's "router running" log line: it starts reading the file then),
   and also from the process's start.

The best of each kind is kept; target: postgres at least 0.5 x jsonl. Reported per run: the
rates, the lag percentiles (to persisted, and to readable), and the CPU seconds of the router
(its trio thread and other threads), the daemon, PostgreSQL's processes and this client.

Prints one line per measurement and ends with one JSON object of every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import psycopg2
import psycopg2.extras
from common import (  # bench/common.py: run as `python bench/...`
    HOST,
    Daemon,
    Postgres,
    Router,
    cpu_split,
    find_postgres,
    in_workdir,
    ratio,
    say,
    tree_cpu,
)

LOGICAL = {"wal_level": "logical", "max_wal_senders": "10", "max_replication_slots": "10"}
TABLE = "public.docs"
SLOT = "indexer_public_docs"  # the router's default slot name for public.docs
CREATE = "CREATE TABLE docs (id text PRIMARY KEY, address jsonb, age integer, name text)"
INSERT = "INSERT INTO docs (id, address, age, name) VALUES %s"
CITIES = ["Oslo", "Lima", "Kyiv", "Pune", "Rome", "Cairo", "Quito", "Osaka", "Perth", "Dakar"]
POLL_S = 0.02
QUICK_ROWS = 20_000
TARGET = 0.5  # postgres changes/s over the JSONL docs/s, at least
MIB = 1 << 20

Row = tuple[str, str, int, str]  # id, address as JSON text, age, name: one INSERT's values
Json = dict[str, Any]


# --------------------------------------------------------------------------------------------
# Input


def make_rows(n: int, seed: int) -> list[Row]:
    """N rows with distinct ids, seeded: the table's contents, in insert order."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        address = {"city": rng.choice(CITIES), "zip": f"{rng.randrange(100_000):05}"}
        rows.append(
            (
                f"doc{i:08}",
                json.dumps(address, separators=(",", ":")),
                rng.randrange(18, 90),
                f"user{rng.randrange(10**6)}",
            )
        )
    return rows


def write_jsonl(rows: Sequence[Row], path: Path) -> Path:
    """The router's input of the same documents it makes of the rows: every column, the id too."""
    with open(path, "w") as f:
        for docid, address, age, name in rows:
            body = {"id": docid, "address": json.loads(address), "age": age, "name": name}
            f.write(json.dumps({"id": docid, "doc": body}, separators=(",", ":")) + "\n")
    return path


# --------------------------------------------------------------------------------------------
# Measuring


class Poller(threading.Thread):
    """The daemon's `GET /stats` every POLL_S from a thread: per answer (its arrival time, the
    persisted seqno sum, the readable seqno sum), until the persisted sum reaches `until`."""

    def __init__(self, url: str, until: int) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.until = until
        self.samples: list[tuple[float, int, int]] = []
        self.failures = 0
        self.reached = threading.Event()
        self.stopped = threading.Event()

    def run(self) -> None:
        due = time.monotonic()
        with httpx.Client(timeout=5) as client:
            while not self.stopped.is_set():
                try:
                    stats = client.get(f"{self.url}/stats").json()
                except (httpx.HTTPError, ValueError):
                    self.failures += 1
                else:
                    at = time.time()  # after the answer: a lag is never understated
                    persisted = int(stats["persisted"]["seqno_sum"])
                    self.samples.append((at, persisted, int(stats["stable"]["seqno_sum"])))
                    if persisted >= self.until:
                        self.reached.set()
                        return
                due = max(due + POLL_S, time.monotonic())
                self.stopped.wait(due - time.monotonic())

    def wait(self, timeout: float, alive: Callable[[], None]) -> float:
        """Until the persisted sum reaches `until` (checking the processes); that poll's time."""
        deadline = time.monotonic() + timeout
        while not self.reached.wait(0.1):
            alive()
            if time.monotonic() > deadline or not self.is_alive():
                last = self.samples[-1] if self.samples else None
                raise RuntimeError(
                    f"persisted {last[1] if last else 0} of {self.until} within {timeout} s "
                    f"({self.failures} failed polls)"
                )
        return self.samples[-1][0]

    def stop(self) -> None:
        self.stopped.set()
        if self.is_alive():
            self.join()

    def first_at(self, column: int, target: int) -> float | None:
        """When a poll first saw the sum of `column` (1 persisted, 2 readable) at `target`."""
        sums = [s[column] for s in self.samples]  # both sums only grow
        i = bisect_left(sums, target)
        return self.samples[i][0] if i < len(sums) else None


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear between closest ranks."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def lags_ms(poller: Poller, column: int, commits: Sequence[float], batch: int, n: int) -> Json:
    """p50, p99 and max of each transaction's commit to the first poll that covers it, ms."""
    lags = []
    for i, committed in enumerate(commits):
        seen = poller.first_at(column, min((i + 1) * batch, n))
        if seen is not None:
            lags.append((seen - committed) * 1000)
    if not lags:
        return {"p50": None, "p99": None, "max": None, "transactions": 0}
    return {
        "p50": round(percentile(lags, 50), 1),
        "p99": round(percentile(lags, 99), 1),
        "max": round(max(lags), 1),
        "transactions": len(lags),
    }


def router_cpu(router: Router) -> tuple[float, float, float]:
    """CPU seconds of the router so far: all (with children), its trio thread, other threads."""
    own, children = tree_cpu(router.process)
    main, threads = cpu_split(router.process)
    return own + children, main, threads


def index_entries(daemon: Daemon) -> dict[str, int]:
    """A daemon's entries of each index."""
    indexes = httpx.get(f"{daemon.url}/indexes", timeout=30).json()["indexes"]
    return {index["name"]: index["entries"] for index in indexes}


# --------------------------------------------------------------------------------------------
# PostgreSQL


def dsn(pg: Postgres) -> str:
    """The server's DSN, over its unix socket."""
    return f"host={pg.dir} port={pg.port} user=postgres dbname=postgres"


def drop_slot(pg: Postgres) -> str:
    """`indexer router --postgres DSN --drop-slot NAME` (the slot and its publication); its
    line."""
    done = subprocess.run(
        [sys.executable, "-m", "indexer", "router", "--postgres", dsn(pg), "--drop-slot", SLOT],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    if done.returncode != 0:
        raise RuntimeError(f"--drop-slot failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout.strip()


def fresh_table(pg: Postgres) -> None:
    """No slot, the table dropped and created empty, a checkpoint (none falls in the run)."""
    drop_slot(pg)
    pg.query("DROP TABLE IF EXISTS docs")
    pg.query(CREATE)
    pg.query("CHECKPOINT")


def insert_rows(conn: Any, rows: Sequence[Row], batch: int) -> list[float]:
    """The rows, `batch` a transaction; each commit's wall time."""
    commits = []
    with conn.cursor() as cur:
        for start in range(0, len(rows), batch):
            psycopg2.extras.execute_values(
                cur, INSERT, rows[start : start + batch], page_size=batch
            )
            conn.commit()
            commits.append(time.time())
    return commits


def pg_run(pg: Postgres, rows: Sequence[Row], batch: int, run_dir: Path, timeout: float) -> Json:
    """The router following the table into a fresh daemon while the rows are inserted."""
    n = len(rows)
    fresh_table(pg)
    daemon = Daemon.in_workdir(run_dir / "daemon")
    router: Router | None = None
    poller: Poller | None = None
    conn: Any = None
    try:
        daemon.start()
        router = Router(
            run_dir / "router.log", "--state", str(run_dir / "state"), "--postgres", dsn(pg),
            "--table", TABLE, "--to", daemon.address, "--http", f"{HOST}:0",
        )  # fmt: skip
        router.wait_url()
        router.wait_log(r"following public\.docs through slot")
        router.wait_log(r"connected; resuming")
        conn = psycopg2.connect(dsn(pg))
        poller = Poller(daemon.url, n)
        poller.start()
        router_before = router_cpu(router)
        daemon_before = sum(daemon.cpu())
        server_before = pg.server_cpu()
        client_before = time.process_time()
        started = time.time()
        commits = insert_rows(conn, rows, batch)
        client_cpu = time.process_time() - client_before

        def alive() -> None:
            assert router is not None
            router.check_alive()
            daemon.check_alive()

        done = poller.wait(timeout, alive)
        router_after = router_cpu(router)
        daemon_cpu = sum(daemon.cpu()) - daemon_before
        server_cpu = pg.server_cpu() - server_before
        stats = router.stats()
        entries = index_entries(daemon)
        router.stop_cleanly()
        daemon.stop_cleanly()
    finally:
        if poller is not None:
            poller.stop()
        if conn is not None:
            conn.close()
        if router is not None:
            router.kill()
        daemon.kill()
    dropped = drop_slot(pg)
    first = commits[0]
    seconds = done - first
    cpu = [after - before for after, before in zip(router_after, router_before, strict=True)]
    source = stats["postgres"]
    high = stats["source"]["high_seqno_sum"]
    if high != n or source["changes"] != n:
        raise RuntimeError(f"the router appended {high} (changes {source['changes']}), not {n}")
    readable_at = poller.first_at(2, n) or done
    return {
        "rows": n,
        "batch": batch,
        "transactions": len(commits),
        "seconds": round(seconds, 3),
        "per_s": round(n / seconds),
        "first_commit_s": round(first - started, 3),
        "insert_s": round(commits[-1] - started, 3),
        "commit_rows_per_s": round(n / (commits[-1] - started)),
        "readable_s": round(readable_at - first, 3),
        "persisted_s": round(seconds, 3),
        "lag_ms": lags_ms(poller, 1, commits, batch, n),
        "readable_lag_ms": lags_ms(poller, 2, commits, batch, n),
        "appends": source["appends"],
        "polls": len(poller.samples),
        "failed_polls": poller.failures,
        "router_cpu_s": round(cpu[0], 2),
        "router_main_cpu_s": round(cpu[1], 2),
        "router_thread_cpu_s": round(cpu[2], 2),
        "router_cpu_us_per_change": round(cpu[0] / n * 1e6, 1),
        "daemon_cpu_s": round(daemon_cpu, 2),
        "daemon_cpu_us_per_change": round(daemon_cpu / n * 1e6, 1),
        "postgres_cpu_s": round(server_cpu, 2),
        "client_cpu_s": round(client_cpu, 2),
        "router_transactions": source["transactions"],
        "entries": entries,
        "drop_slot": dropped,
    }


def jsonl_run(jsonl: Path, n: int, run_dir: Path, timeout: float) -> Json:
    """The router reading the same documents from a JSONL file into a fresh daemon."""
    daemon = Daemon.in_workdir(run_dir / "daemon")
    router: Router | None = None
    poller: Poller | None = None
    try:
        daemon.start()
        daemon_before = sum(daemon.cpu())
        poller = Poller(daemon.url, n)
        poller.start()
        router = Router(
            run_dir / "router.log", "--state", str(run_dir / "state"), "--jsonl", str(jsonl),
            "--to", daemon.address, "--http", f"{HOST}:0",
        )  # fmt: skip
        started = router.started

        def alive() -> None:
            assert router is not None
            router.check_alive()
            daemon.check_alive()

        done = poller.wait(timeout, alive)
        cpu = router_cpu(router)
        daemon_cpu = sum(daemon.cpu()) - daemon_before
        router.wait_url()
        high = router.appended()
        entries = index_entries(daemon)
        router.stop_cleanly()
        daemon.stop_cleanly()
    finally:
        if poller is not None:
            poller.stop()
        if router is not None:
            router.kill()
        daemon.kill()
    if high != n:
        raise RuntimeError(f"the router appended {high}, not {n}")
    running = router.logged_at("router running") or started
    read = router.logged_at(f"read {n} documents") or done
    readable_at = poller.first_at(2, n) or done
    return {
        "rows": n,
        "seconds": round(done - running, 3),
        "per_s": round(n / (done - running)),
        "seconds_from_start": round(done - started, 3),
        "per_s_from_start": round(n / (done - started)),
        "startup_s": round(running - started, 3),
        "read_s": round(read - running, 3),
        "readable_s": round(readable_at - running, 3),
        "persisted_s": round(done - running, 3),
        "router_cpu_s": round(cpu[0], 2),
        "router_main_cpu_s": round(cpu[1], 2),
        "router_thread_cpu_s": round(cpu[2], 2),
        "router_cpu_us_per_doc": round(cpu[0] / n * 1e6, 1),
        "daemon_cpu_s": round(daemon_cpu, 2),
        "daemon_cpu_us_per_doc": round(daemon_cpu / n * 1e6, 1),
        "entries": entries,
    }


# --------------------------------------------------------------------------------------------
# Lines


def report_pg(round_: int, r: Json) -> None:
    """The lines of one postgres run."""
    lag, seen = r["lag_ms"], r["readable_lag_ms"]
    say(
        f"round {round_}, postgres: {r['per_s']:,} changes/s ({r['rows']:,} rows in "
        f"{r['seconds']:.2f} s from the first commit to persisted; {r['transactions']} "
        f"transactions of {r['batch']:,} committed at {r['commit_rows_per_s']:,} rows/s, the "
        f"last {r['insert_s']:.2f} s after the first insert; all readable at "
        f"{r['readable_s']:.2f} s, persisted at {r['persisted_s']:.2f} s; "
        f"{r['appends']} appends, {r['rows'] / max(1, r['appends']):,.0f} changes each)"
    )
    say(
        f"  lag, commit to persisted: p50 {lag['p50']} ms, p99 {lag['p99']} ms, max "
        f"{lag['max']} ms; commit to readable: p50 {seen['p50']} ms, p99 {seen['p99']} ms, max "
        f"{seen['max']} ms ({r['polls']} polls every {POLL_S * 1000:.0f} ms)"
    )
    say(
        f"  CPU from the first insert: router {r['router_cpu_s']:.2f} s "
        f"({r['router_cpu_us_per_change']} us/change: {r['router_main_cpu_s']:.2f} s trio "
        f"thread + {r['router_thread_cpu_s']:.2f} s other threads), daemon "
        f"{r['daemon_cpu_s']:.2f} s ({r['daemon_cpu_us_per_change']} us/change), PostgreSQL "
        f"{r['postgres_cpu_s']:.2f} s, this client {r['client_cpu_s']:.2f} s; {r['drop_slot']}"
    )


def report_jsonl(round_: int, r: Json) -> None:
    """The lines of one JSONL run."""
    say(
        f"round {round_}, jsonl: {r['per_s']:,} docs/s ({r['rows']:,} in {r['seconds']:.2f} s "
        f"from the router's 'router running' line to persisted; {r['per_s_from_start']:,}/s from "
        f"its process start, {r['startup_s']:.2f} s of start-up; file read at "
        f"{r['read_s']:.2f} s, readable at {r['readable_s']:.2f} s)"
    )
    say(
        f"  CPU: router {r['router_cpu_s']:.2f} s ({r['router_cpu_us_per_doc']} us/doc: "
        f"{r['router_main_cpu_s']:.2f} s trio thread + {r['router_thread_cpu_s']:.2f} s other "
        f"threads; start-up included), daemon {r['daemon_cpu_s']:.2f} s "
        f"({r['daemon_cpu_us_per_doc']} us/doc)"
    )


def check(ok: bool, text: str) -> None:
    say(("check: " if ok else "WARNING: ") + text)


# --------------------------------------------------------------------------------------------
# Main


def run(opts: argparse.Namespace, workdir: Path) -> Json:
    """Input, the PostgreSQL server, the interleaved rounds; the JSON summary."""
    bindir = find_postgres()
    reason = None
    pg: Postgres | None = None
    if bindir is None:
        reason = "no initdb and postgres binaries on this machine"
    else:
        try:
            pg = Postgres(bindir, opts.keep, settings=LOGICAL)
        except KeyError:
            reason = "running as root and no 'postgres' user to run the server as"
    if pg is None:
        say(f"not run: {reason}")
        return {"rows": opts.rows, "batch": opts.batch, "skipped": reason, "cores": os.cpu_count()}
    n = opts.rows
    began = time.monotonic()
    rows = make_rows(n, opts.seed)
    jsonl = write_jsonl(rows, workdir / "docs.jsonl")
    say(
        f"input: {n:,} rows of {CREATE[13:]}, seed {opts.seed}; the same documents as JSONL, "
        f"{jsonl.stat().st_size / MIB:.1f} MiB ({time.monotonic() - began:.1f} s, untimed); "
        f"{os.cpu_count()} cores, Python {sys.version.split()[0]}"
    )
    pg_runs: list[Json] = []
    jsonl_runs: list[Json] = []
    try:
        pg.start(opts.timeout)
        version = pg.query("SHOW server_version")
        say(f"PostgreSQL {version}: {', '.join(f'{k}={v}' for k, v in LOGICAL.items())}")
        for round_ in range(1, opts.rounds + 1):
            run_dir = workdir / f"pg{round_}"
            pg_runs.append(pg_run(pg, rows, opts.batch, run_dir, opts.timeout))
            report_pg(round_, pg_runs[-1])
            if not opts.keep:
                shutil.rmtree(run_dir, ignore_errors=True)
            run_dir = workdir / f"jsonl{round_}"
            jsonl_runs.append(jsonl_run(jsonl, n, run_dir, opts.timeout))
            report_jsonl(round_, jsonl_runs[-1])
            if not opts.keep:
                shutil.rmtree(run_dir, ignore_errors=True)
    finally:
        pg.stop()
    best_pg = max(pg_runs, key=lambda r: r["per_s"])
    best_jsonl = max(jsonl_runs, key=lambda r: r["per_s"])
    pg_vs_jsonl = ratio(best_pg["per_s"], best_jsonl["per_s"])
    entries = [r["entries"] for r in pg_runs + jsonl_runs]
    check(
        all(e == entries[0] for e in entries) and entries[0].get("by_age") == n,
        f"every run's index entries agree and hold every row: {entries[0]}",
    )
    lag = best_pg["lag_ms"]
    say(
        f"summary: postgres {best_pg['per_s']:,} changes/s, jsonl {best_jsonl['per_s']:,} docs/s "
        f"(best of {opts.rounds} each): {pg_vs_jsonl}x (target {TARGET}x); spread postgres "
        f"{min(r['per_s'] for r in pg_runs):,}-{best_pg['per_s']:,}, jsonl "
        f"{min(r['per_s'] for r in jsonl_runs):,}-{best_jsonl['per_s']:,}; lag commit to "
        f"persisted p50 {lag['p50']} ms, p99 {lag['p99']} ms; router "
        f"{best_pg['router_cpu_us_per_change']} us/change vs "
        f"{best_jsonl['router_cpu_us_per_doc']} us/doc"
    )
    return {
        "rows": n,
        "batch": opts.batch,
        "rounds": opts.rounds,
        "seed": opts.seed,
        "postgres_version": version,
        "pg_changes_per_s": best_pg["per_s"],
        "jsonl_docs_per_s": best_jsonl["per_s"],
        "jsonl_docs_per_s_from_start": best_jsonl["per_s_from_start"],
        "ratio_pg_vs_jsonl": pg_vs_jsonl,
        "lag_p50_ms": lag["p50"],
        "lag_p99_ms": lag["p99"],
        "lag_max_ms": lag["max"],
        "readable_lag_p50_ms": best_pg["readable_lag_ms"]["p50"],
        "readable_lag_p99_ms": best_pg["readable_lag_ms"]["p99"],
        "commit_rows_per_s": best_pg["commit_rows_per_s"],
        "router_cpu_us_per_change": best_pg["router_cpu_us_per_change"],
        "jsonl_router_cpu_us_per_doc": best_jsonl["router_cpu_us_per_doc"],
        "pg_runs": pg_runs,
        "jsonl_runs": jsonl_runs,
        "cores": os.cpu_count(),
        "targets": {"pg_vs_jsonl": TARGET},
        "targets_met": {"pg_vs_jsonl_ge_0.5": pg_vs_jsonl is not None and pg_vs_jsonl >= TARGET},
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rows", type=int, default=None, help="default 200,000")
    parser.add_argument("--batch", type=int, default=1_000, help="rows a transaction")
    parser.add_argument("--rounds", type=int, default=2, help="of each kind, interleaved")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--timeout", type=float, default=600, help="of every wait, seconds")
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK_ROWS:,} rows: check the chain"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temp directories")
    opts = parser.parse_args(argv)
    if opts.rows is None:
        opts.rows = QUICK_ROWS if opts.quick else 200_000
    if opts.rows < 1 or opts.batch < 1 or opts.rounds < 1:
        parser.error("--rows, --batch and --rounds must be >= 1")
    return in_workdir("postgres-bench-", opts.keep, lambda workdir: run(opts, workdir))


if __name__ == "__main__":
    raise SystemExit(main())
