"""Moving vbuckets between nodes without a gap: plan, catch up, hand over.

A change of owners (rebalance, remove-node) is two transactions on the map's revision. The
first writes the plan: each vbucket that changes owner is `building` on its new owner, which
then receives it from the routers' source logs while the owner now still answers scans for it.
Once every new owner's readable snapshot has reached what the old owner had (read in that order,
each poll), the second transaction hands every moving vbucket over in one map. A merged scan
reads each vbucket from the node the map it read names, and reads the map again if that node
has given it up since (indexer/cluster/scan.py, `scan_cluster`), so no scan during the move
misses or repeats a row. The plan stays in the map until the hand-over: a command stopped
halfway is resumed (`--resume`) or dropped (`--abort`) by the next one.
"""

from __future__ import annotations

import dataclasses
import ssl
import time
from collections.abc import Callable, Sequence
from typing import Any

from indexer.cluster.etcd import EtcdError
from indexer.cluster.map import ClusterMap, ClusterMapError, ClusterNode
from indexer.cluster.store import EtcdMap, handed_over, map_document, planned

POLL_S = 0.3  # how often the nodes' snapshots are compared while they catch up
SAY_EVERY_S = 5.0  # a line of progress this often


def in_progress(cluster: ClusterMap) -> ClusterMapError:
    moving = cluster.moves
    to = sorted({dst for _, dst in moving.values()})
    return ClusterMapError(
        f"a rebalance is in progress ({len(moving)} vbuckets moving to {', '.join(to)}): "
        "wait for it, or run `indexer cluster rebalance --resume` (or --abort)"
    )


def stable_seqnos(client: Any, node: ClusterNode, tls: bool) -> list[int] | None:
    """The seqnos of the node's readable snapshot, or None if it cannot say (down, or none
    yet)."""
    import httpx

    try:
        answer = client.get(node.base_url(tls) + "/snapshots")
    except httpx.HTTPError:
        return None
    if answer.status_code != 200:
        return None
    stable = answer.json().get("stable")
    return None if stable is None else list(stable["seqnos"])


def behind(cluster: ClusterMap, client: Any, tls: bool) -> dict[str, int]:
    """For each node vbuckets move to, how many have not caught up with their owner yet: the
    owner's snapshot is read first, then the new owner's, which must have reached it."""
    moving = cluster.moves
    sources = {src for src, _ in moving.values()}
    had = {name: stable_seqnos(client, cluster.node(name), tls) for name in sorted(sources)}
    count: dict[str, int] = {}
    for dst in sorted({dst for _, dst in moving.values()}):
        now = stable_seqnos(client, cluster.node(dst), tls)
        count[dst] = 0
        for vb, (src, to) in moving.items():
            if to != dst:
                continue
            # An owner that cannot say (down) is not waited for: its replicas' failover and
            # the routers' logs are what the new owner catches up from.
            owner_had = had[src]
            wanted = 0 if owner_had is None else owner_had[vb]
            if now is None or now[vb] < wanted:
                count[dst] += 1
    return count


@dataclasses.dataclass
class Mover:
    """Carries out a change of owners on the map in etcd (see the module's doc)."""

    etcd_map: EtcdMap
    say: Callable[[str], None]
    timeout_s: float = 600.0
    token: str | None = None
    ssl_context: ssl.SSLContext | None = None

    def start(
        self, make: Callable[[ClusterMap], ClusterMap], leaving: Sequence[str] = ()
    ) -> tuple[ClusterMap, int]:
        """Plan the change from the map to `make(map)`, wait for the new owners, hand over."""

        def plan(now: ClusterMap | None) -> ClusterMap:
            if now is None:
                where = self.etcd_map.location
                raise ClusterMapError(f"{where}: no map yet (indexer cluster init)")
            if now.moves:
                raise in_progress(now)
            first = planned(now, make(now))
            return first if first.moves else handed_over(first, leaving)

        cluster, revision = self.etcd_map.change(plan)
        if not cluster.moves:
            return cluster, revision
        moving = cluster.moves
        to = ", ".join(sorted({dst for _, dst in moving.values()}))
        self.say(
            f"map revision {revision}: {len(moving)} vbuckets move to {to}; they receive them "
            "while their owners answer, and take them over once caught up"
        )
        return self.finish(leaving)

    def abort(self) -> tuple[ClusterMap, int]:
        """Drop the plan in progress: the vbuckets stay with their owners."""

        def drop(now: ClusterMap | None) -> ClusterMap:
            if now is None or not now.moves:
                raise ClusterMapError(f"{self.etcd_map.location}: no rebalance in progress")
            nodes = tuple(dataclasses.replace(n, building=()) for n in now.nodes)
            return dataclasses.replace(now, nodes=nodes)

        return self.etcd_map.change(drop)

    def finish(self, leaving: Sequence[str] = ()) -> tuple[ClusterMap, int]:
        """Wait until every new owner has caught up, then hand over in one transaction on the
        revision that was compared."""
        import httpx

        from indexer.client import bearer

        deadline = time.monotonic() + self.timeout_s
        said_at = time.monotonic()
        verify: ssl.SSLContext | bool = self.ssl_context if self.ssl_context is not None else True
        headers = bearer(self.token)
        tls = self.ssl_context is not None
        with httpx.Client(timeout=10, headers=headers, verify=verify) as client:
            while True:
                try:
                    cluster, revision = self.etcd_map.read()
                except EtcdError as exc:
                    raise ClusterMapError(
                        f"{exc}; the plan stays in the map: `indexer cluster rebalance --resume` "
                        "goes on once etcd answers"
                    ) from None
                if not cluster.moves:
                    raise ClusterMapError(
                        f"{self.etcd_map.location}: the rebalance was ended by another change "
                        f"(map revision {revision})"
                    )
                lagging = behind(cluster, client, tls)
                if not any(lagging.values()):
                    final = handed_over(cluster, leaving)
                    key, document = self.etcd_map.key, map_document(final)
                    if self.etcd_map.client.put_if(key, document, revision):
                        written: tuple[ClusterMap, int] = self.etcd_map.read()
                        return written
                    continue  # the map changed meanwhile (a failover): compare again
                now = time.monotonic()
                if now >= deadline:
                    waiting = ", ".join(f"{n} ({k} vbuckets)" for n, k in lagging.items() if k)
                    raise ClusterMapError(
                        f"after {self.timeout_s:g} s still catching up: {waiting}; the plan "
                        "stays in the map: `indexer cluster rebalance --resume` waits again, "
                        "--abort drops it"
                    )
                if now - said_at >= SAY_EVERY_S:
                    said_at = now
                    self.say(
                        "catching up: "
                        + ", ".join(f"{n} {k} vbuckets behind" for n, k in lagging.items())
                    )
                time.sleep(POLL_S)
