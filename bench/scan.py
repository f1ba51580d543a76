"""Scan benchmark: rows/s of index scans over HTTP and Spark against a raw plyvel iterator, and
request_plus latency while a feed runs.

    python bench/scan.py [--mutations N] [--keys K] [--seed S] [--skip-spark]
                         [--requests R] [--feed-rate M] [--keep]

One daemon (`python -m indexer serve`, default configuration and indexes, temp data dir, both
ports 0 and read from its log) is fed N mutations over K docids by the real router
(`python -m indexer feed`, which waits until they are persisted). Then, in this order:

1. HTTP scans of the whole `by_city` index with httpx, streamed: NDJSON (newlines counted) and
   Arrow IPC (`Accept: application/vnd.apache.arrow.stream`, read with pyarrow.ipc.open_stream),
   best of 3 each; then a range scan on the leading key (cities "A" <= city < "N", about half).
2. Spark, when `indexer/spark.py` exists: `spark.read.format("indexer")...load().count()` in one
   local[2] SparkSession, best of 2, session start-up excluded.
3. The daemon is stopped (SIGINT, exit 0 checked) and the same store is read with plyvel in this
   process: the bare iterator over the index's main entries (the reference of the ratio), the
   iterator plus `split_entry` decoding, and the daemon's own NDJSON and Arrow streaming code
   driven in-process without HTTP (a breakdown of where a scan's time goes).
4. The daemon is restarted on the same store, a feeder process (`--feeder`, below) streams more
   of the same workload at a steady rate, and GET /indexes/by_age/count?consistency=request_plus
   is sent --requests times in sequence, each after a random pause in [0, interval) so requests
   land at every phase of the snapshot cycle. Every fourth request is followed by one at
   consistency=any: the cost of the count itself under the same load. A thread polls
   GET /snapshots to time every published snapshot; the gap between two consecutive publishes
   minus the interval is the flush time of that cycle (cycles that also persisted are left out).
   Target: request_plus p99 <= 2 x in-memory interval + mean flush time.

Why a feeder of its own rather than a second `indexer feed`: the router numbers seqnos per
vbucket in input order and skips what the daemon reports persisted, so a feed of other documents
(another seed) is mostly skipped as a replay; and `indexer feed` sends a vbucket's batch only at
512 records (about every 500k documents with 1024 vbuckets), so it arrives in bursts. The feeder
continues the same seeded workload after the N persisted mutations (the router skips those) and
sends whatever it generated every 50 ms.

Step 4 (the latency run and its feeder) is `scan_latency.py`'s.

Everything lives in a temporary directory, removed at the end unless --keep. The last line
printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import httpx
import pyarrow as pa
import pyarrow.ipc
import trio
from common import (  # bench/common.py: run as `python bench/...`
    Daemon,
    in_workdir,
    ratio,
    say,
)
from scan_latency import (  # bench/scan_latency.py
    COUNT_INDEX,
    DELETE_RATIO,
    FEED_TICK_S,
    measure_latency,
    percentile,
    run_feeder,
    summarize_ms,
)

from indexer.config import load_config
from indexer.keys import split_entry
from indexer.scans import KeyRange, entry_batches
from indexer.storage import IndexStore, StoredIndex

ARROW = "application/vnd.apache.arrow.stream"
SCAN_INDEX = "by_city"
RANGE = {"low": '"A"', "high": '"N"', "inclusion": "low"}  # cities A..M: 13 of the 26
HTTP_REPEATS = 3
SPARK_REPEATS = 2
RAW_REPEATS = 5
DECODE_REPEATS = 3
PUSHDOWN_REPEATS = 3  # each of the aggregate and spans measurements


def rate(rows_per_s: float | None) -> str:
    """ "N rows/s", or "n/a"."""
    return "n/a" if rows_per_s is None else f"{rows_per_s:,.0f} rows/s"


# --------------------------------------------------------------------------------------------
# The daemon process


def feed_initial(daemon: Daemon, mutations: int, keys: int, seed: int) -> float:
    """`indexer feed --generate N` through the real router, until persisted; its seconds."""
    started = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "indexer",
            "feed",
            "--to",
            daemon.address,
            "--generate",
            str(mutations),
            "--keys",
            str(keys),
            "--seed",
            str(seed),
        ],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the feed failed ({done.returncode}): {done.stderr.strip()}")
    return time.perf_counter() - started


# --------------------------------------------------------------------------------------------
# HTTP scans


class ChunkReader(io.RawIOBase):
    """A readable file over an iterator of byte chunks (an HTTP body as it arrives)."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        super().__init__()
        self._chunks = chunks
        self._view = memoryview(b"")
        self.total = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._view:
            try:
                chunk = next(self._chunks)
            except StopIteration:
                return 0
            self.total += len(chunk)
            self._view = memoryview(chunk)
        n = min(len(buffer), len(self._view))
        buffer[:n] = self._view[:n]
        self._view = self._view[n:]
        return n


