"""Change-feed benchmark: the feed's read rate against a full Arrow scan of the same index, the
rate of Spark's readStream over it, the latency from a write to the feed, and what writing the
history costs the ingest.

    python bench/changes.py [--mutations N] [--keys K] [--seed S] [--rounds R] [--pairs P]
                            [--skip-spark] [--writes W] [--keep]

1. Ingest cost: R rounds, each feeding the same N mutations (`indexer feed --generate`, until
   persisted) to a fresh daemon with `changes.history = true` and to one with `false`, one after
   the other (interleaved, so the machine's drift falls on both): documents/s of each, the
   median of each and their ratio (target: the history costs at most 10%).
2. Read rate: on the last daemon with history, N mutations more over the same K docids (the
   same workload generated twice as long: updates and deletes); then the rows/s of GET
   /indexes/by_city/changes between the tokens before and after them in Arrow and of a full
   Arrow scan of the index (its entries after them), P pairs read one after the other (the
   machine's drift falls on both): the median of each, and the median and spread of the
   pairs' ratios (target: feed >= 0.5x the Arrow scan); and the feed in NDJSON, best of 3.
3. Spark: `spark.readStream.format("indexer")` from the first token to the second, under
   Trigger.AvailableNow into the noop sink (session start-up excluded), twice in one
   session: rows/s of the first query (with its Python workers' start) and of the second.
4. Latency: on a daemon of its own, W documents PUT one at a time through a router's HTTP API
   (each synced before its 200), each followed by a long poll of the feed (`wait`) until a
   change of its id shows: p50 and p99 of the time from the PUT's answer to the row (a
   micro-batch adds its trigger interval).

Everything lives in a temporary directory, removed unless --keep. The last line printed is one
JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
from common import Daemon, Router, free_port, in_workdir, say  # bench/common.py

NAME = "by_city"
NO_HISTORY = "[changes]\nhistory = false\n"


def feed(daemon: Daemon, mutations: int, keys: int, seed: int) -> float:
    """`indexer feed --generate` until persisted; documents/s."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "indexer", "feed", "--to", daemon.address, "--generate",
         str(mutations), "--keys", str(keys), "--seed", str(seed)],
        capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the feed failed ({done.returncode}): {done.stderr.strip()}")
    return mutations / (time.perf_counter() - started)


def latest(client: httpx.Client, daemon: Daemon) -> str:
    answer = client.get(f"{daemon.url}/indexes/{NAME}/changes", params={"since": "latest"})
    answer.raise_for_status()
    return str(answer.headers["x-indexer-next"])


def read_rate(
    client: httpx.Client, url: str, params: dict[str, str], arrow: bool, times: int = 3
) -> float:
    """Rows/s of one streamed GET (Arrow batches, or NDJSON lines), best of `times`."""
    best = 0.0
    headers = {"accept": "application/vnd.apache.arrow.stream"} if arrow else {}
    for _ in range(times):
        started = time.perf_counter()
        rows = 0
        with client.stream("GET", url, params=params, headers=headers) as response:
            response.raise_for_status()
            if arrow:
                body = response.read()
                for batch in pa.ipc.open_stream(body):
                    rows += batch.num_rows
            else:
                for line in response.iter_lines():
                    rows += bool(line)
        best = max(best, rows / (time.perf_counter() - started))
    return best


def spark_rate(daemon: Daemon, since: str, rows: int) -> tuple[float, float]:
    """Rows/s of the same readStream twice in one session: the first pays the start of the
    driver's and the executor's Python workers, the second is the warm rate."""
    from indexer.spark import session

    spark = session("changes-bench", "local[2]")
    rates = []
    try:
        for _ in range(2):
            started = time.perf_counter()
            query = (
                spark.readStream.format("indexer")
                .option("url", daemon.url)
                .option("index", NAME)
                .option("columns", "json")
                .option("startingOffsets", since)
                .load()
                .writeStream.format("noop")
                .trigger(availableNow=True)
                .start()
            )
            query.awaitTermination()
            rates.append(rows / (time.perf_counter() - started))
        return rates[0], rates[1]
    finally:
        spark.stop()


def latency(daemon: Daemon, workdir: Path, writes: int) -> list[float]:
    """Seconds from each synced PUT to the first feed row of its id."""
    port = free_port()
    router = Router(
        workdir / "router.log", "--state", str(workdir / "router"), "--to", daemon.address,
        "--http", f"127.0.0.1:{port}",
    )  # fmt: skip
    try:
        url = router.wait_url()
        router.wait_log(r"connected; resuming")
        seen: list[float] = []
        with httpx.Client(timeout=60) as client:
            token = latest(client, daemon)
            for n in range(writes):
                docid = f"latency-{n}"
                body = {"address": {"city": f"City{n % 7}"}, "age": n % 90}
                client.put(f"{url}/docs/{docid}", json=body).raise_for_status()
                written = time.perf_counter()
                found = False
                while not found:
                    answer = client.get(
                        f"{daemon.url}/indexes/{NAME}/changes",
                        params={"since": token, "wait": "10"},
                    )
                    answer.raise_for_status()
                    token = answer.headers["x-indexer-next"]
                    found = any(
                        json.loads(line)["id"] == docid for line in answer.text.splitlines()
                    )
                seen.append(time.perf_counter() - written)
        return seen
    finally:
        router.kill()


