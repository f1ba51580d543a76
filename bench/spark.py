"""Spark benchmark: loading a DataFrame through the writer, and reading an index back.

    python bench/spark.py [--documents N] [--seed S] [--rounds R] [--timeout S] [--keep]

Everything runs on 127.0.0.1 in a temporary directory, removed at the end unless --keep.

Input: N documents (default 1,000,000) with distinct ids and a fixed shape (name, age with a
tenth null, score, active, address {city, zip}, tags, a timestamp), written once, untimed, as a
Parquet file and as the JSONL lines the writer makes of the same rows. The daemons have the
default configuration (by_city on address.city and age, by_age on age).

1. Write. Per round, on fresh daemons, in turn:
   - the router's JSONL rate: `indexer router --state NEW --jsonl FILE --to DAEMON`, the clock
     from just before the router starts to the daemon's persisted snapshot covering all N;
   - the writer: the router (`--http`) and a local[2] SparkSession already up, the clock from
     the job's start (`spark.read.parquet(FILE).write.format("indexer")...save()`) to the same
     persisted snapshot.
   Reported: documents/s of each, the writer's rate over the router's (target: at least 0.8),
   and the routers' CPU per document.
2. Read, on the daemon of the last write round (by_city: N entries), in one local[2] session:
   `count()` (best of 3) and a Parquet write of the DataFrame (best of 2), rows/s; then, the
   daemon stopped, the raw plyvel iterator over the same index's keys (best of 3). Reported:
   rows/s and the ratios to the iterator. Target: count() at least 800,000 rows/s.

Prints one line per measurement and ends with one JSON object of every figure.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
from common import Daemon, Router, in_workdir, ratio, say, tree_cpu  # bench/common.py

from indexer.storage import IndexStore

CITIES = ["Oslo", "Lima", "Kyiv", "Pune", "Rome", "Cairo", "Quito", "Osaka", "Perth", "Dakar"]
TAGS = ["a", "b", "c", "d"]
POLL_S = 0.05
WRITE_TARGET = 0.8
COUNT_TARGET = 800_000
WARM = 10  # documents written before the clock starts


# --------------------------------------------------------------------------------------------
# Input


def make_input(n: int, seed: int, workdir: Path) -> tuple[Path, Path]:
    """The Parquet file and the JSONL file of the same N documents."""
    rng = np.random.default_rng(seed)
    ages = rng.integers(18, 90, n)
    age_valid = rng.random(n) >= 0.1
    cities = rng.integers(0, len(CITIES), n)
    seen = np.datetime64("2025-01-01T00:00:00", "us") + rng.integers(0, 10**13, n).astype(
        "timedelta64[us]"
    )
    table = pa.table(
        {
            "id": pa.array([f"doc{i:08}" for i in range(n)]),
            "name": pa.array([f"user{v}" for v in rng.integers(0, 10**6, n)]),
            "age": pa.array(ages, mask=~age_valid),
            "score": pa.array(np.round(rng.normal(0, 50, n), 3)),
            "active": pa.array(rng.random(n) < 0.5),
            "address": pa.StructArray.from_arrays(
                [
                    pa.array([CITIES[c] for c in cities]),
                    pa.array([f"{z:05}" for z in rng.integers(0, 100_000, n)]),
                ],
                names=["city", "zip"],
            ),
            "tags": pa.array([TAGS[: 1 + i % 4] for i in range(n)]),
            "seen": pa.array(seen, pa.timestamp("us", tz="UTC")),
        }
    )
    parquet = workdir / "docs.parquet"
    pq.write_table(table, parquet)
    jsonl = workdir / "docs.jsonl"
    with open(jsonl, "w") as f:
        for row in table.to_pylist():
            doc = {k: v for k, v in row.items() if k != "id" and v is not None}
            doc["seen"] = doc["seen"].isoformat()
            f.write(json.dumps({"id": row["id"], "doc": doc}, separators=(",", ":")) + "\n")
    return parquet, jsonl


# --------------------------------------------------------------------------------------------
# 1. Write


def wait_persisted(daemon: Daemon, router: Router, total: int, timeout: float) -> float:
    """Until the daemon's persisted snapshot covers `total` seqnos; the wall time then."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=10) as client:
        while True:
            persisted = daemon.stats(client)["persisted"]["seqno_sum"]
            if persisted >= total:
                return time.time()
            router.check_alive()
            daemon.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"persisted {persisted} of {total} within {timeout} s")
            time.sleep(POLL_S)


def router_cpu(router: Router) -> float:
    """CPU seconds of the router and its children so far."""
    return sum(tree_cpu(router.process))


