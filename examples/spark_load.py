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
"""

from __future__ import annotations

import argparse
import sys
import time

from indexer.spark import error_message, session


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
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    started = time.monotonic()
    spark = session("indexer-load", args.master)
    try:
        df = spark.read.parquet(args.parquet)
        rows = df.count()
        write = (
            df.write.format("indexer")
            .mode("append")
            .option("router", args.router)
            .option("id", args.id)
            .option("wait", args.wait)
            .option("on_error", args.on_error)
        )
        if args.delete:
            write = write.option("delete", args.delete)
        if args.token_file:
            write = write.option("token_file", args.token_file)
        write.save()
    except Exception as exc:  # Spark wraps the writer's one-line reason in pages of trace
        print(f"spark_load: error: {error_message(exc)}", file=sys.stderr)
        return 1
    finally:
        spark.stop()
    print(
        f"loaded {rows} rows of {args.parquet} through {args.router} "
        f"({args.wait}) in {time.monotonic() - started:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
