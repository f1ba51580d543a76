"""The cluster map: which indexer node owns which vbuckets (its slice), and scans over all nodes.

A map is a TOML file:

    num_vbuckets = 1024
    [nodes.a]
    feed = "127.0.0.1:9105"        # where routers connect
    http = "127.0.0.1:9102"        # the node's HTTP API
    vbuckets = ["0-511"]           # numbers and "first-last" ranges
    [nodes.b]
    feed = "127.0.0.1:9205"
    http = "127.0.0.1:9202"
    vbuckets = ["512-1023"]

Every vbucket belongs to exactly one active node, and to `num_replicas` replicas on other nodes
(`replicas = [...]` on each node: the vbuckets it holds as a replica). A replica receives its
vbuckets from the routers as the active node does, with its own store, snapshots and history;
scans read each vbucket from its active node only, and a failover makes a replica active. A node
with `replica_of = "a"` (and no `vbuckets`) is shorthand for a replica of all of node a's
vbuckets. During a rebalance a node's `building` vbuckets are moving to it: it receives them from
the routers while their owner still answers for them, and the rebalance hands them over once it
has caught up. `indexer serve --cluster-map F --node a` takes its slice and ports from it, `indexer
router --cluster-map F` streams to every node (each gets only its vbuckets), and `indexer scan
--cluster-map F` fans a scan out to every active node and merges the rows in index order
(`merge_rows`): a document lives in one vbucket, so in one node's slice. With a shared token
and TLS (docs/security.md) the scan sends the token to every node and
speaks HTTPS to each.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import logging
import re
import ssl
import time
import tomllib
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import msgspec

from indexer.client import index_path
from indexer.keys import MISSING, encode_key, entry_tail

log = logging.getLogger("indexer.cluster")
NODE_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")


class ClusterMapError(ValueError):
    """The map is unreadable or inconsistent; the message names the key."""


@dataclass(frozen=True)
class ClusterNode:
    """One indexer node: its name, feed address, HTTP address and vbuckets."""

    name: str
    feed: tuple[str, int]
    http: tuple[str, int]
    vbuckets: tuple[int, ...]  # those it is the active node of: scans read them here
    # Vbuckets moving to this node in a rebalance: received, not yet answered for.
    building: tuple[int, ...] = ()
    # Vbuckets it holds as a replica: received as the active node receives them, with its own
    # store, snapshots and history, and made active by a failover; scans do not read them here.
    replicas: tuple[int, ...] = ()

    @property
    def receives(self) -> tuple[int, ...]:
        """What the routers stream to this node: its vbuckets, its replicas and those moving
        to it."""
        return tuple(sorted({*self.vbuckets, *self.building, *self.replicas}))

    @property
    def role(self) -> str:
        """How `cluster status` names it: active, replica, both, or empty."""
        if self.vbuckets:
            return "active+replica" if self.replicas else "active"
        return "replica" if self.replicas else "empty"

    @property
    def feed_address(self) -> str:
        return f"{self.feed[0]}:{self.feed[1]}"

    @property
    def url(self) -> str:
        return f"http://{self.http[0]}:{self.http[1]}"

    def base_url(self, tls: bool = False) -> str:
        """The node's HTTP API, over HTTPS when `tls`."""
        return f"{'https' if tls else 'http'}://{self.http[0]}:{self.http[1]}"


@dataclass(frozen=True)
class ClusterMap:
    num_vbuckets: int
    nodes: tuple[ClusterNode, ...]
    # How many replicas of each vbucket a rebalance places (on nodes other than its active one).
    num_replicas: int = 0

    @property
    def active_nodes(self) -> tuple[ClusterNode, ...]:
        """The nodes scans and change feeds read: those that are some vbucket's active owner."""
        return tuple(n for n in self.nodes if n.vbuckets)

    @property
    def moves(self) -> dict[int, tuple[str, str]]:
        """The moves of a rebalance in progress: vbucket -> (its owner now, the node it goes to)."""
        return {vb: (self.owner(vb).name, node.name) for node in self.nodes for vb in node.building}

    def replica_holders(self, vbucket: int) -> tuple[ClusterNode, ...]:
        """The nodes that hold `vbucket` as a replica."""
        return tuple(n for n in self.nodes if vbucket in n.replicas)

    def node(self, name: str) -> ClusterNode:
        for node in self.nodes:
            if node.name == name:
                return node
        known = ", ".join(n.name for n in self.nodes)
        raise ClusterMapError(f"no node named {name!r} in the map (nodes: {known})")

    def owner(self, vbucket: int) -> ClusterNode:
        for node in self.active_nodes:
            if vbucket in node.vbuckets:
                return node
        raise ClusterMapError(f"vbucket {vbucket} has no node")


