"""The Spark writer (`df.write.format("indexer")`) through a real router into a real daemon,
checked against a model of the documents the rows stand for.

One SparkSession (local[2,4]: a failed task is tried up to 4 times), one daemon and one
router serve the whole module. The example job runs last: it stops the session when it ends.
"""

from __future__ import annotations

import datetime
import json
import math
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from examples import spark_load
from indexer.router.documents import Document
from indexer.spark import error_message
from tests.e2e.conftest import scan
from tests.harness import Daemon, Etcd, Router, free_port, http, indexer_command, model
from tests.spark.stream_driver import shared_session

pytestmark = [pytest.mark.spark, pytest.mark.e2e]

UTC = datetime.UTC
INDEXES = {
    "by_city": ["address.city", "age"],
    "by_seen": ["seen"],
    "by_tags": ["tags", "age"],
    "by_score": ["score"],
}
SCHEMA = (
    "id string, age int, address struct<city:string, zip:string>, tags array<string>, "
    "seen timestamp, score double, deleted boolean"
)
CITIES = ["Oslo", "Lyon", "Kyiv", None]


@dataclass
class Node:
    daemon: Daemon
    router: Router
    url: str  # the router's API, on a fixed port: a restarted router has the same
    args: tuple[str, ...]  # the router's, for a restart
    log: Path

    def bulk(self) -> dict[str, int]:
        stats: dict[str, int] = http().get(f"{self.url}/stats", timeout=30).json()["bulk"]
        return stats

    def appended(self) -> int:
        """The seqnos in the router's source log (these survive a restart)."""
        stats = http().get(f"{self.url}/stats", timeout=30).json()
        value: int = stats["source"]["high_seqno_sum"]
        return value

    def restart_router(self, down_s: float) -> None:
        """SIGKILL the router; start it again with the same state and port after `down_s`."""
        self.router.kill()
        time.sleep(down_s)
        self.router = Router(self.log, *self.args)
        self.router.wait_url()


@pytest.fixture(scope="module")
def spark() -> Iterator[SparkSession]:
    spark = shared_session()  # local[2,4]
    zone = spark.conf.get("spark.sql.session.timeZone")
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    yield spark
    if spark.sparkContext._jsc is not None:  # the example job stopped it
        spark.conf.set("spark.sql.session.timeZone", zone)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    tmp = tmp_path_factory.mktemp("writer")
    indexes = "".join(f"[indexes.{n}]\nkeys = {keys!r}\n" for n, keys in INDEXES.items())
    daemon = Daemon.in_workdir(tmp / "daemon", indexes.replace("'", '"')).start()
    args = (
        "--state", str(tmp / "state"), "--to", daemon.address,
        "--http", f"127.0.0.1:{free_port()}",
    )  # fmt: skip
    router = Router(tmp / "router.log", *args)
    url = router.wait_url()
    router.wait_log(r"connected; resuming")
    node = Node(daemon, router, url, args, tmp / "router.log")
    yield node
    node.router.kill()
    daemon.kill()


def plain(value: Any) -> Any:
    """A Python value of a row as the document holds it (written here apart from the writer)."""
    if isinstance(value, datetime.datetime):
        return value.astimezone(UTC).isoformat()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [None if v is None else plain(v) for v in value]
    return value


def expected(row: dict[str, Any]) -> Document:
    if row.get("deleted"):
        return Document(row["id"], None)
    body = {k: plain(v) for k, v in row.items() if k not in ("id", "deleted") and v is not None}
    return Document(row["id"], body)


def people(ids: range, seed: int, deletes: int = 0) -> list[dict[str, Any]]:
    rows = []
    for n in ids:
        rows.append(
            {
                "id": f"p{n}",
                "age": None if (n + seed) % 11 == 0 else (n * 7 + seed) % 90,
                "address": None
                if (n + seed) % 13 == 0
                else {"city": CITIES[(n + seed) % 4], "zip": None if n % 2 else f"{n:05}"},
                "tags": [f"t{(n + seed) % 5}", None, f"t{n % 3}"][: (n + seed) % 4] or None,
                "seen": datetime.datetime(2025, 1, 1, tzinfo=UTC)
                + datetime.timedelta(seconds=n * 97 + seed, microseconds=n),
                "score": None if n % 7 == 0 else n / 8 + seed,
                "deleted": n % 10 < deletes,
            }
        )
    return rows


