"""Pipeline benchmark: documents/s from a JSONL file through `indexer router` into real daemons,
until a persisted snapshot covers everything; beside the daemon's own intake and PostgreSQL.

    python bench/pipeline.py [--documents N] [--keys K] [--seed S] [--skip-postgres]
                             [--timeout S] [--keep] [--history-rounds R] [--profile DIR]
                             [--against TREE [--rounds R]]

With --profile DIR it runs only the one-node layout, with py-spy (the bench extra) sampling
the router and the daemon at 250 Hz into DIR (raw stacks), and prints each one's CPU per
document per stage (bench/stages.py: a stage is the project's module that the CPU was spent
in or called a library from).

With --history-rounds R it runs only the one-node layout, with the change history
(`changes.history`, the default) and without it, R rounds each interleaved: what the history
costs the whole path from JSONL to persisted.

With --against TREE it runs only the one-node layout, from this checkout and from TREE (another
checkout, say `git worktree add TREE COMMIT`, its modules compiled as its Makefile does), R
rounds each interleaved (default 3): the CPU per document of both in one sitting, so that
drift falls on both. Both read the same input file.

Everything runs as subprocesses on 127.0.0.1, in a temporary directory removed at the end unless
--keep is given.

Input: `indexer.router.generate(Workload(N, K, 0.1, S))` (default 1,000,000 documents over
K = N/5 docids, 10% deletes, seed 42) written once as a JSONL file, untimed. The daemons have
the default configuration (the two default indexes, by_city and by_age).

1. Pipeline, three layouts of nodes: one daemon (`--to A`); two daemons sliced by a cluster map,
   each owning half the vbuckets (`indexer serve --cluster-map F --node a|b`, the router
   `--cluster-map F`); two replica daemons owning every vbucket (`--to A --to B`). A fourth run
   has one daemon and the router as `--shards 2` (a parent and two shard processes; the CPU is
   reported per process and summed). The daemons
   start first; the clock runs from just before `indexer router --state NEW --jsonl FILE
   --http 127.0.0.1:0` starts until every daemon's `GET /stats` (polled every 50 ms) says a
   persisted snapshot covers everything it owns: `persisted.seqno_sum` reaches the sum of the
   router's high seqnos over its vbuckets. The router numbers each vbucket's documents 1, 2, ...,
   so that sum is the number of input documents in those vbuckets, counted from the input with
   the router's own vbucket function; the router's `source.high_seqno_sum` must equal N at the
   end. Reported per run: documents/s, the router's CPU (user + system of the process and its
   children; also split into its trio thread and other threads) per document, each daemon's CPU,
   when the input was read and when each daemon had everything received, readable and persisted.
   Each daemon's index entries are checked against the model of the input.
2. Ceiling: bench/ingest.py's end-to-end run on the same workload, in this run: the daemon's
   intake of frames its router pre-encoded, first byte to the ack of a persisted snapshot
   covering everything. What the pipeline can at best reach with one daemon.
3. PostgreSQL, where its binaries are found (/usr/lib/postgresql/*/bin, else PATH): initdb in a
   temporary directory, postgres on a free port of 127.0.0.1 (unix socket in the temp dir,
   default settings: fsync on), a table `docs(id text primary key, doc jsonb)` with B-tree
   expression indexes of the same two definitions. The clock runs from reading the JSONL file to
   the last commit: per 10,000 lines, COPY into a temporary staging table, then one statement
   that keeps each id's last version in the batch, deletes the deleted ones and upserts the
   others (INSERT ... ON CONFLICT DO UPDATE), and a commit. Through psycopg (v3) if it can be
   imported, else psql with COPY FROM STDIN. Its row count is checked against the model.

Prints one line per measurement and ends with one JSON object of every figure.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import IO, Any

import httpx
import psutil
from common import (  # bench/common.py: run as `python bench/...`
    Daemon,
    Postgres,
    Router,
    RssSampler,
    cpu_by_thread_kind,
    cpu_split,
    find_postgres,
    free_port,
    in_workdir,
    jsonl_lines,
    ratio,
    say,
    stop_process,
    tree_cpu,
    write_cluster_map,
)
from ingest import measure_e2e
from router import SAMPLE_S, start_router
from stages import read_samples, stages, table

from indexer.config import Config, parse_config
from indexer.keys import MISSING, field_value
from indexer.router import Workload, generate, vbucket_of

try:  # PostgreSQL's client: psycopg (v3) when installed, else psql
    import psycopg
except ImportError:  # pragma: no cover - depends on the machine
    psycopg = None

DELETE_RATIO = 0.1
POLL_S = 0.05
PROFILE_RATE = 250  # py-spy samples per second with --profile
WRITE_CHUNK = 10_000  # lines per write of the input file
PG_BATCH = 10_000  # input lines per PostgreSQL transaction
MIB = 1 << 20
LAYOUTS = ("1", "2_slices", "2_replicas", "1_shards2")
NO_HISTORY = "[changes]\nhistory = false\n"  # the layout 1_no_history: no change history
LABELS = {
    "1": "1 node",
    "2_slices": "2 nodes sliced by a cluster map",
    "2_replicas": "2 replica nodes",
    "1_shards2": "1 node, router --shards 2",
    "1_no_history": "1 node without the change history",
}
AT_MOST = ("router_cpu_us_per_doc", "shards2_cpu_vs_1")  # the other targets are minimums
TARGETS = {  # the targets for these figures
    "docs_per_s_1": 100_000,
    "ratio_1": 0.3,
    "ratio_vs_postgres": 3.0,
    "ratio_2_slices_vs_1": 1.0,
    "ratio_2_replicas_vs_1": 0.8,
    "router_cpu_us_per_doc": 12.0,
    "shards2_cpu_vs_1": 1.2,  # at most: the CPU per document of K = 2 over K = 1
}


# --------------------------------------------------------------------------------------------
# Input


@dataclass
class Input:
    """The JSONL file and what the router and the daemons must end up with."""

    path: Path
    documents: int
    keys: int
    deletes: int
    per_vbucket: list[int]  # input documents per vbucket: the router's high seqno of each
    live: int  # docids whose last version is not a delete
    entries: dict[str, int]  # index entries of the live documents, by index

    def seqnos(self, vbuckets: Sequence[int]) -> int:
        """The sum of the router's high seqnos over `vbuckets` once it has read everything."""
        return sum(self.per_vbucket[vb] for vb in vbuckets)


