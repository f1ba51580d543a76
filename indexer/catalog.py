"""The index catalog: creating, building and dropping indexes while the daemon runs.

Records carry one key per index, so a change of the index set happens between two epochs of
the stream: routers are closed with INDEXES_CHANGED and new connections wait; an IndexChange
marker follows everything already received through the dispatcher to every worker; all queued
records are written with the old definitions; then the writers, the back-index cache and the
handshake switch to the new set, and routers reconnect, learn it, and resume from their restart
timestamp (the daemon skips what it already has).

An index created when the daemon already holds data is built first (indexer/build.py): it gets
its own build stream and writer. Its creation is such a change too: from then on maintenance
records carry its key beside those of the active indexes, and the writers skip it. Once the build
has caught up it is merged in band, with no router reconnecting: flushes stop at a timestamp M,
the end of the last complete snapshots (what follows stays queued), the build completes up to M,
and the writers write its key from the records after M on.

An index created with `defer_build` is only stored ("deferred"): no stream carries its key, so
creating or dropping it changes nothing of the pipeline. `build` starts the deferred indexes it
is given as one build, on one build stream (GSI's `BUILD INDEX`): one pass over the router's
history fills them all, and one merge makes them all active.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Sequence

import trio

from indexer.build import BuildShare, IndexBuild, forget_progress
from indexer.pipeline import Pipeline, PipelineClosed
from indexer.protocol import ErrorCode, IndexDefinition
from indexer.storage import StoredIndex, StoreError
from workers.flush import BackIndexCache, BuiltIndexMerge, IndexWriter

log = logging.getLogger("indexer.catalog")

MAINTENANCE_BACKLOG = 1_000
"""Queued maintenance records above which index builds wait: keeping indexes current comes
first."""

MERGE_TIMEOUT_S = 30.0
"""How long maintenance may stay stopped for a build to reach its timestamp; past it the merge
is given up and tried again once the build catches up again."""


MERGE_SLICE_S = 0.002
MERGE_PAUSE_S = 0.006
"""A merge prepares the back-index cache in slices of MERGE_SLICE_S of the event loop with
pauses of MERGE_PAUSE_S between them: a quarter of the loop, so that maintenance keeps the rest
(back to back, the slices of a 333k-document cache doubled the lag of writes for a second)."""


class CatalogError(Exception):
    """A create or drop that cannot be done; `status` is the HTTP status that says why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class IndexCatalog:
    """The live set of indexes, and the one place that changes it."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.store = pipeline.store
        self.indexes = pipeline.indexes  # shared with the HTTP API's view: changed in place
        self.reader = reader = pipeline.reader
        self.workers = workers = pipeline.workers
        self.timekeeper = pipeline.timekeeper
        self.cache = cache = pipeline.cache
        # Index name -> its build (the indexes of one build share it), shared with the reader
        # and the HTTP API.
        self.builds = reader.builds
        self.cache_capacity = cache.capacity
        self.build_share = BuildShare(workers[0].pool)
        self._caught_up, self._caught_up_receive = trio.open_memory_channel[IndexBuild](math.inf)
        self._build_scopes: dict[str, trio.CancelScope] = {}
        self._nursery: trio.Nursery | None = None
        self.merged = 0
        # The indexes whose keys maintenance records carry, in record order: the active ones
        # and those being built. A merge leaves it as it is; creates and drops change it.
        self.columns: list[IndexDefinition] = [i.definition for i in self.indexes]
        # While a merge holds flushes, maintenance's queues grow and wait for the build: the
        # build must not wait behind them for its last flushes.
        self._merging = False
        # Set once intake has stopped (`stop_merging`): no build stream moves any more.
        self._stopping = False
        self._merge_wait: trio.CancelScope | None = None

    def add_build(
        self, indexes: Sequence[StoredIndex], cache: BackIndexCache | None = None
    ) -> IndexBuild:
        """Start the initial build of stored "building" indexes, on one build stream (at
        start-up, on create, or when deferred indexes are built); `cache` as IndexBuild takes
        it, its columns in the order of `indexes`. Without one the indexes go by id, so a build
        resumed after a restart has the stream name it had."""
        if cache is None:
            indexes = sorted(indexes, key=lambda index: index.index_id)
        owned = [vb for vb, flag in enumerate(self.reader.registry.owned) if flag]
        build = IndexBuild(
            self.store,
            indexes,
            owned,
            self.reader.registry,
            self.cache_capacity,
            self.build_share,
            self._maintenance_backlog,
            cache,
        )
        for index in indexes:
            self.builds[index.definition.name] = build
            if all(d.name != index.definition.name for d in self.columns):
                self.columns.append(index.definition)
        if self._nursery is not None:
            self._nursery.start_soon(self._run_build, build)
        return build

    def _current(self, build: IndexBuild) -> bool:
        """Whether the build still runs (not merged, dropped or restarted meanwhile)."""
        return self.builds.get(build.names[0]) is build

    def _running_builds(self) -> list[IndexBuild]:
        """Every build once, in the order they started."""
        return list({id(b): b for b in self.builds.values()}.values())

    def deferred_indexes(self) -> list[StoredIndex]:
        """The indexes created with `defer_build` and not built yet, by id."""
        return [i for i in self.store.all_indexes() if i.state == "deferred"]

    def _forget_history(self, index: StoredIndex) -> StoredIndex:
        """A dropped index's change history ends: an index created later with its name (and
        perhaps its id) starts its own at the next persisted snapshot."""
        if self.timekeeper.retention is not None:
            self.timekeeper.retention.history.forget_index(index.index_id)
        return index

    def switch_writers(self) -> None:
        """Give every worker a writer of the active indexes for records of `columns`."""
        names = [d.name for d in self.columns]
        for worker in self.workers:
            worker.writer = IndexWriter(
                self.store,
                self.indexes,
                self.cache,
                worker.writer.undo,
                names,
                history=worker.writer.history,
            )

    def _maintenance_backlog(self) -> bool:
        """Whether builds should wait: the maintenance queues hold more than MAINTENANCE_BACKLOG
        records, and no merge is holding their flushes."""
        return not self._merging and sum(w.ring.queued for w in self.workers) > MAINTENANCE_BACKLOG

    def stop_merging(self) -> None:
        """Intake has stopped (the daemon is shutting down): builds receive nothing more, so a
        merge waiting for one gives up now instead of holding the last flush for up to
        MERGE_TIMEOUT_S, and no merge starts. A build resumes from its progress at the next
        start."""
        self._stopping = True
        if self._merge_wait is not None:
            self._merge_wait.cancel()

    def _remove_column(self, name: str) -> None:
        """Records stop carrying the index's key (from the routers' next handshake)."""
        self.columns[:] = [d for d in self.columns if d.name != name]

    async def run(self) -> None:
        """Run the builds and merge each once it has caught up; until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for build in self._running_builds():
                nursery.start_soon(self._run_build, build)
            async for build in self._caught_up_receive:
                if self._current(build):
                    try:
                        await self.merge_build(build)
                    except CatalogError as exc:  # shutting down
                        log.info("index %s not merged: %s", build.name, exc.message)
                        build.rearm()

    async def _run_build(self, build: IndexBuild) -> None:
        with trio.CancelScope() as scope:
            self._build_scopes[build.name] = scope
            try:
                await build.run(self._caught_up)
            finally:
                if self._build_scopes.get(build.name) is scope:
                    del self._build_scopes[build.name]
                build.stopped.set()

    def _stop_build(
        self, build: IndexBuild, message: str, code: ErrorCode = ErrorCode.BUILD_DONE
    ) -> None:
        scope = self._build_scopes.pop(build.name, None)
        if scope is not None:
            scope.cancel()
        if self._current(build):
            for name in build.names:
                del self.builds[name]
            build.release()  # its queued records leave the slab pool
        self.reader.close_builds(build.name, code, message)

    async def create(self, definition: IndexDefinition, defer: bool = False) -> StoredIndex:
        """Create an index: active at once on a daemon with nothing streamed yet, else built
        over the data; with `defer`, only stored, until `build` is asked for it."""
        if definition.name in self.store.indexes:
            raise CatalogError(409, f"an index named {definition.name!r} exists")
        if defer:
            return self._create_deferred(definition)
        if sum(self.reader.registry.received) > 0:
            return await self._create_building(definition)
        created: list[StoredIndex] = []

        def apply() -> None:
            stored = self.store.create_index(definition)
            created.append(stored)
            self._add_empty(stored)

        await self.change_pipeline(apply)
        log.info(
            "index %s(%s)%s created (nothing streamed yet: no build needed)",
            definition.name,
            ", ".join(definition.keys),
            "" if definition.where is None else f" WHERE {definition.where}",
        )
        return created[0]

    def _add_empty(self, index: StoredIndex) -> None:
        """A new active index the stream has put nothing in yet: the last column of every
        record, of the back-index cache and of the entry counts (with the pipeline stopped)."""
        self.indexes.append(index)
        self.columns.append(index.definition)
        self.cache.add_index()
        self.timekeeper.entry_counts.append(0)

    def _create_deferred(self, definition: IndexDefinition) -> StoredIndex:
        """Store a deferred index: no stream carries it, so the pipeline is left alone."""
        try:
            stored = self.store.create_index(definition, "deferred")
        except StoreError as exc:
            raise CatalogError(409, str(exc)) from None
        log.info(
            "index %s(%s)%s created, deferred: it is built by POST /indexes/_build",
            definition.name,
            ", ".join(definition.keys),
            "" if definition.where is None else f" WHERE {definition.where}",
        )
        return stored

    async def build(self, names: Sequence[str]) -> list[StoredIndex]:
        """Build deferred indexes together, on one build stream (GSI's BUILD INDEX); with
        nothing streamed yet they are active at once. The indexes as stored now."""
        if not names:
            raise CatalogError(400, "indexes: name at least one deferred index to build")
        twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
        if twice is not None:
            raise CatalogError(400, f"indexes: {twice!r} is named twice")
        self._check_deferred(names)
        built: list[StoredIndex] = []
        listed = _listing(names)

        def apply() -> None:
            self._check_deferred(names)  # nothing changed them while the stream was stopped
            if sum(self.reader.registry.received) == 0:
                stored = self.store.set_states(names, "active")
                for index in stored:
                    self._add_empty(index)
            else:
                stored = self.store.set_states(names, "building")
                self.add_build(stored)
            built.extend(stored)

        # Routers learn of the build, and carry the indexes' keys, at their next handshake.
        await self.change_pipeline(apply, message=f"{listed}: being built: handshake again")
        if built[0].state == "active":
            log.info("%s built (nothing streamed yet: active at once)", listed)
        else:
            log.info("building %s over the data already streamed, on one stream", listed)
        return built

    def _check_deferred(self, names: Sequence[str]) -> None:
        """A 404 for a name no index has, a 409 for an index that is not deferred."""
        stored = self.store.indexes
        for name in names:
            index = stored.get(name)
            if index is None:
                raise CatalogError(404, f"no index named {name!r}")
            if index.state != "deferred":
                build = self.builds.get(name)
                state = index.state if build is None else build.state
                raise CatalogError(
                    409,
                    f"index {name!r} is {state}, not deferred: only an index created with "
                    "defer_build is built by request",
                )

    async def _create_building(self, definition: IndexDefinition) -> StoredIndex:
        created: list[StoredIndex] = []

        def apply() -> None:
            stored = self.store.create_index(definition, "building")
            created.append(stored)
            self.add_build([stored])

        # Routers learn of the build, and carry its key from now on, at their next handshake.
        await self.change_pipeline(
            apply, message=f"index {definition.name} is being built: handshake again"
        )
        log.info(
            "index %s(%s)%s created: building it over the data already streamed",
            definition.name,
            ", ".join(definition.keys),
            "" if definition.where is None else f" WHERE {definition.where}",
        )
        return created[0]

    async def merge_build(self, build: IndexBuild) -> bool:
        """Make a caught-up build's indexes active in band (see module doc): flushes stop at
        the last complete snapshots M, the build completes up to M, and the writers switch."""
        name = build.name
        phases: dict[str, float] = {}

        async def complete_build(upto: Sequence[int], started: float) -> None:
            phases["flush"] = trio.current_time() - started
            with trio.move_on_after(MERGE_TIMEOUT_S) as waiting:
                self._merge_wait = waiting
                try:
                    while not build.reached(upto) and not self._stopping:
                        await build.wait_moved()
                finally:
                    self._merge_wait = None
            if not build.reached(upto):
                raise _GiveUp(f"the build of {name} did not reach the maintenance timestamp")
            # No build flush may land after maintenance starts writing these indexes: stop the
            # build's writer and wait for a flush in progress to finish.
            scope = self._build_scopes.pop(name, None)
            if scope is not None:
                scope.cancel()
                await build.stopped.wait()
            phases["build"] = trio.current_time() - started - phases["flush"]

        def apply() -> None:
            t0 = trio.current_time()
            try:
                stored = self.store.set_states(build.names, "active")
            except StoreError as exc:
                raise CatalogError(409, str(exc)) from None
            self.indexes.extend(stored)  # in the order of the build cache's columns
            self.cache.add_built_index(build.cache, merge)
            self.timekeeper.entry_counts.extend(build.entries)
            self.timekeeper.forget_recovery_points()
            build.state = "merged"
            for index_name in build.names:
                del self.builds[index_name]
            build.release()  # what it received past M, maintenance applies
            self.switch_writers()
            phases["switch"] = trio.current_time() - t0

        # Widen the back-index cache by the build's columns while maintenance goes on: at the
        # merge only what was written meanwhile is left to do.
        merge = BuiltIndexMerge(self.cache, build.cache)
        try:
            while merge.step(MERGE_SLICE_S):
                await trio.sleep(MERGE_PAUSE_S)
            async with self.pipeline.lock:  # a merge pauses flushes only, not the routers
                if not self._current(build):  # dropped meanwhile
                    return False
                if self._stopping:
                    raise _GiveUp(f"the build of {name} caught up as the daemon stopped")
                self._merging = True
                started = trio.current_time()
                try:
                    async with self.timekeeper.stopped_flushes(aligned=True) as upto:
                        merged_at = sum(upto)
                        await complete_build(upto, started)
                        apply()
                finally:
                    self._merging = False
                stopped = trio.current_time() - started
        except _GiveUp as exc:
            build.rearm()
            if self._stopping:
                log.info(
                    "index %s not merged: the daemon is stopping; its build resumes at the next "
                    "start",
                    name,
                )
            else:
                log.warning("%s; maintenance resumed, merging later", exc)
            return False
        finally:
            merge.abandon()  # nothing once applied
        # The readable snapshot predates the build's last writes: scans must see them.
        if not await self.timekeeper.republish():
            log.info("index %s: readable with the next snapshot", name)
        built = _listing(build.names)
        done = f"{built} {'is' if len(build.names) == 1 else 'are'} built"
        self.reader.close_builds(name, ErrorCode.BUILD_DONE, done)
        await trio.to_thread.run_sync(build.forget)
        self.merged += 1
        log.info(
            "%s built: %d mutations from its build stream; active from seqno sum %d; "
            "flushes stopped %.3f s (flush %.3f, build %.3f, switch %.3f), no router reconnected",
            built,
            build.items,
            merged_at,
            stopped,
            phases["flush"],
            phases["build"],
            phases["switch"],
        )
        return True

    async def drop(self, name: str) -> None:
        if name in self.builds:
            await self._drop_building(name)
            return
        position = next((j for j, i in enumerate(self.indexes) if i.definition.name == name), None)
        if position is None:
            stored = self.store.indexes.get(name)
            if stored is not None and stored.state == "deferred":
                self._drop_deferred(name)
                return
            raise CatalogError(404, f"no index named {name!r}")
        dropped: list[StoredIndex] = []

        def apply() -> None:
            dropped.append(self._forget_history(self.store.drop_index(name)))
            del self.indexes[position]
            self._remove_column(name)
            self.cache.remove_index(position)
            del self.timekeeper.entry_counts[position]

        await self.change_pipeline(apply)
        deleted = await trio.to_thread.run_sync(self.store.delete_entries, dropped[0])
        log.info("index %s dropped: %d entries deleted", name, deleted)

    def _drop_deferred(self, name: str) -> None:
        """A deferred index has no entries and no stream carries it: it is only forgotten."""
        try:
            self.store.drop_index(name)
        except StoreError as exc:
            raise CatalogError(404, str(exc)) from None
        log.info("index %s dropped (deferred: it held nothing)", name)

    async def _drop_building(self, name: str) -> None:
        """Drop an index during its build. The build stops; the other indexes built with it
        go on from its progress on a new build stream without it, their entries kept."""
        build = self.builds[name]
        dropped: list[StoredIndex] = []
        rest = [i for i in build.indexes if i.definition.name != name]

        async def stop_build() -> None:
            if not self._current(build):
                raise CatalogError(409, f"index {name!r} finished its build meanwhile: drop again")
            scope = self._build_scopes.pop(build.name, None)
            if scope is not None:
                scope.cancel()
                await build.stopped.wait()  # a build flush in progress lands first
            self._stop_build(build, f"index {name} was dropped")
            if rest:  # the cache holds what the stopped build wrote: the rest's columns of it
                build.cache.remove_index(build.names.index(name))
                self.add_build(rest, build.cache)

        def apply() -> None:
            dropped.append(self._forget_history(self.store.drop_index(name)))
            self._remove_column(name)

        # Maintenance records carry its key: routers stop at the next handshake.
        await self.change_pipeline(apply, stop_build)
        await trio.to_thread.run_sync(forget_progress, self.store, dropped)
        deleted = await trio.to_thread.run_sync(self.store.delete_entries, dropped[0])
        log.info("index %s dropped during its build: %d entries deleted", name, deleted)
        if rest:
            log.info(
                "the build of %s goes on without it",
                ", ".join(i.definition.name for i in rest),
            )

    async def restart_builds(self) -> None:
        """After a rollback (pipeline stopped): every build starts again from zero."""
        for build in self._running_builds():
            self._stop_build(
                build, "the index rolled back: the build starts again", ErrorCode.ROLLBACK
            )
            await trio.to_thread.run_sync(build.forget)
            for index in build.indexes:
                await trio.to_thread.run_sync(self.store.delete_entries, index)
            self.add_build(build.indexes)

    async def change_pipeline(
        self,
        apply: Callable[[], None],
        before: Callable[[], Awaitable[None]] | None = None,
        code: ErrorCode = ErrorCode.INDEXES_CHANGED,
        message: str = "index definitions changed: handshake again",
    ) -> None:
        """A change between two epochs of the stream (index set, slice; see module doc):
        routers are closed with `code`, `before` runs once everything received is queued,
        `apply` once it is written; then routers may connect again."""
        try:
            async with self.pipeline.quiesced(code, message, columns=lambda: self.columns):
                if before is not None:
                    await before()

                def switch() -> None:
                    try:
                        apply()
                    except StoreError as exc:
                        raise CatalogError(409, str(exc)) from None
                    self.switch_writers()

                await self.timekeeper.drain_all(switch)
        except PipelineClosed:
            raise CatalogError(503, "the daemon is shutting down") from None


def _listing(names: Sequence[str]) -> str:
    """Indexes as a log line names them: "index a", "indexes a, b"."""
    return f"index {names[0]}" if len(names) == 1 else "indexes " + ", ".join(names)


class _GiveUp(Exception):
    """A merge that cannot complete now."""