def _address(value: Any, key: str) -> tuple[str, int]:
    if isinstance(value, str):
        host, sep, port = value.rpartition(":")
        if sep and host and port.isdigit() and 0 < int(port) < 65536:
            return host, int(port)
    raise ClusterMapError(f"{key}: {value!r} is not HOST:PORT")


def parse_vbuckets(spec: Any, num: int, key: str) -> tuple[int, ...]:
    """Vbucket numbers and "first-last" ranges (or "all") as a sorted tuple."""
    if spec == "all":
        return tuple(range(num))
    if not isinstance(spec, list) or not spec:
        raise ClusterMapError(f'{key}: must be "all" or a list of vbuckets and "first-last" ranges')
    owned: set[int] = set()
    for item in spec:
        if isinstance(item, int) and not isinstance(item, bool):
            first = last = item
        elif isinstance(item, str) and re.fullmatch(r"\d+-\d+", item):
            first, last = (int(x) for x in item.split("-"))
        else:
            raise ClusterMapError(f"{key}: {item!r} is neither a vbucket nor a range like '0-511'")
        if not 0 <= first <= last < num:
            raise ClusterMapError(f"{key}: {item!r} is outside 0-{num - 1}")
        owned.update(range(first, last + 1))
    return tuple(sorted(owned))


def vbucket_ranges(vbuckets: Sequence[int]) -> list[str]:
    """Sorted vbuckets as the map writes them: "first-last" ranges."""
    ranges: list[str] = []
    start = previous = -2
    for vb in sorted(vbuckets):
        if vb != previous + 1:
            if start >= 0:
                ranges.append(f"{start}-{previous}")
            start = vb
        previous = vb
    if start >= 0:
        ranges.append(f"{start}-{previous}")
    return ranges


def parse_cluster_map(text: str, source: str = "cluster map") -> ClusterMap:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ClusterMapError(f"{source}: not valid TOML: {exc}") from None
    return cluster_map_from(raw, source)


def cluster_map_from(raw: Any, source: str) -> ClusterMap:
    """A map from its tables (a file's TOML, or the JSON etcd holds), checked."""
    if not isinstance(raw, dict):
        raise ClusterMapError(f"{source}: the map is a table of num_vbuckets and nodes")
    unknown = set(raw) - {"num_vbuckets", "num_replicas", "nodes"}
    if unknown:
        raise ClusterMapError(f"{source}: {sorted(unknown)[0]}: unknown key")
    num = raw.get("num_vbuckets", 1024)
    if not isinstance(num, int) or isinstance(num, bool) or not 1 <= num <= 65536:
        raise ClusterMapError(f"{source}: num_vbuckets: a whole number from 1 to 65536")
    tables = raw.get("nodes")
    if not isinstance(tables, dict) or not tables:
        raise ClusterMapError(f"{source}: nodes: at least one [nodes.NAME] table")
    nodes = []
    owner: dict[int, str] = {}
    builder: dict[int, str] = {}  # vbucket -> the node it moves to
    whole_node: dict[str, str] = {}  # a replica of all of a node's vbuckets -> that node
    for name, table in tables.items():
        key = f"{source}: nodes.{name}"
        if not NODE_NAME.match(name):
            raise ClusterMapError(f"{key}: a node name is a letter then letters, digits, _ or -")
        if not isinstance(table, dict):
            raise ClusterMapError(f"{key}: must be a table")
        extra = set(table) - {"feed", "http", "vbuckets", "replica_of", "building", "replicas"}
        if extra:
            raise ClusterMapError(f"{key}.{sorted(extra)[0]}: unknown key")
        replica_of = table.get("replica_of")
        if replica_of is not None:
            if not isinstance(replica_of, str) or replica_of not in tables or replica_of == name:
                raise ClusterMapError(f"{key}.replica_of: {replica_of!r} is not another node")
            for held in ("vbuckets", "building", "replicas"):
                if held in table:
                    raise ClusterMapError(
                        f"{key}.{held}: a replica holds the vbuckets of nodes.{replica_of}"
                    )
            table = {**table, "vbuckets": []}  # filled in below, from its active node
        for needed in ("feed", "http", "vbuckets"):
            if needed not in table:
                raise ClusterMapError(f"{key}.{needed}: missing")
        # A node just added holds none until a rebalance gives it its share.
        vbuckets = (
            ()
            if table["vbuckets"] == []
            else parse_vbuckets(table["vbuckets"], num, f"{key}.vbuckets")
        )
        for vb in vbuckets:
            if vb in owner:
                raise ClusterMapError(
                    f"{key}.vbuckets: vbucket {vb} is also in nodes.{owner[vb]}.vbuckets"
                )
            owner[vb] = name
        building: tuple[int, ...] = ()
        if table.get("building", []) != []:
            building = parse_vbuckets(table["building"], num, f"{key}.building")
            if set(building) & set(vbuckets):
                both = min(set(building) & set(vbuckets))
                raise ClusterMapError(f"{key}.building: vbucket {both} is in its vbuckets already")
            for vb in building:
                if vb in builder:
                    raise ClusterMapError(
                        f"{key}.building: vbucket {vb} is moving to nodes.{builder[vb]} too"
                    )
                builder[vb] = name
        replicas: tuple[int, ...] = ()
        if table.get("replicas", []) != []:
            replicas = parse_vbuckets(table["replicas"], num, f"{key}.replicas")
            if set(replicas) & set(vbuckets):
                both = min(set(replicas) & set(vbuckets))
                raise ClusterMapError(
                    f"{key}.replicas: vbucket {both} is in its vbuckets: a replica is on "
                    "another node than the active one"
                )
        if replica_of is not None:
            whole_node[name] = replica_of
        nodes.append(
            ClusterNode(
                name,
                _address(table["feed"], f"{key}.feed"),
                _address(table["http"], f"{key}.http"),
                vbuckets,
                building,
                replicas,
            )
        )
    for i, node in enumerate(nodes):
        if node.name in whole_node:
            active = whole_node[node.name]
            if active in whole_node:
                raise ClusterMapError(
                    f"{source}: nodes.{node.name}.replica_of: nodes.{active} is a replica itself"
                )
            whole = next(n for n in nodes if n.name == active)
            nodes[i] = dataclasses.replace(node, replicas=whole.vbuckets)
    missing = [vb for vb in range(num) if vb not in owner]
    if missing:
        raise ClusterMapError(
            f"{source}: {len(missing)} vbuckets have no node (the first: {missing[0]})"
        )
    counts = [0] * num
    for node in nodes:
        for vb in node.replicas:
            counts[vb] += 1
    wanted = raw.get("num_replicas", max(counts))
    if not isinstance(wanted, int) or isinstance(wanted, bool) or not 0 <= wanted < len(nodes):
        raise ClusterMapError(
            f"{source}: num_replicas: a whole number from 0 to {len(nodes) - 1} (one less than "
            "the nodes: each replica is on another node)"
        )
    return ClusterMap(num, tuple(nodes), wanted)