def write_input(path: Path, workload: Workload, config: Config) -> Input:
    """Write the workload as JSONL, in chunks; count documents per vbucket and the live model."""
    documents = generate(workload)
    num_vbuckets = config.server.num_vbuckets
    per_vbucket = [0] * num_vbuckets
    last: dict[str, dict[str, Any] | None] = {}
    total = deletes = 0
    with open(path, "w") as f:
        while chunk := list(islice(documents, WRITE_CHUNK)):
            f.write("".join(jsonl_lines(chunk)))
            for document in chunk:
                per_vbucket[vbucket_of(document.docid.encode(), num_vbuckets)] += 1
                last[document.docid] = document.body
                deletes += document.body is None
            total += len(chunk)
    bodies = [body for body in last.values() if body is not None]
    entries = {  # a document is in an index when it has the index's leading field
        index.name: sum(field_value(body, index.keys[0]) is not MISSING for body in bodies)
        for index in config.indexes
    }
    return Input(path, total, workload.key_space, deletes, per_vbucket, len(bodies), entries)


# --------------------------------------------------------------------------------------------
# Processes


# --------------------------------------------------------------------------------------------
# 1. The pipeline


@dataclass
class Node:
    """A daemon of a run: what it owns, what it must persist, and when it had it."""

    name: str
    daemon: Daemon
    vbuckets: list[int]
    target: int  # seqno sum of everything it owns
    received_at: float | None = None
    readable_at: float | None = None
    persisted_at: float | None = None
    last: dict[str, int] = field(default_factory=dict)
    cpu_before: tuple[float, float] = (0.0, 0.0)
    kinds_before: dict[str, float] = field(default_factory=dict)

    def cpu_by_kind(self) -> dict[str, float]:
        """The daemon's CPU seconds since `kinds_before`, by kind of thread."""
        assert self.daemon.proc is not None
        now = cpu_by_thread_kind(psutil.Process(self.daemon.proc.pid))
        return {k: round(v - self.kinds_before.get(k, 0.0), 2) for k, v in now.items()}

    def poll(self, client: httpx.Client, now: float) -> None:
        """One `GET /stats`: note when each seqno sum first reached the target."""
        stats = client.get(f"{self.daemon.url}/stats").json()
        self.last = {
            "received": stats["vbuckets"]["received_seqno_sum"],
            "readable": stats["stable"]["seqno_sum"],
            "persisted": stats["persisted"]["seqno_sum"],
        }
        if self.received_at is None and self.last["received"] >= self.target:
            self.received_at = now
        if self.readable_at is None and self.last["readable"] >= self.target:
            self.readable_at = now
        if self.persisted_at is None and self.last["persisted"] >= self.target:
            self.persisted_at = now


