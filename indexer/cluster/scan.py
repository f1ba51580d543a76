"""A scan across the cluster: every active node's part of an index, merged in index order.

Each node answers for the vbuckets the map makes it active for (`vbuckets=` when it holds others
too), and streams its rows in index order as NDJSON. The merge reads the nodes' answers in runs
of rows, one network chunk at a time, decoded by msgspec in one call, and never compares rows
one by one in Python: the nodes send each row's key as the index orders it (`collation=hex`,
the bytes of its entry), so a run of rows that sorts before every other node's next rows is
found by a binary search and passed on whole, and overlapping runs are merged by one `sorted`
over their orders (timsort merges presorted runs in C).

A node that fails while it streams is taken over by the nodes that replace it in the map, from
the row after its last one (the entry the collation and the docid give); one that refuses before
any row, or no longer holds what the map says, makes the caller read the map again.
"""

from __future__ import annotations

import json
import logging
import ssl
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from itertools import chain, islice
from pathlib import Path
from typing import Any

import msgspec

from indexer.client import index_path
from indexer.cluster.map import ClusterMap, ClusterNode, parse_vbuckets, vbucket_ranges
from indexer.cluster.store import NODE_TTL_S, load_map
from indexer.keys import MISSING, encode_key, entry_tail

log = logging.getLogger("indexer.cluster")

Row = dict[str, Any]


class ClusterScanError(Exception):
    """A node refused or failed a fanned-out scan; the message names the node."""


class ClusterMapMoved(ClusterScanError):
    """A node no longer holds vbuckets the scan's map gives it (a rebalance handed them over):
    read the map again and scan again. Raised before any row."""


class ClusterNodeDown(ClusterScanError):
    """A node did not answer, or answered that it cannot now (503: fenced, short of memory):
    in a cluster that fails over, read the map again and scan again. Raised before any row."""


def row_order(row: Row, desc: Sequence[bool] = ()) -> tuple[bytes, bytes]:
    """Where a scan row (`{"key": [...], "id": ...}`, `missing` positions) sorts in an index:
    its encoded key (`desc`: the key positions stored descending), then its docid's bytes, as
    the main index orders entries."""
    missing = set(row.get("missing", ()))
    values = [MISSING if i in missing else v for i, v in enumerate(row["key"])]
    return encode_key(values, desc), str(row["id"]).encode()


# A row's order as the merge compares it (`collation=hex`): its key's collation in hex, a space,
# its docid. Hex digits sort above the space, so a key that is a prefix of another sorts first as
# its bytes do, and equal keys sort by docid (str order is UTF-8's byte order): the order of the
# entries' bytes.
ORDER_SEPARATOR = " "


def orders_of(rows: list[Row], desc: Sequence[bool] = ()) -> list[str]:
    """Each row's order, its `collation` taken out of it (for rows without one, as in tests,
    their keys encoded here with `desc`)."""
    try:
        return [r.pop("collation") for r in rows]
    except KeyError:
        pass
    orders = []
    for r in rows:
        order = r.pop("collation", None)
        if order is None:
            order = row_order(r, desc)[0].hex() + ORDER_SEPARATOR + str(r.get("id", ""))
        orders.append(order)
    return orders


def resume_entry(order: str) -> bytes:
    """The entry (key and docid, after the index prefix) of the row whose order this is."""
    collation, _, docid = order.partition(ORDER_SEPARATOR)
    return bytes.fromhex(collation) + entry_tail(docid.encode())


def resumed_after(params: dict[str, Any], entry: bytes, reverse: bool) -> dict[str, Any]:
    """A scan's parameters (`start`, `stop` in hex) narrowed to the entries after `entry`
    (before it, with `reverse`): the rest of a scan whose last row was that entry's."""
    rest = dict(params)
    if reverse:
        given = bytes.fromhex(rest.get("stop", "")) or None
        rest["stop"] = (entry if given is None else min(entry, given)).hex()
    else:
        after = entry + b"\x00"  # the first entry after it
        rest["start"] = max(after, bytes.fromhex(rest.get("start", ""))).hex()
    return rest


