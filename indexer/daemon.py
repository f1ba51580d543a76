"""The indexer daemon: opens the store, recovers, and runs the pipeline until SIGINT/SIGTERM.

    readers (one per connection) -> dispatcher -> workers (slab pool + ring) -> LevelDB
                                                   ^ flush up to a stability timestamp
                                                timekeeper -> snapshot store -> acks to routers

Shutdown stops intake, lets the channels and worker queues drain, flushes and persists the last
stable snapshot, and returns.
"""

from __future__ import annotations

import ipaddress
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import trio

from indexer.asgi import serve_asgi
from indexer.build import read_progress, resumed_builds
from indexer.catalog import IndexCatalog
from indexer.changes import ChangeHistory
from indexer.cluster.failover import watch_for_failover
from indexer.cluster.slices import SliceWatch
from indexer.cluster.standing import ClusterStanding
from indexer.cluster.store import EtcdMapSource, keep_registered
from indexer.collector import freeze_long_lived, rare_collections
from indexer.compaction import Compactor
from indexer.config import Config
from indexer.dispatch import dispatch
from indexer.http import DaemonView, HttpApi
from indexer.pipeline import Pipeline
from indexer.protocol import describe_source
from indexer.reader import Reader
from indexer.recovery import RecoveryPoints
from indexer.rollback import Rollback, recover_store
from indexer.snapshots import (
    PersistedState,
    SnapshotFileError,
    SnapshotStore,
    read_persisted_state,
)
from indexer.storage import IndexStore
from indexer.streams import StreamItem, StreamRegistry
from indexer.timekeeper import Recovery, Retention, Timekeeper
from indexer.timestamps import HighWaterTimestamp
from slab import MemoryThrottle, MutationRing, SlabPool, ThrottlePolicy
from workers.flush import BackIndexCache, IndexWriter, entry_counts
from workers.worker import Worker

log = logging.getLogger("indexer.daemon")


class StartError(Exception):
    """The daemon cannot start, for a reason the message names: a port it cannot listen on, a
    data directory it cannot create. The command line prints it as one line."""


@dataclass(frozen=True)
class Listening:
    """Where the daemon accepts router feeds and HTTP requests, once it is ready."""

    host: str
    feed_port: int
    http_port: int


def recover(config: Config) -> PersistedState:
    """The restart state: the last persisted snapshot and recovery points, or zero."""
    n = config.server.num_vbuckets
    try:
        found = read_persisted_state(config.server.data_dir, n)
    except SnapshotFileError as exc:
        # Replaying from zero is always safe: applying a document's mutations again converges.
        log.error("%s; restarting every vbucket from seqno 0", exc)
        return PersistedState.zero(n)
    if found is None:
        log.info("no persisted snapshot: starting every vbucket from seqno 0")
        return PersistedState.zero(n)
    current = found.current
    log.info(
        "recovered persisted snapshot of %s (%d vbuckets past seqno 0; %d recovery points)",
        time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(current.persisted_at)),
        sum(1 for s in current.timestamp.seqnos if s),
        len(found.points),
    )
    return found


def _log_source(source: str | None, adopt: bool, entries: int) -> None:
    """Say which source the node indexes, and what --adopt-source will drop."""
    if source is None:
        log.info("no source yet: the first router or feed to connect becomes this node's source")
    elif adopt:
        log.warning(
            "--adopt-source: the first router or feed of another source than %s takes this node "
            "over, and the %d index entries it holds are dropped then",
            describe_source(source),
            entries,
        )
    else:
        log.info("indexing the history of %s", describe_source(source))