@dataclass
class Scan:
    """One scan format's runs: rows, body bytes, seconds of each run, daemon CPU of the best."""

    name: str
    rows: int = 0
    body_bytes: int = 0
    seconds: list[float] = field(default_factory=list)
    daemon_main_cpu_s: float = 0.0
    daemon_thread_cpu_s: float = 0.0

    @property
    def best(self) -> float:
        return min(self.seconds)

    @property
    def per_s(self) -> float:
        return self.rows / self.best


def scan_ndjson(client: httpx.Client, url: str, params: dict[str, str]) -> tuple[int, int]:
    """Stream an NDJSON scan; (rows, body bytes)."""
    rows = size = 0
    with client.stream("GET", url, params=params) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"scan: HTTP {response.status_code}: {response.text[:200]}")
        for chunk in response.iter_raw():
            rows += chunk.count(b"\n")
            size += len(chunk)
    return rows, size


def scan_arrow(client: httpx.Client, url: str, params: dict[str, str]) -> tuple[int, int]:
    """Stream an Arrow IPC scan, decoding record batches as they arrive; (rows, body bytes)."""
    rows = 0
    with client.stream("GET", url, params=params, headers={"Accept": ARROW}) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"scan: HTTP {response.status_code}: {response.text[:200]}")
        if not response.headers.get("content-type", "").startswith(ARROW):
            raise RuntimeError(f"asked for Arrow, got {response.headers.get('content-type')}")
        raw = ChunkReader(response.iter_raw())
        reader = pyarrow.ipc.open_stream(io.BufferedReader(raw, 1 << 20))
        for batch in reader:
            rows += batch.num_rows
    return rows, raw.total


def measure_scan(
    name: str,
    run: Callable[[httpx.Client, str, dict[str, str]], tuple[int, int]],
    client: httpx.Client,
    daemon: Daemon,
    params: dict[str, str],
) -> Scan:
    """HTTP_REPEATS runs of one scan; the daemon's CPU is kept for the fastest."""
    url = f"{daemon.url}/indexes/{SCAN_INDEX}/scan"
    scan = Scan(name)
    for _ in range(HTTP_REPEATS):
        cpu_before = daemon.cpu()
        started = time.perf_counter()
        rows, size = run(client, url, params)
        seconds = time.perf_counter() - started
        cpu_after = daemon.cpu()
        if scan.seconds and rows != scan.rows:
            raise RuntimeError(f"{name}: {rows} rows, then {scan.rows}: the index changed")
        if not scan.seconds or seconds < scan.best:
            scan.daemon_main_cpu_s = cpu_after[0] - cpu_before[0]
            scan.daemon_thread_cpu_s = cpu_after[1] - cpu_before[1]
        scan.rows, scan.body_bytes = rows, size
        scan.seconds.append(seconds)
    return scan


def report_scan(scan: Scan, raw_per_s: float | None = None) -> None:
    """One line per scan format."""
    runs = ", ".join(f"{s:.3f}" for s in scan.seconds)
    vs_raw = "" if raw_per_s is None else f"; {scan.per_s / raw_per_s:.3f} x raw"
    say(
        f"{scan.name}: {scan.per_s:,.0f} rows/s ({scan.rows} rows, "
        f"{scan.body_bytes / scan.rows:.1f} B/row, "
        f"{scan.body_bytes / scan.best / 2**20:.1f} MiB/s; "
        f"runs {runs} s; daemon CPU in the best run {scan.daemon_main_cpu_s:.2f} s main thread + "
        f"{scan.daemon_thread_cpu_s:.2f} s other threads{vs_raw})"
    )


# --------------------------------------------------------------------------------------------
# Spark


