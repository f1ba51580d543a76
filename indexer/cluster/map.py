"""The cluster map: which indexer node owns which vbuckets (its slice).

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
(indexer/cluster/scan.py): a document lives in one vbucket, so in one node's slice.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
