"""Reading an index's change feed from Spark: `spark.readStream.format("indexer")` (and a
batch read between two offsets), over GET /indexes/NAME/changes.

The offsets are the feed's tokens (`{"token": "3f9a01c2.41"}`); the first offset of a query
starting from `snapshot` is `{"token": "snapshot"}`, and its first micro-batches hold every entry
at the snapshot the query found latest, as inserts: all of them in one without a read limit,
else in micro-batches of at most `maxEntriesPerTrigger` entries, each ending at a token inside
that snapshot start. A micro-batch from one token to another always answers the same rows
(docs/protocol.md §8.3), so a batch Spark runs again after a failure is the same.

With `cluster_map`, each node keeps its own history: an offset is the vector of the nodes'
tokens (`{"token": "a:3f9a01c2.41,b:77aa0011.40"}`), and a micro-batch reads each node's
changes in a partition of its own. A node's changes are those of the vbuckets it owns.
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

from indexer.changes import (
    ChangeToken,
    ChangeTokenError,
    decode_cluster_token,
    encode_cluster_token,
)
from indexer.client import ARROW_STREAM, NEXT_HEADER, Access, index_path
from indexer.spark.columns import Column, from_server, plan_columns, server_kinds
from indexer.spark.options import (
    DEFAULT_TIMEOUT_S,
    IndexerSourceError,
    parse_access,
    seconds_option,
    whole_option,
)
from indexer.spark.pins import Target, _http, cluster_targets, load_cluster

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

    url: str | None
    index: str
    cluster_map: str | None = None  # every node's feed: tokens are vectors of node tokens
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
        url, cluster_map = opts.get("url") or None, opts.get("cluster_map") or None
        if (url is None) == (cluster_map is None):
            raise IndexerSourceError(
                'the change feed is read from running daemons: give .option("url", '
                '"http://HOST:PORT") or .option("cluster_map", MAP_FILE), one of them '
                "(offline reads give snapshots only)"
            )
        starting = opts.get("startingoffsets", SNAPSHOT).strip()
        return cls(
            url=None if url is None else url.rstrip("/"),
            index=opts.get("index", ""),
            cluster_map=cluster_map,
            starting=_token_option("startingOffsets", starting, STARTS),
            ending=opts.get("endingoffsets"),
            max_entries=whole_option(opts, "maxentriespertrigger", 1, 1 << 62),
            consumer=opts.get("consumer") or None,
            lease_s=seconds_option(opts, "lease_s", CONSUMER_LEASE_S),
            timeout=seconds_option(opts, "timeout", DEFAULT_TIMEOUT_S),
            access=parse_access(opts),
        )

    def targets(self) -> list[Target]:
        """The daemons whose feeds are read: the url's, or every node of the cluster map."""
        if self.cluster_map is not None:
            return cluster_targets(load_cluster(self.cluster_map), access=self.access)
        assert self.url is not None
        return [Target(self.url, access=self.access)]


def _token_option(name: str, value: str, words: Sequence[str]) -> str:
    if value not in words:
        try:
            found = json.loads(value)
        except ValueError:
            found = None
        if isinstance(found, dict) and isinstance(found.get("token"), str):
            value = str(found["token"])
    if value in words:
        return value
    try:
        if ":" in value:
            decode_cluster_token(value)
        else:
            ChangeToken.decode(value)
        return value
    except ChangeTokenError:
        pass
    raise IndexerSourceError(
        f"{name}: {' or '.join(words)}, or a token the change feed gave; not {value!r}"
    )


class Position:
    """Where a read of the feed is: a start word, one daemon's token, or a cluster's vector
    of node tokens (a node the vector does not name starts from its snapshot)."""

    def __init__(self, targets: Sequence[Target]) -> None:
        self.targets = list(targets)
        self.clustered = any(t.node is not None for t in self.targets)

    def parts(self, token: str) -> list[str]:
        """The token of each target in `token`, in the targets' order."""
        if token in STARTS:
            return [token] * len(self.targets)
        if not self.clustered:
            if ":" in token:
                raise IndexerSourceError(
                    f"{token!r} is a cluster's token: read it with cluster_map"
                )
            return [token]
        if ":" not in token:
            raise IndexerSourceError(
                f"{token!r} is one daemon's token: a cluster map's read takes a cluster's "
                "(NODE:TOKEN,...), or snapshot"
            )
        found = decode_cluster_token(token)
        unknown = set(found) - {t.node for t in self.targets}
        if unknown:
            raise IndexerSourceError(
                "the token names nodes the cluster map does not have "
                f"({', '.join(sorted(unknown))}): the map changed, start again from a snapshot"
            )
        return [found.get(str(t.node), SNAPSHOT) for t in self.targets]

    def token(self, parts: Sequence[str]) -> str:
        """The token of the targets' `parts`."""
        if not self.clustered:
            return parts[0]
        if all(p == SNAPSHOT for p in parts):
            return SNAPSHOT
        return encode_cluster_token(
            {str(t.node): p for t, p in zip(self.targets, parts, strict=True)}
        )


class FeedPartition(InputPartition):
    """The changes of one daemon from one token to the next (a partition per node: each
    node's feed is read in order)."""

    def __init__(self, target: Target, since: str, until: str, number: int = 0) -> None:
        super().__init__(number)
        self.target = target
        self.since = since
        self.until = until


