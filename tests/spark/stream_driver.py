"""A Spark driver that copies an index's change feed to Parquet until it is killed: the
streaming tests SIGKILL it mid-stream and go on from its checkpoint.

    python -m tests.spark.stream_driver URL INDEX OUT CHECKPOINT MAX_ENTRIES
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from indexer.spark import session


def write_batch(out: Path, batch: DataFrame, batch_id: int) -> None:
    """A micro-batch in a directory of its own, overwritten if Spark runs the batch again;
    one partition, so monotonically_increasing_id keeps the feed's order."""
    rows = batch.withColumn("ordinal", F.monotonically_increasing_id())
    rows.write.mode("overwrite").parquet(str(out / f"batch={batch_id}"))


def main(url: str, index: str, out: str, checkpoint: str, max_entries: str) -> None:
    spark = session("indexer-stream-driver", "local[1]")
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