def start_nodes(layout: str, run_dir: Path, inp: Input) -> tuple[list[Node], Path | None]:
    """The daemons of a layout, started; the cluster map they follow, if any."""
    n = len(inp.per_vbucket)
    every = list(range(n))
    if layout != "2_slices":
        count = 2 if layout == "2_replicas" else 1
        extra = NO_HISTORY if layout == "1_no_history" else ""
        nodes = [
            Node(
                f"node{i}",
                Daemon.in_workdir(run_dir / f"node{i}", extra),
                every,
                inp.seqnos(every),
            )
            for i in range(count)
        ]
        cluster_map = None
    else:
        half = n // 2
        slices = {"a": (0, half - 1), "b": (half, n - 1)}
        ports = {name: (free_port(), free_port()) for name in slices}
        cluster_map = run_dir / "cluster.toml"
        run_dir.mkdir(parents=True, exist_ok=True)
        write_cluster_map(
            cluster_map,
            [(name, *ports[name], f"{lo}-{hi}") for name, (lo, hi) in slices.items()],
        )
        nodes = []
        for name, (lo, hi) in slices.items():
            args = ["--cluster-map", str(cluster_map), "--node", name]
            vbuckets = list(range(lo, hi + 1))
            nodes.append(
                Node(
                    name,
                    Daemon.in_workdir(run_dir / name, args=args),
                    vbuckets,
                    inp.seqnos(vbuckets),
                )
            )
    for node in nodes:
        node.daemon.start()
    return nodes, cluster_map


def index_entries(client: httpx.Client, node: Node) -> dict[str, int]:
    """A daemon's entries of each index."""
    indexes = client.get(f"{node.daemon.url}/indexes").json()["indexes"]
    return {index["name"]: index["entries"] for index in indexes}


def entries_match(layout: str, entries: Sequence[dict[str, int]], model: dict[str, int]) -> bool:
    """Replicas each hold every entry of the model; slices hold them between them."""
    if layout == "2_replicas":
        return all(e == model for e in entries)
    return {name: sum(e.get(name, 0) for e in entries) for name in model} == model


def pipeline_run(
    layout: str, workdir: Path, inp: Input, timeout: float, profile: Path | None = None
) -> dict[str, Any]:
    """Daemons up, then the router from the JSONL file until every daemon persisted all;
    with `profile`, py-spy samples the router and each daemon into files there."""
    run_dir = workdir / f"pipeline-{layout}"
    nodes: list[Node] = []
    router: Router | None = None
    spies: list[Profiler] = []
    client = httpx.Client(timeout=30)
    try:
        nodes, cluster_map = start_nodes(layout, run_dir, inp)
        for node in nodes:
            node.cpu_before = node.daemon.cpu()
            node.kinds_before = node.cpu_by_kind()
            if profile is not None:
                assert node.daemon.proc is not None
                spies.append(Profiler(node.daemon.proc.pid, profile / f"daemon-{node.name}.txt"))
        targets = [] if cluster_map else [node.daemon.address for node in nodes]
        shards = int(layout.split("_shards")[1]) if "_shards" in layout else 1
        router = start_router(run_dir, inp.path, targets, cluster_map=cluster_map, shards=shards)
        if profile is not None:
            spies.append(Profiler(router.proc.pid, profile / "router.txt"))
        started = router.started
        peak = RssSampler(router.proc.pid, SAMPLE_S)
        peak.start()
        router.wait_url()
        deadline = time.monotonic() + timeout
        while any(node.persisted_at is None for node in nodes):
            router.check_alive()
            for node in nodes:
                if node.persisted_at is None:
                    node.poll(client, time.time())
            if time.monotonic() > deadline:
                state = {node.name: node.last for node in nodes}
                raise RuntimeError(f"not everything persisted within {timeout} s: {state}")
            time.sleep(POLL_S)
        done = max(node.persisted_at or 0.0 for node in nodes)
        router_own, router_children = tree_cpu(router.process)
        main_cpu, thread_cpu = cpu_split(router.process)
        router_kinds = cpu_by_thread_kind(router.process)
        daemon_kinds = [node.cpu_by_kind() for node in nodes]
        shard_cpu = [sum(tree_cpu(child)) for child in router.process.children()]
        daemon_cpu = [sum(node.daemon.cpu()) - sum(node.cpu_before) for node in nodes]
        stats = router.stats()
        for spy in spies:
            spy.stop()
        entries = [index_entries(client, node) for node in nodes]
        peak_rss = peak.stop()
        router.stop_cleanly()
        for node in nodes:
            node.daemon.stop_cleanly()  # exit 0 and "stopped cleanly", or it raises
    finally:
        client.close()
        for spy in spies:
            spy.stop()
        if router is not None:
            router.kill()
        for node in nodes:
            node.daemon.kill()
    profiles = [str(spy.out) for spy in spies]  # the daemons', then the router's
    high = stats["source"]["high_seqno_sum"]
    if high != inp.documents:
        raise RuntimeError(f"the router's high seqno sum is {high}, not {inp.documents}")
    seconds = done - started
    running_at = router.logged_at("router running") or started
    read_at = router.logged_at(f"read {inp.documents} documents") or done
    router_cpu = router_own + router_children
    return {
        "layout": layout,
        "nodes": len(nodes),
        "documents": inp.documents,
        "seconds": round(seconds, 3),
        "per_s": round(inp.documents / seconds),
        "startup_s": round(running_at - started, 3),
        "per_s_after_startup": round(inp.documents / (done - running_at)),
        "input_read_s": round(read_at - started, 3),
        "received_s": [round((n.received_at or done) - started, 3) for n in nodes],
        "readable_s": [round((n.readable_at or done) - started, 3) for n in nodes],
        "persisted_s": [round((n.persisted_at or done) - started, 3) for n in nodes],
        "node_seqno_sums": [n.target for n in nodes],
        "router_cpu_s": round(router_cpu, 2),
        "router_main_cpu_s": round(main_cpu, 2),
        "router_thread_cpu_s": round(thread_cpu, 2),
        "router_children_cpu_s": round(router_children, 2),
        "router_cpu_s_by_thread": {k: round(v, 2) for k, v in router_kinds.items()},
        "daemon_cpu_s_by_thread": daemon_kinds,
        "router_process_cpu_s": [round(router_own, 2), *(round(c, 2) for c in shard_cpu)],
        "router_cpu_us_per_doc": round(router_cpu / inp.documents * 1e6, 1),
        "router_peak_rss_bytes": peak_rss,
        "daemon_cpu_s": [round(c, 2) for c in daemon_cpu],
        "daemon_cpu_us_per_doc": round(sum(daemon_cpu) / inp.documents * 1e6, 1),
        "items_sent": sum(p["sent"] + p["backfilled"] for p in stats["nodes"].values()),
        "items_backfilled": sum(p["backfilled"] for p in stats["nodes"].values()),
        "cursors_dropped": stats["mutation_manager"]["cursors_dropped"],
        "entries": entries,
        "entries_match_model": entries_match(layout, entries, inp.entries),
        **({"profiles": profiles} if profiles else {}),
    }


