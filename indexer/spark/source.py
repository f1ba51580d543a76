"""The data source classes Spark calls: the source, its reader, its partitions."""

from __future__ import annotations

import http.client
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import islice
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceReader, Filter, InputPartition
from pyspark.sql.types import StructType

from indexer.client import ARROW_STREAM, index_path
from indexer.cluster.etcd import ETCD_SCHEME
from indexer.keys import encode_key, entry_tail
from indexer.scans import KeyRange, Row, column_kind, iterate, json_text, splits
from indexer.spark.columns import (
    accepts,
    apply_filters,
    convert,
    default_schema,
    filter_range,
    fits,
    from_server,
    intersect,
    plan_columns,
    server_kinds,
    typed_schema,
)
from indexer.spark.offline import (
    BATCH_ROWS,
    OFFLINE_CHUNK_ROWS,
    PLANNING_LOCK_WAIT_S,
    _offline_keys,
    _open_store,
    _stored_index,
    offline_snapshot,
    offline_types,
)
from indexer.spark.options import DEFAULT_PARTITIONS, FORMAT, IndexerSourceError, SourceOptions
from indexer.spark.pins import (
    Pin,
    Target,
    _given_pins,
    _http,
    _json_call,
    _on_each,
    _pin_each,
    _release_each,
    _results,
    _targets,
    index_keys,
    index_keys_everywhere,
    index_types,
    share_partitions,
)
from indexer.spark.rows import BadRow, RowShape
from indexer.spark.stream import (
    FeedOptions,
    IndexerFeedReader,
    IndexerStreamReader,
    feed_schema,
    reads_changes,
)
from indexer.spark.takeover import FollowedRead, without_collation
from indexer.spark.writer import IndexerStreamWriter, IndexerWriter, WriterOptions, find_owners


class IndexerPartition(InputPartition):
    """One key range of the index, read at one snapshot (a pin, or the store as it is); with a
    cluster map, of one node (`url`, `node`), at that node's pin."""

    def __init__(
        self,
        number: int,
        start: bytes | None,
        stop: bytes | None,
        pin: str | None,
        snapshot_checksum: str | None = None,
        empty: bool = False,
        url: str | None = None,
        node: str | None = None,
        vbuckets: str | None = None,
        mine: frozenset[int] | None = None,
        at_plus: dict[str, int] | None = None,
        num_vbuckets: int = 0,
    ) -> None:
        super().__init__(number)
        self.number = number
        self.start = start
        self.stop = stop
        self.pin = pin
        self.snapshot_checksum = snapshot_checksum
        self.empty = empty
        self.url = url  # the daemon to read (None: the url option's)
        self.node = node  # its name in the cluster map
        self.vbuckets = vbuckets  # those it answers for, where it holds others too
        # With a map in etcd, what another node that takes the node over reads: the node's
        # vbuckets, at least at its pin's seqnos (of `num_vbuckets`).
        self.mine = mine
        self.at_plus = at_plus
        self.num_vbuckets = num_vbuckets


