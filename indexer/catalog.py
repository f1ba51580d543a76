"""The index catalog: creating and dropping indexes while the daemon runs.

Records carry one key per index, so a change of the index set happens between two epochs of
the stream: routers are closed with INDEXES_CHANGED and new connections wait; an IndexChange
marker follows everything already received through the dispatcher to every worker; all queued
records are written with the old definitions; then the writers, the back-index cache and the
handshake switch to the new set, and routers reconnect, learn it, and resume from their restart
timestamp (the daemon skips what it already has).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from indexer.protocol import ErrorCode, IndexDefinition
from indexer.reader import Reader
from indexer.storage import IndexStore, StoredIndex, StoreError
from indexer.timekeeper import Timekeeper
from workers.flush import BackIndexCache, IndexWriter
from workers.worker import IndexChange, StreamItem, Worker

log = logging.getLogger("indexer.catalog")


class CatalogError(Exception):
    """A create or drop that cannot be done; `status` is the HTTP status that says why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class IndexCatalog:
    """The live set of indexes, and the one place that changes it."""

    def __init__(
        self,
        store: IndexStore,
        indexes: list[StoredIndex],
        reader: Reader,
        workers: list[Worker],
        timekeeper: Timekeeper,
        cache: BackIndexCache,
        items: trio.MemorySendChannel[list[StreamItem]],
        lock: trio.Lock | None = None,
    ) -> None:
        self.store = store
        self.indexes = indexes  # shared with the HTTP API's view: changed in place
        self.reader = reader
        self.workers = workers
        self.timekeeper = timekeeper
        self.cache = cache
        self.items = items
        self._lock = lock or trio.Lock()  # shared with the rollback: one change at a time

    async def create(self, definition: IndexDefinition) -> StoredIndex:
        if any(i.definition.name == definition.name for i in self.indexes):
            raise CatalogError(409, f"an index named {definition.name!r} exists")
        created: list[StoredIndex] = []

        def apply() -> None:
            stored = self.store.create_index(definition)
            created.append(stored)
            self.indexes.append(stored)
            self.cache.add_index()
            self.timekeeper.entry_counts.append(0)

        await self._change(apply)
        log.info(
            "index %s(%s)%s created: it indexes mutations streamed from now on",
            definition.name,
            ", ".join(definition.keys),
            "" if definition.where is None else f" WHERE {definition.where}",
        )
        return created[0]

    async def drop(self, name: str) -> None:
        position = next((j for j, i in enumerate(self.indexes) if i.definition.name == name), None)
        if position is None:
            raise CatalogError(404, f"no index named {name!r}")
        dropped: list[StoredIndex] = []

        def apply() -> None:
            dropped.append(self.store.drop_index(name))
            del self.indexes[position]
            self.cache.remove_index(position)
            del self.timekeeper.entry_counts[position]

        await self._change(apply)
        deleted = await trio.to_thread.run_sync(self.store.delete_entries, dropped[0])
        log.info("index %s dropped: %d entries deleted", name, deleted)

    async def _change(self, apply: Callable[[], None]) -> None:
        async with self._lock:
            self.reader.close_connections(
                ErrorCode.INDEXES_CHANGED, "index definitions changed: handshake again"
            )
            try:
                while self.reader.connected:
                    await trio.sleep(0.01)
                marker = IndexChange(len(self.workers))
                try:
                    async with self.items.clone() as items:
                        await items.send([marker])
                except trio.ClosedResourceError:
                    raise CatalogError(503, "the daemon is shutting down") from None
                await marker.wait()

                def switch() -> None:
                    try:
                        apply()
                    except StoreError as exc:
                        raise CatalogError(409, str(exc)) from None
                    for worker in self.workers:
                        worker.writer = IndexWriter(
                            self.store, self.indexes, self.cache, worker.writer.undo
                        )

                await self.timekeeper.drain_all(switch)
            finally:
                self.reader.reopen([i.definition for i in self.indexes])
