"""Failover: when a node's registration is gone (its lease expired: killed, or stopped for
longer than the TTL), replicas take over the vbuckets it was active for.

Every node watches the registrations. Once a node that is some vbucket's active owner has been
unregistered for GRACE_S (its lease's TTL has run out already), each live node computes, and
tries to write in one transaction on the map's revision, the map in which every such vbucket is
active on its most caught-up live replica (the one whose readable snapshot has the highest seqno
of it). The first transaction wins; the others find the map changed and nothing left to do. The
failed node stays in the map as a replica of what it lost: it is fenced (it answers for nothing
it was replaced on), and when it comes back it catches up from the routers' logs like any
replica. A vbucket with no live replica stays where it is, and scans of it fail naming its node
until that node returns. Nothing acknowledged is lost: the routers keep every mutation in their
source logs, and stream the new active node what it lacks from its own seqnos on
(docs/cluster.md)."""

from __future__ import annotations

import dataclasses
import logging
import ssl
import time
from collections.abc import Mapping

import trio

from indexer.cluster.etcd import EtcdError, EtcdLocation, watch
from indexer.cluster.map import ClusterMap, ClusterMapError, ClusterNode
from indexer.cluster.store import EtcdMap

log = logging.getLogger("indexer.cluster")

IDLE_CHECK_S = 30.0  # with every node registered, the registrations are read again this often
GRACE_S = 0.5  # how long a node's registration stays gone before its replicas take over
Seqnos = Mapping[str, list[int] | None]  # node -> its readable snapshot's seqnos (None: unknown)


def failed_over(cluster: ClusterMap, failed: str, live: set[str], seqnos: Seqnos) -> ClusterMap:
    """The map with each vbucket `failed` is active for made active on its live replica with
    the highest seqno of it (of equals, the first by name), and `failed` a replica of those.
    Moves to or from `failed` are dropped; vbuckets with no live replica stay on it."""
    gone = cluster.node(failed)
    promoted: dict[int, str] = {}
    for vb in gone.vbuckets:
        holders = [n.name for n in cluster.replica_holders(vb) if n.name in live]

        def caught_up(name: str, vb: int = vb) -> tuple[int, str]:
            found = seqnos.get(name)
            return (-1 if found is None else -found[vb], name)

        if holders:
            promoted[vb] = min(holders, key=caught_up)
    moves = cluster.moves
    nodes: list[ClusterNode] = []
    for node in cluster.nodes:
        gains = {vb for vb, name in promoted.items() if name == node.name}
        if node.name == failed:
            node = dataclasses.replace(
                node,
                vbuckets=tuple(vb for vb in node.vbuckets if vb not in promoted),
                replicas=tuple(sorted({*node.replicas, *promoted})),
                building=(),
            )
        else:
            # A move from the failed node is over: the vbucket is active elsewhere now.
            building = tuple(
                vb for vb in node.building if moves[vb][0] != failed and vb not in gains
            )
            node = dataclasses.replace(
                node,
                vbuckets=tuple(sorted({*node.vbuckets, *gains})),
                replicas=tuple(vb for vb in node.replicas if vb not in gains),
                building=building,
            )
        nodes.append(node)
    return dataclasses.replace(cluster, nodes=tuple(nodes))


async def watch_for_failover(
    location: EtcdLocation,
    name: str,
    ttl_s: float,
    token: str | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> None:
    """On node `name`: fail over every active node whose lease (of `ttl_s` seconds) has run
    out (see the module's doc). Runs until cancelled."""
    etcd_map = EtcdMap(location)
    missing_since: dict[str, float] = {}
    while True:
        wait_s = 1.0  # etcd did not answer: soon again
        try:
            cluster, _ = await trio.to_thread.run_sync(etcd_map.read)
            live = set(await trio.to_thread.run_sync(etcd_map.registered))
            now = time.monotonic()
            down = {n.name for n in cluster.active_nodes if n.name not in live}
            missing_since = {n: missing_since.get(n, now) for n in down}
            if name in live:  # a node that is itself unregistered decides nothing
                for failed, since in sorted(missing_since.items()):
                    # Its lease has run out already: a short grace rides out a registration
                    # being written again (a restart of the node).
                    if now - since >= min(ttl_s, GRACE_S):
                        await _take_over(etcd_map, name, failed, live, token, ssl_context)
            # A registration that goes is an event; a node missing now is looked at again soon.
            wait_s = GRACE_S / 2 if missing_since else IDLE_CHECK_S
        except (ClusterMapError, EtcdError) as exc:
            log.warning("failover watch: %s", exc)
        await _next_change(location, wait_s)


async def _take_over(
    etcd_map: EtcdMap,
    name: str,
    failed: str,
    live: set[str],
    token: str | None,
    ssl_context: ssl.SSLContext | None,
) -> None:
    cluster, _ = await trio.to_thread.run_sync(etcd_map.read)
    holders = {
        n
        for vb in cluster.node(failed).vbuckets
        for n in (h.name for h in cluster.replica_holders(vb))
        if n in live
    }
    seqnos = await trio.to_thread.run_sync(_seqnos_of, cluster, holders, token, ssl_context)

    def make(now: ClusterMap | None) -> ClusterMap:
        if now is None:
            raise ClusterMapError(f"{etcd_map.location}: the cluster map was deleted")
        return failed_over(now, failed, live, seqnos)

    before = len(cluster.node(failed).vbuckets)
    after, revision = await trio.to_thread.run_sync(etcd_map.change, make)
    left = len(after.node(failed).vbuckets)
    if left < before:
        log.warning(
            "failover: node %s's lease expired; its replicas are active for %d of its "
            "vbuckets now (map revision %d, decided by node %s)%s",
            failed,
            before - left,
            revision,
            name,
            f"; {left} have no live replica and wait for it" if left else "",
        )


def _seqnos_of(
    cluster: ClusterMap,
    names: set[str],
    token: str | None,
    ssl_context: ssl.SSLContext | None,
) -> dict[str, list[int] | None]:
    """Each named node's readable snapshot's seqnos (None where it cannot say). Blocking."""
    import httpx

    from indexer.client import bearer
    from indexer.cluster.moves import stable_seqnos

    verify: ssl.SSLContext | bool = ssl_context if ssl_context is not None else True
    tls = ssl_context is not None
    with httpx.Client(timeout=5, headers=bearer(token), verify=verify) as client:
        return {n: stable_seqnos(client, cluster.node(n), tls) for n in sorted(names)}


async def _next_change(location: EtcdLocation, most_s: float) -> None:
    """Until a registration or the map changes, or `most_s` passes."""
    with trio.move_on_after(most_s):
        try:
            async for _, events in watch(location, location.key(""), 0, prefix=True):
                if events:
                    return
        except EtcdError:
            await trio.sleep(most_s)