def report_run(r: dict[str, Any]) -> None:
    """The lines of one pipeline run."""
    persisted = ", ".join(f"{s:.2f}" for s in r["persisted_s"])
    readable = ", ".join(f"{s:.2f}" for s in r["readable_s"])
    daemons = " + ".join(f"{c:.2f}" for c in r["daemon_cpu_s"])
    say(
        f"pipeline, {LABELS[r['layout']]}: {r['per_s']:,} documents/s ({r['documents']:,} in "
        f"{r['seconds']:.2f} s from the router's start to persisted; "
        f"{r['per_s_after_startup']:,}/s after its start-up of {r['startup_s']} s; input read at "
        f"{r['input_read_s']:.2f} s, readable at {readable} s, persisted at {persisted} s)"
    )
    say(
        f"  router CPU {r['router_cpu_s']:.2f} s ({r['router_cpu_us_per_doc']} us/document: "
        f"{r['router_main_cpu_s']:.2f} s trio thread + {r['router_thread_cpu_s']:.2f} s other "
        f"threads + {r['router_children_cpu_s']:.2f} s children; by process "
        f"{' + '.join(f'{c:.2f}' for c in r['router_process_cpu_s'])} s), peak RSS "
        f"{r['router_peak_rss_bytes'] / MIB:.0f} MiB; daemon CPU {daemons} s "
        f"({r['daemon_cpu_us_per_doc']} us/document); {r['items_sent']:,} items streamed "
        f"({r['items_backfilled']:,} from the log, {r['cursors_dropped']} cursors dropped)"
    )
    kinds = [("router", r.get("router_cpu_s_by_thread") or {})]
    kinds += [("daemon", k) for k in r.get("daemon_cpu_s_by_thread") or []]
    if all(k for _, k in kinds):
        say(
            "  CPU by thread (main: trio's; trio: its worker threads; native: LevelDB's "
            "compaction and other threads Python did not start): "
            + "; ".join(
                f"{who} main {k['main']:.2f} s, trio {k['trio']:.2f} s, native {k['native']:.2f} s"
                for who, k in kinds
            )
        )


# --------------------------------------------------------------------------------------------
# 2. The ceiling


def ceiling_run(inp: Input, seed: int, workdir: Path, timeout: float) -> dict[str, Any]:
    """bench/ingest.py's end-to-end run on the same workload: pre-encoded frames to persisted."""
    opts = argparse.Namespace(
        mutations=inp.documents, keys=inp.keys, seed=seed, recovery_points=None, timeout=timeout
    )
    e2e = measure_e2e(opts, workdir / "ceiling")
    result = {
        "per_s": round(e2e.per_s),
        "seconds": round(e2e.seconds, 3),
        "send_seconds": round(e2e.send_seconds, 3),
        "tail_seconds": round(e2e.tail_seconds, 3),
        "encode_seconds_untimed": round(e2e.encode_seconds, 2),
        "daemon_cpu_s": round(e2e.daemon_main_cpu_s + e2e.daemon_thread_cpu_s, 2),
    }
    say(
        f"ceiling (bench/ingest.py end to end, same workload): {result['per_s']:,} mutations/s "
        f"({inp.documents:,} in {result['seconds']:.2f} s from the first pre-encoded byte to the "
        f"persisted ack; encoding {result['encode_seconds_untimed']:.1f} s untimed; daemon CPU "
        f"{result['daemon_cpu_s']:.2f} s)"
    )
    return result