def run(opts: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    started: list[Daemon] = []
    try:
        return measure(opts, workdir, started)
    finally:  # a failed step leaves no daemon running
        for daemon in started:
            if daemon.running:
                daemon.kill()


def measure(opts: argparse.Namespace, workdir: Path, started: list[Daemon]) -> dict[str, Any]:
    rates: dict[str, list[float]] = {"history": [], "none": []}
    daemon = None
    for r in range(opts.rounds):
        for kind in ("history", "none"):
            node = Daemon.in_workdir(
                workdir / f"{kind}{r}", "" if kind == "history" else NO_HISTORY
            )
            started.append(node)
            node.start()
            rate = feed(node, opts.mutations, opts.keys, opts.seed)
            rates[kind].append(rate)
            state = "on " if kind == "history" else "off"
            say(f"round {r + 1}, history {state}: {rate:,.0f} docs/s")
            if kind == "history" and r == opts.rounds - 1:
                daemon = node
            else:
                node.stop()
    on, off = statistics.median(rates["history"]), statistics.median(rates["none"])
    cost = 1 - on / off
    say(f"ingest: {on:,.0f} docs/s with the history, {off:,.0f} without: it costs {cost:.1%}")
    assert daemon is not None
    summary: dict[str, Any] = {"ingest_with": on, "ingest_without": off, "history_cost": cost}
    with httpx.Client(timeout=600) as client:
        before = latest(client, daemon)
        # The same workload, twice as long: the router skips the first N (persisted already).
        feed(daemon, 2 * opts.mutations, opts.keys, opts.seed)
        after = latest(client, daemon)
        url = f"{daemon.url}/indexes/{NAME}/changes"
        params = {"since": before, "until": after, "columns": "string,long"}
        head = client.get(url, params={"since": before, "until": after})
        rows = sum(1 for line in head.text.splitlines() if line)
        scan_url = f"{daemon.url}/indexes/{NAME}/scan"
        feeds, scans = [], []
        for _ in range(opts.pairs):
            feeds.append(read_rate(client, url, params, arrow=True, times=1))
            scans.append(read_rate(client, scan_url, {"columns": "string,long"}, True, times=1))
        feed_ndjson = read_rate(client, url, {"since": before, "until": after}, arrow=False)
    feed_arrow, scan_arrow = statistics.median(feeds), statistics.median(scans)
    ratios = sorted(f / s for f, s in zip(feeds, scans, strict=True))
    say(
        f"feed: {rows:,} rows; Arrow {feed_arrow:,.0f} rows/s, NDJSON {feed_ndjson:,.0f} rows/s; "
        f"full Arrow scan {scan_arrow:,.0f} rows/s (medians of {opts.pairs} pairs): feed / scan "
        f"{statistics.median(ratios):.3f} (pairs {ratios[0]:.3f}-{ratios[-1]:.3f})"
    )
    summary.update(
        feed_rows=rows, feed_arrow=feed_arrow, feed_ndjson=feed_ndjson, scan_arrow=scan_arrow,
        feed_over_scan=round(statistics.median(ratios), 3), feed_over_scan_pairs=ratios,
    )  # fmt: skip
    if not opts.skip_spark:
        cold, warm = spark_rate(daemon, before, rows)
        say(
            f"readStream (noop sink, AvailableNow): {cold:,.0f} rows/s the first query of the "
            f"session, {warm:,.0f} rows/s the second"
        )
        summary["read_stream"] = warm
        summary["read_stream_first"] = cold
    daemon.stop()
    if opts.writes:
        # A daemon of its own: a router with a source log is another source than `indexer feed`.
        fresh = Daemon.in_workdir(workdir / "latency")
        started.append(fresh)
        fresh.start()
        try:
            seen = sorted(latency(fresh, workdir, opts.writes))
        finally:
            fresh.stop()
        p50 = seen[len(seen) // 2] * 1000
        p99 = seen[min(len(seen) - 1, int(len(seen) * 0.99))] * 1000
        say(f"write to feed: p50 {p50:.0f} ms, p99 {p99:.0f} ms over {len(seen)} writes")
        summary.update(latency_p50_ms=p50, latency_p99_ms=p99)
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mutations", type=int, default=300_000)
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--writes", type=int, default=50)
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--skip-spark", action="store_true")
    parser.add_argument("--keep", action="store_true")
    opts = parser.parse_args(argv)
    return in_workdir("changes-bench-", opts.keep, lambda workdir: run(opts, workdir))


if __name__ == "__main__":
    sys.exit(main())
