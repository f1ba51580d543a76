"""The cluster map in etcd, and where a process finds its map: a file or etcd.

etcd holds one key per cluster for the map, `PREFIX/map` (the map file's tables as JSON), which
changes only by a transaction on its revision: two operators' changes never overwrite each
other, the later one is computed again from the map the earlier one wrote. Each daemon
registers under `PREFIX/nodes/NAME` with a lease it keeps alive: when the daemon dies or stops
for longer than the lease's TTL, its key goes, and `indexer cluster status` says so.
Processes watch the map's key instead of polling it."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import trio

from indexer.cluster.etcd import EtcdClient, EtcdError, EtcdLocation, KeyValue, watch
from indexer.cluster.map import (
    ClusterMap,
    ClusterMapError,
    ClusterMapFile,
    cluster_map_from,
    vbucket_ranges,
)
from indexer.cluster.standing import ClusterStanding

log = logging.getLogger("indexer.cluster")
MAP_POLL_S = 2.0  # how often a map file is looked at again
NODE_TTL_S = 10  # a node's registration outlives it by this much
CHANGE_TRIES = 20  # a change computed again from a map changed meanwhile, at most this often


def map_document(cluster: ClusterMap) -> bytes:
    """The map as etcd holds it: the map file's tables, as JSON."""
    nodes: dict[str, dict[str, Any]] = {}
    for node in cluster.nodes:
        table: dict[str, Any] = {
            "feed": node.feed_address,
            "http": f"{node.http[0]}:{node.http[1]}",
        }
        table["vbuckets"] = vbucket_ranges(node.vbuckets)
        if node.building:
            table["building"] = vbucket_ranges(node.building)
        if node.replicas:
            table["replicas"] = vbucket_ranges(node.replicas)
        nodes[node.name] = table
    document = {
        "num_vbuckets": cluster.num_vbuckets,
        "num_replicas": cluster.num_replicas,
        "nodes": nodes,
    }
    return json.dumps(document).encode()


class EtcdMap:
    """The map of the cluster at `location`, read and changed by transactions."""

    def __init__(self, location: EtcdLocation, client: EtcdClient | None = None) -> None:
        self.location = location
        self.client = client if client is not None else EtcdClient(location)
        self.key = location.key("map")

    def read(self) -> tuple[ClusterMap, int]:
        """The map and the revision it was last changed at; ClusterMapError if there is none."""
        found, _ = self.client.get(self.key)
        if found is None:
            raise ClusterMapError(
                f"{self.location}: no cluster map yet (indexer cluster init --cluster "
                f"{self.location} --from MAP.toml)"
            )
        return self.parse(found.value), found.mod_revision

    def parse(self, value: bytes) -> ClusterMap:
        """The map in the value of its key."""
        try:
            raw = json.loads(value)
        except ValueError:
            raise ClusterMapError(f"{self.location}: the map's key holds no JSON") from None
        return cluster_map_from(raw, str(self.location))

    def change(self, make: Callable[[ClusterMap | None], ClusterMap]) -> tuple[ClusterMap, int]:
        """Write `make(the map now)` (None: there is none) in a transaction on the map's
        revision, again from the new map if another change came first; the map written and
        its revision."""
        for _ in range(CHANGE_TRIES):
            found, _ = self.client.get(self.key)
            now = None if found is None else self.parse(found.value)
            wanted = make(now)
            if found is not None and wanted == now:  # nothing to change: no new revision
                return wanted, found.mod_revision
            at = 0 if found is None else found.mod_revision
            if self.client.put_if(self.key, map_document(wanted), at):
                written, _ = self.client.get(self.key)
                assert written is not None
                return wanted, written.mod_revision
        raise ClusterMapError(
            f"{self.location}: the map changed {CHANGE_TRIES} times while this change was "
            "computed: try again"
        )

    def registered(self) -> dict[str, KeyValue]:
        """The registrations alive now, by node name: a key per node, gone with its lease."""
        found, _ = self.client.get_prefix(self.location.key("nodes") + b"/")
        return {kv.key.rsplit(b"/", 1)[-1].decode(): kv for kv in found}

    def members(self) -> dict[str, dict[str, Any]]:
        """The nodes registered now: what each said of itself, and the seconds its lease has
        left (a request per node: for `status`, not for a loop)."""
        members = {}
        for name, kv in self.registered().items():
            try:
                said = json.loads(kv.value)
            except ValueError:
                said = {}
            said["lease_ttl_s"] = self.client.time_to_live(kv.lease) if kv.lease else None
            members[name] = said
        return members


