"""The rollback: taking the index back to a recovery point when a source's history diverged.

A router's handshake carries its failover logs; the reader compares them with the index's and,
where the index holds mutations that did not survive a failover, calls this stage. Like an index
change, it happens between two epochs of the stream: every other router is closed with ROLLBACK,
a marker follows everything received through the pipeline, everything queued is written. Then,
with flushes held off, the newest clean recovery point at or below every rollback seqno becomes
the persisted snapshot (the file first, so a crash half way finishes the restore at start-up),
the store is brought back to it with the undo records, or emptied if no point is old enough,
and the timestamps, the back-index cache and the readable snapshot restart from there. Scans
waiting for a snapshot get a rollback error; routers resume from the restored timestamp.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import trio

from indexer.pipeline import Pipeline
from indexer.protocol import ErrorCode
from indexer.recovery import clear, prune, restore
from indexer.snapshots import PersistedState, RecoveryPoint, write_snapshot_file
from indexer.storage import IndexStore, StoredIndex
from indexer.timestamps import StabilityTimestamp
from workers.flush import entry_counts

log = logging.getLogger("indexer.rollback")


def choose_point(state: PersistedState, needs: dict[int, int]) -> RecoveryPoint | None:
    """The newest clean recovery point at or below every rollback seqno; None: back to zero."""
    for point in state.points:
        seqnos = point.timestamp.seqnos
        if point.clean and all(seqnos[vb] <= seqno for vb, seqno in needs.items()):
            return point
    return None


def restore_store(
    store: IndexStore,
    indexes: Sequence[StoredIndex],
    data_dir: Path,
    state: PersistedState,
) -> int:
    """Make the store hold exactly `state.current` (blocking); how many documents changed.

    The state is written first: if the process dies meanwhile, start-up finishes the job from
    the file (`recover_store`).
    """
    write_snapshot_file(data_dir, state)
    return recover_store(store, indexes, data_dir, state)


def recover_store(
    store: IndexStore,
    indexes: Sequence[StoredIndex],
    data_dir: Path,
    state: PersistedState,
) -> int:
    """Undo what the store holds beyond the persisted snapshot (blocking; also at start-up),
    durably: a power cut after it finds the store as it left it, or finishes the undo again.

    Also drops the undo records no kept recovery point needs (an earlier run may have stopped
    before pruning them).
    """
    if state.cleared:
        clear(store, indexes)
        store.sync()  # durable before the file stops saying to clear
        write_snapshot_file(
            data_dir,
            PersistedState(state.current, state.older, state.failover_logs, cleared=False),
        )
        return -1
    reverted = restore(store, indexes, state.current.point)
    prune(store, state.points[-1].point)
    store.sync()  # the undo is durable before anything newer is acknowledged
    return reverted


@dataclass(frozen=True)
class RollbackRecord:
    """One rollback, as `GET /stats` shows the last one."""

    to: str  # "zero" or "recovery point N"
    seqno_sum: int  # of the timestamp the index went back to
    vbuckets: int  # that had diverged
    documents_reverted: int | None  # None: all (the store was emptied)
    seconds: float
    at: float  # wall time it finished


class Rollback:
    """Rolls the whole index back for a router whose history diverged (see module doc)."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.store = pipeline.store
        self.indexes = pipeline.indexes  # the live list, shared with the catalog
        self.registry = pipeline.registry
        self.timekeeper = pipeline.timekeeper
        self.snapshots = pipeline.snapshots
        self.cache = pipeline.cache
        self.data_dir = pipeline.data_dir
        self.count = 0
        self.last: RollbackRecord | None = None
        # Runs after each rollback, pipeline still stopped: index builds start again from zero
        # (what they wrote may belong to the history that did not survive).
        self.restart_builds: Callable[[], Awaitable[None]] | None = None

    async def __call__(self, conn_id: int, needs: dict[int, int]) -> None:
        reason = "the index rolls back after a failover of another router's source: handshake again"
        async with (
            self.pipeline.quiesced(ErrorCode.ROLLBACK, reason, keep=conn_id),
            self.timekeeper.stopped_flushes(),
        ):
            await self._roll_back(needs)
            if self.restart_builds is not None:
                await self.restart_builds()

    async def _roll_back(self, needs: dict[int, int]) -> None:
        started = time.monotonic()
        recovery = self.timekeeper.recovery
        state = recovery.state
        # Without undo records (recovery_points = 0) only going back to zero is exact.
        point = choose_point(state, needs) if recovery.points.enabled else None
        tag = recovery.points.tag
        if point is None:
            zero = StabilityTimestamp.zero(len(self.registry.received))
            target = PersistedState(
                RecoveryPoint(tag + 1, zero, time.time()), (), state.failover_logs, cleared=True
            )
        else:
            older = tuple(p for p in state.older if p.point < point.point)
            target = PersistedState(point, older, state.failover_logs)
        indexes = list(self.indexes)
        reverted = await trio.to_thread.run_sync(
            restore_store, self.store, indexes, self.data_dir, target
        )
        retention = self.timekeeper.retention
        if retention is not None:
            # The history past the point described the history that did not survive.
            history = retention.history
            ts = target.current.timestamp
            await trio.to_thread.run_sync(history.recover, ts, indexes, target.cleared)
            retention.history.latest = await trio.to_thread.run_sync(history.open, ts, indexes)
        if target.cleared:
            target = PersistedState(target.current, (), target.failover_logs)
        self.cache.complete = True
        await trio.to_thread.run_sync(self.cache.load, self.store, indexes)
        counts = await trio.to_thread.run_sync(entry_counts, self.store, indexes, self.cache)
        ts = target.current.timestamp
        self.timekeeper.reset(ts, counts)
        recovery.state = target
        recovery.points.advance(target.current.point)
        self.registry.received[:] = ts.seqnos
        snapshot = self.snapshots.publish(ts, self.store.snapshot(), self.timekeeper.counts())
        self.snapshots.roll_back(snapshot)
        self.count += 1
        self.last = RollbackRecord(
            "zero" if point is None else f"recovery point {point.point}",
            ts.total,
            len(needs),
            None if reverted < 0 else reverted,
            round(time.monotonic() - started, 3),
            time.time(),
        )
        log.warning(
            "rolled back to %s (seqnos summing to %d) for %d diverged vbuckets: "
            "%s documents reverted in %.2f s",
            self.last.to,
            ts.total,
            len(needs),
            "all" if reverted < 0 else reverted,
            self.last.seconds,
        )

    def statistics(self) -> dict[str, Any]:
        """How many rollbacks this run made, and the last one."""
        return {"count": self.count, "last": None if self.last is None else asdict(self.last)}
