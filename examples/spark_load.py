"""Load a Parquet file (or directory) into the indexer through its routers.

    python examples/spark_load.py --parquet people.parquet --router http://127.0.0.1:9110 --id id
    spark-submit examples/spark_load.py --parquet hdfs:///people \\
        --router http://r1:9110,http://r2:9110 --id id --delete deleted --wait visible

Every row becomes a document: its --id column is the document id and its other columns the
document (structs nested, timestamps as ISO-8601 text, nulls left out). With --delete, a row
whose value in that column is true deletes the document instead. Each task posts its rows to
the router that owns them in bounded bulks (`POST /docs/_bulk`); the job ends once the routers
have every row in their source logs (--wait persisted) or once the nodes can read them
(--wait visible). Running it again is harmless: the latest version of a document wins.

With --stream CHECKPOINT the directory is read as a stream (`writeStream.format("indexer")`):
each run loads the files added since the last (Spark's checkpoint remembers which), and
--follow keeps loading new files every 10 s.

    python examples/spark_load.py --parquet incoming/ --router http://127.0.0.1:9110 --id id \
        --stream out/load_checkpoint
"""

from __future__ import annotations

import argparse
import sys
import time

from pyspark.sql import SparkSession

from indexer.spark import error_message, run_stream, session


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--parquet", required=True, help="the Parquet file or directory to load")
    parser.add_argument(
        "--router", required=True, help="the routers' HTTP APIs, comma-separated (http://HOST:PORT)"
    )
    parser.add_argument("--id", required=True, help="the column of the document ids")
    parser.add_argument("--delete", help="a boolean column: true deletes the document")
    parser.add_argument("--wait", choices=["persisted", "visible"], default="persisted")
    parser.add_argument(
        "--on-error", choices=["fail", "skip"], default="fail", help="what a bad row does"
    )
    parser.add_argument("--token-file", help="a file holding the routers' token")
    parser.add_argument("--master", help="Spark master (default: spark-submit's, or local[*])")
    parser.add_argument("--stream", metavar="CHECKPOINT", help="load the directory as a stream")
    parser.add_argument("--follow", action="store_true", help="with --stream: keep loading")
    args = parser.parse_args(argv)
    if args.follow and not args.stream:
        parser.error("--follow goes with --stream")
    return args


def options(args: argparse.Namespace) -> dict[str, str]:
    """The writer's options, the same for a batch and a stream."""
    found = {"router": args.router, "id": args.id, "wait": args.wait, "on_error": args.on_error}
    if args.delete:
        found["delete"] = args.delete
    if args.token_file:
        found["token_file"] = args.token_file
    return found


def stream(spark: SparkSession, args: argparse.Namespace) -> int:
    """Load the files of the directory that the checkpoint has not seen; the rows loaded."""
    schema = spark.read.parquet(args.parquet).schema
    writer = (
        spark.readStream.schema(schema)
        .parquet(args.parquet)
        .writeStream.format("indexer")
        .options(**options(args))
        .option("checkpointLocation", args.stream)
    )
    query = run_stream(writer, args.follow)
    return sum(int(p["numInputRows"]) for p in query.recentProgress)


def main(argv: list[str] | None = None, stop: bool = True) -> int:
    """Run the job on `argv` (the command line's by default); the exit status. With
    `stop=False` its session stays up for the caller's next job: one application, one set of
    executors."""
    args = arguments(argv)
    started = time.monotonic()
    spark = session("indexer-load", args.master)
    try:
        if args.stream:
            rows = stream(spark, args)
        else:
            df = spark.read.parquet(args.parquet)
            rows = df.count()
            df.write.format("indexer").mode("append").options(**options(args)).save()
    except Exception as exc:  # Spark wraps the writer's one-line reason in pages of trace
        print(f"spark_load: error: {error_message(exc)}", file=sys.stderr)
        return 1
    finally:
        if stop:
            spark.stop()
    print(
        f"loaded {rows} rows of {args.parquet} through {args.router} "
        f"({args.wait}) in {time.monotonic() - started:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