@dataclass
class SparkRun:
    """The Spark count: rows and seconds of each run, or why it did not run."""

    rows: int = 0
    seconds: list[float] = field(default_factory=list)
    session_s: float = 0.0
    skipped: str | None = None

    @property
    def per_s(self) -> float | None:
        return self.rows / min(self.seconds) if self.seconds and self.skipped is None else None


def measure_spark(url: str) -> SparkRun:
    """`spark.read.format("indexer")...load().count()` in one local[2] session, best of 2.

    The session is built with `indexer.spark.configure` and the source registered with
    `indexer.spark.register` (partitions default to the parallelism, 2), as `session()` does.
    """
    import importlib.util

    if importlib.util.find_spec("indexer.spark") is None:
        return SparkRun(skipped="indexer/spark.py does not exist (yet)")
    if shutil.which("java") is None:
        return SparkRun(skipped="no java on PATH")
    try:
        from pyspark.sql import SparkSession

        from indexer.spark import FORMAT, configure, register
    except ImportError as exc:
        return SparkRun(skipped=f"cannot import: {exc}")
    result = SparkRun()
    started = time.perf_counter()
    builder = SparkSession.builder.master("local[2]").appName("indexer-scan-bench")
    builder = configure(builder.config("spark.ui.enabled", "false"), "local[2]")
    try:
        spark = builder.getOrCreate()
    except Exception as exc:
        return SparkRun(skipped=f"cannot start Spark: {type(exc).__name__}: {exc}"[:300])
    try:
        spark.sparkContext.setLogLevel("ERROR")
        register(spark)
        result.session_s = time.perf_counter() - started
        for _ in range(SPARK_REPEATS):
            started = time.perf_counter()
            frame = spark.read.format(FORMAT).option("url", url).option("index", SCAN_INDEX)
            rows = frame.load().count()
            result.seconds.append(time.perf_counter() - started)
            result.rows = rows
    except Exception as exc:
        message = str(exc).strip().splitlines()
        result.skipped = f"failed: {type(exc).__name__}: {message[0] if message else ''}"[:300]
    finally:
        spark.stop()
    return result


# --------------------------------------------------------------------------------------------
# Raw: the same store read in this process


@dataclass
class Raw:
    """Rows/s of the store read in-process, from the bare iterator to the daemon's encoders."""

    rows: int
    bare_s: list[float]
    decode_s: list[float]
    ndjson_s: list[float]
    arrow_s: list[float]
    range_rows: int
    range_bare_s: list[float]

    def per_s(self, seconds: list[float], rows: int | None = None) -> float:
        return (self.rows if rows is None else rows) / min(seconds)

    def maybe_per_s(self, seconds: list[float]) -> int | None:
        """Rounded rows/s of the whole index, None when not measured."""
        return round(self.per_s(seconds)) if seconds else None


def best_of(repeats: int, run: Callable[[], int]) -> tuple[int, list[float]]:
    """Call `run` `repeats` times; the rows it returned (always the same) and each run's time."""
    times = []
    rows = -1
    for _ in range(repeats):
        started = time.perf_counter()
        got = run()
        times.append(time.perf_counter() - started)
        if rows >= 0 and got != rows:
            raise RuntimeError(f"{got} rows, then {rows}")
        rows = got
    return rows, times


def stream_in_process(store: IndexStore, index: StoredIndex, arrow: bool) -> int:
    """The daemon's own NDJSON or Arrow streaming code over the whole index, no HTTP: body bytes.

    `HttpApi._stream_ndjson` / `_stream_arrow` read nothing from the API object, so they run on a
    bare instance, with a stand-in for the snapshot (number, seqno sum) and an ASGI `send` that
    only counts bytes.
    """
    from indexer.http import HttpApi
    from indexer.http.wire import Projection

    api = object.__new__(HttpApi)
    snap = cast(Any, SimpleNamespace(number=0, timestamp=SimpleNamespace(total=0)))
    size = 0

    async def send(message: dict[str, Any]) -> None:
        nonlocal size
        size += len(message.get("body", b""))

    async def run() -> None:
        rows = entry_batches(store, index, None, KeyRange())
        if arrow:
            await api._stream_arrow(index, snap, rows, send, {}, {})
        else:
            whole = Projection(tuple(range(len(index.definition.keys))))
            await api._stream_ndjson(rows, send, {}, whole)

    trio.run(run)
    return size