# --------------------------------------------------------------------------------------------
# 3. PostgreSQL

PG_SCHEMA = """
CREATE TABLE docs (id text PRIMARY KEY, doc jsonb NOT NULL);
CREATE INDEX by_city ON docs ((doc->'address'->>'city'), (doc->'age'));
CREATE INDEX by_age ON docs ((doc->'age'));
"""
# Each batch's lines, in input order; cleared at every commit.
PG_STAGING = (
    "CREATE TEMPORARY TABLE staging (seq bigint GENERATED ALWAYS AS IDENTITY, line jsonb NOT NULL)"
    " ON COMMIT DELETE ROWS"
)
PG_COPY = "COPY staging (line) FROM STDIN"
# The last version of each id in the batch: deleted, or upserted.
PG_APPLY = """
WITH last AS (
    SELECT DISTINCT ON (line->>'id') line->>'id' AS id, line->'doc' AS doc,
           coalesce((line->>'deleted')::boolean, false) AS deleted
    FROM staging ORDER BY line->>'id', seq DESC
), gone AS (
    DELETE FROM docs USING last WHERE last.deleted AND docs.id = last.id
)
INSERT INTO docs (id, doc) SELECT id, doc FROM last WHERE NOT deleted
ON CONFLICT (id) DO UPDATE SET doc = EXCLUDED.doc
""".strip()


def copy_rows(lines: Sequence[bytes]) -> bytes:
    """Lines as COPY text rows of one jsonb column (backslash is COPY's escape)."""
    return b"".join(lines).replace(b"\\", b"\\\\")


def batches(path: Path) -> Iterator[list[bytes]]:
    """The JSONL file's lines, PG_BATCH at a time."""
    with open(path, "rb") as f:
        while batch := list(islice(f, PG_BATCH)):
            yield batch


def load_psycopg(pg: Postgres, path: Path) -> float:
    """The timed load through psycopg; the client's CPU seconds."""
    assert psycopg is not None
    before = cpu_with_children()
    with psycopg.connect(host=str(pg.dir), port=pg.port, user="postgres", dbname="postgres") as c:
        c.execute(PG_STAGING)
        c.commit()
        for batch in batches(path):
            with c.cursor() as cursor:
                with cursor.copy(PG_COPY) as copy:
                    copy.write(copy_rows(batch))
                cursor.execute(PG_APPLY)
            c.commit()
    return cpu_with_children() - before


def psql_script(path: Path, out: IO[bytes]) -> None:
    """The whole load as one psql script: per batch BEGIN, COPY with its rows inline, the
    apply statement, COMMIT."""
    out.write(f"{PG_STAGING};\n".encode())
    for batch in batches(path):
        out.write(f"BEGIN;\n{PG_COPY};\n".encode())
        out.write(copy_rows(batch))
        out.write(f"\\.\n{PG_APPLY};\nCOMMIT;\n".encode())