@dataclass(slots=True)
class RowRun:
    """Consecutive rows of one node's answer, in index order, with their orders (`orders_of`;
    empty when nothing is merged with them)."""

    rows: list[Row]
    orders: list[str]


def ndjson_batches(chunks: Iterable[bytes]) -> Iterator[list[Row]]:
    """The rows of an NDJSON stream, a list per chunk of complete lines (one msgspec call a
    chunk; json's decoder for a chunk msgspec refuses, such as one with a lone surrogate's
    escape)."""
    decoder = msgspec.json.Decoder()
    left = b""
    for chunk in chunks:
        end = chunk.rfind(b"\n")
        if end < 0:
            left += chunk
            continue
        lines, left = left + chunk[: end + 1], chunk[end + 1 :]
        try:
            rows: list[Row] = decoder.decode_lines(lines)
        except msgspec.DecodeError:
            rows = [json.loads(line) for line in lines.splitlines() if line.strip()]
        if rows:
            yield rows
    if left.strip():
        yield [json.loads(left)]


def _cut(orders: list[str], bound: str, at: int, reverse: bool) -> int:
    """The end of the rows from `at` that come no later than `bound` (orders ascending, or
    descending with `reverse`)."""
    lo, hi = at, len(orders)
    while lo < hi:
        mid = (lo + hi) // 2
        if (orders[mid] >= bound) if reverse else (orders[mid] <= bound):
            lo = mid + 1
        else:
            hi = mid
    return lo


class _Head:
    """A stream being merged: its current run and how far it was taken."""

    __slots__ = ("at", "more", "run")

    def __init__(self, run: RowRun, more: Iterator[RowRun]) -> None:
        self.run, self.more, self.at = run, more, 0

    def advance(self) -> bool:
        """The next run with rows; False at the end of the stream."""
        for run in self.more:
            if run.rows:
                self.run, self.at = run, 0
                return True
        return False


def merge_runs(streams: Iterable[Iterator[RowRun]], reverse: bool = False) -> Iterator[RowRun]:
    """The rows of several streams of runs (each in index order, or with `reverse` the other
    way) as one stream in that order, a run at a time. Every row's order is distinct: each
    comes from one node."""
    heads = []
    for stream in streams:
        head = _Head(RowRun([], []), stream)
        if head.advance():
            heads.append(head)
    while len(heads) > 1:
        lasts = [h.run.orders[-1] for h in heads]
        bound = max(lasts) if reverse else min(lasts)
        parts = []
        for head in heads:
            cut = _cut(head.run.orders, bound, head.at, reverse)
            if cut > head.at:
                parts.append(RowRun(head.run.rows[head.at : cut], head.run.orders[head.at : cut]))
                head.at = cut
        if len(parts) == 1:
            yield parts[0]
        else:
            orders = list(chain.from_iterable(p.orders for p in parts))
            rows = list(chain.from_iterable(p.rows for p in parts))
            ranked = sorted(range(len(orders)), key=orders.__getitem__, reverse=reverse)
            yield RowRun([rows[i] for i in ranked], [orders[i] for i in ranked])
        heads = [h for h in heads if h.at < len(h.run.rows) or h.advance()]
    for head in heads:
        yield RowRun(head.run.rows[head.at :], head.run.orders[head.at :])
        yield from head.more


def answered_for(
    batches: Iterator[list[Row]], vbuckets: frozenset[int], num_vbuckets: int
) -> Iterator[list[Row]]:
    """The rows of documents in `vbuckets` (a node's answer holds others too during a move)."""
    for rows in batches:
        yield [r for r in rows if zlib.crc32(str(r["id"]).encode()) % num_vbuckets in vbuckets]


def _ranges(said: str | None, default: frozenset[int], num: int) -> frozenset[int]:
    """The vbuckets a node's header names ("" none; no header: `default`)."""
    if said is None:
        return default
    return frozenset(parse_vbuckets(said.split(","), num, "")) if said else frozenset()


