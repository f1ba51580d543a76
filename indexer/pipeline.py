"""The daemon's pipeline as one object, and the one way to pause it between two epochs of the
stream: `Pipeline.quiesced`.

An index created or dropped, a build merged, a node's vbuckets changed and a rollback all need
the same thing first: every router connection closed with an error frame saying why, and
everything those routers sent queued in the workers (an `IndexChange` marker sent after it has
reached every worker). Then the change runs, one at a time, and routers may connect again,
handshaking with the index definitions of the new epoch.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import trio

from indexer.protocol import ErrorCode, IndexDefinition
from indexer.reader import Reader
from indexer.snapshots import SnapshotStore
from indexer.storage import IndexStore, StoredIndex
from indexer.streams import IndexChange, StreamItem, StreamRegistry
from indexer.timekeeper import Timekeeper
from workers.flush import BackIndexCache
from workers.worker import Worker


class PipelineClosed(Exception):
    """The daemon is shutting down: the pipeline takes nothing more."""


@dataclass
class Pipeline:
    """The stages a change of the stream's epoch stops and touches."""

    store: IndexStore
    indexes: list[StoredIndex]  # the live list, shared with the HTTP API: changed in place
    registry: StreamRegistry
    reader: Reader
    workers: list[Worker]
    timekeeper: Timekeeper
    snapshots: SnapshotStore
    cache: BackIndexCache
    items: trio.MemorySendChannel[list[StreamItem]]  # into the dispatcher
    data_dir: Path
    lock: trio.Lock = field(default_factory=trio.Lock)  # one change at a time

    @asynccontextmanager
    async def quiesced(
        self,
        code: ErrorCode,
        reason: str,
        keep: int | None = None,
        columns: Callable[[], Sequence[IndexDefinition]] | None = None,
    ) -> AsyncIterator[None]:
        """Close every router connection but `keep` with `code` and `reason`, wait until all
        they sent is in the worker queues, and run the body (under the pipeline's lock); then
        let routers connect again, handshaking with `columns()` (by default, as before).
        PipelineClosed if the daemon is shutting down."""
        async with self.lock:
            self.reader.close_connections(code, reason, keep=keep)
            try:
                await self.reader.wait_connected(at_most=0 if keep is None else 1)
                marker = IndexChange(len(self.workers))
                try:
                    async with self.items.clone() as items:
                        await items.send([marker])
                except trio.ClosedResourceError:
                    raise PipelineClosed("the daemon is shutting down") from None
                await marker.wait()
                yield
            finally:
                self.reader.reopen(None if columns is None else columns())
