"""The timekeeper: the one place that decides what is stable.

Workers raise the high-water timestamp (HWT) of each vbucket as mutations reach their queues.
Every in-memory snapshot interval the timekeeper cuts a stability timestamp aligned to snapshot
markers (a vbucket counts up to the end of its last complete snapshot), has every worker flush
up to it, and publishes it as a readable snapshot. Every persisted snapshot interval it syncs the
store and records the latest readable timestamp in the snapshot file.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import trio

from indexer.changes import ChangeHistory, Mark
from indexer.metrics import FLUSH_BUCKETS_S, PERSIST_LAG_BUCKETS_S, Histogram
from indexer.recovery import FailoverLog, RecoveryPoints
from indexer.snapshots import PersistedState, RecoveryPoint, SnapshotStore, write_snapshot_file
from indexer.storage import IndexStore, StoredIndex, describe
from indexer.timestamps import HighWaterTimestamp, StabilityTimestamp
from workers.flush import FlushResult

log = logging.getLogger("indexer.timekeeper")
PERSIST_FAILURE_LOG_S = 10.0
HISTORY_PRUNE_INTERVAL_S = 30.0  # how often the change history's retention is applied


@dataclass
class Retention:
    """The change history the timekeeper marks at every persist and prunes by age and size."""

    history: ChangeHistory
    keep_s: float
    keep_snapshots: int
    keep_bytes: int | None = None
    next_prune: float = 0.0


class QueueFlusher(Protocol):
    """What the timekeeper asks of a worker: whether its queue is full (a flush is due early),
    and to flush what it holds at or below a timestamp."""

    @property
    def blocked(self) -> bool: ...

    async def flush(self, upto: Sequence[int]) -> FlushResult | None: ...


@dataclass
class Recovery:
    """Recovery points as the timekeeper makes them: undo tag, persisted state, how many kept."""

    points: RecoveryPoints
    state: PersistedState
    keep: int
    failover_logs: Callable[[], dict[int, FailoverLog]] = field(default=dict)


@dataclass(frozen=True)
class TimekeeperStatistics:
    flushes: int
    memory_flushes: int
    mutations_flushed: int
    puts: int
    deletes: int
    entry_counts: tuple[int, ...]
    persist_errors: int = 0  # failed persists (a full disk), each tried again at the next cut
    persist_failing: bool = False  # the last persist failed: acknowledgements wait
    persist_error: str | None = None  # why, while it fails


class Timekeeper:
    """Cuts stability timestamps, drives worker flushes, publishes and persists snapshots."""

    def __init__(
        self,
        hwt: HighWaterTimestamp,
        workers: Sequence[QueueFlusher],
        store: IndexStore,
        snapshots: SnapshotStore,
        data_dir: Path,
        in_memory_interval_s: float,
        persist_interval_s: float,
        entry_counts: Sequence[int],
        indexes: Sequence[StoredIndex] = (),
        recovery: Recovery | None = None,
        retention: Retention | None = None,
    ) -> None:
        self.hwt = hwt
        self.workers = workers
        self.store = store
        self.snapshots = snapshots
        self.data_dir = data_dir
        self.in_memory_interval_s = in_memory_interval_s
        self.persist_interval_s = persist_interval_s
        start = snapshots.persisted
        self._stable = start
        # What the store may hold beyond the stable timestamp after a flush under memory pressure.
        self._store_high = list(start.seqnos)
        self.recovery = recovery or Recovery(
            RecoveryPoints(0, enabled=False), PersistedState(RecoveryPoint(0, start, 0.0)), 0
        )
        self.retention = retention
        self._stopping = trio.Event()
        # Flushes of one worker must not overlap: a later batch could land before an earlier one.
        self._flush_lock = trio.Lock()
        self._flushes = 0
        self._memory_flushes = 0
        self._mutations = 0
        self._puts = 0
        self._deletes = 0
        self.entry_counts = list(entry_counts)
        self.indexes = indexes  # the live list, in the order of entry_counts
        self._persist_failures = 0  # in a row
        self._persist_errors = 0
        self._persist_error: str | None = None
        self._persist_failure_logged = 0.0
        # For /metrics: how long each flush of every worker took, and how old a readable
        # snapshot was when it was persisted (what a crash then would lose, at most).
        self.flush_seconds = Histogram(FLUSH_BUCKETS_S)
        self.persist_lag_seconds = Histogram(PERSIST_LAG_BUCKETS_S)

    def stop(self) -> None:
        """Ask `run` to flush what is stable, persist it and return."""
        self._stopping.set()

    async def run(self) -> None:
        # What the store holds at start is readable at once: the recovered timestamp.
        start = self.snapshots.publish(self._stable, self.store.snapshot(), self.counts())
        self.snapshots.record_persisted(start, 0.0)
        last_persist = trio.current_time()
        # A fixed cadence: a cut that takes long does not push the next one a whole interval away.
        next_cut = trio.current_time() + self.in_memory_interval_s
        while not self._stopping.is_set():
            with trio.move_on_at(next_cut):
                await self._stopping.wait()
            next_cut = max(next_cut + self.in_memory_interval_s, trio.current_time())
            moved = await self.cut()
            self.snapshots.expire_pins()
            # Persist on the interval, and at once when intake went quiet: a router that has
            # sent its last mutation should not wait a whole interval for its ack.
            due = trio.current_time() - last_persist >= self.persist_interval_s
            if (not moved or due) and await self.persist():
                last_persist = trio.current_time()
        await self.cut()
        await self.persist()
        # Queued mutations of snapshots never completed: write them so nothing queued is
        # dropped; the persisted timestamp stays aligned and routers resend from it.
        await self._flush_all(self.hwt.high_water().seqnos)

    async def cut(self) -> bool:
        """Flush up to a new stability timestamp and publish it, or relieve memory pressure.

        Returns whether the stability timestamp moved.
        """
        async with self._flush_lock:  # a rollback may reset the timestamps meanwhile
            ts = self.hwt.stability_timestamp()
            if ts.seqnos != self._stable.seqnos:
                await self._flush_workers(ts.seqnos)
                self._stable = ts
                self._flushes += 1
                if all(h <= s for h, s in zip(self._store_high, ts.seqnos, strict=True)):
                    self.snapshots.publish(ts, self.store.snapshot(), self.counts())
                return True
        if any(w.blocked for w in self.workers):
            # The queues are full of snapshots not yet complete: write them without publishing.
            await self.drain_all()
            self._memory_flushes += 1
        return False

    async def republish(self, force: bool = False) -> bool:
        """Publish the stable timestamp again with a fresh store snapshot (after entries were
        written or deleted outside the stream, as by an index build), if the store holds
        exactly it, or anyway with `force` (a slice change: the old timestamp must go)."""
        async with self._flush_lock:
            ts = self._stable
            ahead = any(h > s for h, s in zip(self._store_high, ts.seqnos, strict=True))
            if ahead and not force:
                return False  # the next cut publishes: the store is ahead of the stable point
            self.snapshots.publish(ts, self.store.snapshot(), self.counts())
            return True

    def reset_vbuckets(self, vbuckets: set[int], entry_counts: Sequence[int]) -> None:
        """Vbuckets this node no longer holds (their entries were deleted): back to seqno 0.

        Recovery points made so far still count them, so none is rolled back to any more.
        """
        self.hwt.reset_vbuckets(vbuckets)
        seqnos = list(self._stable.seqnos)
        for vb in vbuckets:
            seqnos[vb] = 0
            self._store_high[vb] = 0
        self._stable = StabilityTimestamp(tuple(seqnos), self._stable.vbuuids)
        self.entry_counts[:] = entry_counts
        self.forget_recovery_points()

    def forget_recovery_points(self) -> None:
        """Entries were written without undo records (an index build merged): no recovery point
        made so far could restore them, so a rollback before the next one goes to zero."""
        state = self.recovery.state
        unclean = [dataclasses.replace(point, clean=False) for point in state.points]
        self.recovery.state = dataclasses.replace(
            state, current=unclean[0], older=tuple(unclean[1:])
        )

    def counts(self) -> dict[str, int]:
        return {i.definition.name: n for i, n in zip(self.indexes, self.entry_counts, strict=True)}

    async def drain_all(self, then: Callable[[], None] | None = None) -> None:
        """Write everything queued, aligned or not, without publishing it (see `cut`).

        `then` runs before any other flush can start: the index catalog changes the writers
        there.
        """
        high = self.hwt.high_water().seqnos
        async with self._flush_lock:
            await self._flush_workers(high)
            if then is not None:
                then()

    async def _flush_all(self, upto: Sequence[int]) -> None:
        async with self._flush_lock:
            await self._flush_workers(upto)

    async def _flush_workers(self, upto: Sequence[int]) -> None:
        self._store_high = [max(a, b) for a, b in zip(self._store_high, upto, strict=True)]
        results = []
        started = time.perf_counter()

        async def flush_one(worker: QueueFlusher) -> None:
            result = await worker.flush(upto)
            if result is not None:
                results.append(result)

        async with trio.open_nursery() as nursery:
            for worker in self.workers:
                nursery.start_soon(flush_one, worker)
        if results:  # a flush that wrote something
            self.flush_seconds.observe(time.perf_counter() - started)
        for r in results:
            self._mutations += r.mutations
            self._puts += r.puts
            self._deletes += r.deletes
            for j, d in enumerate(r.entry_deltas):
                self.entry_counts[j] += d

    async def persist(self) -> bool:
        """Sync the store and record the latest readable timestamp in the snapshot file.

        The persisted snapshot becomes a recovery point: undo records written from now on are
        tagged with it, and those no kept point needs are pruned. Returns whether there was
        anything new to persist.
        """
        recovery = self.recovery
        async with self._flush_lock:  # no flush between the file and the new undo tag
            stable = self.snapshots.stable
            if stable is None or stable.timestamp == self.snapshots.persisted:
                return False
            ts = stable.timestamp
            started = time.time()
            stable.acquire()  # a newer publish must not close it while the file is written
            mark: Mark | None = None
            try:
                if self.retention is not None:
                    mark = await trio.to_thread.run_sync(
                        self.retention.history.write_mark, ts, list(self.indexes)
                    )
                await trio.to_thread.run_sync(self.store.sync)
                clean = all(h <= s for h, s in zip(self._store_high, ts.seqnos, strict=True))
                state = recovery.state
                point = RecoveryPoint(recovery.points.tag + 1, ts, started, clean)
                older = state.points[: max(recovery.keep - 1, 0)]
                new_state = PersistedState(point, older, recovery.failover_logs())
                await trio.to_thread.run_sync(write_snapshot_file, self.data_dir, new_state)
            except OSError as exc:
                # A full disk: nothing new is acknowledged, and the next cut tries again.
                self._persist_failed(exc)
                return False
            else:
                recovery.state = new_state
                recovery.points.advance(point.point)
                if self.retention is not None:
                    self.retention.history.latest = mark
                lag = time.time() - stable.created_at
                self.snapshots.record_persisted(stable, lag)
                self.persist_lag_seconds.observe(lag)
            finally:
                stable.release()
        if self._persist_failures:
            log.warning("snapshots persist again after %d failures", self._persist_failures)
            self._persist_failures = 0
            self._persist_error = None
        stale = recovery.points.take_below(new_state.points[-1].point)
        if stale:
            try:
                await trio.to_thread.run_sync(self.store.write, (), stale)
            except OSError as exc:  # the undo records stay: a little space, no harm
                log.warning("could not prune %d undo records: %s", len(stale), describe(exc))
        await self._prune_history()
        log.info(
            "snapshot persisted: seqnos summing to %d, lag %.0f ms, sync %.0f ms",
            ts.total,
            lag * 1000,
            (time.time() - started) * 1000,
        )
        return True

    async def _prune_history(self) -> None:
        """Drop the change history older than retention, every HISTORY_PRUNE_INTERVAL_S."""
        retention = self.retention
        now = time.monotonic()
        if retention is None or now < retention.next_prune:
            return
        retention.next_prune = now + min(HISTORY_PRUNE_INTERVAL_S, retention.keep_s / 10)
        try:
            deleted = await trio.to_thread.run_sync(
                retention.history.prune,
                retention.keep_s,
                retention.keep_snapshots,
                None,
                retention.keep_bytes,
            )
        except OSError as exc:  # kept a little longer: no harm
            log.warning("could not prune the change history: %s", describe(exc))
            return
        if deleted:
            log.info("change history: %d records past retention dropped", deleted)

    def _persist_failed(self, exc: OSError) -> None:
        """Log a failed persist: the first of a run, then every PERSIST_FAILURE_LOG_S."""
        self._persist_failures += 1
        self._persist_errors += 1
        self._persist_error = describe(exc)
        now = time.monotonic()
        since = now - self._persist_failure_logged
        if self._persist_failures == 1 or since >= PERSIST_FAILURE_LOG_S:
            self._persist_failure_logged = now
            log.error(
                "cannot persist a snapshot (%d attempts): %s; acknowledgements wait until it "
                "succeeds",
                self._persist_failures,
                describe(exc),
            )

    @asynccontextmanager
    async def stopped_flushes(self, aligned: bool = False) -> AsyncIterator[tuple[int, ...]]:
        """Hold off every flush, cut and persist, after writing everything queued, or with
        `aligned` what the last complete snapshots hold (nothing past what is written already);
        gives the timestamp written up to. What is not written stays queued."""
        async with self._flush_lock:
            if aligned:
                stable = self.hwt.stability_timestamp().seqnos
                upto = tuple(max(s, h) for s, h in zip(stable, self._store_high, strict=True))
            else:
                upto = self.hwt.high_water().seqnos
            await self._flush_workers(upto)
            yield upto

    def reset(self, start: StabilityTimestamp, entry_counts: Sequence[int]) -> None:
        """After a rollback (inside `stopped_flushes`): the store holds exactly `start`."""
        self.hwt.reset(start)
        self._stable = start
        self._store_high = list(start.seqnos)
        self.entry_counts[:] = entry_counts

    def statistics(self) -> TimekeeperStatistics:
        return TimekeeperStatistics(
            flushes=self._flushes,
            memory_flushes=self._memory_flushes,
            mutations_flushed=self._mutations,
            puts=self._puts,
            deletes=self._deletes,
            entry_counts=tuple(self.entry_counts),
            persist_errors=self._persist_errors,
            persist_failing=self._persist_failures > 0,
            persist_error=self._persist_error,
        )
