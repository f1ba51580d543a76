"""Sessions: a SparkSession set up for the source (`session`, `configure`), its registration
and the pushdown default, and error messages for users."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession

from indexer.spark.options import IndexerSourceError, log
from indexer.spark.source import IndexerDataSource

# The JVM class whose private field `readInfo` tells that Spark keeps the read plan per scan
PYTHON_SCAN_BUILDER = "org.apache.spark.sql.execution.datasources.v2.python.PythonScanBuilder"


def error_message(exc: BaseException) -> str:
    """The one line saying why a Spark action on this source failed (Spark wraps it deeply)."""
    text = str(exc)
    marker = f"{IndexerSourceError.__name__}: "
    for line in text.splitlines():
        if marker in line:
            return line.split(marker, 1)[1].strip()
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__


def run_stream(writer: Any, follow: bool) -> Any:
    """Start a `DataStreamWriter` and wait for it: every ten seconds until Ctrl-C when
    `follow`, else once over what is there (`availableNow`). Returns the stopped query and
    raises the query's own exception if it failed."""
    if follow:
        query = writer.trigger(processingTime="10 seconds").start()
    else:
        query = writer.trigger(availableNow=True).start()
    try:
        query.awaitTermination()
    except KeyboardInterrupt:
        query.stop()
    failure = query.exception()
    if failure is not None:
        raise failure
    return query


_LOG4J2 = """\
rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n
logger.hadoop.name = org.apache.hadoop.util.NativeCodeLoader
logger.hadoop.level = error
"""


def _under_spark_submit() -> bool:
    """True in a driver that spark-submit started (its JVM exists already)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def _is_local(master: str | None) -> bool:
    return master is None or master.startswith("local")


def configure(builder_or_conf: Any, master: str | None = None) -> Any:
    """Settings the source needs, on a `SparkSession.Builder` or a `SparkConf` (returned).

    Sets PYSPARK_PYTHON to this interpreter unless it is set (Python workers then import this
    package and its dependencies), turns on Python filter pushdown, hides the progress bar and,
    for a local master, binds to 127.0.0.1 (SPARK_LOCAL_IP) and keeps Spark's logs to warnings.
    Environment settings only matter before the session's JVM starts.
    """
    set_conf = getattr(builder_or_conf, "config", None) or builder_or_conf.set
    if "PYSPARK_PYTHON" not in os.environ:
        os.environ["PYSPARK_PYTHON"] = sys.executable
    set_conf("spark.sql.python.filterPushdown.enabled", "true")
    set_conf("spark.ui.showConsoleProgress", "false")
    if _is_local(master) and not _under_spark_submit():
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        log4j = _log4j_file()
        if log4j is not None and not _has_conf(builder_or_conf, "spark.driver.extraJavaOptions"):
            set_conf("spark.driver.extraJavaOptions", f"-Dlog4j.configurationFile=file:{log4j}")
    return builder_or_conf


def _log4j_file() -> Path | None:
    """A log4j2 configuration keeping Spark to warnings (None if it cannot be written)."""
    path = Path(tempfile.gettempdir()) / f"indexer-spark-log4j2-{os.getuid()}.properties"
    try:
        if not path.exists() or path.read_text() != _LOG4J2:
            path.write_text(_LOG4J2)
    except OSError:
        return None
    return path


def _has_conf(builder_or_conf: Any, key: str) -> bool:
    if hasattr(builder_or_conf, "contains"):  # a SparkConf
        return bool(builder_or_conf.contains(key))
    return key in getattr(builder_or_conf, "_options", {})  # a Builder keeps them there


def read_plan_per_scan(spark: SparkSession) -> bool:
    """True when the running Spark keeps the read plan made while pushing filters per scan
    (`PythonScanBuilder` has a `readInfo` field, SPARK-58551); False for Spark 4.3.0, which keeps
    it on the DataFrame's data source object (docs/spark.md). Raises when the JVM cannot be
    asked (Spark Connect has no gateway, an unknown Spark may lack the class)."""
    jvm: Any = spark._jvm
    fields = jvm.java.lang.Class.forName(PYTHON_SCAN_BUILDER).getDeclaredFields()
    return any(f.getName() == "readInfo" for f in fields)


def pushdown_default(
    spark: SparkSession, check: Callable[[SparkSession], bool] | None = None
) -> tuple[bool, str]:
    """The `pushdown` default for this session and why: on only when `check` (by default
    `read_plan_per_scan`) finds that Spark keeps the read plan per scan; off when Spark shares
    it or the check cannot run."""
    try:
        version = str(spark.version)
    except Exception:  # asks the JVM on a classic session
        version = "?"
    try:
        per_scan = bool((check or read_plan_per_scan)(spark))
    except Exception as exc:  # no JVM gateway (Spark Connect), class renamed, ...
        reason = f"could not tell how Spark {version} keeps read plans ({exc!r:.200})"
        return False, f"{reason}: off"
    if per_scan:
        return True, f"Spark {version} keeps the read plan per scan: on"
    return False, f"Spark {version} shares one read plan among a DataFrame's scans: off"


def register(spark: SparkSession) -> type[IndexerDataSource]:
    """Register the source as format "indexer", defaulting partitions to the parallelism and
    `pushdown` to what the running Spark allows (`pushdown_default`)."""
    parallelism = spark.sparkContext.defaultParallelism
    pushdown, reason = pushdown_default(spark)
    log.info("indexer source: pushdown default: %s", reason)
    # A subclass made here is pickled by value, defaults included, to the planning workers.
    defaults = {
        "default_partitions": parallelism,
        "default_pushdown": pushdown,
        "default_pushdown_reason": reason,
    }
    source = type("RegisteredIndexerDataSource", (IndexerDataSource,), defaults)
    spark.dataSource.register(source)
    return source


def session(
    app_name: str, master: str | None = None, log_level: str | None = "WARN"
) -> SparkSession:
    """A SparkSession ready for the source: configured, registered, local[*] by default.

    Under spark-submit the master comes from spark-submit unless `master` is given. `log_level`
    (None: leave it) applies once the session runs; lines logged while it starts are up to
    Spark's log4j2 configuration.
    """
    builder = SparkSession.builder.appName(app_name)
    if master is None and not _under_spark_submit():
        master = "local[*]"
    if master is not None:
        builder = builder.master(master)
    configure(builder, master)
    spark = builder.getOrCreate()
    if log_level is not None:
        spark.sparkContext.setLogLevel(log_level)
    register(spark)
    return spark