@contextmanager
def scan_cluster(
    cluster: ClusterMap,
    index: str,
    params: dict[str, Any],
    timeout: float,
    *,
    token: str | None = None,
    ssl_context: ssl.SSLContext | None = None,
    follow: Callable[[], ClusterMap] | None = None,
    failover_wait_s: float = 0.0,
    transport: Any = None,
) -> Iterator[Iterator[Row]]:
    """Every active node's scan of `index` with the same parameters, merged in index order.

    All nodes are asked at once and read as the merge needs them (each node streams its rows in
    order, so the merge holds a chunk of rows per node). `limit` is applied to the merged rows
    too. `token` goes to every node as a bearer token; with `ssl_context` the nodes are asked
    over HTTPS and their certificates checked with it (`transport`: httpx's, for its socket
    options).

    Each vbucket is read from the one node the map gives it to, whatever else nodes hold: a
    node's answer says which vbuckets its snapshot holds (VBUCKETS_HEADER). Rows of the others
    (moving to it in a rebalance, or given up since the map was read) are left out, and a node
    that no longer holds all of its own raises ClusterMapMoved. So a scan during a rebalance
    neither misses nor repeats a row.

    With `follow` (the map as it is now), a node that fails while it streams is taken over:
    once the map makes other nodes active for its vbuckets (a failover, within
    `failover_wait_s`), they are asked for those vbuckets' rows after the last one it sent, and
    the scan goes on with every row once. A scan of `spans` fails instead.
    """
    import httpx

    from indexer.client import ACTIVE_HEADER, VBUCKETS_HEADER, bearer, error_text

    headers = bearer(token)
    # Plain HTTP checks no certificate: loading the CA bundle would cost more than a small scan.
    verify: ssl.SSLContext | bool = ssl_context if ssl_context is not None else False
    num = cluster.num_vbuckets
    reverse = params.get("order") == "desc"
    active = cluster.active_nodes
    collated = {**params, "collation": "hex"}
    with (
        httpx.Client(timeout=timeout, headers=headers, verify=verify, transport=transport)
        as client,
        ExitStack() as stack,
    ):  # fmt: skip

        def open_scan(node: ClusterNode, asked: dict[str, Any]) -> httpx.Response:
            base = node.base_url(ssl_context is not None)
            url = base + index_path(index, "scan")
            try:
                response = stack.enter_context(client.stream("GET", url, params=asked))
            except httpx.HTTPError as exc:
                raise ClusterNodeDown(f"node {node.name} ({base}): {exc}") from None
            if response.status_code != 200:
                message = error_text(response.read())
                error = ClusterNodeDown if response.status_code == 503 else ClusterScanError
                raise error(f"node {node.name} ({base}): HTTP {response.status_code}: {message}")
            return response

        def node_runs(
            node: ClusterNode, mine: frozenset[int], params: dict[str, Any]
        ) -> Iterator[RowRun]:
            """The node's rows of `mine`, checked against what it says it holds."""
            asked = params
            if set(node.receives) != mine:  # it holds others too: it leaves them out
                asked = {**params, "vbuckets": ",".join(vbucket_ranges(sorted(mine)))}
            while True:
                response = open_scan(node, asked)
                held = _ranges(response.headers.get(VBUCKETS_HEADER), mine, num)
                if mine - held:
                    raise ClusterMapMoved(
                        f"node {node.name} no longer holds {len(mine - held)} of its vbuckets "
                        "in the map (a rebalance moved them): read the map again"
                    )
                answers = _ranges(response.headers.get(ACTIVE_HEADER), mine, num)
                if mine - answers:
                    raise ClusterMapMoved(
                        f"node {node.name} is no longer active for {len(mine - answers)} of "
                        "its vbuckets in the map (a failover moved them): read the map again"
                    )
                if held - mine and "limit" in asked:
                    # Its first rows may be others' (it receives them too): read on past them.
                    response.close()
                    asked = {k: v for k, v in asked.items() if k != "limit"}
                    continue
                break
            batches = ndjson_batches(response.iter_bytes())
            if held - mine:  # only its own count here
                batches = answered_for(batches, mine, num)
            if "collation" not in params:
                return (RowRun(rows, []) for rows in batches)
            return (RowRun(rows, orders_of(rows)) for rows in batches)

        def taken_over(
            node: ClusterNode, mine: frozenset[int], runs: Iterator[RowRun]
        ) -> Iterator[RowRun]:
            """`runs`, and if the node fails part way, the rest from the nodes replacing it."""
            last = ""
            try:
                for run in runs:
                    if run.orders:
                        last = run.orders[-1]
                    yield run
                return
            except httpx.HTTPError as exc:
                failure = f"node {node.name} failed during the scan: {exc}"
                if follow is None or "spans" in params:
                    raise ClusterScanError(failure) from None
            rest = {k: v for k, v in collated.items() if k != "limit"}  # the merge counts rows
            if last:
                rest = resumed_after(rest, resume_entry(last), reverse)
            deadline = time.monotonic() + failover_wait_s
            why = failure
            while True:
                now = follow()
                owners = {
                    n: frozenset(mine & set(n.vbuckets))
                    for n in now.active_nodes
                    if n.name != node.name and mine & set(n.vbuckets)
                }
                if set().union(*owners.values()) == mine:
                    log.warning(
                        "%s; %s answer the rest of its %d vbuckets",
                        failure,
                        ", ".join(n.name for n in owners),
                        len(mine),
                    )
                    try:
                        parts = [
                            taken_over(n, share, node_runs(n, share, rest))
                            for n, share in owners.items()
                        ]
                    except ClusterScanError as exc:  # before any row: try again
                        why = f"{failure}; then {exc}"
                    else:
                        yield from merge_runs(parts, reverse)
                        return
                if time.monotonic() >= deadline:
                    raise ClusterScanError(
                        f"{why}; no other node became active for its vbuckets within "
                        f"{failover_wait_s:g} s"
                    )
                time.sleep(0.2)

        # Rows are merged, and so need their orders, with more than one node, or when a node
        # that fails may be taken over by several.
        merging = len(active) > 1 or follow is not None
        asked = collated if merging else params
        streams: list[Iterator[RowRun]] = []
        for node in active:
            mine = frozenset(node.vbuckets)
            streams.append(taken_over(node, mine, node_runs(node, mine, asked)))
        merged = chain.from_iterable(run.rows for run in merge_runs(streams, reverse))
        limit = params.get("limit")
        yield merged if limit is None else islice(merged, int(limit))


