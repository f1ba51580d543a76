"""Keep a Parquet table of an index's changes, from which the index can be rebuilt at any batch.

    python examples/spark_stream.py --url http://127.0.0.1:9102 --index by_city --out out/
    python examples/spark_stream.py --cluster-map cluster.toml --index by_city --out out/ --follow

Streams the change feed (`spark.readStream.format("indexer")`, docs/spark.md): the first
micro-batches hold every entry at the latest persisted snapshot as an insert, then the entries
inserted and deleted since, each at most --max-entries rows. Every micro-batch overwrites a
directory of its own under --out (`batch=N`): `foreachBatch` runs a batch again after a failure,
and appending would store it twice. Run again, the query goes on from its checkpoint. At the end
it rebuilds the index from the table (the last change of each entry, in batch and feed order)
and prints how many entries it holds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from indexer.spark import error_message, run_stream, session


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--url", help="the daemon's HTTP API, e.g. http://127.0.0.1:9102")
    source.add_argument("--cluster-map", help="every node of a cluster map")
    parser.add_argument("--index", default="by_city", help="index name (default: by_city)")
    parser.add_argument("--out", required=True, help="the Parquet table of changes")
    parser.add_argument("--checkpoint", help="the query's checkpoint (default: OUT_checkpoint)")
    parser.add_argument("--max-entries", type=int, default=100_000, help="rows per micro-batch")
    parser.add_argument("--consumer", help="hold a lease on the history under this name")
    parser.add_argument(
        "--follow", action="store_true", help="keep reading every 10 s (Ctrl-C stops)"
    )
    parser.add_argument("--master", help="Spark master (default: spark-submit's, or local[*])")
    return parser.parse_args(argv)


def write_batch(out: str, batch: DataFrame, batch_id: int) -> None:
    """One directory per batch, overwritten: a batch Spark runs again replaces its own rows.
    A node's feed is one partition, so monotonically_increasing_id keeps its order."""
    rows = batch.withColumn("ordinal", F.monotonically_increasing_id())
    rows.write.mode("overwrite").parquet(f"{out}/batch={batch_id}")


def rebuilt(table: DataFrame) -> DataFrame:
    """The entries the changes leave: those whose last change is an insert. An entry's changes
    all come from one node's feed (its document's vbucket), so batch and ordinal order them."""
    entry = [c for c in table.columns if c not in ("op", "snapshot", "batch", "ordinal")]
    last = Window.partitionBy(*entry).orderBy(F.desc("batch"), F.desc("ordinal"))
    ranked = table.withColumn("rank", F.row_number().over(last))
    return ranked.filter("rank = 1 AND op = 'insert'").select(*entry)


def run(spark: SparkSession, args: argparse.Namespace) -> Any:
    stream = (
        spark.readStream.format("indexer")
        .option("index", args.index)
        .option("startingOffsets", "snapshot")
        .option("maxEntriesPerTrigger", args.max_entries)
        .option("columns", "json")  # the key types of a long stream may change
    )
    if args.url:
        stream = stream.option("url", args.url)
    else:
        stream = stream.option("cluster_map", args.cluster_map)
    if args.consumer:
        stream = stream.option("consumer", args.consumer)
    out = args.out.rstrip("/")
    writer = (
        stream.load()
        .writeStream.foreachBatch(lambda batch, batch_id: write_batch(out, batch, batch_id))
        .option("checkpointLocation", args.checkpoint or f"{out}_checkpoint")
    )
    query = run_stream(writer, args.follow)
    return query.lastProgress


def main(argv: list[str] | None = None, stop: bool = True) -> int:
    """Run the job on `argv` (the command line's by default); the exit status. With
    `stop=False` its session stays up for the caller's next job: one application, one set of
    executors."""
    args = arguments(argv)
    started = time.monotonic()
    spark = session(f"indexer-stream-{args.index}", args.master)
    try:
        progress = run(spark, args)
        if not Path(args.out).exists():
            print("no changes read (the index had no persisted snapshot)")
            return 0
        table = spark.read.parquet(args.out)
        batches = table.select("batch").distinct().count()
        rows = table.count()
        entries = rebuilt(table).count()
    except Exception as exc:  # Spark wraps the source's one-line reason in pages of trace
        print(f"spark_stream: error: {error_message(exc)}", file=sys.stderr)
        return 1
    finally:
        if stop:
            spark.stop()
    end = progress["sources"][0]["endOffset"] if progress else "(no new batch)"
    print(f"{rows} changes in {batches} micro-batches in {args.out}, up to offset {end}")
    print(f"{entries} entries of index {args.index} rebuilt from them")
    print(f"in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
