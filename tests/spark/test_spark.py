"""The Spark data source against a real daemon fed by the real router, checked against a model.

The test process's SparkSession and one daemon serve the whole module. The tests
run in file order: the offline test, after the online ones, stops the daemon to read its data
directory. The cluster tests then start two daemons sharing the vbuckets through a cluster map,
fed by one router. The last tests need neither Spark nor a daemon.
"""

from __future__ import annotations

import http.server
import json
import operator
import random
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.datasource import (
    EqualTo,
    Filter,
    GreaterThan,
    GreaterThanOrEqual,
    IsNotNull,
    LessThan,
    LessThanOrEqual,
)

from indexer.changes import decode_cluster_token
from indexer.cluster.scan import row_order
from indexer.keys import encode_key
from indexer.router import Workload, generate
from indexer.router.documents import Document, vbucket_of
from indexer.spark import (
    ClusterPin,
    Column,
    IndexerDataSource,
    IndexerPartition,
    IndexerSourceError,
    Pin,
    SourceOptions,
    accepts,
    apply_filters,
    convert,
    error_message,
    filter_range,
    offline_snapshot,
    pin_snapshot,
    pinned,
    pinned_cluster,
    pushdown_default,
    read_plan_per_scan,
    register,
    release,
    share_partitions,
)
from indexer.spark.source import partitions_for
from tests.e2e.conftest import (
    INDEXES,
    Daemon,
    Router,
    free_port,
    indexer_command,
    model,
    run_feed,
    wait_equal,
    write_config,
    write_jsonl,
)
from tests.e2e.conftest import (
    http as shared_client,
)
from tests.e2e.test_gsi_keys import INDEXES as GSI_INDEXES
from tests.e2e.test_gsi_keys import documents as gsi_documents
from tests.harness import Etcd
from tests.spark.stream_driver import shared_session
from tests.spark.test_stream import replayed, run_query

pytestmark = [pytest.mark.spark, pytest.mark.e2e]


@dataclass
class Node:
    """The module's daemon and every document fed to it so far, in feed order."""

    daemon: Daemon
    data_dir: Path
    tmp: Path
    documents: list[Document] = field(default_factory=list)

    def feed(self, documents: list[Document]) -> None:
        """Feed more documents: the feed skips what the daemon persisted, so give it them all."""
        self.documents = self.documents + documents
        jsonl = write_jsonl(self.tmp / f"docs{len(self.documents)}.jsonl", self.documents)
        fed = run_feed(self.daemon, jsonl)
        assert fed.returncode == 0, fed.stderr


@pytest.fixture(scope="module")
def spark() -> SparkSession:
    return shared_session()  # the test process's: left running for the modules after


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    tmp = tmp_path_factory.mktemp("spark")
    port = free_port()
    data_dir = tmp / "data"
    daemon = Daemon(write_config(tmp / "indexer.toml", data_dir, port), tmp / "daemon.log", port)
    node = Node(daemon.start(), data_dir, tmp)
    node.feed(list(generate(Workload(10_000, 2_500, 0.1, 21))))
    yield node
    if daemon.running:
        daemon.kill()


def read(spark: SparkSession, schema: str | None = None, **options: Any) -> DataFrame:
    """A DataFrame of the source; without a schema or columns option, of JSON text columns
    (which tell MISSING from null, as the model does). Typed reads ask columns="typed"."""
    if schema is None:
        options.setdefault("columns", "json")
    reader = spark.read.format("indexer")
    if schema is not None:
        reader = reader.schema(schema)
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load()


def as_entries(df: DataFrame, paths: list[str]) -> list[dict[str, Any]]:
    """Rows of the default schema (JSON text, null for MISSING) as `indexer dump` prints them."""
    out = []
    for row in df.collect():
        texts = list(row)[1:]
        entry: dict[str, Any] = {
            "key": [None if t is None else json.loads(t) for t in texts],
            "id": row["id"],
        }
        missing = [i for i, t in enumerate(texts) if t is None]
        if missing:
            entry["missing"] = missing
        out.append(entry)
    assert df.columns == ["id", *(p.replace(".", "_") for p in paths)]
    return out


def ndjson_scan(url: str, index: str, **params: str) -> list[dict[str, Any]]:
    response = shared_client().get(f"{url}/indexes/{index}/scan", params=params, timeout=60)
    assert response.status_code == 200, response.text
    return [json.loads(line) for line in response.text.splitlines() if line]


def filtered_by_spark(df: DataFrame) -> bool:
    """True when the physical plan filters rows after the scan (Spark kept a filter)."""
    plan = str(df._jdf.queryExecution().executedPlan().toString())
    return any(line.lstrip(" +-:*()0123456789").startswith("Filter ") for line in plan.splitlines())