class IndexerDataSource(DataSource):
    """`spark.read.format("indexer")`: options url, path or cluster_map, index, partitions,
    snapshot, at_plus, pin, lease_s, timeout, pushdown, columns, order (docs/spark.md), and
    token, token_file,
    tls, tls_ca for a daemon with a token or TLS (docs/security.md)."""

    default_partitions: int | None = None  # set by `register` to spark's default parallelism
    default_pushdown: bool = False  # set by `register`: on when the Spark keeps plans per scan
    default_pushdown_reason: str = "the source registered without register(): off"

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> StructType:
        """The id and a column per key: of the Spark type of what the index holds there (JSON
        text where it holds several types), or all JSON text with columns=json; a read of the
        change feed (startingOffsets given) has `op` first and `snapshot` last."""
        options = SourceOptions.parse(self.options)
        keys = _keys(options)
        if options.columns == "json":
            found = default_schema(keys)
        else:
            found = typed_schema(keys, [column_kind(t) for t in _types(options)])
        return feed_schema(found) if reads_changes(self.options) else found

    def streamReader(self, schema: StructType) -> IndexerStreamReader:
        """`spark.readStream.format("indexer")`: the index's change feed (spark/stream.py)."""
        if not reads_changes(self.options):
            raise IndexerSourceError(
                "a stream reads the change feed: say where it starts with .option("
                '"startingOffsets", "snapshot") (every entry, then the changes), "latest" or a '
                "token"
            )
        options = SourceOptions.parse(self.options)
        return IndexerStreamReader(FeedOptions.parse(self.options), schema, _keys(options))

    def reader(self, schema: StructType) -> DataSourceReader:
        if reads_changes(self.options):
            options = SourceOptions.parse(self.options)
            return IndexerFeedReader(FeedOptions.parse(self.options), schema, _keys(options))
        options = SourceOptions.parse(self.options, self.default_pushdown)
        parts = options.partitions or self.default_partitions or DEFAULT_PARTITIONS
        reader = PushdownIndexerReader if options.pushdown else IndexerReader
        return reader(options, schema, _keys(options), parts)

    def streamWriter(self, schema: StructType, overwrite: bool) -> IndexerStreamWriter:
        """`df.writeStream.format("indexer")`: each micro-batch as `writer` writes a DataFrame,
        with its options."""
        # The query's own option, which Spark passes on to its sink too.
        given = {k: v for k, v in self.options.items() if k.lower() != "checkpointlocation"}
        return IndexerStreamWriter(*self._writer_parts(schema, overwrite, given))

    def writer(self, schema: StructType, overwrite: bool) -> IndexerWriter:
        """`df.write.format("indexer")`: options router, id, delete, doc, wait, on_error, nulls,
        batch_rows, batch_bytes, timeout, and token, token_file, tls, tls_ca (docs/spark.md)."""
        return IndexerWriter(*self._writer_parts(schema, overwrite, self.options))

    def _writer_parts(
        self, schema: StructType, overwrite: bool, given: Mapping[str, str]
    ) -> tuple[WriterOptions, Any, RowShape]:
        if overwrite:
            raise IndexerSourceError(
                'the indexer writer adds and replaces documents: use .mode("append") (overwrite '
                "would mean deleting every document first)"
            )
        options = WriterOptions.parse(given)
        try:
            shape = RowShape.of(
                schema, options.id_column, options.delete_column, options.doc_column,
                options.keep_nulls,
            )  # fmt: skip
        except BadRow as exc:
            raise IndexerSourceError(str(exc)) from None
        return options, find_owners(options), shape


def partitions_for(pin: Pin, most: int) -> int:
    """Partitions of one node by default: as many as the cores its process scans with, half
    as many when it is on this machine (Spark's tasks then run on the same cores), from 1 to
    `most` (Spark's parallelism). On 2 shared cores one partition read 0.9-1.0M rows/s and two
    0.73-0.82M (docs/performance.md)."""
    cores = pin.cores or 1
    host = urllib.parse.urlsplit(pin.url).hostname or ""
    if host == "localhost" or host.startswith("127.") or host == "::1":
        cores //= 2
    return max(1, min(most, cores))


def _keys(options: SourceOptions) -> list[str]:
    if options.cluster_map is not None:
        return index_keys_everywhere(_targets(options), options.index, options.timeout)
    if options.url is not None:
        return index_keys(options.url, options.index, options.timeout, options.access)
    assert options.path is not None
    return _offline_keys(options.path, options.index)


TYPES_PIN_LEASE_S = 60.0  # the pin load() makes to ask what the index holds, released at once


def _types(options: SourceOptions) -> list[set[str]]:
    """What each key position holds, over every node, at a snapshot pinned for the question
    (or the `pin` option's); a stopped node's store offline."""
    if options.path is not None:
        return offline_types(options.path, options.index)
    targets = _targets(options)
    if options.pin is not None:
        pins, made = _given_pins(options.pin, targets), []
    else:
        made = _pin_each(
            targets, options.snapshot, options.at_plus, TYPES_PIN_LEASE_S, options.timeout
        )
        pins = [pin.id for pin in made]
    try:
        return _types_at(targets, pins, options.index, options.timeout)
    finally:
        _release_each(made)


def _types_at(
    targets: Sequence[Target], pin_ids: Sequence[str], index: str, timeout: float
) -> list[set[str]]:
    """The JSON types each key position of `index` holds over every node at its pin."""
    found = _results(
        _on_each(targets, lambda i, t: index_types(t.url, index, pin_ids[i], timeout, t.access))
    )
    return [set().union(*(node[j] for node in found)) for j in range(len(found[0]))]


