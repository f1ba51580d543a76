"""Entries per leading key value of an index, with averages of its other keys, into Parquet.

    spark-submit examples/spark_job.py --url http://127.0.0.1:9102 --index by_city --out out/
    python examples/spark_job.py --url http://127.0.0.1:9102 --index by_city --out out/
    python examples/spark_job.py --path data --index by_age --out out/      # a stopped node

Reads one snapshot of the index (pinned on the daemon for the job and released at the end, or
the persisted snapshot of a data directory), groups by the leading key column, writes the result
as Parquet to --out, then prints the top rows and the snapshot it read. Key columns are typed from
what the index holds (JSON text where a key holds several types); the averages take the numbers
among them.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from indexer.spark import error_message, offline_snapshot, pinned, session


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--url", help="the daemon's HTTP API, e.g. http://127.0.0.1:9102")
    source.add_argument("--path", help="a stopped node's data directory (read offline)")
    parser.add_argument("--index", default="by_city", help="index name (default: by_city)")
    parser.add_argument("--out", required=True, help="output directory for the Parquet files")
    parser.add_argument("--partitions", type=int, help="read partitions (default: parallelism)")
    parser.add_argument("--snapshot", choices=["persisted", "stable"], default="persisted")
    parser.add_argument("--top", type=int, default=10, help="rows to print (default: 10)")
    parser.add_argument("--master", help="Spark master (default: spark-submit's, or local[*])")
    return parser.parse_args(argv)


def aggregate(df: DataFrame) -> DataFrame:
    """Entries per leading key value, with the average of every other key as a number."""
    keys = [c for c in df.columns if c != "id"]
    lead, rest = keys[0], keys[1:]
    averages = [F.avg(F.col(c).try_cast("double")).alias(f"avg_{c}") for c in rest]
    return df.groupBy(lead).agg(F.count("*").alias("entries"), *averages)


def run(spark: SparkSession, args: argparse.Namespace, read: Any) -> tuple[int, list[Any]]:
    """Aggregate the index, write Parquet, return the entry count and the top rows."""
    df = read.load()
    result = aggregate(df)
    result.write.mode("overwrite").parquet(args.out)
    written = spark.read.parquet(args.out)  # the rest reads the output, not the index again
    lead = written.columns[0]
    total = written.agg(F.sum("entries")).first()
    top = written.orderBy(F.desc("entries"), lead).limit(args.top).collect()
    return int(total[0] or 0) if total else 0, top


def show(rows: list[Any]) -> None:
    if not rows:
        print("(no entries)")
        return
    names = list(rows[0].asDict())
    cells = [[_cell(r[n]) for n in names] for r in rows]
    widths = [max(len(n), *(len(c[i]) for c in cells)) for i, n in enumerate(names)]
    print("  ".join(n.ljust(w) for n, w in zip(names, widths, strict=True)))
    for c in cells:
        print("  ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)))


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None, stop: bool = True) -> int:
    """Run the job on `argv` (the command line's by default); the exit status. With
    `stop=False` its session stays up for the caller's next job: one application, one set of
    executors."""
    args = arguments(argv)
    started = time.monotonic()
    spark = session(f"indexer-{args.index}", args.master)
    try:
        read = spark.read.format("indexer").option("index", args.index)
        if args.partitions:
            read = read.option("partitions", args.partitions)
        if args.url:
            with pinned(args.url, args.snapshot) as pin:
                total, top = run(spark, args, read.option("url", args.url).option("pin", pin.id))
            where = (
                f"snapshot {pin.snapshot} (seqno sum {pin.seqno_sum}) of {args.url}, "
                f"pinned as {pin.id} and released"
            )
        else:
            persisted = offline_snapshot(args.path)
            total, top = run(spark, args, read.option("path", args.path))
            where = (
                f"persisted snapshot (seqno sum {persisted.seqno_sum}, written "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(persisted.persisted_at))}) "
                f"of {args.path}"
                if persisted
                else f"{args.path} (no persisted snapshot file)"
            )
    except Exception as exc:  # Spark wraps the source's one-line reason in pages of trace
        print(f"spark_job: error: {error_message(exc)}", file=sys.stderr)
        return 1
    finally:
        if stop:
            spark.stop()
    show(top)
    print(f"{total} entries of index {args.index}, read from the {where}")
    print(f"written to {args.out} in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