def as_double(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def as_int(value: Any) -> int | None:
    number = as_double(value)
    if number is None or not number.is_integer() or not -(2**31) <= number < 2**31:
        return None
    return int(number)


def test_dataframe_equals_the_ndjson_scan_and_the_model(spark: SparkSession, node: Node) -> None:
    url = node.daemon.url
    for name, paths in INDEXES.items():
        with pinned(url) as pin:
            df = read(spark, url=url, index=name, pin=pin.id, partitions=3)
            assert df.rdd.getNumPartitions() == 3
            got = as_entries(df, paths)
            scanned = ndjson_scan(url, name, pin=pin.id)
        assert pin.seqno_sum == len(node.documents)
        want = model(node.documents, paths)
        assert len(got) == len(want) > 1000, name
        assert got == scanned == want, name
    # Without a partitions option: the cores the daemon scans with, halved as it shares this
    # machine with Spark's tasks, at most the session's parallelism (local[2]).
    with pinned(url) as probe:
        cores = probe.cores
    assert cores is not None and cores >= 1
    want_parts = max(1, min(2, cores // 2))
    assert read(spark, url=url, index="by_age").rdd.getNumPartitions() == want_parts
    with pinned(url) as given:  # a pin of the caller's: the session's parallelism
        df = read(spark, url=url, index="by_age", pin=given.id)
        assert df.rdd.getNumPartitions() == 2


def test_typed_columns_by_default_equal_the_json_text_read_converted(
    spark: SparkSession, node: Node
) -> None:
    url = node.daemon.url
    for name, paths in INDEXES.items():
        answer = shared_client().get(f"{url}/indexes/{name}/types", timeout=60).json()
        with pinned(url) as pin:
            typed = read(spark, url=url, index=name, pin=pin.id, columns="typed")
            texts = read(spark, url=url, index=name, pin=pin.id, columns="json")
            kinds = {
                f.name: f.metadata.get("indexer.inferred", "json") for f in typed.schema.fields
            }
            assert [kinds[c] for c in typed.columns[1:]] == answer["columns"], answer
            got = [r.asDict() for r in typed.collect()]
            want = [
                {
                    k: v if k == "id" or v is None else convert(kinds[k], json.loads(v))
                    for k, v in r.asDict().items()
                }
                for r in texts.collect()
            ]
        assert len(got) == len(model(node.documents, paths)) and got == want, name
    # by_age holds numbers (and nulls): a DOUBLE column, as its types say.
    ages = shared_client().get(f"{url}/indexes/by_age/types", timeout=60).json()
    assert set(ages["types"][0]) - {"null", "missing"} <= {"integer", "number"}
    by_age = spark.read.format("indexer").option("url", url).option("index", "by_age").load()
    assert dict(by_age.dtypes)["age"] in ("double", "bigint")  # typed is the default


def test_null_and_missing_are_null_in_typed_columns_and_apart_in_json_text_columns(
    spark: SparkSession, node: Node
) -> None:
    """The one rule (docs/spark.md): a typed column (BIGINT, DOUBLE, BOOLEAN, STRING of
    strings) reads JSON null and MISSING both as NULL; a column of JSON text (every column with
    columns=json, and one whose position holds several types) reads null as 'null' and MISSING
    as NULL."""
    node.feed(
        [
            Document("nulls-a", {"address": {"city": "Zz"}, "age": None}),
            Document("nulls-b", {"address": {"city": "Zz"}}),  # age MISSING
            Document("nulls-c", {"address": {"city": None}, "age": 4}),
        ]
    )
    url = node.daemon.url

    def rows(columns: str) -> dict[str, tuple[Any, Any]]:
        df = read(spark, url=url, index="by_city", columns=columns)
        picked = df.where(df.id.startswith("nulls-")).collect()
        return {r.id: (r.address_city, r.age) for r in picked}

    typed = rows("typed")
    assert typed == {"nulls-a": ("Zz", None), "nulls-b": ("Zz", None), "nulls-c": (None, 4)}
    assert rows("json") == {
        "nulls-a": ('"Zz"', "null"),
        "nulls-b": ('"Zz"', None),
        "nulls-c": ("null", "4"),
    }


def test_a_user_schema_converts_values_and_those_that_do_not_fit_are_null(
    spark: SparkSession, node: Node
) -> None:
    url = node.daemon.url
    want = model(node.documents, INDEXES["by_city"])
    df = read(spark, "age INT, id STRING, address_city STRING", url=url, index="by_city")
    rows = [tuple(r) for r in df.collect()]
    expected = [
        (as_int(e["key"][1]), e["id"], e["key"][0] if isinstance(e["key"][0], str) else None)
        for e in want
    ]
    assert rows == expected
    fractional = [e for e in want if isinstance(e["key"][1], float) and e["key"][1] % 1]
    nulls = [e for e in want if e["key"][1] is None]
    assert fractional and nulls  # both kinds of non-fitting age are there, and read as null
    ages = read(spark, "age DOUBLE, id STRING", url=url, index="by_age").collect()
    assert [(r.age, r.id) for r in ages] == [
        (as_double(e["key"][0]), e["id"]) for e in model(node.documents, ["age"])
    ]
    with pytest.raises(Exception) as raised:
        read(spark, "nope STRING", url=url, index="by_age").collect()
    assert error_message(raised.value) == "no column 'nope' in the index: its columns are id, age"


def test_pushed_down_filters_give_the_rows_of_a_filter_after_the_read(
    spark: SparkSession, node: Node
) -> None:
    url = node.daemon.url
    typed = "age DOUBLE, id STRING"
    # Each query on its own DataFrame: Spark 4.3 serves a DataFrame's last pushed plan to all.
    everything = [
        tuple(r) for r in read(spark, typed, url=url, index="by_age", pushdown="true").collect()
    ]
    ranged = read(spark, typed, url=url, index="by_age", pushdown="true").filter(
        "age >= 30 AND age < 40.5"
    )
    assert not filtered_by_spark(ranged)  # Spark handed both bounds to the source
    assert [tuple(r) for r in ranged.collect()] == [
        r for r in everything if r[0] is not None and 30 <= r[0] < 40.5
    ]
    # JSON text (the default schema): equality is pushed, a range is left to Spark.
    cities = read(spark, url=url, index="by_city", pushdown="true").collect()
    paris = read(spark, url=url, index="by_city", pushdown="true").filter(
        "address_city = '\"Paris\"'"
    )
    assert not filtered_by_spark(paris)
    assert paris.collect() == [r for r in cities if r.address_city == '"Paris"']
    after = read(spark, url=url, index="by_city", pushdown="true").filter("address_city > '\"P'")
    assert filtered_by_spark(after)
    assert after.collect() == [r for r in cities if r.address_city > '"P']
    # Typed strings: ranges are pushed and compare like Spark.
    named = "address_city STRING, id STRING"
    middle = read(spark, named, url=url, index="by_city", pushdown="true").filter(
        "address_city > 'Lima' AND address_city <= 'Rome'"
    )
    assert not filtered_by_spark(middle)
    values = [(json.loads(r.address_city), r.id) for r in cities]
    assert [r.id for r in middle.collect()] == [
        i for v, i in values if isinstance(v, str) and "Lima" < v <= "Rome"
    ]
    # The partitions the source plans cover the pushed range only, and read exactly its rows.
    schema = read(spark, typed, url=url, index="by_age", pushdown="true").schema
    options = {"url": url, "index": "by_age", "partitions": "4", "pushdown": "true"}
    reader = IndexerDataSource(options).reader(schema)
    on_id = GreaterThan(("id",), "doc")
    left = list(
        reader.pushFilters([GreaterThanOrEqual(("age",), 30.0), LessThan(("age",), 40.5), on_id])
    )
    assert left == [on_id]
    parts = [p for p in reader.partitions() if isinstance(p, IndexerPartition)]
    try:
        assert parts[0].start is not None and parts[-1].stop is not None
        read_back = [
            tuple(row)
            for p in parts
            for batch in reader.read(p)
            for row in zip(*batch.to_pydict().values(), strict=True)
        ]
    finally:
        release(url, str(parts[0].pin))
    assert read_back == [tuple(r) for r in ranged.collect()]


def test_a_pinned_snapshot_is_unchanged_by_writes_during_the_read(
    spark: SparkSession, node: Node
) -> None:
    url = node.daemon.url
    before = node.documents
    planned = read(spark, url=url, index="by_age", partitions=3)
    assert planned.count() == len(model(before, ["age"]))  # the first action pins and plans
    with pinned(url) as pin:
        explicit = read(spark, url=url, index="by_city", pin=pin.id)
        first = explicit.collect()
        # Updates, deletes and new documents, persisted before the reads go on.
        node.feed(list(generate(Workload(6_000, 8_000, 0.3, 22))))
        assert as_entries(planned, ["age"]) == model(before, ["age"])  # the same snapshot
        assert read(spark, url=url, index="by_city", pin=pin.id).collect() == first
    latest = as_entries(read(spark, url=url, index="by_age"), ["age"])
    assert latest == model(node.documents, ["age"]) != model(before, ["age"])
    # at_plus: a snapshot holding at least the seqnos given, one per vbucket.
    seqnos = shared_client().get(url + "/snapshots").json()["persisted"]["seqnos"]
    vector = json.dumps({str(vb): s for vb, s in enumerate(seqnos) if s})
    at_plus = read(spark, url=url, index="by_city", at_plus=vector)
    assert as_entries(at_plus, INDEXES["by_city"]) == model(node.documents, INDEXES["by_city"])


# Queries run one after the other on one DataFrame (None: the DataFrame itself).
ORDERS: dict[str, list[str | None]] = {
    "filtered, whole": ["age IS NOT NULL", None],
    "whole, filtered, whole": [None, "age < 30", None],
    "two filters, whole": ["age < 30", "age >= 30", None],
}


def counts_in_every_order(load: Callable[[], DataFrame]) -> dict[str, list[int]]:
    """The counts of each sequence of ORDERS, of a union and of a query planned but never run,
    each on its own DataFrame from `load`."""
    out = {}
    for name, queries in ORDERS.items():
        df = load()
        out[name] = [df.count() if q is None else df.filter(q).count() for q in queries]
    df = load()
    out["filtered union whole"] = [df.filter("age < 30").union(df).count()]
    df = load()
    filtered_by_spark(df.filter("age < 30"))  # plans the filtered query (pushFilters) only
    out["planned filter, whole"] = [df.count()]
    return out


def age_counts(node: Node) -> dict[str | None, int]:
    ages = [as_double(e["key"][0]) for e in model(node.documents, ["age"])]
    known = [a for a in ages if a is not None]
    return {
        None: len(ages),
        "age IS NOT NULL": len(known),
        "age < 30": sum(1 for a in known if a < 30),
        "age >= 30": sum(1 for a in known if a >= 30),
    }


def test_by_default_every_query_on_a_dataframe_gets_all_its_rows_in_any_order(
    spark: SparkSession, node: Node
) -> None:
    url, typed = node.daemon.url, "age DOUBLE, id STRING"
    want = age_counts(node)
    assert 0 < want["age < 30"] < want["age IS NOT NULL"] < want[None]
    df = read(spark, typed, url=url, index="by_age")  # pushdown: off on Spark 4.3
    assert filtered_by_spark(df.filter("age < 30")) != read_plan_per_scan(spark)
    got = counts_in_every_order(lambda: read(spark, typed, url=url, index="by_age"))
    assert got == {
        **{name: [want[q] for q in queries] for name, queries in ORDERS.items()},
        "filtered union whole": [want["age < 30"] + want[None]],
        "planned filter, whole": [want[None]],
    }


def test_pushdown_on_spark_4_3_serves_the_last_pushed_plan_to_every_scan_of_a_dataframe(
    spark: SparkSession, node: Node
) -> None:
    """Why pushdown is off by default (docs/spark.md): the counts are those of the filtered
    plan. Once Spark keeps that plan per scan, every count is right and pushdown can be on."""
    url, typed = node.daemon.url, "age DOUBLE, id STRING"
    want = age_counts(node)
    got = counts_in_every_order(
        lambda: read(spark, typed, url=url, index="by_age", pushdown="true")
    )
    young, known, everything = want["age < 30"], want["age IS NOT NULL"], want[None]
    if read_plan_per_scan(spark):
        assert got == {
            **{name: [want[q] for q in queries] for name, queries in ORDERS.items()},
            "filtered union whole": [young + everything],
            "planned filter, whole": [everything],
        }
    else:
        assert got == {
            "filtered, whole": [known, known],
            "whole, filtered, whole": [everything, young, young],
            "two filters, whole": [young, want["age >= 30"], want["age >= 30"]],
            "filtered union whole": [young + young],
            "planned filter, whole": [young],
        }


def test_the_pushdown_default_follows_the_running_spark_and_the_option_wins(
    spark: SparkSession, node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`register` asks the JVM once: off on Spark 4.3.0. Forced to find a Spark that keeps the
    plan per scan, it turns pushdown on, and `.option("pushdown", ...)` still decides."""
    url, typed = node.daemon.url, "age DOUBLE, id STRING"
    source = register(spark)
    assert source.default_pushdown == read_plan_per_scan(spark)
    assert source.default_pushdown_reason.endswith(": on" if source.default_pushdown else ": off")
    if spark.version == "4.3.0":
        assert not source.default_pushdown
        assert "shares one read plan" in source.default_pushdown_reason
    try:
        monkeypatch.setattr("indexer.spark.sessions.read_plan_per_scan", lambda _: True)
        assert register(spark).default_pushdown
        assert not filtered_by_spark(read(spark, typed, url=url, index="by_age").filter("age < 30"))
        df = read(spark, typed, url=url, index="by_age", pushdown="false")
        assert filtered_by_spark(df.filter("age < 30"))
        monkeypatch.setattr("indexer.spark.sessions.read_plan_per_scan", lambda _: False)
        assert not register(spark).default_pushdown
        df = read(spark, typed, url=url, index="by_age", pushdown="true")
        assert not filtered_by_spark(df.filter("age < 30"))
    finally:
        monkeypatch.undo()
        register(spark)


def test_a_session_without_the_pushdown_setting_reads_unless_pushdown_is_asked_for(
    spark: SparkSession, node: Node
) -> None:
    """A plain SparkSession lacks spark.sql.python.filterPushdown.enabled: a read with pushdown
    off works there, and only a read that asks for pushdown needs the setting."""
    key = "spark.sql.python.filterPushdown.enabled"
    url = node.daemon.url
    want = len(model(node.documents, INDEXES["by_age"]))
    spark.conf.set(key, "false")
    try:
        assert read(spark, url=url, index="by_age").filter("id > ''").count() == want
        with pytest.raises(Exception, match="DATA_SOURCE_PUSHDOWN_DISABLED"):
            read(spark, url=url, index="by_age", pushdown="true").filter("id > ''").count()
    finally:
        spark.conf.set(key, "true")
    assert read(spark, url=url, index="by_age", pushdown="true").count() == want


def test_a_typed_column_that_no_longer_fits_asks_to_load_the_dataframe_again(
    spark: SparkSession, node: Node
) -> None:
    url = node.daemon.url
    df = spark.read.format("indexer").option("url", url).option("index", "by_age").load()
    assert dict(df.dtypes)["age"] in ("double", "bigint")
    node.feed([Document("odd-age", {"age": "forty", "address": {"city": "Oslo"}})])
    with pytest.raises(Exception) as failed:
        df.count()
    message = error_message(failed.value)
    assert "column age was typed" in message and "load it again" in message, message
    again = spark.read.format("indexer").option("url", url).option("index", "by_age").load()
    assert dict(again.dtypes)["age"] == "string"  # several types there now: JSON text
    assert again.filter("""age = '"forty"'""").count() == 1


def test_offline_read_of_a_stopped_node_equals_the_online_read(
    spark: SparkSession, node: Node
) -> None:
    url, data = node.daemon.url, str(node.data_dir)
    with pytest.raises(Exception) as raised:
        read(spark, path=data, index="by_city").collect()
    message = error_message(raised.value)
    assert "held by another process" in message and '.option("url"' in message
    with pinned(url) as pin:
        online = read(spark, url=url, index="by_city", pin=pin.id, partitions=3).collect()
        ages = read(spark, "id STRING, age DOUBLE", url=url, index="by_age", pin=pin.id).collect()
    assert node.daemon.stop(signal.SIGTERM) == 0
    # More partitions than cores: Python workers take turns on the store's LevelDB lock.
    offline = read(spark, path=data, index="by_city", partitions=6).collect()
    assert offline == online and len(offline) == len(model(node.documents, INDEXES["by_city"]))
    offline_ages = read(spark, "id STRING, age DOUBLE", path=data, index="by_age").collect()
    assert offline_ages == ages
    assert any(r.age is not None for r in ages) and any(r.age is None for r in ages)
    persisted = offline_snapshot(data)
    assert persisted is not None and persisted.seqno_sum == pin.seqno_sum == len(node.documents)


def test_array_primary_and_expression_indexes_read_as_their_scans(
    spark: SparkSession, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """One row per entry, columns named after the keys, typed as the values are, equal to the
    scan (which tests/e2e/test_gsi_keys.py checks against a model); a DESC leading key is read
    in its order, with filters left to Spark."""
    tmp = tmp_path_factory.mktemp("gsi")
    port = free_port()
    sections = {**GSI_INDEXES, "indexes.name_age": {"keys": ["LOWER(name)", "age * 10 + 1"]}}
    sections["indexes.age_desc"] = {"keys": ["age DESC"]}
    daemon = Daemon(
        write_config(tmp / "c.toml", tmp / "data", port, **sections), tmp / "d.log", port
    )
    daemon.start()
    try:
        fed = run_feed(daemon, write_jsonl(tmp / "docs.jsonl", gsi_documents(8, 4_000)))
        assert fed.returncode == 0, fed.stderr
        columns = {
            "#primary": ["id", "META_id"],
            "tags": ["id", "LOWER_tags"],
            "kid_age": ["id", "kids_name", "age"],
            "name_age": ["id", "LOWER_name", "age_10_1"],
            "age_desc": ["id", "age"],
        }
        for name, names in columns.items():
            with pinned(daemon.url) as pin:
                df = read(spark, url=daemon.url, index=name, pin=pin.id, partitions=3)
                assert df.columns == names, name
                got = as_entries(df, names[1:])
                scanned = ndjson_scan(daemon.url, name.replace("#", "%23"), pin=pin.id)
            assert len(got) == len(scanned) > 300, name
            assert got == scanned, name
            typed = spark.read.format("indexer").option("url", daemon.url).option("index", name)
            assert typed.load().count() == len(scanned), name
        # Filters on a DESC leading key: Spark applies them, and they give what they give
        # after the read (a range pushed as if ascending would give nothing).
        typed = "id STRING, age DOUBLE"
        everything = read(spark, typed, url=daemon.url, index="age_desc").collect()
        middle = read(spark, typed, url=daemon.url, index="age_desc", pushdown="true")
        middle = middle.filter("age >= 20 AND age < 40")
        assert filtered_by_spark(middle)
        want = [r for r in everything if r.age is not None and 20 <= r.age < 40]
        assert want and sorted(middle.collect()) == sorted(want)
        assert [r.age for r in want] == sorted((r.age for r in want), reverse=True)

        # order=desc: the partitions last first, each read from its end, online and offline.
        with pinned(daemon.url) as pin:
            backwards = read(
                spark, url=daemon.url, index="tags", pin=pin.id, partitions=3, order="desc"
            )
            assert backwards.rdd.getNumPartitions() == 3
            got = as_entries(backwards, ["LOWER_tags"])
            scanned = ndjson_scan(daemon.url, "tags", pin=pin.id)
        assert got == scanned[::-1] and len(got) > 300
        assert daemon.stop(signal.SIGTERM) == 0
        offline = read(spark, path=str(tmp / "data"), index="tags", partitions=3, order="desc")
        assert as_entries(offline, ["LOWER_tags"]) == got
        with pytest.raises(Exception) as raised:
            read(spark, url=daemon.url, index="tags", order="up").collect()
        assert """order: "asc" or "desc", not 'up'""" in error_message(raised.value)
    finally:
        daemon.kill()


# ---------------------------------------------------------------------------------------------
# Several nodes: two daemons sharing the vbuckets through a cluster map


@dataclass
class Cluster:
    """Two daemons, each owning half the vbuckets of the map, fed by one router."""

    map: Path
    nodes: dict[str, Daemon]
    documents: list[Document]
    jsonl: Path  # the router follows it: documents appended reach the nodes


SLICES = {"a": (0, 511), "b": (512, 1023)}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("cluster")
    nodes: dict[str, Daemon] = {}
    lines = ["num_vbuckets = 1024"]
    for name, (first, last) in SLICES.items():
        port = free_port()
        config = write_config(tmp / f"{name}.toml", tmp / f"data-{name}", port)
        nodes[name] = Daemon(config, tmp / f"{name}.log", port)
        lines += [
            f"[nodes.{name}]",
            f'feed = "{nodes[name].address}"',
            f'http = "127.0.0.1:{nodes[name].http_port}"',
            f'vbuckets = ["{first}-{last}"]',
        ]
    cluster_map = tmp / "cluster.toml"
    cluster_map.write_text("\n".join(lines) + "\n")
    documents = list(generate(Workload(12_000, 3_000, 0.1, 23)))
    jsonl = write_jsonl(tmp / "in.jsonl", documents)
    router = None
    try:
        for name, daemon in nodes.items():
            daemon.args = ["--cluster-map", str(cluster_map), "--node", name]
            daemon.start()
        router = Router(
            tmp / "router.log", "--state", str(tmp / "state"), "--jsonl", str(jsonl), "--follow",
            "--cluster-map", str(cluster_map),
        )  # fmt: skip
        found = Cluster(cluster_map, nodes, documents, jsonl)
        wait_cluster_equal(found)
        yield found
    finally:
        if router is not None and router.proc.poll() is None:
            router.proc.kill()
            router.proc.wait()
        for daemon in nodes.values():
            if daemon.running:
                daemon.kill()


def wait_cluster_equal(cluster: Cluster) -> None:
    for name, (first, last) in SLICES.items():
        owned = [
            d for d in cluster.documents if first <= vbucket_of(d.docid.encode(), 1024) <= last
        ]
        wait_equal(cluster.nodes[name], owned)


def node_count(daemon: Daemon, index: str, pin: str) -> int:
    answer = shared_client().get(
        f"{daemon.url}/indexes/{index}/count", params={"pin": pin}, timeout=60
    )
    assert answer.status_code == 200, answer.text
    count: int = answer.json()["count"]
    return count


def pin_ids(daemon: Daemon) -> set[str]:
    return {
        p["id"] for p in shared_client().get(f"{daemon.url}/snapshots", timeout=30).json()["pinned"]
    }


def test_a_cluster_map_reads_every_node_with_partitions_shared_out_among_them(
    spark: SparkSession, cluster: Cluster
) -> None:
    """The DataFrame holds the rows of both nodes: the model of every document, as many rows as
    the nodes count at their pins, in `partitions` partitions (at least one per node)."""
    where = str(cluster.map)
    with pinned_cluster(where, "stable") as pins:
        assert isinstance(pins, ClusterPin) and list(pins.pins) == ["a", "b"]
        assert pins.seqno_sum == len(cluster.documents)
        for name, paths in INDEXES.items():
            df = read(spark, cluster_map=where, index=name, pin=pins.id, partitions=4)
            assert df.rdd.getNumPartitions() == 4
            counts = [node_count(d, name, pins.pins[n].id) for n, d in cluster.nodes.items()]
            got = as_entries(df, paths)
            want = model(cluster.documents, paths)
            assert df.count() == len(got) == sum(counts) == len(want) > 1000, name
            assert min(counts) > len(want) // 3  # each node holds about half of the rows
            # Rows come partition by partition, node by node: in index order within a node.
            assert sorted(got, key=row_order) == want, name
        # Each node's entries are split in two: half the 4 partitions read node a, half node b.
        schema = read(spark, cluster_map=where, index="by_age", pin=pins.id).schema
        options = {"cluster_map": where, "index": "by_age", "pin": pins.id, "partitions": "4"}
        parts = IndexerDataSource(options).reader(schema).partitions()
        assert [(p.node, p.url, p.pin) for p in parts if isinstance(p, IndexerPartition)] == [
            (n, cluster.nodes[n].url, pins.pins[n].id) for n in ("a", "a", "b", "b")
        ]
        with pytest.raises(Exception) as raised:
            read(spark, cluster_map=where, index="by_age", pin=pins.pins["a"].id).collect()
        assert error_message(raised.value).startswith("pin: with cluster_map, a JSON object")
    assert not pin_ids(cluster.nodes["a"]) & {p.id for p in pins.pins.values()}  # released
    # Pins made by the source: the session's parallelism (2), one partition per node at least.
    ages = model(cluster.documents, INDEXES["by_age"])
    for partitions, want_parts in ((None, 2), (1, 2), (5, 5)):
        extra = {} if partitions is None else {"partitions": partitions}
        df = read(spark, cluster_map=where, index="by_age", snapshot="stable", **extra)
        assert df.rdd.getNumPartitions() == want_parts
        assert sorted(as_entries(df, INDEXES["by_age"]), key=row_order) == ages
    # at_plus over the whole cluster: each node waits only for the seqnos of its own vbuckets.
    vector: dict[str, int] = {}
    for name, daemon in cluster.nodes.items():
        seqnos = (
            shared_client().get(f"{daemon.url}/snapshots", timeout=30).json()["stable"]["seqnos"]
        )
        first, last = SLICES[name]
        vector.update({str(vb): seqnos[vb] for vb in range(first, last + 1) if seqnos[vb]})
    assert sum(vector.values()) == len(cluster.documents)
    df = read(spark, cluster_map=where, index="by_age", at_plus=json.dumps(vector), timeout=30)
    assert sorted(as_entries(df, INDEXES["by_age"]), key=row_order) == ages
    # Pushdown: the range on the leading key cuts every node's partitions alike.
    typed = "age DOUBLE, id STRING"
    ranged = read(
        spark, typed, cluster_map=where, index="by_age", snapshot="stable", pushdown="true"
    ).filter("age >= 30 AND age < 40.5")
    assert not filtered_by_spark(ranged)
    in_range = [
        (as_double(e["key"][0]), e["id"])
        for e in ages
        if as_double(e["key"][0]) is not None and 30 <= e["key"][0] < 40.5
    ]
    assert sorted(tuple(r) for r in ranged.collect()) == sorted(in_range) and in_range


def test_the_map_in_etcd_reads_as_the_map_file(spark: SparkSession, cluster: Cluster) -> None:
    """`.option("cluster", "etcd://...")`: the same nodes and rows as the file it came from."""
    server = Etcd().start()
    try:
        url = server.url("indexer/spark")
        done = subprocess.run(
            indexer_command("cluster", "init", "--cluster", url, "--from", str(cluster.map)),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        want = model(cluster.documents, INDEXES["by_city"])
        got = as_entries(read(spark, cluster=url, index="by_city"), INDEXES["by_city"])
        assert sorted(got, key=row_order) == want
        # Node a's daemon as two nodes, each active for half its vbuckets and a replica of
        # the other half: each node's reads leave its replicas out, so no row comes twice.
        split = server.url("indexer/replicas")
        a, b = cluster.nodes["a"], cluster.nodes["b"]
        layout = {"num_vbuckets": 1024, "nodes": {
            "a1": {"feed": a.address, "http": f"127.0.0.1:{a.http_port}", "vbuckets": ["0-255"],
                   "replicas": ["256-511"]},
            "a2": {"feed": a.address, "http": f"127.0.0.1:{a.http_port}",
                   "vbuckets": ["256-511"], "replicas": ["0-255"]},
            "b": {"feed": b.address, "http": f"127.0.0.1:{b.http_port}", "vbuckets": ["512-1023"]},
        }}  # fmt: skip
        replicated = cluster.map.with_name("replicated.toml")
        replicated.write_text(toml_text(layout))
        done = subprocess.run(
            indexer_command("cluster", "init", "--cluster", split, "--from", str(replicated)),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        got = as_entries(read(spark, cluster=split, index="by_city"), INDEXES["by_city"])
        assert sorted(got, key=row_order) == want
        for args in (["scan", "by_city"], ["changes", "by_city", "--limit", "1000"]):
            done = subprocess.run(
                indexer_command(*args, "--cluster", split),
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert done.returncode == 0, done.stderr
            rows = [json.loads(line) for line in done.stdout.splitlines()]
            entries = [{k: r[k] for k in ("key", "id", "missing") if k in r} for r in rows]
            assert sorted(entries, key=row_order) == want, args
        with pytest.raises(Exception) as raised:
            read(spark, cluster=server.url("indexer/none"), index="by_city").collect()
        assert "no cluster map yet" in error_message(raised.value)
    finally:
        server.stop()


def toml_text(layout: dict[str, Any]) -> str:
    """A cluster map's tables as a TOML file."""
    lines = [f"num_vbuckets = {layout['num_vbuckets']}"]
    for name, table in layout["nodes"].items():
        lines.append(f"[nodes.{name}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in table.items()]
    return "\n".join(lines) + "\n"


def test_a_stream_over_a_cluster_map_reads_each_nodes_changes_once(
    spark: SparkSession, cluster: Cluster, tmp_path: Path
) -> None:
    """Offsets are vectors of the nodes' tokens; replaying the micro-batches, each node's
    changes in a partition, gives the index of every node together, across a restart of the
    query from its checkpoint."""
    out, checkpoint = tmp_path / "changes", tmp_path / "checkpoint"
    paths = INDEXES["by_city"]

    def run() -> Any:
        return run_query(
            spark,
            out,
            checkpoint,
            cluster_map=str(cluster.map),
            startingOffsets="snapshot",
            maxEntriesPerTrigger="1500",
            consumer="cluster-copy",
        )

    def modelled() -> set[str]:
        return {json.dumps([e["key"], e["id"]]) for e in model(cluster.documents, paths)}

    run()
    assert replayed(spark, out)[0] == modelled()
    # Each node's snapshot start comes in batches of its share of the limit, as its changes.
    sizes = spark.read.parquet(str(out)).groupBy("batch").count().collect()
    assert len(sizes) >= 2 and all(r["count"] <= 1500 for r in sizes), sizes
    more = list(generate(Workload(4_000, 3_000, 0.2, 24)))  # updates of the same ids, deletes
    write_jsonl(cluster.jsonl, more, append=True)
    cluster.documents += more
    wait_cluster_equal(cluster)
    progress = run()
    entries, batches = replayed(spark, out)
    assert entries == modelled()
    assert batches == list(range(len(batches))) and len(batches) > 3
    end = json.loads(progress["sources"][0]["endOffset"])["token"]
    parts = decode_cluster_token(end)
    assert sorted(parts) == sorted(SLICES)
    for name, daemon in cluster.nodes.items():
        stats = shared_client().get(f"{daemon.url}/stats", timeout=30).json()["changes"]
        assert stats["id"] == parts[name].split(".")[0]  # each node's own history
        assert "cluster-copy" in stats["leases"]


def test_a_cluster_node_that_does_not_answer_fails_the_read_with_its_name(
    spark: SparkSession, cluster: Cluster
) -> None:
    """Planning releases the pins it made on the other nodes; the error is one line."""
    where, a, b = str(cluster.map), cluster.nodes["a"], cluster.nodes["b"]
    schema = read(spark, cluster_map=where, index="by_age").schema
    options = {"cluster_map": where, "index": "by_age", "snapshot": "stable"}
    reader = IndexerDataSource(options).reader(schema)
    before = pin_ids(a)
    assert b.stop() == 0
    with pytest.raises(IndexerSourceError) as planning:
        reader.partitions()
    assert str(planning.value).startswith(f"node b: cannot reach the indexer at {b.url}")
    assert pin_ids(a) == before  # the pin made on node a was released
    with pytest.raises(Exception) as raised:
        read(spark, cluster_map=where, index="by_age").collect()
    message = error_message(raised.value)
    assert message.startswith(f"node b: cannot reach the indexer at {b.url}"), message
    assert "\n" not in message
    with pytest.raises(Exception) as both:
        read(spark, url=a.url, cluster_map=where, index="by_age").collect()
    assert "give exactly one of" in error_message(both.value)


COMPARE = {
    EqualTo: operator.eq,
    GreaterThan: operator.gt,
    GreaterThanOrEqual: operator.ge,
    LessThan: operator.lt,
    LessThanOrEqual: operator.le,
}


def test_filter_ranges_hold_every_value_that_passes() -> None:
    """Without Spark: a pushed range holds every entry that passes; the batch filter is exact."""
    rng = random.Random(5)
    values: list[Any] = [None, True, False, "", "a", "ab", "b", "Paris", "\x00", "é", [], [1], {}]
    values += [0, 1, -1, 30, 2**53, 2**53 + 1, 2**63, -(2**31), 2**31 - 1, 2**31, 1e300]
    values += [30.0, 29.999999, 30.5, -0.5, 3.4e38, 3.5e38, 1e-300]
    values += [rng.uniform(-100, 100) for _ in range(40)]
    values += [rng.randrange(-100, 100) for _ in range(40)]
    kinds = {
        "long": pa.int64(),
        "integer": pa.int32(),
        "byte": pa.int8(),
        "double": pa.float64(),
        "float": pa.float32(),
        "string": pa.string(),
        "boolean": pa.bool_(),
        "json": pa.string(),
    }
    for kind, arrow in kinds.items():
        column = Column("k", 0, "k", kind, arrow)
        converted = [convert(kind, v) for v in values]
        batch = pa.RecordBatch.from_arrays([pa.array(converted, arrow)], names=["k"])
        literals = [lit for lit in converted if lit is not None]
        for _ in range(300):
            filters: list[Filter] = [
                rng.choice(list(COMPARE))(("k",), rng.choice(literals))
                for _ in range(rng.randrange(1, 3))
            ]
            filters.append(IsNotNull(("k",)))
            taken = [accepts(column, f) for f in filters]
            pushed = [t for t in taken if t is not None]
            bounds = filter_range(kind, pushed)
            kept = apply_filters(batch, 0, pushed).column(0).to_pylist()
            expected = []
            for value in values:
                spark_value = convert(kind, value)
                passes = spark_value is not None and all(
                    COMPARE[type(f)](spark_value, f.value)  # type: ignore[attr-defined]
                    for f, t in zip(filters, taken, strict=True)
                    if t is not None and t[0] != "notnull"
                )
                entry = encode_key([value, 7]) + b"doc1"
                inside = (bounds.start is None or entry >= bounds.start) and (
                    bounds.stop is None or entry < bounds.stop
                )
                assert inside or not passes, (kind, filters, value)
                if passes:
                    expected.append(spark_value)
            assert kept == expected, (kind, filters)


def test_partitions_are_shared_out_among_nodes_by_entry_count() -> None:
    """Without Spark: in proportion to the entries, at least one per node, max(total, nodes)."""
    assert share_partitions([500], 4) == [4]
    assert share_partitions([5100, 4900], 4) == [2, 2]
    assert share_partitions([900, 100], 4) == [3, 1]
    assert share_partitions([900, 100], 10) == [9, 1]
    assert share_partitions([1000, 0, 10], 4) == [2, 1, 1]
    assert share_partitions([5, 5, 5], 2) == [1, 1, 1]
    assert share_partitions([0, 0], 3) == [2, 1]
    assert share_partitions([1, 2, 3], 100) == [17, 33, 50]
    rng = random.Random(7)
    for _ in range(500):
        counts = [rng.choice([0, 1, rng.randrange(10**6)]) for _ in range(rng.randrange(1, 9))]
        total = rng.randrange(1, 200)
        shares = share_partitions(counts, total)
        assert sum(shares) == max(total, len(counts)) and min(shares) >= 1, (counts, total)


def test_the_pushdown_default_is_on_only_when_the_check_finds_plans_per_scan() -> None:
    """Without Spark: a check that cannot run (no JVM gateway) leaves pushdown off."""
    fake: Any = type("FakeSession", (), {"version": "9.9.9"})()

    def no_gateway(spark: SparkSession) -> bool:
        raise AttributeError("'SparkSession' object has no attribute '_jvm'")

    assert pushdown_default(fake, lambda _: True) == (
        True,
        "Spark 9.9.9 keeps the read plan per scan: on",
    )
    assert pushdown_default(fake, lambda _: False)[0] is False
    off, reason = pushdown_default(fake, no_gateway)
    assert not off and reason.startswith("could not tell") and "_jvm" in reason
    assert pushdown_default(fake)[0] is False  # a fake session has no JVM either
    options = {"index": "i", "url": "http://h"}
    assert SourceOptions.parse(options).pushdown is False
    assert SourceOptions.parse(options, default_pushdown=True).pushdown is True
    assert SourceOptions.parse({**options, "pushdown": "false"}, True).pushdown is False
    assert SourceOptions.parse({**options, "PushDown": "TRUE"}).pushdown is True


def test_a_503_that_says_when_is_retried_and_other_errors_are_one_line() -> None:
    """Without Spark or daemon: a fake API answering 503 (Retry-After) twice, then a pin."""
    answers = [
        (503, {"retry-after": "0.1"}, {"error": "no persisted snapshot yet"}),
        (503, {"retry-after": "0.1"}, {"error": "no persisted snapshot yet"}),
        (200, {}, {"id": "p1", "snapshot": 3, "seqno_sum": 9, "lease_s": 60}),
        (400, {}, {"error": "lease_s: from 1 to 86400, not 0"}),
    ]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            status, headers, body = answers.pop(0)
            raw = json.dumps(body).encode()
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args: Any) -> None:
            return None

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        pin = pin_snapshot(url, lease_s=60, timeout=5)
        assert (pin.id, pin.snapshot, pin.seqno_sum, answers[0][0]) == ("p1", 3, 9, 400)
        with pytest.raises(IndexerSourceError) as raised:
            pin_snapshot(url, lease_s=0.5)
        assert str(raised.value) == (
            f"indexer at {url}: POST /snapshots/pin: HTTP 400: lease_s: from 1 to 86400, not 0"
        )
    finally:
        server.shutdown()


def test_default_partitions_follow_the_cores_that_serve_them() -> None:
    def pin(url: str, cores: int | None) -> Pin:
        return Pin("p1", 1, 1, 60.0, url, cores=cores)

    assert partitions_for(pin("http://10.0.0.5:9102", 8), 16) == 8  # a node of its own
    assert partitions_for(pin("http://10.0.0.5:9102", 8), 4) == 4  # at most the parallelism
    assert partitions_for(pin("http://127.0.0.1:9102", 8), 16) == 4  # shared with Spark
    assert partitions_for(pin("http://localhost:9102", 1), 16) == 1
    assert partitions_for(pin("http://10.0.0.5:9102", None), 16) == 1
