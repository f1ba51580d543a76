"""Failover: a replica takes over the vbuckets of its active node once that node's
registration is gone (its lease expired: killed, or stopped for longer than the TTL).

Each replica watches the registrations. When its active node has been unregistered for a
whole TTL, the replica writes, in one transaction on the map's revision, a map in which it is
the active node of those vbuckets and the old node is gone. Of several replicas the first
transaction wins; the others find the map changed and become replicas of the winner. The old
node is fenced: its name is no longer in the map, so it owns nothing if it is still running
and a restart under that name is refused. Nothing acknowledged is lost: the routers keep every
mutation in their source logs, and stream the new active node what it lacks from its own
seqnos on."""

from __future__ import annotations

import dataclasses
import logging
import time

import trio

from indexer.cluster.etcd import EtcdError, EtcdLocation, watch
from indexer.cluster.map import ClusterMap, ClusterMapError
from indexer.cluster.store import EtcdMap

log = logging.getLogger("indexer.cluster")


def promoted(cluster: ClusterMap, replica: str, failed: str) -> ClusterMap:
    """The map with `replica` active in place of `failed`, and the other replicas of `failed`
    replicas of it."""
    nodes = []
    for node in cluster.nodes:
        if node.name == failed:
            continue
        if node.name == replica:
            node = dataclasses.replace(node, replica_of=None)
        elif node.replica_of == failed:
            node = dataclasses.replace(node, replica_of=replica)
        nodes.append(node)
    return ClusterMap(cluster.num_vbuckets, tuple(nodes))


async def watch_for_failover(location: EtcdLocation, name: str, ttl_s: float) -> None:
    """On node `name`: while it is a replica, take over from its active node once that node
    has been unregistered for `ttl_s` seconds. Runs until cancelled."""
    etcd_map = EtcdMap(location)
    missing_since: float | None = None
    while True:
        try:
            cluster, _ = await trio.to_thread.run_sync(etcd_map.read)
            me = cluster.node(name)
            active = me.replica_of
            if active is not None:
                if active in await trio.to_thread.run_sync(etcd_map.registered):
                    missing_since = None
                elif missing_since is None:
                    missing_since = time.monotonic()
                elif time.monotonic() - missing_since >= ttl_s:
                    await _take_over(etcd_map, name, active)
                    missing_since = None
                    continue
        except (ClusterMapError, EtcdError) as exc:
            log.warning("failover watch: %s", exc)
        await _next_change(location, max(0.5, ttl_s / 4))


async def _take_over(etcd_map: EtcdMap, name: str, failed: str) -> None:
    def make(now: ClusterMap | None) -> ClusterMap:
        if now is None:
            raise ClusterMapError(f"{etcd_map.location}: the cluster map was deleted")
        me = now.node(name)
        if me.replica_of != failed:  # another replica took over first: follow the map
            return now
        return promoted(now, name, failed)

    cluster, revision = await trio.to_thread.run_sync(etcd_map.change, make)
    if cluster.node(name).replica_of is None:
        log.warning(
            "failover: node %s's lease expired; this node %s is active for its %d vbuckets "
            "(map revision %d)",
            failed,
            name,
            len(cluster.node(name).vbuckets),
            revision,
        )


async def _next_change(location: EtcdLocation, most_s: float) -> None:
    """Until a registration or the map changes, or `most_s` passes."""
    with trio.move_on_after(most_s):
        try:
            async for _, events in watch(location, location.key(""), 0, prefix=True):
                if events:
                    return
        except EtcdError:
            await trio.sleep(most_s)
