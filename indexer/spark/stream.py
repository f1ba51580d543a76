"""Reading an index's change feed from Spark: `spark.readStream.format("indexer")` (and a
batch read between two offsets), over GET /indexes/NAME/changes.

The offsets are the feed's tokens (`{"token": "3f9a01c2.41"}`); the first offset of a query
starting from `snapshot` is `{"token": "snapshot"}`, and its first micro-batch holds every entry
at the snapshot that ends it, as inserts. A micro-batch from one token to another always answers
the same rows (docs/protocol.md §8.3), so a batch Spark runs again after a failure is the same.
"""

from __future__ import annotations

import http.client
import json
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSourceReader, DataSourceStreamReader, InputPartition

try:  # Spark 4.2 and newer; on older ones batch reads still work, streams cannot
    from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow
except ImportError:  # pragma: no cover - depends on the installed Spark

    class SupportsTriggerAvailableNow:  # type: ignore[no-redef]
        """Stands in on a Spark without streaming read limits."""


from pyspark.sql.types import StringType, StructField, StructType

from indexer.client import ARROW_STREAM, NEXT_HEADER, Access, index_path
from indexer.spark.columns import Column, from_server, plan_columns, server_kinds
from indexer.spark.options import (
    DEFAULT_TIMEOUT_S,
    IndexerSourceError,
    parse_access,
    seconds_option,
    whole_option,
)
from indexer.spark.pins import _http

STARTS = ("snapshot", "latest")
SNAPSHOT = "snapshot"
FEED_COLUMNS = ("op", "snapshot")  # beside the id and the keys of a batch read
CONSUMER_LEASE_S = 86400.0  # a stream's lease on the history, renewed by every commit


def reads_changes(options: Mapping[str, str]) -> bool:
    """Whether a read asks for the change feed (it names where to start)."""
    return any(k.lower() == "startingoffsets" for k in options)


def feed_schema(batch: StructType) -> StructType:
    """A batch read's columns with `op` first and `snapshot` last."""
    fields = [StructField("op", StringType(), False), *batch.fields]
    return StructType([*fields, StructField("snapshot", StringType(), False)])


@dataclass(frozen=True)
class FeedOptions:
    """The options of a change-feed read, checked once on the driver."""

    url: str
    index: str
    starting: str = SNAPSHOT
    ending: str | None = None  # batch reads only
    max_entries: int | None = None
    consumer: str | None = None  # the name of the query's lease on the history, moved by commits
    lease_s: float = CONSUMER_LEASE_S
    timeout: float = DEFAULT_TIMEOUT_S
    access: Access = field(default_factory=Access)

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> FeedOptions:
        opts = {k.lower(): v for k, v in options.items()}
        if not opts.get("url"):
            raise IndexerSourceError(
                'the change feed is read from a running daemon: give .option("url", '
                '"http://HOST:PORT") (cluster maps and offline reads give snapshots only)'
            )
        starting = opts.get("startingoffsets", SNAPSHOT).strip()
        return cls(
            url=opts["url"].rstrip("/"),
            index=opts.get("index", ""),
            starting=_token_option("startingOffsets", starting, STARTS),
            ending=opts.get("endingoffsets"),
            max_entries=whole_option(opts, "maxentriespertrigger", 1, 1 << 62),
            consumer=opts.get("consumer") or None,
            lease_s=seconds_option(opts, "lease_s", CONSUMER_LEASE_S),
            timeout=seconds_option(opts, "timeout", DEFAULT_TIMEOUT_S),
            access=parse_access(opts),
        )


def _token_option(name: str, value: str, words: Sequence[str]) -> str:
    if value in words or value.count(".") in (1, 4):
        return value
    try:
        found = json.loads(value)
    except ValueError:
        found = None
    if isinstance(found, dict) and isinstance(found.get("token"), str):
        return str(found["token"])
    raise IndexerSourceError(
        f"{name}: {' or '.join(words)}, or a token the change feed gave; not {value!r}"
    )


class FeedPartition(InputPartition):
    """The changes from one token to the next (one partition: the feed is read in order)."""

    def __init__(self, since: str, until: str) -> None:
        super().__init__(0)
        self.since = since
        self.until = until


