"""A partition's read that outlives its node: when the node fails before or while it streams,
the nodes the cluster's map then makes active for its vbuckets answer the rest.

They read from the row after the node's last one (each batch's `collation` column, the bytes of
its entries' keys, with the docid, gives the entry), at or after the seqnos of the snapshot the
read was pinned at, each for its share of the vbuckets. Several are merged in index order by
the same columns. Only a map in etcd fails over, so only a read over one takes a node over.
"""

from __future__ import annotations

import http.client
import json
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from indexer.client import (
    ACTIVE_HEADER,
    ARROW_STREAM,
    VBUCKETS_HEADER,
    Access,
    ClientError,
    request,
)
from indexer.cluster.map import ClusterMapError, parse_vbuckets, vbucket_ranges
from indexer.cluster.scan import _cut, resumed_after
from indexer.cluster.store import NODE_TTL_S, load_map
from indexer.keys import entry_tail
from indexer.spark.options import IndexerSourceError
from indexer.spark.pins import vector_of

log = logging.getLogger("indexer.spark")

# How long a read waits for another node to become active for a failed node's vbuckets: its
# registration's lease runs out within the TTL, and the live nodes fail it over at once.
FAILOVER_WAIT_S = 2 * NODE_TTL_S + 5
RETRY_S = 0.2  # between readings of the map while a failover is awaited


class NodeFailed(IndexerSourceError):
    """A node did not answer, answered that it cannot now (503), broke off its stream, or no
    longer is active for the vbuckets it was asked for."""