def write(df: DataFrame, url: str, **options: str) -> None:
    writer = df.write.format("indexer").mode("append").option("router", url)
    for key, value in {"id": "id", **options}.items():
        writer = writer.option(key, value)
    writer.save()


def assert_indexes(node: Node, documents: list[Document]) -> None:
    for name, paths in INDEXES.items():
        # consistency=any: wait=visible made everything readable before save() returned
        assert scan(node.daemon, name, "any") == model(documents, paths), name


def test_parquet_with_nulls_structs_arrays_and_timestamps_equals_the_model(
    spark: SparkSession, node: Node, tmp_path: Path
) -> None:
    first = people(range(600), 1)
    second = people(range(400, 800), 2, deletes=3)  # updates, new ones, 30% deletes
    documents: list[Document] = []
    for number, rows in enumerate((first, second)):
        parquet = tmp_path / f"people{number}.parquet"
        spark.createDataFrame(rows, SCHEMA).repartition(3).write.parquet(str(parquet))
        write(spark.read.parquet(str(parquet)), node.url, delete="deleted", wait="visible")
        documents += [expected(row) for row in rows]
        assert_indexes(node, documents)
    assert sum(1 for d in documents if d.body is None) == 120
    seen = scan(node.daemon, "by_seen", "any")[0]["key"][0]
    assert isinstance(seen, str) and seen.startswith("2025-01-01T") and seen.endswith("+00:00")


def test_versions_of_a_document_in_one_task_keep_their_order_across_bulks(
    spark: SparkSession, node: Node
) -> None:
    # A task builds its next bulk while the one before is on its way: five versions of each
    # document, in bulks of 70 rows, must still end with the last version.
    rows = [
        {**row, "id": "v" + row["id"]}
        for version in range(5)
        for row in people(range(100), version, deletes=1)
    ]
    df = spark.createDataFrame(rows, SCHEMA).coalesce(1)
    write(df, node.url, delete="deleted", wait="visible", batch_rows="70")
    documents = [expected(row) for row in rows]
    for name, paths in INDEXES.items():
        got = [e for e in scan(node.daemon, name, "any") if e["id"].startswith("vp")]
        assert got == model(documents, paths), name


def test_a_task_failed_by_a_router_restart_runs_again_and_the_result_is_the_same(
    spark: SparkSession, node: Node
) -> None:
    """The router is killed once the load has begun and comes back 1.2 s later on the same
    port. The writer gives up on it after its 1 s timeout, which fails the task; Spark runs the
    task again, which sends its rows again (new seqnos, the same documents)."""
    before = node.appended()
    rows = 20_000
    df = spark.range(rows, numPartitions=1).select(
        F.concat(F.lit("r"), "id").alias("id"),
        (F.col("id") % 50).cast("int").alias("age"),
        F.struct(F.lit("Lyon").alias("city")).alias("address"),
    )
    failures: list[BaseException] = []

    def restart_once_loading() -> None:
        try:
            deadline = time.monotonic() + 60
            while node.appended() == before:
                assert time.monotonic() < deadline, "the load did not begin"
                time.sleep(0.01)
            node.restart_router(1.2)
        except BaseException as exc:  # reported below
            failures.append(exc)

    restarter = threading.Thread(target=restart_once_loading)
    restarter.start()
    try:
        write(df, node.url, batch_rows="200", timeout="1")
    finally:
        restarter.join()
    assert not failures, failures
    resent = node.appended() - before - rows
    assert resent > 0, "no row was sent twice: the task did not run again"
    want = [Document(f"r{n}", {"age": n % 50, "address": {"city": "Lyon"}}) for n in range(rows)]
    wait_equal_index(node, "by_city", "r", model(want, INDEXES["by_city"]))


def wait_equal_index(node: Node, name: str, prefix: str, want: list[dict[str, Any]]) -> None:
    """Until the index's entries of ids starting with `prefix` are `want` (request_plus)."""
    deadline = time.monotonic() + 60
    while True:
        got = [e for e in scan(node.daemon, name) if e["id"].startswith(prefix)]
        if got == want:
            return
        assert time.monotonic() < deadline, (len(got), len(want))
        time.sleep(0.2)