class MapSource(Protocol):
    """Where a process reads its cluster map, again whenever it may have changed."""

    def load(self) -> ClusterMap: ...

    def changed(self, force: bool = False) -> ClusterMap | None: ...

    async def wait_change(self, most_s: float) -> None: ...

    def __str__(self) -> str: ...


class FileMapSource:
    """A map file, looked at again every MAP_POLL_S."""

    def __init__(self, path: Path) -> None:
        self.file = ClusterMapFile(path)

    def load(self) -> ClusterMap:
        found = self.file.changed(force=True)
        assert found is not None
        return found

    def changed(self, force: bool = False) -> ClusterMap | None:
        return self.file.changed(force)

    async def wait_change(self, most_s: float) -> None:
        await trio.sleep(min(most_s, MAP_POLL_S))

    def __str__(self) -> str:
        return str(self.file.path)


class EtcdMapSource:
    """The map in etcd, watched: `wait_change` returns as soon as the map's key changes."""

    def __init__(self, location: EtcdLocation) -> None:
        self.location = location
        self.map = EtcdMap(location)
        self.revision = 0  # of the map last read

    def load(self) -> ClusterMap:
        try:
            cluster, self.revision = self.map.read()
        except EtcdError as exc:
            raise ClusterMapError(str(exc)) from None
        return cluster

    def changed(self, force: bool = False) -> ClusterMap | None:
        try:
            found, _ = self.map.client.get(self.map.key)
        except EtcdError as exc:
            raise ClusterMapError(str(exc)) from None
        if found is None:
            raise ClusterMapError(f"{self.location}: the cluster map was deleted")
        if found.mod_revision == self.revision and not force:
            return None
        self.revision = found.mod_revision
        return self.map.parse(found.value)

    async def wait_change(self, most_s: float) -> None:
        with trio.move_on_after(most_s):
            try:
                async for _, events in watch(self.location, self.map.key, self.revision + 1):
                    if events:
                        return
            except EtcdError as exc:
                log.warning("%s; reading the map again in %g s", exc, MAP_POLL_S)
                await trio.sleep(MAP_POLL_S)

    def __str__(self) -> str:
        return str(self.location)


def map_source(where: str | Path) -> MapSource:
    """The map at `where`: `etcd://HOST:PORT[,...]/PREFIX`, or a map file's path."""
    text = str(where)
    if text.startswith("etcd:"):
        try:
            return EtcdMapSource(EtcdLocation.parse(text))
        except ValueError as exc:
            raise ClusterMapError(str(exc)) from None
    return FileMapSource(Path(where))


def load_map(where: str | Path) -> ClusterMap:
    """The map at `where` now (a file or etcd); ClusterMapError with one line if there is none."""
    return map_source(where).load()