def measure_raw(data_dir: Path) -> Raw:
    """The stopped daemon's store: bare iterator, + decoding, + the daemon's encoders."""
    from indexer.scans import key_range

    with IndexStore(data_dir, create=False) as store:
        index = store.index(SCAN_INDEX)
        db = store.db
        prefix = index.main_prefix
        cut = len(prefix)
        nkeys = len(index.definition.keys)

        def bare() -> int:
            n = 0
            for _ in db.iterator(prefix=prefix, include_value=False):
                n += 1
            return n

        def decode() -> int:
            n = 0
            for key in db.iterator(prefix=prefix, include_value=False):
                split_entry(key[cut:], nkeys)
                n += 1
            return n

        bounds = key_range(
            nkeys,
            low=json.loads(RANGE["low"]),
            high=json.loads(RANGE["high"]),
            inclusion=RANGE["inclusion"],
            has_low=True,
            has_high=True,
        )
        start = prefix + (bounds.start or b"")
        stop = prefix + bounds.stop if bounds.stop is not None else None

        def bare_range() -> int:
            n = 0
            for _ in db.iterator(start=start, stop=stop, include_value=False):
                n += 1
            return n

        rows, bare_s = best_of(RAW_REPEATS, bare)
        _, decode_s = best_of(DECODE_REPEATS, decode)
        ndjson_s: list[float] = []
        arrow_s: list[float] = []
        try:
            _, ndjson_s = best_of(DECODE_REPEATS, lambda: stream_in_process(store, index, False))
            _, arrow_s = best_of(DECODE_REPEATS, lambda: stream_in_process(store, index, True))
        except Exception as exc:  # private methods: a diagnostic, never worth the whole run
            say(f"in-process streaming code: not measured ({type(exc).__name__}: {exc})")
        range_rows, range_s = best_of(RAW_REPEATS, bare_range)
    return Raw(rows, bare_s, decode_s, ndjson_s, arrow_s, range_rows, range_s)