def spark_cpu() -> tuple[float, float]:
    """CPU seconds so far of this process's Spark JVM itself, and of the Python workers under it
    (live, and those reaped)."""
    jvm = python = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            if "java" not in child.name():
                continue
            own = child.cpu_times()
            jvm += own.user + own.system
            for worker in child.children(recursive=True):
                times = worker.cpu_times()
                python += times.user + times.system + times.children_user + times.children_system
        except psutil.Error:
            continue
    return jvm, python


def jsonl_run(jsonl: Path, n: int, run_dir: Path, timeout: float) -> dict[str, Any]:
    daemon = Daemon.in_workdir(run_dir / "daemon").start()
    router = None
    try:
        started = time.time()
        router = Router(
            run_dir / "router.log", "--state", str(run_dir / "state"), "--jsonl", str(jsonl),
            "--to", daemon.address,
        )  # fmt: skip
        done = wait_persisted(daemon, router, n, timeout)
        cpu = router_cpu(router)
        router.stop_cleanly()
        daemon.stop_cleanly()
    finally:
        if router is not None:
            router.kill()
        daemon.kill()
    seconds = done - started
    return {
        "seconds": round(seconds, 3),
        "per_s": round(n / seconds),
        "router_cpu_us": cpu / n * 1e6,
    }


def writer_run(
    spark: Any, parquet: Path, n: int, run_dir: Path, timeout: float, keep_daemon: bool
) -> tuple[dict[str, Any], Daemon | None]:
    daemon = Daemon.in_workdir(run_dir / "daemon").start()
    router = Router(
        run_dir / "router.log", "--state", str(run_dir / "state"), "--http", "127.0.0.1:0",
        "--to", daemon.address,
    )  # fmt: skip
    try:
        url = router.wait_url()
        router.wait_log(r"connected; resuming")
        # Warm the session's Python workers up with a few documents no index holds.
        warm = spark.createDataFrame([(f"warm{i}", i) for i in range(WARM)], "id string, w int")
        warm.write.format("indexer").mode("append").option("router", url).option("id", "id").save()
        cpu_before = router_cpu(router)
        assert daemon.proc is not None
        daemon_process = psutil.Process(daemon.proc.pid)
        daemon_before = sum(tree_cpu(daemon_process))
        jvm_before, python_before = spark_cpu()
        started = time.time()
        (
            spark.read.parquet(str(parquet))
            .write.format("indexer")
            .option("router", url)
            .option("id", "id")
            .mode("append")
            .save()
        )
        saved = time.time()
        jvm_after, python_after = spark_cpu()
        done = wait_persisted(daemon, router, n + WARM, timeout)
        cpu = router_cpu(router) - cpu_before
        daemon_cpu = sum(tree_cpu(daemon_process)) - daemon_before
        bulk = router.stats()["bulk"]
        router.stop_cleanly()
        if not keep_daemon:
            daemon.stop_cleanly()
    except BaseException:
        daemon.kill()
        raise
    finally:
        router.kill()
        if not keep_daemon:
            daemon.kill()
    if bulk["appended"] != n + WARM:
        raise RuntimeError(f"the writer appended {bulk['appended'] - WARM} of {n} documents")
    seconds = done - started
    result = {
        "seconds": round(seconds, 3),
        "save_s": round(saved - started, 3),
        "per_s": round(n / seconds),
        "router_cpu_us": round(cpu / n * 1e6, 1),
        "daemon_cpu_us": round(daemon_cpu / n * 1e6, 1),
        "spark_jvm_cpu_us": round((jvm_after - jvm_before) / n * 1e6, 1),
        "spark_python_cpu_us": round((python_after - python_before) / n * 1e6, 1),
        "bulk_requests": bulk["requests"] - 1,
    }
    return result, daemon if keep_daemon else None


# --------------------------------------------------------------------------------------------
# 2. Read


def best(repeats: int, run: Any) -> tuple[float, list[float]]:
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - started)
    return min(seconds), seconds


def read_runs(spark: Any, daemon: Daemon, n: int, workdir: Path) -> dict[str, Any]:
    frame = spark.read.format("indexer").option("url", daemon.url).option("index", "by_city")
    rows = frame.load().count()  # the first read warms the Python workers up
    if rows != n:
        raise RuntimeError(f"by_city holds {rows} entries, not {n}")
    partitions = frame.load().rdd.getNumPartitions()
    count_s, counts = best(3, lambda: frame.load().count())
    out = workdir / "read.parquet"
    write_s, writes = best(2, lambda: frame.load().write.mode("overwrite").parquet(str(out)))
    daemon.stop_cleanly()
    with IndexStore(daemon.data_dir, create=False) as store:
        prefix = store.index("by_city").main_prefix

        def bare() -> None:
            for _ in store.db.iterator(prefix=prefix, include_value=False):
                pass

        raw_s, raws = best(3, bare)
        keys = sum(1 for _ in store.db.iterator(prefix=prefix, include_value=False))
    return {
        "rows": rows,
        "partitions": partitions,
        "count_per_s": round(rows / count_s),
        "parquet_per_s": round(rows / write_s),
        "raw_keys": keys,
        "raw_per_s": round(keys / raw_s),
        "count_seconds": [round(s, 3) for s in counts],
        "parquet_seconds": [round(s, 3) for s in writes],
        "raw_seconds": [round(s, 3) for s in raws],
    }