MAP_MOVED_TRIES = 10  # a merged scan reads the map again at most this often while it moves


@contextmanager
def scan_the_cluster(
    where: str | Path,
    index: str,
    params: dict[str, Any],
    timeout: float,
    *,
    token: str | None = None,
    ssl_context: ssl.SSLContext | None = None,
    failover_wait_s: float | None = None,
    transport: Any = None,
) -> Iterator[Iterator[dict[str, Any]]]:
    """`scan_cluster` on the map at `where` as it is now, read again and scanned again while a
    rebalance hands vbuckets over under it (ClusterMapMoved comes before any row). In a cluster
    in etcd a node that does not answer is waited for until its replicas take over, for at most
    `failover_wait_s` (default: twice the lease's TTL and 5 s), and one that fails while it
    streams is taken over by its replicas from its last row on; a map file has no failover."""
    in_etcd = str(where).startswith("etcd:")
    if failover_wait_s is None:
        failover_wait_s = 2 * NODE_TTL_S + 5 if in_etcd else 0.0
    follow = (lambda: load_map(where)) if in_etcd else None
    deadline = time.monotonic() + failover_wait_s
    attempt = 0
    while True:
        cluster = load_map(where)
        stack = ExitStack()
        try:
            rows = stack.enter_context(
                scan_cluster(
                    cluster,
                    index,
                    params,
                    timeout,
                    token=token,
                    ssl_context=ssl_context,
                    follow=follow,
                    failover_wait_s=failover_wait_s,
                    transport=transport,
                )
            )
        except ClusterMapMoved:
            stack.close()
            attempt += 1
            if attempt == MAP_MOVED_TRIES:
                raise
            time.sleep(0.1 * attempt)
            continue
        except ClusterNodeDown:
            stack.close()
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)
            continue
        with stack:
            yield rows
        return
