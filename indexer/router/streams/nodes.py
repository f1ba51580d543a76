"""The router's streams to its indexer nodes: one task per node keeps its maintenance stream
going, and a build stream for each build the node's handshake names; each reconnects with
backoff when the node is down, restarts or asks to handshake again.

A stream itself (`node_stream.follow_memory`) reads memory while the node keeps up and the source
log when it is behind.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import trio

from indexer import protocol as p
from indexer.router.source.appender import Appender
from indexer.router.source.log import SourceLog
from indexer.router.streams.feed import RECONNECT_CODES, FeedError, FeedSecurity
from indexer.router.streams.node_stream import MaintenanceFirst, NodeProgress, follow_memory
from indexer.router.streams.shared_frames import SharedFrames

log = logging.getLogger("indexer.router")

ROUTER_NAME = "indexer-router"
BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 5.0
STEADY_S = 2.0  # a connection up this long resets the backoff

Address = tuple[str, int]


class Nodes:
    """The indexer nodes' connections: their progress, and a way to make them all reconnect."""

    def __init__(self, targets: Sequence[Address]) -> None:
        self.progress = {f"{host}:{port}": NodeProgress() for host, port in targets}
        self.scopes: dict[str, trio.CancelScope] = {}
        self.frames = SharedFrames()  # snapshots encoded once for nodes that agree
        # Called when a node refuses a vbucket (NOT_MY_SLICE): the cluster map may have changed.
        self.on_not_my_slice: Callable[[], None] | None = None

    def reconnect_all(self) -> None:
        """Close every connection; each node task connects again at once (a new handshake)."""
        for scope in self.scopes.values():
            scope.cancel()


async def stream_to_node(
    address: Address,
    source: SourceLog,
    appender: Appender,
    nodes: Nodes,
    router_name: str = ROUTER_NAME,
    security: FeedSecurity | None = None,
) -> None:
    """Keep the node fed until cancelled: its maintenance stream, and a build stream for each
    build its handshake names (one or more indexes built together; until the node says that
    build is done)."""
    host, port = address
    node = f"{host}:{port}"
    building: set[str] = set()
    maintenance_first = MaintenanceFirst(appender.mm, node, lambda: appender.input_waiting)
    async with trio.open_nursery() as nursery:

        async def build_stream(build: str) -> None:
            try:
                await _keep_streaming(
                    address,
                    source,
                    appender,
                    nodes,
                    router_name,
                    build,
                    defer=maintenance_first,
                    security=security,
                )
            finally:
                building.discard(build)

        def on_maintenance(reply: p.HandshakeReply) -> None:
            # The node's vbuckets that this router streams (a shard or peer has a range).
            maintenance_first.vbuckets = [vb for vb in reply.owned if source.owns(vb)]
            for build in reply.builds:
                if build not in building:
                    building.add(build)
                    nursery.start_soon(build_stream, build)

        await _keep_streaming(
            address, source, appender, nodes, router_name, "", on_maintenance, security=security
        )
    log.info("%s: stopped", node)


# Refusals no retry can cure: the node indexes another source (it adopts one only when its
# operator restarts it with --adopt-source, and the router then needs a restart too).
FINAL_CODES = frozenset({p.ErrorCode.SOURCE_MISMATCH})


async def _keep_streaming(
    address: Address,
    source: SourceLog,
    appender: Appender,
    nodes: Nodes,
    router_name: str,
    build: str,
    on_connect: Callable[[p.HandshakeReply], None] | None = None,
    defer: Callable[[], bool] | None = None,
    security: FeedSecurity | None = None,
) -> None:
    """One stream to the node (maintenance, or the build named `build`: its indexes' names,
    comma-separated): connect, stream, reconnect with backoff on errors; a build stream returns
    once the node says it is done."""
    host, port = address
    name = f"{host}:{port}" if not build else f"{host}:{port}/build:{build}"
    progress = nodes.progress.setdefault(name, NodeProgress())
    backoff = BACKOFF_MIN_S
    last_failure = ""
    try:
        while True:
            connected: float | None = None  # when the handshake was answered

            def on_connected(reply: p.HandshakeReply, backfills: int) -> None:
                nonlocal connected
                connected = trio.current_time()
                restart = sum(position.seqno for position in reply.restart)
                log.info(
                    "%s: connected; resuming from restart seqno sum %d, %d vbuckets from the log",
                    name,
                    restart,
                    backfills,
                )
                if on_connect is not None:
                    on_connect(reply)

            def on_rollback(vbucket: int, seqno: int) -> None:
                log.warning(
                    "%s: vbucket %d: the indexer rolled back to seqno %d", name, vbucket, seqno
                )

            try:
                with trio.CancelScope() as scope:
                    nodes.scopes[name] = scope
                    await follow_memory(
                        host,
                        port,
                        source,
                        appender.mm,
                        appender.next_change,
                        consumer=name,
                        router_name=router_name,
                        on_rollback=on_rollback,
                        on_connected=on_connected,
                        progress=progress,
                        build=build,
                        defer=defer,
                        recent=appender.recent,
                        # One node has nobody to share its encoded snapshots with.
                        shared=nodes.frames if len(nodes.progress) > 1 else None,
                        security=security,
                        visibility=appender.visibility,
                    )
                log.info("%s: handshaking again after a failover", name)
                continue
            except (FeedError, OSError) as exc:
                code = exc.code if isinstance(exc, FeedError) else None
                progress.last_error = str(exc)
                if code in FINAL_CODES:
                    # Retrying cannot cure it: the stream stops, and /stats says why.
                    log.error("%s: stopped streaming to this node: %s", name, exc)
                    progress.stopped = True
                    return
                if code is p.ErrorCode.NOT_MY_SLICE and nodes.on_not_my_slice is not None:
                    log.warning("%s: %s; re-reading the cluster map", name, exc)
                    nodes.on_not_my_slice()
                if build and code is p.ErrorCode.BUILD_DONE:
                    log.info("%s: the build stream is done: %s", name, exc)
                    nodes.progress.pop(name, None)
                    return
                delay = backoff
                if connected is not None:
                    if trio.current_time() - connected >= STEADY_S:
                        backoff = BACKOFF_MIN_S  # a connection that worked a while: start over
                    delay = 0 if code in RECONNECT_CODES else backoff
                    log.warning("%s: disconnected: %s", name, exc)
                    last_failure = ""
                elif str(exc) != last_failure:  # once per kind of failure while it lasts
                    log.warning("%s: %s; retrying", name, exc)
                    last_failure = str(exc)
                backoff = min(backoff * 2, BACKOFF_MAX_S)
                await trio.sleep(delay)
    finally:
        # Gone for good (stopped, the node left the map, the build is done): memory kept
        # for its reconnects is freed.
        appender.mm.forget_consumer(name)