# --------------------------------------------------------------------------------------------
# Main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line; --feeder PORT is the feeder child process's mode."""
    parser = argparse.ArgumentParser(
        description="Scan benchmark: HTTP (NDJSON, Arrow) and Spark scans vs a raw plyvel "
        "iterator; request_plus latency under a feed."
    )
    parser.add_argument("--mutations", type=int, default=300_000, help="default 300,000")
    parser.add_argument("--keys", type=int, default=100_000, help="docids (default 100,000)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--skip-spark", action="store_true", help="do not run the Spark scan")
    parser.add_argument(
        "--requests", type=int, default=200, help="request_plus requests (default 200)"
    )
    parser.add_argument(
        "--feed-rate",
        type=float,
        default=20_000,
        help="mutations/s of the feed during the latency measurement (default 20,000)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the temp directory")
    parser.add_argument("--feeder", type=int, metavar="PORT", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.mutations < 1 or opts.keys < 1 or opts.requests < 1 or opts.feed_rate <= 0:
        parser.error("--mutations, --keys, --requests and --feed-rate must be positive")
    return opts


@dataclass
class Pushdown:
    """Work done in the index against the same work done in the client, in one run."""

    aggregate_s: float
    client_count_s: float
    groups: int
    spans_s: float
    single_scans_s: float
    span_rows: int


def measure_pushdown(client: httpx.Client, daemon: Daemon) -> Pushdown:
    """Best of PUSHDOWN_REPEATS each: a group-by count of SCAN_INDEX's leading key computed in
    the index against a full NDJSON scan counted in this client; one scan of 10 `eq` spans (an
    IN list of the 10 most common leading values) against 10 scans of one value each."""
    base = f"{daemon.url}/indexes/{SCAN_INDEX}"
    params = {"group_by": "1", "aggregates": "count"}

    def in_index() -> list[dict[str, Any]]:
        answer = client.get(f"{base}/aggregate", params=params)
        answer.raise_for_status()
        return [json.loads(line) for line in answer.text.splitlines()]

    def in_client() -> dict[str, int]:
        counts: dict[str, int] = {}
        with client.stream("GET", f"{base}/scan") as answer:
            for line in answer.iter_lines():
                if line:
                    lead = json.dumps(json.loads(line)["key"][0])
                    counts[lead] = counts.get(lead, 0) + 1
        return counts

    groups, aggregate_runs = best_of(PUSHDOWN_REPEATS, lambda: len(in_index()))
    _, client_runs = best_of(PUSHDOWN_REPEATS, lambda: len(in_client()))
    counted = in_client()
    by_index = {json.dumps(g["group"][0]): g["count"] for g in in_index()}
    if by_index != counted:
        raise RuntimeError("the aggregate's counts differ from the scan counted in the client")
    common = sorted(counted, key=lambda k: -counted[k])[:10]
    spans = json.dumps([{"eq": json.loads(k)} for k in common])

    def one_scan() -> int:
        answer = client.get(f"{base}/scan", params={"spans": spans})
        answer.raise_for_status()
        return answer.text.count("\n")

    def ten_scans() -> int:
        rows = 0
        for k in common:
            answer = client.get(f"{base}/scan", params={"eq": k})
            answer.raise_for_status()
            rows += answer.text.count("\n")
        return rows

    span_rows, spans_runs = best_of(PUSHDOWN_REPEATS, one_scan)
    single_rows, singles_runs = best_of(PUSHDOWN_REPEATS, ten_scans)
    if span_rows != single_rows:
        raise RuntimeError(f"10 spans read {span_rows} rows, 10 scans {single_rows}")
    return Pushdown(
        min(aggregate_runs), min(client_runs), groups, min(spans_runs), min(singles_runs), span_rows
    )


ARRAY_DOCS = 40_000
ARRAY_TAGS = 5  # distinct elements per document's array
ARRAY_ROUNDS = 2
PLAIN_KEYS = '["name"]'
ARRAY_KEYS = '["DISTINCT ARRAY t FOR t IN tags END"]'


@dataclass
class ArrayIngest:
    """The same documents fed into an index on a plain field and into an array index."""

    documents: int
    plain_entries: int
    array_entries: int
    plain_s: list[float] = field(default_factory=list)
    array_s: list[float] = field(default_factory=list)

    def entries_per_s(self, array: bool) -> float:
        entries = self.array_entries if array else self.plain_entries
        return entries / min(self.array_s if array else self.plain_s)


def measure_array_ingest(workdir: Path, seed: int, documents: int = ARRAY_DOCS) -> ArrayIngest:
    """`indexer feed --jsonl` of one file, from its first line to the persisted snapshot, into
    a daemon whose one index is `name` and into one whose index is DISTINCT ARRAY over `tags`
    (ARRAY_TAGS elements each): the user's whole path, the keys computed by the feed. Rounds
    interleaved, fresh data directories; the best of each."""
    rng = random.Random(seed)
    vocabulary = [f"tag{i}" for i in range(2_000)]
    jsonl = workdir / "array-docs.jsonl"
    with open(jsonl, "w") as f:
        for i in range(documents):
            body = {"name": f"user{rng.randrange(10**6)}", "tags": rng.sample(vocabulary, 5)}
            f.write(json.dumps({"id": f"doc{i}", "doc": body}) + "\n")
    result = ArrayIngest(documents, 0, 0)
    for round_ in range(ARRAY_ROUNDS):
        for array in (False, True):
            keys = ARRAY_KEYS if array else PLAIN_KEYS
            daemon = Daemon.in_workdir(
                workdir / f"array-{round_}-{int(array)}", f"[indexes.x]\nkeys = {keys}\n"
            )
            try:
                daemon.start()
                started = time.perf_counter()
                feed = [sys.executable, "-m", "indexer", "feed", "--to", daemon.address]
                done = subprocess.run(
                    [*feed, "--jsonl", str(jsonl)],
                    capture_output=True,
                    text=True,
                )
                seconds = time.perf_counter() - started
                if done.returncode != 0:
                    raise RuntimeError(f"the feed failed: {done.stderr.strip()}")
                entries = httpx.get(daemon.url + "/indexes/x", timeout=60).json()["entries"]
                daemon.stop_cleanly()
            finally:
                daemon.kill()
            (result.array_s if array else result.plain_s).append(seconds)
            if array:
                result.array_entries = entries
            else:
                result.plain_entries = entries
    if result.plain_entries != documents or result.array_entries != documents * ARRAY_TAGS:
        raise RuntimeError(
            f"entries: plain {result.plain_entries}, array {result.array_entries} "
            f"for {documents} documents of {ARRAY_TAGS} tags"
        )
    return result


def run(opts: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Every measurement in order; the JSON summary."""
    load_start = os.getloadavg()[0]
    daemon = Daemon.in_workdir(workdir)
    config = load_config(daemon.config)
    interval_s = config.snapshots.in_memory_interval_s
    say(
        f"workload: {opts.mutations} mutations over {opts.keys} docids, {DELETE_RATIO:.0%} "
        f"deletes, seed {opts.seed}; indexes: "
        + ", ".join(f"{i.name}({', '.join(i.keys)})" for i in config.indexes)
        + f"; in-memory snapshots every {interval_s * 1000:g} ms, persisted every "
        f"{config.snapshots.persist_interval_s * 1000:g} ms; {os.cpu_count()} cores, "
        f"Python {sys.version.split()[0]}, pyarrow {pa.__version__}"
    )
    try:
        daemon.start()
        fed_s = feed_initial(daemon, opts.mutations, opts.keys, opts.seed)
        with httpx.Client(timeout=300) as client:
            entries = {
                i["name"]: i["entries"]
                for i in client.get(daemon.url + "/indexes").json()["indexes"]
            }
            say(
                f"fed and persisted in {fed_s:.1f} s (indexer feed); entries: "
                + ", ".join(f"{k} {v}" for k, v in entries.items())
            )
            ndjson = measure_scan("HTTP NDJSON full scan", scan_ndjson, client, daemon, {})
            arrow = measure_scan("HTTP Arrow full scan", scan_arrow, client, daemon, {})
            range_ndjson = measure_scan(
                "HTTP NDJSON range scan", scan_ndjson, client, daemon, RANGE
            )
            range_arrow = measure_scan("HTTP Arrow range scan", scan_arrow, client, daemon, RANGE)
            pushdown = measure_pushdown(client, daemon)
        for scan in (ndjson, arrow, range_ndjson, range_arrow):
            report_scan(scan)
        aggregate_ratio = ratio(pushdown.client_count_s, pushdown.aggregate_s)
        spans_ratio = ratio(pushdown.single_scans_s, pushdown.spans_s)
        say(
            f"aggregate: group-by count of {pushdown.groups} groups in the index "
            f"{pushdown.aggregate_s * 1000:.1f} ms, a full NDJSON scan counted in the client "
            f"{pushdown.client_count_s * 1000:.1f} ms: {aggregate_ratio}x faster (target 5x)"
        )
        say(
            f"spans: one scan of 10 eq spans ({pushdown.span_rows} rows) "
            f"{pushdown.spans_s * 1000:.1f} ms, 10 single scans "
            f"{pushdown.single_scans_s * 1000:.1f} ms: {spans_ratio}x"
        )
        if not ndjson.rows == arrow.rows == entries[SCAN_INDEX]:
            raise RuntimeError(
                f"rows: NDJSON {ndjson.rows}, Arrow {arrow.rows}, index {entries[SCAN_INDEX]}"
            )

        spark = SparkRun(skipped="--skip-spark") if opts.skip_spark else measure_spark(daemon.url)
        if spark.skipped is not None:
            say(f"Spark: skipped ({spark.skipped})")
        else:
            runs = ", ".join(f"{s:.2f}" for s in spark.seconds)
            say(
                f"Spark count(): {spark.per_s:,.0f} rows/s ({spark.rows} rows; runs {runs} s; "
                f"session start-up {spark.session_s:.1f} s, not counted)"
            )
            if spark.rows != entries[SCAN_INDEX]:
                say(
                    f"WARNING: Spark counted {spark.rows} rows, the index has {entries[SCAN_INDEX]}"
                )

        daemon.stop_cleanly()
        raw = measure_raw(daemon.data_dir)
        raw_per_s = raw.per_s(raw.bare_s)
        if raw.rows != arrow.rows or raw.range_rows != range_arrow.rows:
            raise RuntimeError(
                f"raw rows {raw.rows}/{raw.range_rows}, HTTP {arrow.rows}/{range_arrow.rows}"
            )
        say(
            f"raw plyvel iterator: {raw_per_s:,.0f} rows/s ({raw.rows} rows, best of "
            f"{RAW_REPEATS}: {min(raw.bare_s) * 1000:.1f} ms); range {raw.range_rows} rows: "
            f"{raw.per_s(raw.range_bare_s, raw.range_rows):,.0f} rows/s"
        )
        say(
            "in-process breakdown (same store, no HTTP): iterator + split_entry "
            f"{raw.per_s(raw.decode_s):,.0f} rows/s; the daemon's NDJSON streaming code "
            f"{rate(raw.maybe_per_s(raw.ndjson_s))}; its Arrow streaming code "
            f"{rate(raw.maybe_per_s(raw.arrow_s))}"
        )
        for scan, rows_per_s in (
            (ndjson, raw_per_s),
            (arrow, raw_per_s),
            (range_ndjson, raw.per_s(raw.range_bare_s, raw.range_rows)),
            (range_arrow, raw.per_s(raw.range_bare_s, raw.range_rows)),
        ):
            say(f"  {scan.name}: {scan.per_s / rows_per_s:.3f} x raw")

        daemon.start()
        latency = measure_latency(daemon, opts, interval_s, workdir)
        daemon.stop_cleanly()
    finally:
        daemon.kill()

    plus = latency.request_plus_ms
    flush_mean = statistics.fmean(latency.flush_ms) if latency.flush_ms else None
    target_ms = 2 * interval_s * 1000 + flush_mean if flush_mean is not None else None
    feeder = latency.feeder
    say(
        f"feed during the latency run: {feeder['sent'] / feeder['seconds']:,.0f} mutations/s sent "
        f"(asked {opts.feed_rate:,.0f}; {feeder['sent']} mutations in {feeder['seconds']:.1f} s, "
        f"frames every {FEED_TICK_S * 1000:g} ms, at most {feeder['max_late_s'] * 1000:.0f} ms "
        f"late; {feeder['skipped']} persisted mutations skipped first, {feeder['resent']} "
        "resent); the daemon received "
        f"{latency.ingested} in {latency.feed_seconds:.1f} s of requests, CPU "
        f"{latency.daemon_main_cpu_s:.1f} s main thread + {latency.daemon_thread_cpu_s:.1f} s "
        f"others; {latency.queued_at_end} queued at the end"
    )
    say(f"request_plus count of {COUNT_INDEX} ({len(plus)} requests): {summarize_ms(plus)}")
    if latency.wait_ms:
        say(
            f"  of which waiting for the snapshot read to be published ({len(latency.wait_ms)} "
            f"matched to a polled snapshot): {summarize_ms(latency.wait_ms)}"
        )
    say(
        f"  consistency=any, same load ({len(latency.any_ms)} requests): "
        f"{summarize_ms(latency.any_ms)}"
    )
    if flush_mean is not None:
        say(
            f"  flush time per cycle (publish gap - {interval_s * 1000:g} ms, "
            f"{len(latency.flush_ms)} cycles without a persist, {latency.polls} polls): mean "
            f"{flush_mean:.1f} ms, {summarize_ms(latency.flush_ms)}"
            + (
                f"; cycles with a persist: mean {statistics.fmean(latency.persist_cycle_ms):.1f} ms"
                if latency.persist_cycle_ms
                else ""
            )
        )
        met = percentile(plus, 99) <= cast(float, target_ms)
        say(
            f"  target p99 <= 2 x {interval_s * 1000:g} ms + mean flush = {target_ms:.1f} ms: "
            + ("met" if met else "NOT met")
        )
    else:
        say("  flush time: no two consecutive snapshots were seen; no target figure")

    array = measure_array_ingest(workdir, opts.seed)
    array_ratio = ratio(array.entries_per_s(True), array.entries_per_s(False))
    say(
        f"array index ingest ({array.documents} documents through `indexer feed --jsonl`, to "
        f"the persisted snapshot; rounds interleaved): plain index on name "
        f"{array.plain_entries / min(array.plain_s):,.0f} entries/s (runs "
        + ", ".join(f"{s:.2f}" for s in array.plain_s)
        + f" s), DISTINCT ARRAY of {ARRAY_TAGS} tags "
        f"{array.entries_per_s(True):,.0f} entries/s = "
        f"{array.documents / min(array.array_s):,.0f} documents/s (runs "
        + ", ".join(f"{s:.2f}" for s in array.array_s)
        + f" s): {array_ratio}x per entry (target 0.5x)"
    )
    say(
        f"machine load average (1 min): {load_start:.2f} at the start, {os.getloadavg()[0]:.2f} now"
    )
    arrow_ratio = ratio(arrow.per_s, raw_per_s)
    p99 = percentile(plus, 99)
    summary: dict[str, Any] = {
        "mutations": opts.mutations,
        "keys": opts.keys,
        "seed": opts.seed,
        "index": SCAN_INDEX,
        "rows": raw.rows,
        "raw_rows_per_s": round(raw_per_s),
        "raw_decode_rows_per_s": round(raw.per_s(raw.decode_s)),
        "inprocess_ndjson_rows_per_s": raw.maybe_per_s(raw.ndjson_s),
        "inprocess_arrow_rows_per_s": raw.maybe_per_s(raw.arrow_s),
        "ndjson_rows_per_s": round(ndjson.per_s),
        "arrow_rows_per_s": round(arrow.per_s),
        "spark_rows_per_s": round(spark.per_s) if spark.per_s is not None else None,
        "spark_skipped": spark.skipped,
        "ratio_arrow_vs_raw": arrow_ratio,
        "ratio_ndjson_vs_raw": ratio(ndjson.per_s, raw_per_s),
        "ratio_arrow_vs_raw_decode": ratio(arrow.per_s, raw.per_s(raw.decode_s)),
        "ratio_spark_vs_raw": ratio(spark.per_s, raw_per_s),
        "ndjson_bytes_per_row": round(ndjson.body_bytes / ndjson.rows, 1),
        "arrow_bytes_per_row": round(arrow.body_bytes / arrow.rows, 1),
        "range_rows": raw.range_rows,
        "range_raw_rows_per_s": round(raw.per_s(raw.range_bare_s, raw.range_rows)),
        "range_ndjson_rows_per_s": round(range_ndjson.per_s),
        "range_arrow_rows_per_s": round(range_arrow.per_s),
        "request_plus_requests": len(plus),
        "request_plus_p50_ms": round(percentile(plus, 50), 1),
        "request_plus_p99_ms": round(p99, 1),
        "request_plus_max_ms": round(max(plus), 1),
        "any_p50_ms": round(percentile(latency.any_ms, 50), 1) if latency.any_ms else None,
        "any_p99_ms": round(percentile(latency.any_ms, 99), 1) if latency.any_ms else None,
        "snapshot_interval_ms": round(interval_s * 1000),
        "flush_mean_ms": round(flush_mean, 1) if flush_mean is not None else None,
        "flush_p99_ms": round(percentile(latency.flush_ms, 99), 1) if latency.flush_ms else None,
        "request_plus_target_ms": round(target_ms, 1) if target_ms is not None else None,
        "feed_rate_per_s": round(feeder["sent"] / feeder["seconds"]),
        "aggregate_ms": round(pushdown.aggregate_s * 1000, 1),
        "client_count_ms": round(pushdown.client_count_s * 1000, 1),
        "ratio_aggregate_vs_client": ratio(pushdown.client_count_s, pushdown.aggregate_s),
        "spans_ms": round(pushdown.spans_s * 1000, 1),
        "single_scans_ms": round(pushdown.single_scans_s * 1000, 1),
        "ratio_spans_vs_single_scans": ratio(pushdown.single_scans_s, pushdown.spans_s),
        "array_documents": array.documents,
        "plain_index_entries_per_s": round(array.entries_per_s(False)),
        "array_index_entries_per_s": round(array.entries_per_s(True)),
        "ratio_array_vs_plain_per_entry": array_ratio,
        "cores": os.cpu_count(),
        "load_avg_1m": [round(load_start, 2), round(os.getloadavg()[0], 2)],
    }
    aggregate_ratio = summary["ratio_aggregate_vs_client"]
    summary["targets_met"] = {
        "arrow_vs_raw_ge_0.5": bool(arrow_ratio is not None and arrow_ratio >= 0.5),
        "aggregate_vs_client_ge_5": bool(aggregate_ratio is not None and aggregate_ratio >= 5),
        "array_vs_plain_per_entry_ge_0.5": bool(array_ratio is not None and array_ratio >= 0.5),
        "request_plus_p99_le_2_intervals_plus_flush": bool(
            target_ms is not None and p99 <= target_ms
        ),
    }
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    """Feeder mode for the child process, else the whole benchmark."""
    opts = parse_args(argv)
    if opts.feeder is not None:
        result = run_feeder(opts.feeder, opts.mutations, opts.keys, opts.seed, opts.feed_rate)
        print(json.dumps(result), flush=True)
        return 0
    return in_workdir("scan-bench-", opts.keep, lambda workdir: run(opts, workdir))


if __name__ == "__main__":
    sys.exit(main())