class FeedReads:
    """What the batch and the stream reader share: asking the daemons, converting their rows."""

    def __init__(self, options: FeedOptions, schema: StructType, keys: list[str]) -> None:
        from pyspark.sql.pandas.types import to_arrow_schema

        self.options = options
        self.keys = keys
        self.position = Position(options.targets())
        names = [f.name for f in schema.fields]
        if names[:1] != ["op"] or names[-1:] != ["snapshot"]:
            raise IndexerSourceError(
                "a change-feed read's schema starts with op and ends with snapshot "
                "(STRING), the id and key columns between"
            )
        inner = StructType(schema.fields[1:-1])
        self.columns: list[Column] = plan_columns(inner, keys)
        self.arrow_schema = to_arrow_schema(schema, timezone="UTC")

    def ask(self, target: Target, params: dict[str, Any]) -> tuple[str, Any]:
        """The token after a read of a daemon's feed, and the open response (Arrow)."""
        options = self.options
        params = {**params, "columns": ",".join(server_kinds(self.columns, len(self.keys)))}
        if target.answers is not None:  # the node holds others' vbuckets too
            params["vbuckets"] = target.answers
        try:
            response = _http(
                "GET",
                target.url,
                index_path(options.index, "changes"),
                params=params,
                accept=ARROW_STREAM,
                timeout=options.timeout,
                access=target.access,
            )
        except IndexerSourceError as exc:
            raise IndexerSourceError(target.say(str(exc))) from None
        return str(response.headers[NEXT_HEADER]), response

    def token_after(self, target: Target, params: dict[str, Any]) -> str:
        """Where a read of a daemon's feed ends, without its rows."""
        token, response = self.ask(target, {**params, "only": "token"})
        response.close()
        return token

    def latest(self) -> str:
        parts = []
        for target in self.position.targets:
            token, response = self.ask(target, {"since": "latest"})
            response.close()
            parts.append(token)
        return self.position.token(parts)

    def partitions(self, since: str, until: str) -> list[FeedPartition]:
        """A partition per daemon whose position moves from `since` to `until`."""
        pairs = zip(self.position.parts(since), self.position.parts(until), strict=True)
        return [
            FeedPartition(target, a, b, number)
            for number, (target, (a, b)) in enumerate(
                zip(self.position.targets, pairs, strict=True)
            )
            if a != b
        ]

    def rows(self, partition: FeedPartition) -> Iterator[Any]:
        """Arrow record batches of a daemon's changes from `since` to `until` (a snapshot's
        rows when `since` is "snapshot")."""
        target = partition.target
        _, response = self.ask(target, {"since": partition.since, "until": partition.until})
        with response:
            try:
                for batch in pa.ipc.open_stream(response):
                    if batch.num_rows:
                        yield self._converted(batch)
            except (pa.ArrowInvalid, OSError, http.client.HTTPException) as exc:
                raise IndexerSourceError(
                    target.say(f"indexer at {target.url}: the change feed broke off: {exc}")
                ) from None

    def _converted(self, batch: Any) -> Any:
        arrays = [batch.column("op"), *from_server(batch, self.columns), batch.column("snapshot")]
        return pa.RecordBatch.from_arrays(arrays, schema=self.arrow_schema)


class IndexerStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """`spark.readStream.format("indexer")`: micro-batches between tokens of the change feed,
    at most `maxEntriesPerTrigger` rows each (whole documents' changes; on a cluster map, the
    limit is shared evenly by the nodes, and each node's changes are a partition)."""

    def __init__(self, options: FeedOptions, schema: StructType, keys: list[str]) -> None:
        self.reads = FeedReads(options, schema, keys)
        self.options = options
        self.target: str | None = None  # Trigger.AvailableNow: the latest token at its start

    def prepareForTriggerAvailableNow(self) -> None:
        """Read up to the snapshots persisted now, in micro-batches of the read limit."""
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
        position = self.reads.position
        if not isinstance(limit, ReadMaxRows):
            return {"token": latest}
        share = max(1, limit.max_rows // len(position.targets))
        parts = []
        for target, a, b in zip(
            position.targets, position.parts(since), position.parts(latest), strict=True
        ):
            if a == b:
                parts.append(b)  # nothing new
                continue
            # Where a read of at most `share` rows from `a` ends (the daemon counts, sends none).
            # From `snapshot`, the start is the one at `b`, read in pages of `share` entries as
            # the changes are; a token inside a start names its own mark.
            params: dict[str, Any] = {"since": a, "limit": share}
            if a == SNAPSHOT or ChangeToken.decode(a).at_mark:
                params["until"] = b
            parts.append(self.reads.token_after(target, params))
        return {"token": position.token(parts)}

    def partitions(self, start: dict[str, str], end: dict[str, str]) -> Sequence[InputPartition]:
        return self.reads.partitions(start["token"], end["token"])

    def read(self, partition: InputPartition) -> Iterator[Any]:
        assert isinstance(partition, FeedPartition)
        yield from self.reads.rows(partition)

    def commit(self, end: dict[str, str]) -> None:
        """Spark has what ends at `end`: with a `consumer`, its lease on each daemon moves
        there, and the history before it may go."""
        options = self.options
        if options.consumer is None:
            return
        position = self.reads.position
        for target, token in zip(position.targets, position.parts(end["token"]), strict=True):
            if token in STARTS:
                continue
            answer = _http(
                "PUT",
                target.url,
                "/changes/leases/" + urllib.parse.quote(options.consumer, safe=""),
                body={"token": token, "lease_s": options.lease_s},
                timeout=options.timeout,
                access=target.access,
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
        return self.reads.partitions(self.options.starting, until)

    def read(self, partition: InputPartition) -> Iterator[Any]:
        assert isinstance(partition, FeedPartition)
        yield from self.reads.rows(partition)