def test_a_bad_row_fails_the_job_with_its_id_and_reason_unless_skipped(
    spark: SparkSession, node: Node, tmp_path: Path
) -> None:
    rows = [(f"j{n}", f'{{"age": {n}, "address": {{"city": "Rome"}}}}') for n in range(200)]
    rows[50] = ("j50", '{"age": NaN}')  # the router refuses it
    rows[120] = (None, '{"age": 1}')  # no id: the writer refuses it
    df = spark.createDataFrame(rows, "key string, body string").repartition(2)
    with pytest.raises(Exception) as failed:
        write(df, node.url, id="key", doc="body")
    message = error_message(failed.value)
    assert "row with id" in message and ("'j50'" in message or "None" in message), message
    assert "NaN" in message or "is null" in message, message
    # Named by its row in its task (which of the two partitions holds it is Spark's choice),
    # never by a line of the writer's own request.
    assert re.search(r"partition [01], row \d+: row with id", message), message
    assert "line:" not in message, message
    failed_before = node.bulk()["failed"]
    report = tmp_path / "report.json"
    write(df, node.url, id="key", doc="body", on_error="skip", wait="visible", report=str(report))
    assert node.bulk()["failed"] == failed_before + 1  # the NaN line; the null id never left
    # The job's figures, in a file written before save() returned.
    figures = json.loads(report.read_text())
    assert figures["skipped"] == 2 and figures["documents"] == 198, figures
    assert any("'j50'" in line for line in figures["skipped_sample"]), figures
    good = [
        Document(f"j{n}", {"age": n, "address": {"city": "Rome"}})
        for n in range(200)
        if n not in (50, 120)
    ]
    got = [e for e in scan(node.daemon, "by_city", "any") if e["id"].startswith("j")]
    assert got == model(good, INDEXES["by_city"])
    nan = spark.createDataFrame([("k1", math.nan)], "id string, score double")
    with pytest.raises(Exception) as failed:
        write(nan, node.url)
    assert "NaN and Infinity have no JSON form" in error_message(failed.value)