# --------------------------------------------------------------------------------------------
# Main


def run(opts: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from indexer.spark import session

    n = opts.documents
    started = time.monotonic()
    parquet, jsonl = make_input(n, opts.seed, workdir)
    say(
        f"input: {n:,} documents, Parquet {parquet.stat().st_size / 2**20:.1f} MiB, JSONL "
        f"{jsonl.stat().st_size / 2**20:.1f} MiB ({time.monotonic() - started:.1f} s, untimed)"
    )
    spark = session("indexer-spark-bench", "local[2]", log_level="ERROR")
    jsonl_runs: list[dict[str, Any]] = []
    writer_runs: list[dict[str, Any]] = []
    last: Daemon | None = None
    try:
        for round_ in range(opts.rounds):
            jsonl_runs.append(jsonl_run(jsonl, n, workdir / f"jsonl{round_}", opts.timeout))
            r = jsonl_runs[-1]
            say(f"round {round_ + 1}: router JSONL {r['per_s']:,} docs/s ({r['seconds']} s, "
                f"router {r['router_cpu_us']:.1f} us/doc)")  # fmt: skip
            final = round_ == opts.rounds - 1
            result, last = writer_run(
                spark, parquet, n, workdir / f"writer{round_}", opts.timeout, final
            )
            writer_runs.append(result)
            say(f"round {round_ + 1}: Spark writer {result['per_s']:,} docs/s "
                f"({result['seconds']} s, save() {result['save_s']} s, {result['bulk_requests']} "
                f"bulks; CPU per document: router {result['router_cpu_us']:.1f} us, daemon "
                f"{result['daemon_cpu_us']:.1f}, Spark's JVM {result['spark_jvm_cpu_us']:.1f}, "
                f"Spark's Python workers {result['spark_python_cpu_us']:.1f})")  # fmt: skip
            if round_ == 0:
                shutil.rmtree(workdir / "jsonl0", ignore_errors=True)
        assert last is not None
        read = read_runs(spark, last, n, workdir)
    finally:
        spark.stop()
        if last is not None:
            last.kill()
    jsonl_best = max(r["per_s"] for r in jsonl_runs)
    writer_best = max(r["per_s"] for r in writer_runs)
    write_ratio = ratio(writer_best, jsonl_best)
    say(
        f"write: Spark writer {writer_best:,} docs/s, router JSONL {jsonl_best:,} docs/s: "
        f"{write_ratio}x (target {WRITE_TARGET}x); spread writer "
        f"{min(r['per_s'] for r in writer_runs):,}-{writer_best:,}, JSONL "
        f"{min(r['per_s'] for r in jsonl_runs):,}-{jsonl_best:,}"
    )
    say(
        f"read ({read['rows']:,} entries, {read['partitions']} partitions): count() "
        f"{read['count_per_s']:,} rows/s (target {COUNT_TARGET:,}), Parquet write "
        f"{read['parquet_per_s']:,} rows/s; raw plyvel iterator {read['raw_per_s']:,} keys/s: "
        f"{ratio(read['count_per_s'], read['raw_per_s'])}x and "
        f"{ratio(read['parquet_per_s'], read['raw_per_s'])}x"
    )
    return {
        "documents": n,
        "seed": opts.seed,
        "rounds": opts.rounds,
        "jsonl_per_s": jsonl_best,
        "writer_per_s": writer_best,
        "ratio_writer_vs_jsonl": write_ratio,
        "jsonl_runs": jsonl_runs,
        "writer_runs": writer_runs,
        "count_per_s": read["count_per_s"],
        "parquet_per_s": read["parquet_per_s"],
        "raw_per_s": read["raw_per_s"],
        "ratio_count_vs_raw": ratio(read["count_per_s"], read["raw_per_s"]),
        "ratio_parquet_vs_raw": ratio(read["parquet_per_s"], read["raw_per_s"]),
        "read": read,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--documents", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--rounds", type=int, default=2, help="write rounds, interleaved")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    opts = parser.parse_args()
    return in_workdir("indexer-bench-spark-", opts.keep, lambda w: run(opts, w))


if __name__ == "__main__":
    raise SystemExit(main())
