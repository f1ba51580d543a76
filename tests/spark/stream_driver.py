"""A Spark driver that copies an index's change feed to Parquet until it is killed: the
streaming tests SIGKILL it mid-stream and go on from its checkpoint.

    python -m tests.spark.stream_driver URL INDEX OUT CHECKPOINT MAX_ENTRIES

Also the SparkSession the Spark tests share: one per test process, started once and left
running for every module after (a cold session takes 8-12 s).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from indexer.spark import configure, session

# JVM options for the short-lived JVMs of the tests: the client compiler alone and the serial
# collector, so that JIT and GC threads do not take the two cores from the daemons beside them
# (tests/spark/test_writer.py alone: 94 s -> 81 s; docs/testing.md).
TEST_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
# Settings a test session does without: no web UI to start, and a few shuffle tasks rather
# than 200 for the few thousand rows a test sorts or groups.
TEST_CONF = {
    "spark.ui.enabled": "false",
    "spark.sql.shuffle.partitions": "2",
    "spark.driver.defaultJavaOptions": TEST_JVM_OPTIONS,
}
# Two cores, and a failed task tried up to 4 times (the writer's tests fail tasks on purpose).
SHARED_MASTER = "local[2,4]"

_shared: SparkSession | None = None


def start_session(app_name: str, master: str) -> SparkSession:
    """`indexer.spark.session(app_name, master)`, started with TEST_CONF."""
    builder = SparkSession.builder.appName(app_name).master(master)
    for key, value in TEST_CONF.items():
        builder = builder.config(key, value)
    configure(builder, master).getOrCreate()
    return session(app_name, master)  # the one just started, set up as a user's would be


def shared_session() -> SparkSession:
    """The test process's session (local[2,4]), started on first use or after a stop."""
    global _shared
    if _shared is None or _shared.sparkContext._jsc is None:
        _shared = start_session("indexer-tests", SHARED_MASTER)
    return _shared


def write_batch(out: Path, batch: DataFrame, batch_id: int) -> None:
    """A micro-batch in a directory of its own, overwritten if Spark runs the batch again;
    one partition, so monotonically_increasing_id keeps the feed's order."""
    rows = batch.withColumn("ordinal", F.monotonically_increasing_id())
    rows.write.mode("overwrite").parquet(str(out / f"batch={batch_id}"))


def main(url: str, index: str, out: str, checkpoint: str, max_entries: str) -> None:
    spark = start_session("indexer-stream-driver", "local[1]")
    query = (
        spark.readStream.format("indexer")
        .option("url", url)
        .option("index", index)
        .option("columns", "json")
        .option("startingOffsets", "snapshot")
        .option("maxEntriesPerTrigger", max_entries)
        .load()
        .writeStream.foreachBatch(functools.partial(write_batch, Path(out)))
        .option("checkpointLocation", checkpoint)
        .trigger(processingTime="200 milliseconds")
        .start()
    )
    print("streaming", flush=True)
    query.awaitTermination()


if __name__ == "__main__":
    main(*sys.argv[1:6])
