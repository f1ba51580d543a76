"""Compaction of the index store: on a schedule and on demand, with its effect reported.

LevelDB compacts in the background as it writes, but deleted and overwritten entries (updated
keys, dropped indexes, pruned undo records) keep their space until their level is compacted
again. A full `compact_range` rewrites every level and frees it. It runs in a worker thread (plyvel
releases the GIL), so scans and flushes go on; LevelDB serialises it with its own compactions.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import trio

from indexer.storage import IndexStore

log = logging.getLogger("indexer.compaction")


def disk_bytes(path: Path) -> int:
    """Bytes of the files in a LevelDB directory (blocking)."""
    total = 0
    for entry in path.iterdir():
        try:
            if entry.is_file():
                total += entry.stat().st_size
        except FileNotFoundError:  # a file LevelDB deleted meanwhile
            continue
    return total


@dataclass(frozen=True)
class CompactionResult:
    """One compaction: the store's size on disk before and after, and how long it took."""

    bytes_before: int
    bytes_after: int
    seconds: float
    finished_at: float
    reason: str  # "scheduled" or "requested"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def compact_store(store: IndexStore, reason: str) -> CompactionResult:
    """Compact every level of the store and measure its effect (blocking)."""
    started = time.monotonic()
    before = disk_bytes(store.path)
    store.compact()
    after = disk_bytes(store.path)
    return CompactionResult(before, after, time.monotonic() - started, time.time(), reason)


class Compactor:
    """Runs compactions one at a time: every `interval_s` (0: never) and when asked."""

    def __init__(self, store: IndexStore, interval_s: float) -> None:
        self.store = store
        self.interval_s = interval_s
        self._lock = trio.Lock()
        self.runs = 0
        self.last: CompactionResult | None = None

    @property
    def running(self) -> bool:
        return self._lock.locked()

    async def compact(self, reason: str = "requested") -> CompactionResult:
        """Compact now (after a compaction already running, if any)."""
        async with self._lock:
            result = await trio.to_thread.run_sync(compact_store, self.store, reason)
            self.runs += 1
            self.last = result
        log.info(
            "compacted the store (%s): %d -> %d bytes in %.2f s",
            reason,
            result.bytes_before,
            result.bytes_after,
            result.seconds,
        )
        return result

    async def run(self) -> None:
        """Compact on the schedule until cancelled."""
        if self.interval_s <= 0:
            return
        while True:
            await trio.sleep(self.interval_s)
            await self.compact("scheduled")

    def statistics(self) -> dict[str, Any]:
        return {
            "interval_s": self.interval_s,
            "runs": self.runs,
            "running": self.running,
            "last": None if self.last is None else self.last.as_dict(),
        }
