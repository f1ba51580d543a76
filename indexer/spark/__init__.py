"""A Spark 4 Python Data Source over the indexer: `spark.read.format("indexer")`.

    from indexer.spark import session
    spark = session("my-job")                     # PYSPARK_PYTHON set, source registered
    df = (spark.read.format("indexer")
          .option("url", "http://127.0.0.1:9102")  # or .option("path", DATA_DIR): offline
          .option("index", "by_city")                # or .option("cluster_map", MAP): all nodes
          .load())

Planning (a Python worker on the driver) pins one snapshot through the daemon's HTTP API (or,
offline, notes the persisted snapshot file), asks for key ranges of about equal size and turns
each into a partition; every partition reads that snapshot as Arrow record batches. Range
filters on the leading key column narrow the scanned key range. With a cluster map it does the
same on every node (one pin per node, the partitions shared out by entry count), each partition
reading one range of one node. A daemon with a shared token or TLS (docs/security.md) is read
with `.option("token_file", FILE)` (or `token`) and `.option("tls_ca", PEM_FILE)`.

One module per job: `options` (the options, read once), `pins` (the daemon's API: pins, keys,
planning on every node), `offline` (a stopped node's store), `columns` (Spark types, value
conversion, pushed filters), `source` (the classes Spark calls), `rows` (a DataFrame's rows as the
router's input lines), `writer` (posting them to the routers' bulk input) and `sessions` (a
SparkSession set up for the source, its registration, error messages). This package re-exports
their public names.
"""

from __future__ import annotations

from indexer.client import Access
from indexer.spark.columns import (
    JSON_TEXT,
    Column,
    accepts,
    apply_filters,
    convert,
    default_schema,
    filter_range,
    intersect,
    plan_columns,
)
from indexer.spark.offline import (
    BATCH_ROWS,
    OFFLINE_CHUNK_ROWS,
    PLANNING_LOCK_WAIT_S,
    PersistedSnapshot,
    offline_snapshot,
)
from indexer.spark.options import (
    DEFAULT_LEASE_S,
    DEFAULT_PARTITIONS,
    DEFAULT_TIMEOUT_S,
    FORMAT,
    OPTIONS,
    SNAPSHOTS,
    IndexerSourceError,
    SourceOptions,
)
from indexer.spark.pins import (
    MAX_PLANNING_THREADS,
    ClusterPin,
    Pin,
    Target,
    cluster_targets,
    index_keys,
    index_keys_everywhere,
    load_cluster,
    pin_cluster,
    pin_snapshot,
    pinned,
    pinned_cluster,
    release,
    release_cluster,
    share_partitions,
)
from indexer.spark.rows import BadRow, RowLine, RowShape, lines_of
from indexer.spark.sessions import (
    PYTHON_SCAN_BUILDER,
    configure,
    error_message,
    pushdown_default,
    read_plan_per_scan,
    register,
    run_stream,
    session,
)
from indexer.spark.source import (
    IndexerDataSource,
    IndexerPartition,
    IndexerReader,
    PushdownIndexerReader,
)
from indexer.spark.writer import (
    WRITE_OPTIONS,
    IndexerCommit,
    IndexerWriter,
    Owners,
    WriterOptions,
    find_owners,
)

__all__ = [
    "BATCH_ROWS",
    "DEFAULT_LEASE_S",
    "DEFAULT_PARTITIONS",
    "DEFAULT_TIMEOUT_S",
    "FORMAT",
    "JSON_TEXT",
    "MAX_PLANNING_THREADS",
    "OFFLINE_CHUNK_ROWS",
    "OPTIONS",
    "PLANNING_LOCK_WAIT_S",
    "PYTHON_SCAN_BUILDER",
    "SNAPSHOTS",
    "WRITE_OPTIONS",
    "Access",
    "BadRow",
    "ClusterPin",
    "Column",
    "IndexerCommit",
    "IndexerDataSource",
    "IndexerPartition",
    "IndexerReader",
    "IndexerSourceError",
    "IndexerWriter",
    "Owners",
    "PersistedSnapshot",
    "Pin",
    "PushdownIndexerReader",
    "RowLine",
    "RowShape",
    "SourceOptions",
    "Target",
    "WriterOptions",
    "accepts",
    "apply_filters",
    "cluster_targets",
    "configure",
    "convert",
    "default_schema",
    "error_message",
    "filter_range",
    "find_owners",
    "index_keys",
    "index_keys_everywhere",
    "intersect",
    "lines_of",
    "load_cluster",
    "offline_snapshot",
    "pin_cluster",
    "pin_snapshot",
    "pinned",
    "pinned_cluster",
    "plan_columns",
    "pushdown_default",
    "read_plan_per_scan",
    "register",
    "release",
    "release_cluster",
    "run_stream",
    "session",
    "share_partitions",
]
