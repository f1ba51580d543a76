"""Slice changes: a node started from a cluster map follows the map as it changes (rebalance).

When the map gives this node vbuckets it did not own, it accepts them from then on: routers are
asked to handshake again, learn the new slice, and stream those vbuckets from seqno 0 (the
router reads its source log), so nothing of them is lost. When the map takes vbuckets away, the
node writes what it had received, deletes the documents of those vbuckets from every index,
forgets their seqnos (a later return starts from 0 again), persists, and refuses them from then
on (NOT_MY_SLICE). A node receives the vbuckets moving to it in a rebalance (`building`) as its
own; each snapshot records the vbuckets it holds, so a merged scan reads each vbucket from the
node its map names and reads the map again when that node has given it up
(indexer/cluster/moves.py).
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Sequence
from pathlib import Path

import trio

from indexer.catalog import IndexCatalog
from indexer.cluster.map import ClusterMapError
from indexer.cluster.standing import ClusterStanding
from indexer.cluster.store import map_source
from indexer.keys import entry_tail
from indexer.protocol import ErrorCode
from indexer.storage import IndexStore, StoredIndex
from workers.flush import BackIndexCache, entry_counts

log = logging.getLogger("indexer.slices")

MAP_WAIT_S = 30.0  # the map is read again at least this often (a file's every 2 s)


def delete_vbuckets(
    store: IndexStore,
    indexes: Sequence[StoredIndex],
    cache: BackIndexCache,
    vbuckets: set[int],
    num_vbuckets: int,
    batch_size: int = 10_000,
) -> int:
    """Delete every entry of the documents in `vbuckets` from every index (blocking); how many
    documents."""
    gone: set[bytes] = set()
    for index in indexes:
        prefix_main = index.main_prefix
        puts: list[tuple[bytes, bytes]] = []
        deletes: list[bytes] = []
        for docid, back in store.back_entries(index):
            if zlib.crc32(docid) % num_vbuckets in vbuckets:
                gone.add(docid)
                deletes.append(index.back_prefix + docid)
                tail = entry_tail(docid)
                deletes.extend(prefix_main + key + tail for key in index.entry_keys(back))
                if len(deletes) >= batch_size:
                    store.write(puts, deletes)
                    deletes = []
        store.write(puts, deletes)
    cache.forget(gone)
    return len(gone)


class SliceWatch:
    """Re-reads the cluster map and applies changes of this node's slice (see module doc);
    tells `standing` what the map makes this node active for."""

    def __init__(
        self,
        where: Path | str,
        node: str,
        catalog: IndexCatalog,
        cache: BackIndexCache,
        standing: ClusterStanding | None = None,
    ) -> None:
        self.source = map_source(where)
        self.node = node
        self.catalog = catalog
        self.cache = cache
        self.standing = standing
        self.changes = 0

    def _owned(self) -> set[int]:
        registry = self.catalog.reader.registry
        return {vb for vb, flag in enumerate(registry.owned) if flag}

    def _read(self, force: bool = False) -> tuple[set[int], frozenset[int]] | None:
        """What this node receives and what it is active for in the map, if it changed (or
        `force`), else None (errors logged). Blocking (etcd is asked over HTTP): in a thread."""
        try:
            cluster = self.source.changed(force)
            if cluster is None:
                return None
            if cluster.num_vbuckets != len(self.catalog.reader.registry.owned):
                raise ClusterMapError(f"{self.source}: num_vbuckets changed")
            if all(n.name != self.node for n in cluster.nodes):
                # Removed from the map: it owns nothing.
                log.warning(
                    "%s: node %s is no longer in the map: it owns nothing now",
                    self.source,
                    self.node,
                )
                return set(), frozenset()
            me = cluster.node(self.node)
            return set(me.receives), frozenset(me.vbuckets)
        except ClusterMapError as exc:
            log.error("%s; keeping this node's vbuckets", exc)
            return None

    async def run(self) -> None:
        await self._follow(True, first=True)  # the map the node started with
        while True:
            reread = await self._wait()
            await self._follow(reread)

    async def _follow(self, force: bool, first: bool = False) -> None:
        read_at = time.monotonic()
        found = await trio.to_thread.run_sync(self._read, force)
        if found is None:
            return
        wanted, active = found
        if wanted != self._owned() and not first:
            await self.apply(wanted)
        if self.standing is not None:
            self.standing.map_read(active, read_at)

    async def _wait(self) -> bool:
        """Until the map changes, MAP_WAIT_S pass, or the standing asks for a read (True)."""
        standing = self.standing
        if standing is None:
            await self.source.wait_change(MAP_WAIT_S)
            return False
        asked = False
        async with trio.open_nursery() as race:

            async def change() -> None:
                await self.source.wait_change(MAP_WAIT_S)
                race.cancel_scope.cancel()

            async def reread() -> None:
                nonlocal asked
                await standing.reread.wait()
                asked = True
                race.cancel_scope.cancel()

            race.start_soon(change)
            race.start_soon(reread)
        return asked

    async def apply(self, wanted: set[int]) -> None:
        """Own exactly `wanted` from now on."""
        catalog = self.catalog
        reader = catalog.reader
        registry = reader.registry
        timekeeper = catalog.timekeeper
        owned = self._owned()
        added, removed = wanted - owned, owned - wanted
        started = time.monotonic()
        deleted = 0

        async def hand_over() -> None:
            nonlocal deleted
            await timekeeper.drain_all()  # what was received for them is written first
            if removed:
                # Snapshots from here on do not hold them (their documents are being deleted):
                # a merged scan that asks for them reads the map again (cluster.scan.scan_cluster).
                # Until their documents are gone, snapshots made meanwhile leave them out of
                # every answer, also one that does not ask for some vbuckets alone.
                snapshots = timekeeper.snapshots
                snapshots.leaving.update(removed)
                for vb in removed:
                    registry.owned[vb] = 0
                n = len(registry.owned)
                try:
                    deleted = await trio.to_thread.run_sync(
                        delete_vbuckets, catalog.store, list(catalog.indexes), self.cache, removed,
                        n,
                    )  # fmt: skip
                finally:
                    snapshots.leaving.difference_update(removed)
                counts = await trio.to_thread.run_sync(
                    entry_counts, catalog.store, list(catalog.indexes), self.cache
                )
                timekeeper.reset_vbuckets(removed, counts)
                if timekeeper.retention is not None:
                    await trio.to_thread.run_sync(timekeeper.retention.history.restart, removed)
                for vb in removed:
                    registry.received[vb] = 0
                    registry.failover_logs.pop(vb, None)
                await timekeeper.republish(force=True)
                await timekeeper.persist()

        def switch() -> None:
            for vb in added:
                registry.owned[vb] = 1
            for vb in removed:
                registry.owned[vb] = 0

        await catalog.change_pipeline(
            switch,
            hand_over,
            ErrorCode.SLICE_CHANGED,
            "this node's vbuckets changed: handshake again",
        )
        self.changes += 1
        log.info(
            "cluster map: now %d vbuckets here (+%d, -%d; %d documents of the removed ones "
            "deleted) in %.2f s",
            len(wanted),
            len(added),
            len(removed),
            deleted,
            time.monotonic() - started,
        )