def without_collation(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A batch of a scan asked with `collation=hex`, its last column (the collation) left out."""
    last = batch.num_columns - 1
    return pa.RecordBatch.from_arrays(batch.columns[:last], schema=batch.schema.remove(last))


def _orders(batch: pa.RecordBatch, id_at: int) -> list[tuple[bytes, str]]:
    """Each row's place in the index: its key's collation, then its docid."""
    collations = batch.column(batch.num_columns - 1).to_pylist()
    return list(zip(collations, batch.column(id_at).to_pylist(), strict=True))


class _Head:
    """A stream of batches being merged: its current batch, its rows' orders, how far taken."""

    __slots__ = ("at", "batch", "id_at", "more", "orders")

    def __init__(self, more: Iterator[pa.RecordBatch], id_at: int) -> None:
        self.more, self.id_at = more, id_at
        self.batch: pa.RecordBatch | None = None
        self.orders: list[tuple[bytes, str]] = []
        self.at = 0

    def advance(self) -> bool:
        """The next batch with rows; False at the end of the stream."""
        for batch in self.more:
            if batch.num_rows:
                self.batch, self.orders, self.at = batch, _orders(batch, self.id_at), 0
                return True
        return False


def merge_batches(
    streams: Sequence[Iterator[pa.RecordBatch]], id_at: int = 0, reverse: bool = False
) -> Iterator[pa.RecordBatch]:
    """The rows of several streams of batches (each in index order, or the other way with
    `reverse`; the collation last, the docid at `id_at`) as batches of one stream in that order.
    A batch that sorts before every other stream's passes on whole or cut; overlapping parts
    are sorted by Arrow."""
    heads = []
    for stream in streams:
        head = _Head(stream, id_at)
        if head.advance():
            heads.append(head)
    direction = "descending" if reverse else "ascending"
    while len(heads) > 1:
        lasts = [h.orders[-1] for h in heads]
        bound = max(lasts) if reverse else min(lasts)
        parts = []
        for head in heads:
            assert head.batch is not None
            cut = _cut(head.orders, bound, head.at, reverse)  # type: ignore[arg-type]
            if cut > head.at:
                parts.append(head.batch.slice(head.at, cut - head.at))
                head.at = cut
        if len(parts) == 1:
            yield parts[0]
        else:
            table = pa.Table.from_batches(parts).combine_chunks()
            last = table.num_columns - 1
            keys = pa.table({"c": table.column(last), "i": table.column(id_at)})
            ranked = pc.sort_indices(keys, sort_keys=[("c", direction), ("i", direction)])
            yield from table.take(ranked).to_batches()
        heads = [h for h in heads if (h.batch and h.at < h.batch.num_rows) or h.advance()]
    for head in heads:
        assert head.batch is not None
        yield head.batch.slice(head.at)
        yield from head.more


@dataclass(frozen=True)
class FollowedRead:
    """How a partition's scan is asked of a node, and where the map that replaces it is."""

    where: str  # the cluster's map in etcd
    path: str  # the index's scan path
    access: Access
    timeout: float
    num_vbuckets: int
    reverse: bool = False
    id_at: int = 0

    def read(
        self,
        node: str,
        url: str,
        mine: frozenset[int],
        params: dict[str, Any],
        at_plus: dict[str, int],
    ) -> Iterator[pa.RecordBatch]:
        """The batches of `node`'s scan (`params` with `collation=hex`) of `mine`, and if it
        fails, the rest from the nodes the map makes active for them instead, read at least
        at `at_plus`."""
        asked = params
        failure = ""
        deadline = time.monotonic() + FAILOVER_WAIT_S
        while True:
            last: tuple[bytes, str] | None = None
            try:
                for batch in self._batches(node, url, mine, asked):
                    if batch.num_rows:
                        last = _orders(batch.slice(batch.num_rows - 1), self.id_at)[0]
                        yield batch
                return
            except NodeFailed as exc:
                if last is not None or not failure:  # the first of a node's failures is said
                    failure = str(exc)
            # The rest: after the last row had, from whoever is active for `mine` now.
            asked = {k: v for k, v in asked.items() if k not in ("pin", "consistency", "timeout")}
            if last is not None:
                entry = last[0] + entry_tail(last[1].encode())
                asked = resumed_after(asked, entry, self.reverse)
                deadline = time.monotonic() + FAILOVER_WAIT_S
            while (owners := self._owners(mine)) is None or owners == {(node, url): mine}:
                if time.monotonic() >= deadline:
                    raise IndexerSourceError(
                        f"{failure}; no other node became active for its vbuckets within "
                        f"{FAILOVER_WAIT_S:g} s"
                    )
                time.sleep(RETRY_S)
                if owners is not None:  # the map has not moved yet: ask the node again
                    break
            else:
                log.warning(
                    "%s; %s answer the rest of its %d vbuckets",
                    failure,
                    ", ".join(name for name, _ in owners),
                    len(mine),
                )
                failure = ""
            assert owners is not None
            shares = {
                owner: {**asked, "vbuckets": ",".join(vbucket_ranges(sorted(share))),
                        "at_plus": json.dumps(vector_of(at_plus, share))}
                for owner, share in owners.items()
            }  # fmt: skip
            if len(owners) == 1:
                ((node, url),) = owners
                mine = owners[(node, url)]
                asked = shares[(node, url)]
                continue
            parts = [
                self.read(name, where, share, shares[(name, where)], at_plus)
                for (name, where), share in owners.items()
            ]
            yield from merge_batches(parts, self.id_at, self.reverse)
            return

    def _owners(self, mine: frozenset[int]) -> dict[tuple[str, str], frozenset[int]] | None:
        """The active node of each of `mine` in the map now, with its share; None if the map
        cannot be read or some of them have no live active node in it."""
        try:
            now = load_map(self.where)
        except ClusterMapError as exc:
            log.warning("reading the map to fail a node over: %s", exc)
            return None
        owners = {}
        for n in now.active_nodes:
            share = mine & frozenset(n.vbuckets)
            if share:
                owners[(n.name, n.base_url(self.access.tls))] = share
        if frozenset().union(*owners.values()) != mine:
            return None
        return owners

    def _batches(
        self, node: str, url: str, mine: frozenset[int], params: dict[str, Any]
    ) -> Iterator[pa.RecordBatch]:
        """One node's scan, as Arrow batches; NodeFailed if the node is down or gone."""
        try:
            response = request(
                "GET",
                url,
                self.path,
                params=params,
                accept=ARROW_STREAM,
                timeout=self.timeout,
                access=self.access,
            )
        except ClientError as exc:
            if exc.status in (None, 503):
                raise NodeFailed(f"node {node}: {exc}") from None
            raise IndexerSourceError(f"node {node}: {exc}") from None
        with response:
            if "pin" not in params:  # a takeover: the node must be active for its share now
                num = self.num_vbuckets
                for header, what in ((VBUCKETS_HEADER, "holds"), (ACTIVE_HEADER, "is active for")):
                    said = response.headers.get(header)
                    if said is None:
                        continue
                    has = set(parse_vbuckets(said.split(","), num, node)) if said else set()
                    if mine - has:
                        raise NodeFailed(
                            f"node {node} no longer {what} {len(mine - has)} of the vbuckets asked"
                        )
            try:
                yield from pa.ipc.open_stream(response)
            except (pa.ArrowInvalid, OSError, http.client.HTTPException) as exc:
                raise NodeFailed(
                    f"node {node}: indexer at {url}: the scan stream broke off: {exc}"
                ) from None