def load_cluster_map(path: Path) -> ClusterMap:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ClusterMapError(f"{path}: cannot read: {exc.strerror}") from None
    return parse_cluster_map(text, str(path))


class ClusterMapFile:
    """A map file looked at again and again (by a router, by a node that follows it)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None

    def changed(self, force: bool = False) -> ClusterMap | None:
        """The map if the file changed since the last look (or `force`), else None.

        Raises ClusterMapError when the file cannot be read or is not a valid map.
        """
        try:
            stat = self.path.stat()
        except OSError as exc:
            raise ClusterMapError(f"{self.path}: cannot read: {exc.strerror}") from None
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp == self._stamp and not force:
            return None
        self._stamp = stamp
        return load_cluster_map(self.path)


def row_order(row: dict[str, Any], desc: Sequence[bool] = ()) -> tuple[bytes, bytes]:
    """Where a scan row (`{"key": [...], "id": ...}`, `missing` positions) sorts in an index:
    its encoded key (`desc`: the key positions stored descending), then its docid's bytes, as
    the main index orders entries."""
    missing = set(row.get("missing", ()))
    values = [MISSING if i in missing else v for i, v in enumerate(row["key"])]
    return encode_key(values, desc), str(row["id"]).encode()


MEMO_KEYS = 65_536  # distinct keys whose encoding a merge remembers


def _row_orders(desc: Sequence[bool]) -> Callable[[dict[str, Any]], tuple[bytes, bytes]]:
    """`row_order` that encodes each distinct key once (rows share keys: an index of cities has
    a few hundred among millions of rows). The values' types are part of what is remembered,
    as 1 and True are equal in Python but not in the index's collation."""
    memo: dict[tuple[Any, ...], bytes] = {}

    def order(row: dict[str, Any]) -> tuple[bytes, bytes]:
        try:
            seen = (*((type(v), v) for v in row["key"]), tuple(row.get("missing", ())))
            encoded = memo.get(seen)
        except TypeError:  # an array or object among the values: not hashable
            return row_order(row, desc)
        if encoded is None:
            if len(memo) >= MEMO_KEYS:
                memo.clear()
            encoded = memo[seen] = row_order(row, desc)[0]
        return encoded, str(row["id"]).encode()

    return order


def merge_rows(
    streams: Iterable[Iterable[dict[str, Any]]], desc: Sequence[bool] = (), reverse: bool = False
) -> Iterator[dict[str, Any]]:
    """The rows of several nodes' scans (each in index order, or with `reverse` the other way)
    as one scan in that order."""
    return heapq.merge(*streams, key=_row_orders(desc), reverse=reverse)