def test_a_write_and_a_read_through_a_cluster_in_etcd_equal_the_model(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Two nodes with a replica of each vbucket, on etcd: the writer posts to a router that
    follows the map, and a read with the `cluster` option gets every row once."""
    etcd = Etcd().start()
    url = etcd.url("indexer/writer")
    indexes = "".join(f"[indexes.{n}]\nkeys = {keys!r}\n" for n, keys in INDEXES.items())
    nodes = {n: Daemon.in_workdir(tmp_path / n, indexes.replace("'", '"')) for n in ("a", "b")}
    router = None
    try:
        lines = ["num_vbuckets = 1024"]
        for name, daemon in nodes.items():
            daemon.port, daemon.http_port = free_port(), free_port()
            vbuckets = '["0-1023"]' if name == "a" else "[]"
            lines += [
                f"[nodes.{name}]",
                f'feed = "{daemon.address}"',
                f'http = "127.0.0.1:{daemon.http_port}"',
                f"vbuckets = {vbuckets}",
            ]
        start = tmp_path / "cluster.toml"
        start.write_text("\n".join(lines) + "\n")

        def cli(*args: str) -> None:
            done = subprocess.run(
                indexer_command(*args), capture_output=True, text=True, timeout=120
            )
            assert done.returncode == 0, done.stderr

        cli("cluster", "init", "--cluster", url, "--from", str(start))
        for name, daemon in nodes.items():
            daemon.args = ["--cluster", url, "--node", name]
            daemon.start()
        cli("cluster", "rebalance", "--cluster", url, "--replicas", "1")
        router = Router(
            tmp_path / "router.log", "--state", str(tmp_path / "state"), "--cluster", url,
            "--http", f"127.0.0.1:{free_port()}",
        )  # fmt: skip
        router_url = router.wait_url()
        router.wait_log(r"connected; resuming", count=2)
        rows = people(range(0, 3000), 5, deletes=1)
        write(spark.createDataFrame(rows), router_url, delete="deleted", wait="visible")
        documents = [expected(row) for row in rows]
        for name, paths in INDEXES.items():
            read = spark.read.format("indexer").option("cluster", url).option("index", name)
            read = read.option("snapshot", "stable")  # what wait=visible made readable
            got = sorted(row["id"] for row in read.load().select("id").collect())
            assert got == sorted(r["id"] for r in model(documents, paths)), name
    finally:
        if router is not None:
            router.kill()
        for daemon in nodes.values():
            daemon.kill()
        etcd.stop()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"id": ""}, "give the id column"),
        ({"id": "nope"}, "id: no column 'nope'"),
        ({"router": "127.0.0.1:1"}, "is not an http:// or https:// URL"),
        ({"routing": "x"}, "unknown write option 'routing'"),
        ({"wait": "never"}, 'wait: "persisted" or "visible"'),
        ({"router": "http://127.0.0.1:1"}, "cannot reach the indexer at http://127.0.0.1:1"),
    ],
)
def test_bad_options_fail_with_one_line(
    spark: SparkSession, node: Node, options: dict[str, str], message: str
) -> None:
    df = spark.createDataFrame([("a", 1)], "id string, age int")
    writer = df.write.format("indexer").mode("append").option("router", node.url).option("id", "id")
    for key, value in options.items():
        writer = writer.option(key, value)
    with pytest.raises(Exception) as failed:
        writer.save()
    assert message in error_message(failed.value)


def test_overwrite_is_refused(spark: SparkSession, node: Node) -> None:
    df = spark.createDataFrame([("a", 1)], "id string, age int")
    with pytest.raises(Exception) as failed:
        df.write.format("indexer").mode("overwrite").option("router", node.url).option(
            "id", "id"
        ).save()
    assert 'use .mode("append")' in error_message(failed.value)


def test_a_stream_writes_each_micro_batch_and_a_replayed_batch_changes_nothing_twice(
    spark: SparkSession, node: Node, tmp_path: Path
) -> None:
    incoming, checkpoint = tmp_path / "incoming", tmp_path / "checkpoint"
    incoming.mkdir()
    schema = "id string, age int, city string, deleted boolean"
    rows: list[dict[str, Any]] = []

    def arrive(number: int, ids: range, deleted: bool = False) -> None:
        batch = [
            {"id": f"s{n}", "age": (n * 3 + number) % 90, "city": CITIES[n % 3], "deleted": deleted}
            for n in ids
        ]
        (incoming / f"{number}.json").write_text("".join(json.dumps(r) + "\n" for r in batch))
        # The documents as the query shapes them: the city inside an address.
        rows.extend({**r, "address": {"city": r.pop("city")}} for r in batch)

    def run() -> None:
        query = (
            spark.readStream.schema(schema)
            .json(str(incoming))
            .select("id", "age", F.struct(F.col("city").alias("city")).alias("address"), "deleted")
            .writeStream.format("indexer")
            .option("router", node.url)
            .option("id", "id")
            .option("delete", "deleted")
            .option("wait", "visible")
            .option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(300)
        assert query.exception() is None, query.exception()

    def want() -> list[dict[str, Any]]:
        documents = [expected(r) for r in rows]
        return model(documents, INDEXES["by_city"])

    arrive(0, range(300))
    run()
    wait_equal_index(node, "by_city", "s", want())
    arrive(1, range(200, 500))
    arrive(2, range(0, 100), deleted=True)
    run()
    wait_equal_index(node, "by_city", "s", want())
    # The last micro-batch runs again, as after a driver that died before recording its
    # commit: its rows are sent again and the index ends the same.
    commits = sorted(
        (p for p in (checkpoint / "commits").iterdir() if p.name.isdigit()),
        key=lambda p: int(p.name),
    )
    commits[-1].unlink()
    (checkpoint / "commits" / f".{commits[-1].name}.crc").unlink(missing_ok=True)
    before = node.appended()
    run()
    assert node.appended() > before, "the batch was not written again"
    wait_equal_index(node, "by_city", "s", want())


def test_the_example_job_loads_a_parquet_file(
    spark: SparkSession, node: Node, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """examples/spark_load.py's main, here: its session() finds the process's session, which
    it leaves up for the next file's tests (stop=False)."""
    rows = people(range(10_000, 10_500), 3, deletes=1)
    parquet = tmp_path / "load.parquet"
    spark.createDataFrame(rows, SCHEMA).write.parquet(str(parquet))
    capsys.readouterr()
    code = spark_load.main(
        [
            "--parquet", str(parquet), "--router", node.url, "--id", "id",
            "--delete", "deleted", "--wait", "visible", "--master", "local[1]",
        ],
        stop=False,
    )  # fmt: skip
    printed = capsys.readouterr()
    assert code == 0, printed.err[-3000:]
    assert f"loaded 500 rows of {parquet}" in printed.out
    want = model([expected(row) for row in rows], INDEXES["by_city"])
    ours = {f"p{n}" for n in range(10_000, 10_500)}
    assert [e for e in scan(node.daemon, "by_city", "any") if e["id"] in ours] == want