async def serve(
    config: Config,
    ready: Callable[[Listening], None] | None = None,
    adopt_source: bool = False,
) -> None:
    """Run the daemon until SIGINT or SIGTERM, then drain and persist.

    With `adopt_source`, the first router of another source than the store's takes the node
    over: everything the store holds is dropped then (otherwise such a router is refused).
    """
    server = config.server
    try:
        server.data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StartError(
            f"cannot create the data directory {server.data_dir}: {exc.strerror or exc}"
        ) from None
    nice = config.compaction.thread_nice
    with (
        IndexStore(
            server.data_dir, compaction_nice=nice, compression=config.compaction.compression
        ) as store,
        rare_collections() as collector,
    ):
        if store.compaction_thread is not None:
            log.info(
                "LevelDB compactions run at nice %d (thread %d)", nice, store.compaction_thread
            )
        stored = store.ensure_indexes(config.indexes, config.deferred)
        # Indexes in their initial build are written by their build stream, not maintained yet;
        # deferred ones wait for a build to be asked for.
        indexes = [i for i in stored if i.state not in ("building", "deferred")]
        state = recover(config)
        restart = state.current.timestamp
        # What a crash (or a rollback cut short) left beyond the persisted snapshot is undone.
        reverted = await trio.to_thread.run_sync(
            recover_store, store, indexes, server.data_dir, state
        )
        if reverted < 0:
            log.warning("emptied the store: a rollback to zero was cut short")
        elif reverted:
            log.info("undid %d documents changed after the persisted snapshot", reverted)
        history = ChangeHistory(store, server.num_vbuckets, config.changes.history)
        # What the store still holds past the persisted snapshot after an unclean point, the
        # change history reverts; without history, what is kept of it no longer describes
        # what the flushes write: it goes.
        reverted = await trio.to_thread.run_sync(
            history.recover,
            restart,
            indexes,
            state.cleared or not config.changes.history,
        )
        if reverted:
            log.info("undid %d more documents from the change history", reverted)
        if config.changes.history:
            await trio.to_thread.run_sync(history.open, restart, indexes)
        if state.cleared:
            state = PersistedState(state.current, (), state.failover_logs)
        cache = BackIndexCache(config.pipeline.back_index_cache, len(indexes))
        started = time.monotonic()
        await trio.to_thread.run_sync(cache.load, store, indexes)
        counts = await trio.to_thread.run_sync(entry_counts, store, indexes, cache)
        log.info(
            "back index: %d documents loaded in %.2f s (%s)",
            len(cache.entries),
            time.monotonic() - started,
            "complete" if cache.complete else "partial: misses are read from the store",
        )
        snapshots = SnapshotStore(restart)
        hwt = HighWaterTimestamp(restart)
        pool = SlabPool(config.slab.pool_bytes, config.slab.slab_bytes, config.slab.min_chunk)
        memory = config.memory
        throttle = MemoryThrottle(
            ThrottlePolicy(
                memory.quota_bytes, memory.high_mark, memory.low_mark, memory.min_available_bytes
            ),
            memory.sample_interval_s,
        )
        keep = config.snapshots.recovery_points
        points = RecoveryPoints(state.current.point, enabled=keep > 0)
        workers = [
            Worker(
                i,
                pool,
                MutationRing(config.pipeline.ring_slots),
                hwt,
                IndexWriter(store, indexes, cache, points.log(), history=config.changes.history),
            )
            for i in range(config.pipeline.workers)
        ]
        # The loaded cache, the pool and the rings (millions of slots) live as long as the
        # daemon: out of the collector's reach, or its first collections walk all of them.
        freeze_long_lived()
        # Paused reads resume when neither RSS nor the queues move (slab/throttle.py, SETTLE_S).
        throttle.queued = lambda: sum(w.ring.queued for w in workers)
        registry = StreamRegistry(
            server.owned_vbuckets,
            restart.seqnos,
            state.failover_logs,
            source=store.source,
            adopt_source=adopt_source,
        )
        snapshots.owned = registry.owned
        _log_source(store.source, adopt_source, sum(counts))
        timekeeper = Timekeeper(
            hwt,
            workers,
            store,
            snapshots,
            server.data_dir,
            config.snapshots.in_memory_interval_s,
            config.snapshots.persist_interval_s,
            counts,
            indexes,
            Recovery(points, state, keep, lambda: dict(registry.failover_logs)),
            Retention(
                history,
                config.changes.retention_s,
                config.changes.retention_snapshots,
                config.changes.retention_bytes,
            )
            if config.changes.history
            else None,
        )
        capacity = config.pipeline.channel_batches
        to_dispatch, from_readers = trio.open_memory_channel[list[StreamItem]](capacity)
        channels = [trio.open_memory_channel[list[StreamItem]](capacity) for _ in workers]
        reader = Reader(
            registry,
            [i.definition for i in indexes],
            snapshots,
            throttle,
            to_dispatch,
            server.max_frame_bytes,
            server.flow_control_bytes,
            token=config.security.token,
            max_connections=config.limits.max_feed_connections,
            handshake_timeout_s=config.limits.handshake_timeout_s,
        )
        pipeline = Pipeline(
            store,
            indexes,
            registry,
            reader,
            workers,
            timekeeper,
            snapshots,
            cache,
            to_dispatch,
            server.data_dir,
        )
        catalog = IndexCatalog(pipeline)
        building = {i.definition.name: i for i in stored if i.state == "building"}
        progress = {
            name: read_progress(store, index, len(registry.received))
            for name, index in building.items()
        }
        for names in resumed_builds(progress):
            build = catalog.add_build([building[name] for name in names])
            one = len(names) == 1
            log.info(
                "%s %s: resuming %s build from seqno sum %d",
                "index" if one else "indexes",
                ", ".join(names),
                "its" if one else "their",
                sum(build.progress),
            )
        # Maintenance records carry the keys of the indexes being built too; writers skip them.
        catalog.switch_writers()
        reader.reopen(catalog.columns)
        rollback = Rollback(pipeline)
        rollback.restart_builds = catalog.restart_builds
        reader.rollback = rollback
        reader.record_source = store.record_source
        view = DaemonView(
            pipeline,
            hwt,
            pool,
            throttle,
            config.snapshots.in_memory_interval_s,
            catalog,
            Compactor(store, config.compaction.interval_s),
            collector=collector,
            rollback=rollback,
        )
        try:
            async with trio.open_nursery() as services:
                services.start_soon(throttle.run)
                assert view.compactor is not None
                services.start_soon(view.compactor.run)
                api = HttpApi(view, config.security, config.limits)
                http_port = await services.start(_serve_http, config, api)
                services.start_soon(catalog.run)
                if server.cluster_map is not None and server.cluster_node is not None:
                    watch = SliceWatch(server.cluster_map, server.cluster_node, catalog, cache)
                    services.start_soon(watch.run)
                    if isinstance(watch.source, EtcdMapSource):  # the node says it is alive
                        said = {"feed": f"{server.host}:{server.feed_port}", "http_port": http_port}
                        location, lease_s = watch.source.location, server.cluster_lease_s
                        standing = ClusterStanding(server.cluster_node, lease_s)
                        watch.standing = view.standing = standing
                        services.start_soon(
                            keep_registered, location, server.cluster_node, said, lease_s, standing
                        )
                        security = config.security
                        services.start_soon(
                            watch_for_failover,
                            location,
                            server.cluster_node,
                            lease_s,
                            security.token,
                            security.client_ssl_context(),
                        )
                async with trio.open_nursery() as keeping:
                    keeping.start_soon(timekeeper.run)
                    async with trio.open_nursery() as stages:
                        for worker, (_, receive) in zip(workers, channels, strict=True):
                            stages.start_soon(worker.run, receive)
                        stages.start_soon(dispatch, from_readers, [s for s, _ in channels])
                        async with to_dispatch:
                            await _intake(config, reader, view, http_port, ready)
                        # Build streams ended with intake: a merge must not wait for them.
                        catalog.stop_merging()
                    log.info("intake stopped, queues drained; flushing and persisting")
                    timekeeper.stop()
                services.cancel_scope.cancel()
        finally:
            snapshots.close()
        stats = timekeeper.statistics()
        log.info(
            "stopped cleanly: %d mutations flushed (%d under memory pressure), persisted seqno "
            "sum %d; %d stalls on full queues, %d memory throttle pauses",
            stats.mutations_flushed,
            stats.memory_flushes,
            snapshots.persisted.total,
            sum(w.statistics().stalls for w in workers),
            throttle.statistics().pauses,
        )