def ndjson_rows(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """Rows of NDJSON lines (msgspec's decoder: a third of json's time a row; json's where it
    refuses what json takes, such as a lone surrogate's escape)."""
    decode = msgspec.json.decode
    for line in lines:
        if line.strip():
            try:
                row: dict[str, Any] = decode(line)
            except msgspec.DecodeError:
                row = json.loads(line)
            yield row


class ClusterScanError(Exception):
    """A node refused or failed a fanned-out scan; the message names the node."""


class ClusterMapMoved(ClusterScanError):
    """A node no longer holds vbuckets the scan's map gives it (a rebalance handed them over):
    read the map again and scan again. Raised before any row."""


class ClusterNodeDown(ClusterScanError):
    """A node did not answer, or answered that it cannot now (503: fenced, short of memory):
    in a cluster that fails over, read the map again and scan again. Raised before any row."""


def answered_for(
    rows: Iterator[dict[str, Any]], vbuckets: frozenset[int], num_vbuckets: int
) -> Iterator[dict[str, Any]]:
    """The rows of documents in `vbuckets` (a node's answer holds others too during a move)."""
    for row in rows:
        if zlib.crc32(str(row["id"]).encode()) % num_vbuckets in vbuckets:
            yield row


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
) -> Iterator[Iterator[dict[str, Any]]]:
    """Every active node's scan of `index` with the same parameters, merged in index order.

    All nodes are asked at once and read as the merge needs them (each node streams its rows in
    order, so the merge holds one row per node). `limit` is applied to the merged rows too.
    `token` goes to every node as a bearer token; with `ssl_context` the nodes are asked over
    HTTPS and their certificates checked with it (`transport`: httpx's, for its socket options).

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
    with (
        httpx.Client(timeout=timeout, headers=headers, verify=verify, transport=transport)
        as client,
        ExitStack() as stack,
    ):  # fmt: skip
        desc: tuple[bool, ...] = ()

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

        def node_rows(
            node: ClusterNode, mine: frozenset[int], params: dict[str, Any]
        ) -> Iterator[dict[str, Any]]:
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
            rows = ndjson_rows(response.iter_lines())
            return answered_for(rows, mine, num) if held - mine else rows

        def taken_over(
            node: ClusterNode, mine: frozenset[int], rows: Iterator[dict[str, Any]]
        ) -> Iterator[dict[str, Any]]:
            """`rows`, and if the node fails part way, the rest from the nodes replacing it."""
            last: dict[str, Any] | None = None
            try:
                for row in rows:
                    last = row
                    yield row
                return
            except httpx.HTTPError as exc:
                failure = f"node {node.name} failed during the scan: {exc}"
                if follow is None or "spans" in params:
                    raise ClusterScanError(failure) from None
            rest = {k: v for k, v in params.items() if k != "limit"}  # the merge counts rows
            if last is not None:
                entry = row_order(last, desc)[0] + entry_tail(str(last["id"]).encode())
                if reverse:
                    given = bytes.fromhex(rest.get("stop", "")) or None
                    rest["stop"] = (entry if given is None else min(entry, given)).hex()
                else:
                    after = entry + b"\x00"  # the first entry after it
                    rest["start"] = max(after, bytes.fromhex(rest.get("start", ""))).hex()
            deadline = time.monotonic() + failover_wait_s
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
                            (n, share, node_rows(n, share, rest)) for n, share in owners.items()
                        ]
                    except ClusterScanError as exc:
                        failure = f"{failure}; then {exc}"
                    else:
                        resumed = [taken_over(n, share, part) for n, share, part in parts]
                        yield from merge_rows(resumed, desc, reverse)
                        return
                if time.monotonic() >= deadline:
                    raise ClusterScanError(
                        f"{failure}; no other node became active for its vbuckets within "
                        f"{failover_wait_s:g} s"
                    )
                time.sleep(0.2)

        streams: list[Iterator[dict[str, Any]]] = []
        for node in cluster.active_nodes:
            base = node.base_url(ssl_context is not None)
            if not streams:  # the order of the index's keys, to merge the nodes' rows by
                try:
                    described = client.get(base + index_path(index))
                except httpx.HTTPError as exc:
                    raise ClusterNodeDown(f"node {node.name} ({base}): {exc}") from None
                if described.status_code == 200:
                    desc = tuple(k.endswith(" DESC") for k in described.json().get("keys", ()))
            mine = frozenset(node.vbuckets)
            streams.append(taken_over(node, mine, node_rows(node, mine, params)))
        merged = merge_rows(streams, desc, reverse)
        limit = params.get("limit")
        yield merged if limit is None else islice(merged, int(limit))