def cpu_with_children() -> float:
    """CPU seconds of this process and of its reaped children."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def load_psql(pg: Postgres, path: Path) -> float:
    """The timed load through psql reading its script on stdin; the CPU seconds of psql and of
    this process writing the script."""
    before = cpu_with_children()
    with tempfile.TemporaryFile() as errors:
        proc = subprocess.Popen(
            pg.psql_command(), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=errors
        )
        assert proc.stdin is not None
        try:
            psql_script(path, proc.stdin)
            proc.stdin.close()
        except BrokenPipeError:
            pass
        code = proc.wait()  # psql exits after its last commit
        errors.seek(0)
        if code != 0:
            raise RuntimeError(f"psql failed ({code}): {errors.read().decode()[-3000:]}")
    return cpu_with_children() - before


def postgres_run(opts: argparse.Namespace, inp: Input) -> dict[str, Any] | None:
    """The PostgreSQL peer on the same JSONL file, or None when it cannot run here."""
    bindir = find_postgres()
    if bindir is None:
        say("PostgreSQL: not run: no initdb and postgres binaries on this machine")
        return None
    try:
        pg = Postgres(bindir, opts.keep)
    except KeyError:
        say("PostgreSQL: not run: running as root and no 'postgres' user to run the server as")
        return None
    try:
        pg.start(opts.timeout)
        version = pg.query("SHOW server_version")
        pg.query(PG_SCHEMA)
        client = "psycopg" if psycopg is not None else "psql"
        server_before = pg.server_cpu()
        started = time.time()
        client_cpu = load_psycopg(pg, inp.path) if psycopg is not None else load_psql(pg, inp.path)
        seconds = time.time() - started
        server_cpu = pg.server_cpu() - server_before
        rows = int(pg.query("SELECT count(*) FROM docs"))
        size = int(pg.query("SELECT pg_total_relation_size('docs')"))
    finally:
        pg.stop()
    result = {
        "per_s": round(inp.documents / seconds),
        "seconds": round(seconds, 3),
        "client": client,
        "version": version,
        "server_cpu_s": round(server_cpu, 2),
        "client_cpu_s": round(client_cpu, 2),
        "rows": rows,
        "rows_match_model": rows == inp.live,
        "bytes": size,
        "batch": PG_BATCH,
    }
    say(
        f"PostgreSQL {version} ({client}): {result['per_s']:,} documents/s ({inp.documents:,} in "
        f"{seconds:.2f} s from the JSONL file to the last commit, batches of {PG_BATCH:,}: COPY to "
        f"a staging table, upserts and deletes, commit); server CPU {server_cpu:.2f} s, client "
        f"CPU {client_cpu:.2f} s; {rows:,} rows, {size / MIB:.0f} MiB with its indexes"
    )
    return result


# --------------------------------------------------------------------------------------------
# Main


def check(ok: bool, text: str) -> None:
    say(("check: " if ok else "WARNING: ") + text)


class Profiler:
    """py-spy sampling one process until `stop` (SIGINT: it writes its raw stacks then)."""

    def __init__(self, pid: int, out: Path) -> None:
        spy = Path(sys.executable).parent / "py-spy"
        if not spy.exists():
            raise SystemExit("error: --profile needs py-spy: pip install py-spy (the bench extra)")
        self.out = out
        self.proc: subprocess.Popen[bytes] | None = subprocess.Popen(
            [
                str(spy),
                "record",
                "--pid",
                str(pid),
                "--rate",
                str(PROFILE_RATE),
                "--format",
                "raw",
                "--nonblocking",
                "--output",
                str(out),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, signal.SIGINT, 60)
            self.proc = None


def profile_run(opts: argparse.Namespace, workdir: Path, inp: Input) -> dict[str, Any]:
    """--profile DIR: the one-node pipeline with py-spy on the router and the daemon; CPU per
    document per stage of each (bench/stages.py), printed and returned."""
    opts.profile.mkdir(parents=True, exist_ok=True)
    result = pipeline_run("1", workdir, inp, opts.timeout, profile=opts.profile)
    report_run(result)
    found: dict[str, Any] = {"run": result}
    cpu = {"router": result["router_cpu_s"], "daemon": result["daemon_cpu_s"][0]}
    daemon_profile, router_profile = result["profiles"]
    for name, path in (("router", router_profile), ("daemon", daemon_profile)):
        with Path(path).open() as f:
            counts = read_samples(f, opts.profile_depth)
        found[name] = [
            {"stage": s.name, "us_per_doc": round(s.us_per_document, 2), "share": round(s.share, 4)}
            for s in stages(counts, cpu[name], inp.documents)
        ]
        say(f"{name}: {cpu[name]:.1f} s CPU, {cpu[name] / inp.documents * 1e6:.1f} µs/document")
        say(table(stages(counts, cpu[name], inp.documents)))
    return found


def history_cost(opts: argparse.Namespace, workdir: Path, inp: Input) -> dict[str, Any]:
    """--history-rounds R: one node with and without the change history, R rounds each,
    interleaved (so drift falls on both); the medians and their ratios."""
    found: dict[str, list[dict[str, Any]]] = {"1": [], "1_no_history": []}
    for round_ in range(opts.history_rounds):
        for layout in ("1", "1_no_history") if round_ % 2 == 0 else ("1_no_history", "1"):
            result = pipeline_run(layout, workdir / f"round{round_}", inp, opts.timeout)
            report_run(result)
            found[layout].append(result)

    def median(layout: str, key: str) -> float:
        return float(statistics.median(r[key] for r in found[layout]))

    summary: dict[str, Any] = {"documents": inp.documents, "rounds": opts.history_rounds}
    for key in ("per_s", "daemon_cpu_us_per_doc", "router_cpu_us_per_doc"):
        summary[key] = {
            "history": [r[key] for r in found["1"]],
            "no_history": [r[key] for r in found["1_no_history"]],
        }
    summary["throughput_with_vs_without"] = ratio(
        median("1", "per_s"), median("1_no_history", "per_s")
    )
    summary["daemon_cpu_with_vs_without"] = ratio(
        median("1", "daemon_cpu_us_per_doc"), median("1_no_history", "daemon_cpu_us_per_doc")
    )
    summary["entries_match_model"] = all(
        r["entries_match_model"] for runs in found.values() for r in runs
    )
    say(
        f"history cost: {summary['throughput_with_vs_without']}x the documents/s and "
        f"{summary['daemon_cpu_with_vs_without']}x the daemon CPU per document of the same "
        f"pipeline without it (medians of {opts.history_rounds} interleaved rounds)"
    )
    return summary


def compare_trees(opts: argparse.Namespace, workdir: Path, inp: Input) -> dict[str, Any]:
    """--against TREE: one node from this checkout and from TREE, R rounds each, interleaved;
    the medians and the ratios of this checkout's figures to TREE's."""
    trees = {"this": Path(__file__).resolve().parent.parent, "against": opts.against.resolve()}
    if not (trees["against"] / "indexer" / "__main__.py").exists():
        raise SystemExit(f"error: --against {opts.against}: not a checkout of the project")
    found: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    keys = ("per_s", "router_cpu_us_per_doc", "daemon_cpu_us_per_doc")
    before, here = os.environ.get("PYTHONPATH"), Path.cwd()
    # `python -m indexer` looks in its working directory first: none of the checkouts.
    os.chdir(workdir)
    try:
        for round_ in range(opts.rounds):
            for name in trees if round_ % 2 == 0 else reversed(list(trees)):
                os.environ["PYTHONPATH"] = str(trees[name])
                result = pipeline_run("1", workdir / f"{name}{round_}", inp, opts.timeout)
                say(f"{name} ({trees[name]}), round {round_ + 1}:")
                report_run(result)
                found[name].append(result)
    finally:
        os.chdir(here)
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before

    def median(name: str, key: str) -> float:
        return float(statistics.median(r[key] for r in found[name]))

    summary: dict[str, Any] = {"documents": inp.documents, "rounds": opts.rounds}
    summary.update({name: str(tree) for name, tree in trees.items()})
    for key in keys:
        summary[key] = {name: [r[key] for r in runs] for name, runs in found.items()}
        summary[f"{key}_this_vs_against"] = ratio(median("this", key), median("against", key))
    cpu = {
        name: median(name, "router_cpu_us_per_doc") + median(name, "daemon_cpu_us_per_doc")
        for name in trees
    }
    summary["cpu_us_per_doc"] = cpu
    summary["cpu_this_vs_against"] = ratio(cpu["this"], cpu["against"])
    summary["entries_match_model"] = all(
        r["entries_match_model"] for rs in found.values() for r in rs
    )
    say(
        f"this checkout: {summary['per_s_this_vs_against']}x the documents/s and "
        f"{summary['cpu_this_vs_against']}x the CPU per document (router + daemon, "
        f"{cpu['this']:.1f} against {cpu['against']:.1f} us) of {trees['against']} "
        f"(medians of {opts.rounds} interleaved rounds)"
    )
    return summary


def run(opts: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Input, the three pipeline runs, the ceiling, PostgreSQL; the JSON summary."""
    config = parse_config()
    workload = Workload(opts.documents, opts.keys, DELETE_RATIO, opts.seed)
    inp = write_input(workdir / "input.jsonl", workload, config)
    say(
        f"workload: {inp.documents:,} documents over {inp.keys:,} docids, {inp.deletes:,} "
        f"deletes, seed {opts.seed} ({inp.path.stat().st_size / MIB:.1f} MiB of JSONL; "
        f"{inp.live:,} documents live at the end); indexes: "
        + ", ".join(f"{i.name}({', '.join(i.keys)})" for i in config.indexes)
        + f"; {os.cpu_count()} cores, Python {sys.version.split()[0]}"
    )
    if opts.history_rounds:
        return history_cost(opts, workdir, inp)
    if opts.profile is not None:
        return profile_run(opts, workdir, inp)
    if opts.against is not None:
        return compare_trees(opts, workdir, inp)
    runs: dict[str, dict[str, Any]] = {}
    for layout in LAYOUTS:
        runs[layout] = pipeline_run(layout, workdir, inp, opts.timeout)
        report_run(runs[layout])
    check(
        all(r["entries_match_model"] for r in runs.values()),
        "index entries == the input's model in every run "
        + str({k: r["entries"] for k, r in runs.items()})
        + f" (model {inp.entries})",
    )
    ceiling = ceiling_run(inp, opts.seed, workdir, opts.timeout)
    pg = None
    if opts.skip_postgres:
        say("PostgreSQL: skipped (--skip-postgres)")
    else:
        pg = postgres_run(opts, inp)
        if pg is not None:
            check(pg["rows_match_model"], f"PostgreSQL rows {pg['rows']:,}, model {inp.live:,}")

    one = runs["1"]["per_s"]
    summary: dict[str, Any] = {
        "documents": inp.documents,
        "keys": inp.keys,
        "seed": opts.seed,
        "deletes": inp.deletes,
        "live_documents": inp.live,
        "jsonl_bytes": inp.path.stat().st_size,
        "docs_per_s_1": one,
        "docs_per_s_2_slices": runs["2_slices"]["per_s"],
        "docs_per_s_2_replicas": runs["2_replicas"]["per_s"],
        "ceiling_per_s": ceiling["per_s"],
        "ratio_1": ratio(one, ceiling["per_s"]),
        "ratio_2_slices_vs_1": ratio(runs["2_slices"]["per_s"], one),
        "ratio_2_replicas_vs_1": ratio(runs["2_replicas"]["per_s"], one),
        "router_cpu_us_per_doc": runs["1"]["router_cpu_us_per_doc"],
        "router_cpu_us_per_doc_2_slices": runs["2_slices"]["router_cpu_us_per_doc"],
        "router_cpu_us_per_doc_2_replicas": runs["2_replicas"]["router_cpu_us_per_doc"],
        "docs_per_s_1_shards2": runs["1_shards2"]["per_s"],
        "router_cpu_us_per_doc_shards2": runs["1_shards2"]["router_cpu_us_per_doc"],
        "shards2_cpu_vs_1": ratio(
            runs["1_shards2"]["router_cpu_us_per_doc"], runs["1"]["router_cpu_us_per_doc"]
        ),
        "router_process_cpu_s_shards2": runs["1_shards2"]["router_process_cpu_s"],
        "daemon_cpu_us_per_doc_1": runs["1"]["daemon_cpu_us_per_doc"],
        "seconds_1": runs["1"]["seconds"],
        "seconds_2_slices": runs["2_slices"]["seconds"],
        "seconds_2_replicas": runs["2_replicas"]["seconds"],
        "pg_docs_per_s": pg["per_s"] if pg else None,
        "ratio_vs_postgres": ratio(one, pg["per_s"]) if pg else None,
        "pg_seconds": pg["seconds"] if pg else None,
        "entries_match_model": all(r["entries_match_model"] for r in runs.values()),
        "runs": runs,
        "ceiling": ceiling,
        "postgres": pg,
        "cores": os.cpu_count(),
    }
    summary["targets"] = TARGETS
    summary["targets_met"] = {
        key: None
        if summary[key] is None
        else (summary[key] <= goal if key in AT_MOST else summary[key] >= goal)
        for key, goal in TARGETS.items()
    }
    say(
        f"summary: {one:,} documents/s to 1 node = {summary['ratio_1']}x the ceiling of "
        f"{ceiling['per_s']:,}/s; 2 slices {summary['ratio_2_slices_vs_1']}x and 2 replicas "
        f"{summary['ratio_2_replicas_vs_1']}x of 1 node; router {summary['router_cpu_us_per_doc']}"
        f" us/document; --shards 2 {summary['docs_per_s_1_shards2']:,}/s at "
        f"{summary['shards2_cpu_vs_1']}x the CPU per document; "
        + (
            f"{summary['ratio_vs_postgres']}x PostgreSQL's {summary['pg_docs_per_s']:,}/s"
            if pg
            else "PostgreSQL not run"
        )
    )
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--documents", type=int, default=1_000_000, help="default 1,000,000")
    parser.add_argument("--keys", type=int, default=None, help="docids (default documents/5)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--skip-postgres", action="store_true", help="do not run PostgreSQL")
    parser.add_argument("--timeout", type=float, default=1800, help="of every wait, seconds")
    parser.add_argument("--keep", action="store_true", help="keep the temp directories")
    parser.add_argument(
        "--history-rounds",
        type=int,
        default=0,
        metavar="R",
        help="only one node, with and without the change history, R interleaved rounds each",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="only one node, with py-spy sampling the router and the daemon into DIR; "
        "prints CPU per document per stage",
    )
    parser.add_argument(
        "--profile-depth", type=int, default=0, help="with --profile, 1: stages per function"
    )
    parser.add_argument(
        "--against",
        type=Path,
        metavar="TREE",
        help="only one node, from this checkout and from TREE (another checkout), interleaved",
    )
    parser.add_argument("--rounds", type=int, default=3, help="with --against (default 3)")
    opts = parser.parse_args(argv)
    if opts.rounds < 1:
        parser.error("--rounds must be >= 1")
    if opts.keys is None:
        opts.keys = max(1, opts.documents // 5)
    if opts.documents < 1 or opts.keys < 1:
        parser.error("--documents and --keys must be >= 1")
    return in_workdir("pipeline-bench-", opts.keep, lambda workdir: run(opts, workdir))


if __name__ == "__main__":
    raise SystemExit(main())