async def _serve_http(
    config: Config, api: HttpApi, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """The HTTP API under hypercorn (trio worker) until cancelled; reports the bound port."""
    server = config.server
    security = config.security
    tls = None
    if security.tls_cert is not None and security.tls_key is not None:
        tls = (security.tls_cert, security.tls_key, config.limits.handshake_timeout_s)
    address = (server.host, server.http_port)
    async with trio.open_nursery() as nursery:
        try:
            url = await nursery.start(serve_asgi, address, api, "indexer.http", tls)
        except* OSError as group:
            raise _listen_error(server.host, server.http_port, "http", group) from None
        task_status.started(int(url.rsplit(":", 1)[1]))


def _listen_error(
    host: str, port: int, purpose: str, group: BaseExceptionGroup[OSError]
) -> StartError:
    """The start error of a port that cannot be bound: which one, for what, and why."""
    cause: BaseException = group
    while isinstance(cause, BaseExceptionGroup):
        cause = cause.exceptions[0]
    reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(cause)
    return StartError(f"cannot listen on {host}:{port} ({purpose}): {reason}")


def _log_security(config: Config) -> None:
    """Say at start-up what protects the ports (never the token itself)."""
    security = config.security
    if security.token is None:
        auth = "off: anyone who reaches the ports may feed and change indexes"
    elif security.scan_token_required:
        auth = f"token from {security.token_source} required for feeds and every HTTP call"
    else:
        auth = f"token from {security.token_source} required for feeds and HTTP changes"
    tls = f"TLS with {security.tls_cert}" if security.tls else "no TLS"
    log.info("authentication %s; %s", auth, tls)
    if security.token is None and not _loopback(config.server.host):
        log.warning(
            "listening on %s without a token: set [security] token_file (docs/security.md)",
            config.server.host,
        )


def _loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost
        return False


async def _intake(
    config: Config,
    reader: Reader,
    view: DaemonView,
    http_port: int,
    ready: Callable[[Listening], None] | None,
) -> None:
    """Accept router connections until a signal arrives."""
    server = config.server
    ssl_context = config.security.server_ssl_context()
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            try:
                if ssl_context is None:
                    listeners = await nursery.start(
                        lambda task_status: trio.serve_tcp(
                            reader.handle,
                            server.feed_port,
                            host=server.host,
                            task_status=task_status,
                        )
                    )
                    port = listeners[0].socket.getsockname()[1]
                else:
                    # Every connection is a trio.SSLStream; its TLS handshake is made on the
                    # first read, within limits.handshake_timeout_ms like the HANDSHAKE frame.
                    tls_listeners = await nursery.start(
                        lambda task_status: trio.serve_ssl_over_tcp(
                            reader.handle,
                            server.feed_port,
                            ssl_context,
                            host=server.host,
                            https_compatible=True,
                            task_status=task_status,
                        )
                    )
                    port = tls_listeners[0].transport_listener.socket.getsockname()[1]
            except* OSError as group:
                raise _listen_error(server.host, server.feed_port, "feed", group) from None
            view.ready = True
            scheme = "https" if ssl_context is not None else "http"
            log.info("HTTP API on %s://%s:%d", scheme, server.host, http_port)
            _log_security(config)
            log.info(
                "listening for router feeds on %s:%d; data in %s; %d indexes: %s",
                server.host,
                port,
                server.data_dir.resolve(),
                len(config.indexes),
                ", ".join(f"{i.name}({', '.join(i.keys)})" for i in config.indexes),
            )
            if ready is not None:
                ready(Listening(server.host, port, http_port))
            async for signum in signals:
                log.info("%s received: stopping", signal.Signals(signum).name)
                nursery.cancel_scope.cancel()
                break