class IndexerReader(DataSourceReader):
    """Plans partitions over one snapshot and reads each as Arrow record batches."""

    def __init__(
        self, options: SourceOptions, schema: StructType, keys: list[str], partitions: int
    ) -> None:
        from pyspark.sql.pandas.types import to_arrow_schema

        self.options = options
        self.keys = keys
        self.columns = plan_columns(schema, keys)
        self.arrow_schema = to_arrow_schema(schema, timezone="UTC")
        self.parts = partitions
        self.pushed: list[tuple[str, Any]] = []
        # Filters on the leading key narrow the range read, unless it is stored descending.
        self.leading = (
            None
            if keys[0].endswith(" DESC")
            else next((i for i, c in enumerate(self.columns) if c.position == 0), None)
        )

    def key_range(self) -> KeyRange | None:
        """What the pushed filters leave of the key space (None: nothing)."""
        if self.leading is None:
            return KeyRange()
        bounds = filter_range(self.columns[self.leading].kind, self.pushed)
        return intersect(bounds, KeyRange())

    def partitions(self) -> list[InputPartition]:
        """Pin the snapshot (on every node of a cluster map), split the index into ranges of
        about equal size, cut by filters."""
        wanted = self.key_range()
        if self.options.path is None:
            out = self._online_partitions(wanted)
            return _in_order(out, self.options.order) or [
                IndexerPartition(0, None, None, None, empty=True)
            ]
        found = offline_snapshot(self.options.path)
        checksum = found.checksum if found else None
        ranges = self._offline_ranges() if wanted is not None else []
        out = []
        for r in ranges:
            cut = intersect(r, wanted or KeyRange())
            if cut is not None:
                out.append(IndexerPartition(len(out), cut.start, cut.stop, None, checksum))
        return _in_order(out, self.options.order) or [
            IndexerPartition(0, None, None, None, checksum, empty=True)
        ]

    def _online_partitions(self, wanted: KeyRange | None) -> list[InputPartition]:
        """Pin (unless given) on each daemon, get its splits, cut them to `wanted`.

        One daemon gets `partitions` splits; the nodes of a cluster map share them out in
        proportion to their entries at their pins, at least one each. A pin the partitions do
        not use (the filters cut all of its node's ranges away) is released at once, and so is
        every pin made if planning fails; the others live out their lease (docs/spark.md).
        """
        options = self.options
        if wanted is None:  # the filters leave nothing: no pin, no partition to read
            return []
        targets = _targets(options)
        if options.pin is not None:
            pin_ids, made = _given_pins(options.pin, targets), []
        else:
            made = _pin_each(
                targets, options.snapshot, options.at_plus, options.lease_s, options.timeout
            )
            pin_ids = [pin.id for pin in made]
        try:
            self._check_types(targets, pin_ids)
            if options.partitions is None and made and all(p.cores for p in made):
                shares = [partitions_for(p, self.parts) for p in made]
            elif len(targets) == 1:
                shares = [self.parts]
            else:
                counts = _results(_on_each(targets, lambda i, t: self._count(t, pin_ids[i])))
                shares = share_partitions(counts, self.parts)
            ranges = _results(
                _on_each(targets, lambda i, t: self._splits(t, pin_ids[i], shares[i]))
            )
        except BaseException:
            _release_each(made)
            raise
        out: list[InputPartition] = []
        unused = []
        for i, target in enumerate(targets):
            before = len(out)
            for r in ranges[i]:
                cut = intersect(r, wanted)
                if cut is not None:
                    part = IndexerPartition(
                        len(out),
                        cut.start,
                        cut.stop,
                        pin_ids[i],
                        url=target.url,
                        node=target.node,
                        vbuckets=target.answers,
                        **self._takeover(target, made[i] if made else None),
                    )
                    out.append(part)
            if len(out) == before and made:
                unused.append(made[i])
        _release_each(unused)
        return out

    def _takeover(self, target: Target, pin: Pin | None) -> dict[str, Any]:
        """What a partition of `target` needs for another node to take its read over: with a
        map in etcd and a pin made here (whose seqnos are known), its vbuckets and the pin's
        seqnos of them."""
        where = self.options.cluster_map
        if where is None or not where.startswith(ETCD_SCHEME) or pin is None or not pin.seqnos:
            return {}
        if target.vbuckets is None:
            return {}
        return {
            "mine": target.vbuckets,
            "at_plus": {str(vb): pin.seqnos[vb] for vb in sorted(target.vbuckets)},
            "num_vbuckets": len(pin.seqnos),
        }

    def _check_types(self, targets: Sequence[Target], pin_ids: Sequence[str]) -> None:
        """A column typed from what the index held when the DataFrame was loaded must still fit
        what the snapshot read holds: a value of another type would read as null."""
        inferred = [c for c in self.columns if c.inferred]
        if not inferred:
            return
        found = _types_at(targets, pin_ids, self.options.index, self.options.timeout)
        for column in inferred:
            types = found[column.position]
            if not fits(column.kind, types):
                raise IndexerSourceError(
                    f"column {column.name} was typed {column.kind.upper()} when the DataFrame "
                    f"was loaded, and the index now holds {', '.join(sorted(types))} there: "
                    'load it again, or read with .option("columns", "json")'
                )

    def _count(self, target: Target, pin_id: str) -> int:
        """The index's entries on `target` at its pin."""
        path = index_path(self.options.index, "count")
        params = {"pin": pin_id}
        if target.answers is not None:
            params["vbuckets"] = target.answers
        answer = _json_call(
            "GET",
            target.url,
            path,
            params=params,
            timeout=self.options.timeout,
            access=target.access,
        )
        return int(answer["count"])

    def _splits(self, target: Target, pin_id: str, parts: int) -> list[KeyRange]:
        """`parts` key ranges of about equal entry counts on `target` at its pin."""
        answer = _json_call(
            "GET",
            target.url,
            index_path(self.options.index, "splits"),
            params={"parts": parts, "pin": pin_id},
            timeout=self.options.timeout,
            access=target.access,
        )
        return [
            KeyRange(
                bytes.fromhex(s["start"]) if s["start"] else None,
                bytes.fromhex(s["stop"]) if s["stop"] else None,
            )
            for s in answer["splits"]
        ]

    def _offline_ranges(self) -> list[KeyRange]:
        """Splits of the index in the data directory, by a walk of its keys."""
        assert self.options.path is not None
        store = _open_store(self.options.path, PLANNING_LOCK_WAIT_S, planning=True)
        try:
            return splits(store, _stored_index(store, self.options.index), None, self.parts)
        finally:
            store.close()

    def read(self, partition: InputPartition) -> Iterator[Any]:
        """Arrow record batches of one partition, in index order."""
        if not isinstance(partition, IndexerPartition) or partition.empty:
            return
        if self.options.path is None:
            batches = self._read_online(partition)
        else:
            batches = self._read_offline(partition)
        for batch in batches:
            if self.leading is not None:
                batch = apply_filters(batch, self.leading, self.pushed)
            if batch.num_rows:
                yield batch

    # -- online

    def _read_online(self, part: IndexerPartition) -> Iterator[Any]:
        options = self.options
        url = part.url or options.url
        assert url is not None
        target = Target(url, part.node)
        params: dict[str, Any] = {"pin": part.pin, "order": options.order}
        if part.vbuckets is not None:
            params["vbuckets"] = part.vbuckets
        if part.start is not None:
            params["start"] = part.start.hex()
        if part.stop is not None:
            params["stop"] = part.stop.hex()
        path = index_path(options.index, "scan")
        params["columns"] = ",".join(server_kinds(self.columns, len(self.keys)))
        if part.mine is not None and part.at_plus is not None and part.node is not None:
            assert options.cluster_map is not None
            params["collation"] = "hex"
            follow = FollowedRead(
                options.cluster_map,
                path,
                options.access,
                options.timeout,
                part.num_vbuckets,
                reverse=options.order == "desc",
            )
            try:
                for batch in follow.read(part.node, url, part.mine, params, part.at_plus):
                    yield self._from_server(without_collation(batch))
            except IndexerSourceError as exc:
                raise self._no_pin(exc, target) or exc from None
            return
        try:
            response = _http(
                "GET",
                url,
                path,
                params=params,
                accept=ARROW_STREAM,
                timeout=options.timeout,
                access=options.access,
            )
        except IndexerSourceError as exc:
            raise self._no_pin(exc, target) or IndexerSourceError(target.say(str(exc))) from None
        with response:
            try:
                stream = pa.ipc.open_stream(response)
                for batch in stream:
                    yield self._from_server(batch)
            except (pa.ArrowInvalid, OSError, http.client.HTTPException) as exc:
                raise IndexerSourceError(
                    target.say(f"indexer at {url}: the scan stream broke off: {exc}")
                ) from None

    def _no_pin(self, exc: IndexerSourceError, target: Target) -> IndexerSourceError | None:
        """The error to raise for a pin that expired before its partition was read."""
        if "no pin" not in str(exc) or self.options.pin is not None:
            return None
        return IndexerSourceError(
            target.say(
                f"{exc}: a DataFrame reads the snapshot pinned when Spark planned it, "
                f"for lease_s={self.options.lease_s:g} s: load it again, or raise lease_s"
            )
        )

    def _from_server(self, batch: Any) -> Any:
        arrays = from_server(batch, self.columns)
        return pa.RecordBatch.from_arrays(arrays, schema=self.arrow_schema)

    # -- offline

    def _read_offline(self, part: IndexerPartition) -> Iterator[Any]:
        """Read in chunks, holding the store's lock only while reading each chunk."""
        options = self.options
        assert options.path is not None
        start, stop = part.start, part.stop
        reverse = options.order == "desc"
        while True:
            store = _open_store(options.path, options.timeout)
            try:
                found = offline_snapshot(options.path)
                if (found.checksum if found else None) != part.snapshot_checksum:
                    raise IndexerSourceError(
                        f"the persisted snapshot in {options.path} changed during the read "
                        "(a daemon ran on it): read again"
                    )
                stored = _stored_index(store, options.index)
                bounds = KeyRange(start, stop)
                rows = list(
                    islice(
                        iterate(store, stored, None, bounds, reverse=reverse), OFFLINE_CHUNK_ROWS
                    )
                )
            finally:
                store.close()
            for i in range(0, len(rows), BATCH_ROWS):
                yield self._from_rows(rows[i : i + BATCH_ROWS])
            if len(rows) < OFFLINE_CHUNK_ROWS:
                return
            last = rows[-1]
            entry = encode_key(last.key, stored.definition.desc)
            entry += entry_tail(last.docid.encode("utf-8"))
            if reverse:
                stop = entry  # the entries before the last one read
            else:
                start = entry + b"\x00"  # the entry's smallest successor

    def _from_rows(self, rows: Sequence[Row]) -> Any:
        arrays = []
        for column in self.columns:
            if column.kind == "id":
                values: list[Any] = [r.docid for r in rows]
            elif column.kind == "json":
                j = column.position
                values = [json_text(r.key[j]) for r in rows]
            else:
                j, kind = column.position, column.kind
                values = [convert(kind, r.key[j]) for r in rows]
            arrays.append(pa.array(values, type=column.arrow))
        return pa.RecordBatch.from_arrays(arrays, schema=self.arrow_schema)