async def keep_registered(
    location: EtcdLocation,
    name: str,
    said: dict[str, Any],
    ttl_s: int = NODE_TTL_S,
    standing: ClusterStanding | None = None,
) -> None:
    """Register node `name` under a lease and keep it alive until cancelled (then revoke it:
    a node stopped cleanly leaves at once). etcd unreachable: logged, and tried again. What it
    learns of the lease goes to `standing` (indexer/cluster/standing.py)."""
    client = EtcdClient(location)
    key = location.key("nodes", name)
    lease, registered = 0, False
    try:
        while True:
            try:
                left = 0 if lease == 0 else await trio.to_thread.run_sync(client.keep_alive, lease)
                if left <= 0:
                    if lease != 0 and standing is not None:
                        standing.lost()
                        log.warning(
                            "node %s's lease in %s ran out: it answers no read until it has "
                            "registered again and read the map",
                            name,
                            location,
                        )
                    lease, registered = 0, False
                    lease = await trio.to_thread.run_sync(client.grant, ttl_s)
                if not registered:
                    body = json.dumps({**said, "registered_at": time.time()}).encode()
                    await trio.to_thread.run_sync(client.put, key, body, lease)
                    registered = True
                    log.info("registered as node %s in %s (lease %d s)", name, location, ttl_s)
                    if standing is not None:
                        standing.registered_again()
                elif standing is not None:
                    standing.kept_alive()
            except EtcdError as exc:
                if standing is not None:
                    standing.tried()
                # The lease is kept: once etcd answers, it says whether the lease outlived this.
                log.warning("%s; trying again in %d s", exc, max(1, ttl_s // 3))
            await trio.sleep(max(1, ttl_s // 3))
    finally:
        if lease:
            # Shielded: a clean stop leaves at once (else the lease's TTL ends it).
            with trio.CancelScope(shield=True), contextlib.suppress(EtcdError):
                await trio.to_thread.run_sync(client.revoke, lease)
        client.close()


def rebalanced(
    cluster: ClusterMap, names: Sequence[str], num_replicas: int | None = None
) -> ClusterMap:
    """The map with every vbucket active on one of the nodes `names` and held as a replica by
    `num_replicas` others of them (default: the map's number), as evenly as it goes, moving as
    few as it can: each node keeps what it has up to its share, the rest go to those below
    theirs. The other nodes leave the map."""
    num = cluster.num_vbuckets
    wanted_replicas = cluster.num_replicas if num_replicas is None else num_replicas
    if not 0 <= wanted_replicas < len(names):
        raise ClusterMapError(
            f"{wanted_replicas} replicas of each vbucket need {wanted_replicas + 1} nodes; "
            f"the map has {len(names)}"
        )
    order = sorted(names)
    share, extra = divmod(num, len(names))
    targets = {name: share + (1 if i < extra else 0) for i, name in enumerate(order)}
    kept: dict[str, list[int]] = {name: [] for name in names}
    free: list[int] = []
    owners = {vb: node.name for node in cluster.nodes for vb in node.vbuckets}
    for vb in range(num):
        owner = owners.get(vb)
        if owner in kept and len(kept[owner]) < targets[owner]:
            kept[owner].append(vb)
        else:
            free.append(vb)
    for name in order:
        while len(kept[name]) < targets[name]:
            kept[name].append(free.pop(0))
    active = {vb: name for name, vbs in kept.items() for vb in vbs}
    replicas = _replicas_placed(cluster, order, active, wanted_replicas)
    nodes = tuple(
        dataclasses.replace(
            node,
            vbuckets=tuple(sorted(kept[node.name])),
            replicas=tuple(sorted(replicas[node.name])),
        )
        for node in cluster.nodes
        if node.name in kept
    )
    return ClusterMap(num, nodes, wanted_replicas)


def _replicas_placed(
    cluster: ClusterMap, order: Sequence[str], active: dict[int, str], count: int
) -> dict[str, set[int]]:
    """`count` replicas of each vbucket on nodes of `order` other than its active one, each
    node holding about as many as the others: a replica stays where it is while its node is
    below its share, then the vbucket's old active node (which holds its documents) is taken,
    then the node with the fewest."""
    placed: dict[str, set[int]] = {name: set() for name in order}
    if count == 0:
        return placed
    num = cluster.num_vbuckets
    limit = -(-num * count // len(order))  # a node's share, rounded up
    held = {name: set(cluster.node(name).replicas) for name in order if _in(cluster, name)}
    was_active = {vb: n.name for n in cluster.nodes for vb in n.vbuckets}
    for vb in range(num):
        chosen: list[str] = []
        preferred = [name for name in order if vb in held.get(name, ())]
        if was_active.get(vb) in placed:
            preferred.append(was_active[vb])
        for name in preferred:
            fits = len(placed[name]) < limit
            if fits and len(chosen) < count and name != active[vb] and name not in chosen:
                chosen.append(name)
        for name in sorted(order, key=lambda name: (len(placed[name]), name)):
            if len(chosen) < count and name != active[vb] and name not in chosen:
                chosen.append(name)
        for name in chosen:
            placed[name].add(vb)
    # The greedy pass can leave a node over its share where the rest had to go to it: move
    # replicas from nodes over the share to nodes under it, where the vbucket may go.
    while _evened(placed, active):
        pass
    return placed


def _evened(placed: dict[str, set[int]], active: dict[int, str]) -> bool:
    """Move one replica from a node with two or more above another to that one, where the
    vbucket may go; whether one moved."""
    for over in sorted(placed, key=lambda name: (-len(placed[name]), name)):
        for under in sorted(placed, key=lambda name: (len(placed[name]), name)):
            if len(placed[over]) - len(placed[under]) < 2:
                break
            vb = min(
                (vb for vb in placed[over] if active[vb] != under and vb not in placed[under]),
                default=None,
            )
            if vb is not None:
                placed[over].discard(vb)
                placed[under].add(vb)
                return True
    return False


def _in(cluster: ClusterMap, name: str) -> bool:
    return any(node.name == name for node in cluster.nodes)


def planned(cluster: ClusterMap, target: ClusterMap) -> ClusterMap:
    """The first step of a move to `target`: every vbucket that changes owner is `building` on
    its new owner, which receives it from the routers while the owner now still answers for it.
    Replicas go where `target` places them at once (a replica answers no scan), except on a
    vbucket's owner now, which becomes a replica at the hand-over. Nodes that `target` leaves
    out stay until the hand-over (`handed_over`)."""
    wanted = {node.name: node for node in target.nodes}
    nodes = []
    for node in cluster.nodes:
        goal = wanted.get(node.name)
        if goal is None:
            nodes.append(node)
            continue
        gets = set(goal.vbuckets) - set(node.vbuckets)
        replicas = set(goal.replicas) - set(node.vbuckets)
        nodes.append(
            dataclasses.replace(
                node, building=tuple(sorted(gets)), replicas=tuple(sorted(replicas))
            )
        )
    return ClusterMap(cluster.num_vbuckets, tuple(nodes), target.num_replicas)


def handed_over(cluster: ClusterMap, leaving: Sequence[str] = ()) -> ClusterMap:
    """The last step of a move: each moving vbucket leaves its owner for the node that built it,
    in one map (the old owner keeping it as a replica while the vbucket has fewer than the
    map's number); the nodes `leaving` go too, owning nothing now."""
    moves = cluster.moves
    counts = [0] * cluster.num_vbuckets
    for node in cluster.nodes:
        if node.name not in leaving:
            for vb in node.replicas:
                counts[vb] += 1
    nodes = []
    for node in cluster.nodes:
        if node.name in leaving:
            continue
        owns = {vb for vb in node.vbuckets if vb not in moves} | set(node.building)
        kept_as_replica = set()
        for vb in node.vbuckets:
            if vb in moves and counts[vb] < cluster.num_replicas:
                kept_as_replica.add(vb)
                counts[vb] += 1
        replicas = (set(node.replicas) | kept_as_replica) - owns
        nodes.append(
            dataclasses.replace(
                node,
                vbuckets=tuple(sorted(owns)),
                building=(),
                replicas=tuple(sorted(replicas)),
            )
        )
    for name in leaving:
        gone = cluster.node(name)
        still = [vb for vb in gone.vbuckets if vb not in moves]
        if still:
            raise ClusterMapError(f"node {name} still owns {len(still)} vbuckets")
    return ClusterMap(cluster.num_vbuckets, tuple(nodes), cluster.num_replicas)