class FeedReads:
    """What the batch and the stream reader share: asking the daemon, converting its rows."""

    def __init__(self, options: FeedOptions, schema: StructType, keys: list[str]) -> None:
        from pyspark.sql.pandas.types import to_arrow_schema

        self.options = options
        self.keys = keys
        names = [f.name for f in schema.fields]
        if names[:1] != ["op"] or names[-1:] != ["snapshot"]:
            raise IndexerSourceError(
                "a change-feed read's schema starts with op and ends with snapshot "
                "(STRING), the id and key columns between"
            )
        inner = StructType(schema.fields[1:-1])
        self.columns: list[Column] = plan_columns(inner, keys)
        self.arrow_schema = to_arrow_schema(schema, timezone="UTC")

    def ask(self, params: dict[str, Any]) -> tuple[str, Any]:
        """The token after a read of the feed, and the open response (Arrow)."""
        options = self.options
        params = {**params, "columns": ",".join(server_kinds(self.columns, len(self.keys)))}
        response = _http(
            "GET",
            options.url,
            index_path(options.index, "changes"),
            params=params,
            accept=ARROW_STREAM,
            timeout=options.timeout,
            access=options.access,
        )
        return str(response.headers[NEXT_HEADER]), response

    def latest(self) -> str:
        token, response = self.ask({"since": "latest"})
        response.close()
        return token

    def rows(self, since: str, until: str) -> Iterator[Any]:
        """Arrow record batches of the changes from `since` to `until` (a snapshot's rows when
        `since` is "snapshot")."""
        if since == until:
            return
        _, response = self.ask({"since": since, "until": until})
        with response:
            try:
                for batch in pa.ipc.open_stream(response):
                    if batch.num_rows:
                        yield self._converted(batch)
            except (pa.ArrowInvalid, OSError, http.client.HTTPException) as exc:
                raise IndexerSourceError(
                    f"indexer at {self.options.url}: the change feed broke off: {exc}"
                ) from None

    def _converted(self, batch: Any) -> Any:
        arrays = [batch.column("op"), *from_server(batch, self.columns), batch.column("snapshot")]
        return pa.RecordBatch.from_arrays(arrays, schema=self.arrow_schema)


class IndexerStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """`spark.readStream.format("indexer")`: micro-batches between tokens of the change feed,
    at most `maxEntriesPerTrigger` rows each (whole documents' changes)."""

    def __init__(self, options: FeedOptions, schema: StructType, keys: list[str]) -> None:
        self.reads = FeedReads(options, schema, keys)
        self.options = options
        self.target: str | None = None  # Trigger.AvailableNow: the latest token at its start

    def prepareForTriggerAvailableNow(self) -> None:
        """Read up to the snapshot persisted now, in micro-batches of the read limit."""
        self.target = self.reads.latest()

    def initialOffset(self) -> dict[str, str]:
        starting = self.options.starting
        if starting == "latest":
            return {"token": self.reads.latest()}
        return {"token": starting}

    def getDefaultReadLimit(self) -> Any:
        from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

        if self.options.max_entries is None:
            return ReadAllAvailable()
        return ReadMaxRows(self.options.max_entries)

    def latestOffset(self, start: dict[str, str], limit: Any) -> dict[str, str]:
        from pyspark.sql.streaming.datasource import ReadMaxRows

        latest = self.target if self.target is not None else self.reads.latest()
        since = start["token"]
        if since == latest:
            return start
        if since == SNAPSHOT or not isinstance(limit, ReadMaxRows):
            return {"token": latest}
        # Where a read of at most max_rows rows from `since` ends (the daemon counts, sends none).
        params = {"since": since, "limit": max(1, limit.max_rows), "only": "token"}
        if since.count(".") == 1:
            params["until"] = latest
        token, response = self.reads.ask(params)
        response.close()
        return {"token": token}

    def partitions(self, start: dict[str, str], end: dict[str, str]) -> Sequence[InputPartition]:
        if start["token"] == end["token"]:
            return []
        return [FeedPartition(start["token"], end["token"])]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        assert isinstance(partition, FeedPartition)
        yield from self.reads.rows(partition.since, partition.until)

    def commit(self, end: dict[str, str]) -> None:
        """Spark has what ends at `end`: with a `consumer`, its lease moves there, and the
        history before it may go."""
        token = end["token"]
        options = self.options
        if options.consumer is None or token in STARTS:
            return
        answer = _http(
            "PUT",
            options.url,
            "/changes/leases/" + urllib.parse.quote(options.consumer, safe=""),
            body={"token": token, "lease_s": options.lease_s},
            timeout=options.timeout,
            access=options.access,
        )
        answer.close()


class IndexerFeedReader(DataSourceReader):
    """`spark.read.format("indexer").option("startingOffsets", A).option("endingOffsets", B)`:
    the changes between two tokens as one DataFrame."""

    def __init__(self, options: FeedOptions, schema: StructType, keys: list[str]) -> None:
        self.reads = FeedReads(options, schema, keys)
        self.options = options

    def partitions(self) -> Sequence[InputPartition]:
        ending = self.options.ending
        until = self.reads.latest() if ending in (None, "latest") else ending
        until = _token_option("endingOffsets", until, ("latest",))
        return [FeedPartition(self.options.starting, until)]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        assert isinstance(partition, FeedPartition)
        yield from self.reads.rows(partition.since, partition.until)