def _in_order(parts: list[InputPartition], order: str) -> list[InputPartition]:
    """The partitions in the order their rows come: reversed, renumbered, for `desc`."""
    if order == "asc":
        return parts
    reverse: list[InputPartition] = []
    for i, part in enumerate(reversed(parts)):
        assert isinstance(part, IndexerPartition)
        reverse.append(
            IndexerPartition(
                i,
                part.start,
                part.stop,
                part.pin,
                part.snapshot_checksum,
                part.empty,
                part.url,
                part.node,
                part.vbuckets,
                part.mine,
                part.at_plus,
                part.num_vbuckets,
            )
        )
    return reverse


class PushdownIndexerReader(IndexerReader):
    """The reader with filter pushdown. Spark refuses a reader that defines `pushFilters` unless
    spark.sql.python.filterPushdown.enabled is set, so only a read with pushdown on gets it."""

    def pushFilters(self, filters: list[Filter]) -> Iterable[Filter]:
        """Take the comparisons on the leading key column; hand every other filter back."""
        for f in filters:
            taken = None
            if self.leading is not None:
                column = self.columns[self.leading]
                if getattr(f, "attribute", None) == (column.name,):
                    taken = accepts(column, f)
            if taken is None:
                yield f
            else:
                self.pushed.append(taken)
