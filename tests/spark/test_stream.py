"""Spark Structured Streaming over the change feed: `spark.readStream.format("indexer")`.

A query appends every micro-batch to Parquet through `foreachBatch`; replaying the Parquet
changes in batch order over nothing gives exactly the index, compared with a model computed
from the source's documents. The query runs in several runs from its checkpoint (each a
restart), with the daemon SIGKILLed between two of them.
"""

from __future__ import annotations

import functools
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from indexer.router import Workload, generate
from indexer.spark import error_message
from tests.e2e.conftest import run_feed
from tests.e2e.stream_client import VBUCKETS, Source, feed
from tests.harness import Daemon, model, write_jsonl
from tests.spark.stream_driver import shared_session, write_batch

pytestmark = [pytest.mark.spark, pytest.mark.e2e]

NAME = "by_city"
PATHS = ["address.city", "age"]
FAST = "[snapshots]\npersist_interval_ms = 100\nin_memory_interval_ms = 20\n"


@pytest.fixture(scope="module")
def spark() -> SparkSession:
    return shared_session()  # the test process's: left running for the modules after


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    daemon = Daemon.in_workdir(tmp_path / "daemon", FAST).start()
    yield daemon
    daemon.kill()


def run_query(spark: SparkSession, out: Path, checkpoint: Path, **options: str) -> Any:
    """One run of the query from its checkpoint until it has read everything available;
    `options` name the source (`url` or `cluster_map`) and where to start. Its last progress."""
    stream = spark.readStream.format("indexer").option("index", NAME).option("columns", "json")
    for key, value in options.items():
        stream = stream.option(key, value)

    query = (
        stream.load()
        .writeStream.foreachBatch(functools.partial(write_batch, out))
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(300)
    assert query.exception() is None, query.exception()
    return query.lastProgress


def replayed(spark: SparkSession, out: Path) -> tuple[set[str], list[int]]:
    """The entries the Parquet changes give, applied in order; and the batch ids seen."""
    rows = spark.read.parquet(str(out)).orderBy("batch", "ordinal").collect()
    entries: set[str] = set()
    for row in rows:
        key = [None if row[c] is None else json.loads(row[c]) for c in ("address_city", "age")]
        entry = json.dumps([key, row["id"]])
        if row["op"] == "delete":
            assert entry in entries, f"batch {row['batch']} deletes what is not there: {row}"
            entries.remove(entry)
        else:
            assert entry not in entries, f"batch {row['batch']} inserts it twice: {row}"
            entries.add(entry)
    return entries, sorted({row["batch"] for row in rows})


def modelled(source: Source) -> set[str]:
    return {json.dumps([e["key"], e["id"]]) for e in model(source.surviving(), PATHS)}


def test_a_stream_appended_to_parquet_replays_to_the_index_across_restarts(
    spark: SparkSession, daemon: Daemon, tmp_path: Path
) -> None:
    source = Source(21)
    for vb in VBUCKETS:
        source.write(vb, 80)
    feed(daemon, source)
    out, checkpoint = tmp_path / "changes", tmp_path / "checkpoint"

    def copy() -> Any:  # the daemon's address is read at each run: a restart may move it
        return run_query(
            spark,
            out,
            checkpoint,
            url=daemon.url,
            startingOffsets="snapshot",
            maxEntriesPerTrigger="100",
            consumer="parquet-copy",
        )

    copy()
    entries, batches = replayed(spark, out)
    assert entries == modelled(source)
    first_batches = len(batches)
    seen = {r[0] for r in spark.read.parquet(str(out)).select("snapshot").distinct().collect()}
    first_run = max(int(token.split(".")[1]) for token in seen)
    for round_ in range(2):
        for vb in VBUCKETS:
            source.write(vb, 50)  # updates of the same documents, and deletes
        feed(daemon, source)
        if round_ == 0:  # the daemon dies; the query's tokens outlive it
            daemon.kill()
            daemon.start()
        copy()  # from the checkpoint
        entries, batches = replayed(spark, out)
        assert entries == modelled(source), f"round {round_}"
    assert batches == list(range(len(batches))) and len(batches) > first_batches + 2
    # maxEntriesPerTrigger bounds every batch, the snapshot start's too.
    sizes = spark.read.parquet(str(out)).groupBy("batch").count().collect()
    assert all(r["count"] <= 100 for r in sizes), sizes
    # Spark commits a batch when it plans the next: the lease is at the end of a batch of a
    # later run, past everything the first run read.
    lease = daemon.stats()["changes"]["leases"]["parquet-copy"]
    assert int(lease["token"].split(".")[1]) >= first_run and lease["expires_in_s"] > 80000


def test_a_snapshot_start_comes_in_micro_batches_of_the_read_limit(
    spark: SparkSession, daemon: Daemon, tmp_path: Path
) -> None:
    documents = list(generate(Workload(40_000, 32_000, 0.05, 25)))
    fed = run_feed(daemon, write_jsonl(tmp_path / "docs.jsonl", documents))
    assert fed.returncode == 0, fed.stderr
    want = {json.dumps([e["key"], e["id"]]) for e in model(documents, PATHS)}
    assert len(want) >= 20_000
    out, checkpoint = tmp_path / "changes", tmp_path / "checkpoint"
    run_query(
        spark,
        out,
        checkpoint,
        url=daemon.url,
        startingOffsets="snapshot",
        maxEntriesPerTrigger="2000",
    )
    entries, batches = replayed(spark, out)
    assert entries == want
    sizes = spark.read.parquet(str(out)).groupBy("batch").count().collect()
    assert all(r["count"] <= 2000 for r in sizes), sorted(r["count"] for r in sizes)
    assert len(batches) == -(-len(want) // 2000), (len(batches), len(want))


def test_a_batch_read_between_two_offsets_gives_the_changes(
    spark: SparkSession, daemon: Daemon, tmp_path: Path
) -> None:
    source = Source(22)
    for vb in VBUCKETS:
        source.write(vb, 60)
    feed(daemon, source)
    start = (
        spark.read.format("indexer")
        .option("url", daemon.url)
        .option("index", NAME)
        .option("columns", "json")
        .option("startingOffsets", "snapshot")
        .load()
    )
    first = start.collect()
    assert {r["op"] for r in first} == {"insert"}
    token = first[0]["snapshot"]
    for vb in VBUCKETS:
        source.write(vb, 40)
    feed(daemon, source)
    changes = (
        spark.read.format("indexer")
        .option("url", daemon.url)
        .option("index", NAME)
        .option("columns", "json")
        .option("startingOffsets", token)
        .load()
    )
    assert changes.columns == ["op", "id", "address_city", "age", "snapshot"]
    rows = changes.collect()
    assert rows and {r["op"] for r in rows} <= {"insert", "delete"}
    entries = {
        json.dumps([[json.loads(r["address_city"]), json.loads(r["age"])], r["id"]]) for r in first
    }
    for r in rows:
        entry = json.dumps([[json.loads(r["address_city"]), json.loads(r["age"])], r["id"]])
        if r["op"] == "delete":
            entries.remove(entry)
        else:
            entries.add(entry)
    assert entries == modelled(source)


def test_a_stream_without_a_start_and_a_bad_token_fail_with_one_line(
    spark: SparkSession, daemon: Daemon
) -> None:
    with pytest.raises(Exception) as caught:
        spark.readStream.format("indexer").option("url", daemon.url).option(
            "index", NAME
        ).load().writeStream.format("console").start().awaitTermination(60)
    assert "startingOffsets" in error_message(caught.value)
    with pytest.raises(Exception) as bad:
        spark.read.format("indexer").option("url", daemon.url).option("index", NAME).option(
            "startingOffsets", "yesterday"
        ).load().collect()
    assert "startingOffsets" in error_message(bad.value)


def test_a_driver_killed_mid_stream_goes_on_from_its_checkpoint(
    spark: SparkSession, daemon: Daemon, tmp_path: Path
) -> None:
    source = Source(23)
    for vb in VBUCKETS:
        source.write(vb, 80)
    feed(daemon, source)
    out, checkpoint = tmp_path / "changes", tmp_path / "checkpoint"
    args = [daemon.url, NAME, str(out), str(checkpoint), "25"]
    log = tmp_path / "driver.log"
    with open(log, "wb") as output:
        driver = subprocess.Popen(
            [sys.executable, "-m", "tests.spark.stream_driver", *args],
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 600

        def wait_commits(count: int) -> None:
            while len(list((checkpoint / "commits").glob("[0-9]*"))) < count:
                assert driver.poll() is None, f"the driver stopped: {log.read_text()[-2000:]}"
                assert time.monotonic() < deadline, f"no progress: {log.read_text()[-2000:]}"
                time.sleep(0.1)

        wait_commits(1)  # the snapshot start's first 25 entries
        for _ in range(4):  # updates while it streams, 25 rows a batch, then a SIGKILL
            for vb in VBUCKETS:
                source.write(vb, 40)
            feed(daemon, source)
        wait_commits(3)
        driver.send_signal(signal.SIGKILL)
        driver.wait(30)
    finally:
        if driver.poll() is None:
            driver.kill()
    # Killed inside the snapshot start (about 6 batches of 25): the batch it planned last ends
    # at a token inside it.
    offsets = max((checkpoint / "offsets").glob("[0-9]*"), key=lambda p: int(p.name))
    planned = json.loads(offsets.read_text().splitlines()[-1])["token"]
    assert ".s." in planned, planned
    for vb in VBUCKETS:
        source.write(vb, 40)
    feed(daemon, source)
    # The daemon dies too: its pin of the start's snapshot with it, so the start's rest is
    # rebuilt from the history, the same entries in the same order.
    daemon.kill()
    daemon.start()
    # The same query goes on from the killed driver's checkpoint, here, in larger batches
    # (the small ones were for a kill mid-stream).
    run_query(
        spark,
        out,
        checkpoint,
        url=daemon.url,
        startingOffsets="snapshot",
        maxEntriesPerTrigger="1000",
    )
    entries, batches = replayed(spark, out)
    assert entries == modelled(source)
    assert batches == list(range(len(batches)))


def test_a_rollback_past_a_streams_offset_fails_it_with_one_line_and_a_new_query_replays(
    spark: SparkSession, daemon: Daemon, tmp_path: Path
) -> None:
    """A failover rolls a vbucket back past the offset a query has read to: the history it read
    did not survive, so the query fails with the 410's line rather than go on past changes it
    cannot take back; a new query from the snapshot gives the index again."""
    source = Source(31)
    for vb in VBUCKETS:
        source.write(vb, 100)
    feed(daemon, source)
    out, checkpoint = tmp_path / "changes", tmp_path / "checkpoint"
    query = functools.partial(
        run_query, spark, out, checkpoint, url=daemon.url, startingOffsets="snapshot"
    )
    query()
    source.write(11, 100)
    feed(daemon, source)
    query()  # its offset is now past seqno 100 of vbucket 11
    assert replayed(spark, out)[0] == modelled(source)
    # vbucket 11's replica had only its first 150 seqnos; it takes over and goes on.
    source.failover(11, 150)
    source.write(11, 30)
    source.write(222, 20)
    router = feed(daemon, source)
    assert set(router.reply.rollback) == {11}
    with pytest.raises(Exception) as failed:
        query()
    message = error_message(failed.value)
    assert "HTTP 410" in message and "start again from a snapshot" in message, message
    again = tmp_path / "again"
    run_query(spark, again, tmp_path / "checkpoint2", url=daemon.url, startingOffsets="snapshot")
    assert replayed(spark, again)[0] == modelled(source)
