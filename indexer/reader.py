"""The reader: one task per router connection.

It receives bytes, decodes every complete frame of a receive at once, checks each frame against
the stream rules (`streams.py`: handshake first, vbucket owned, stream begun, seqnos increasing
inside the current snapshot marker) and hands the accepted items onward as one list. A frame
that breaks a rule gets an error frame and closes the connection; nothing of that frame is
handed on, and the daemon keeps serving every other connection. Acks of persisted snapshots go
back on the same connection from a second task. When the daemon has a token, a handshake
without it is refused (UNAUTHORIZED) before any of its contents is used; a connection over the
connection limit, or without a handshake in time, is refused too.
"""

from __future__ import annotations

import itertools
import logging
import ssl
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

from indexer import protocol as p
from indexer.build import IndexBuild
from indexer.protocol import ErrorCode, ProtocolError
from indexer.recovery import rollback_seqno
from indexer.snapshots import RolledBackError, SnapshotStore
from indexer.streams import Connection, StreamItem, StreamRegistry
from slab import MemoryThrottle

log = logging.getLogger("indexer.reader")

RECEIVE_BYTES = 256 * 1024


class Reader:
    """Serves router connections: handshake, frames in, items to the dispatcher, acks out."""

    def __init__(
        self,
        registry: StreamRegistry,
        indexes: Sequence[p.IndexDefinition],
        snapshots: SnapshotStore,
        throttle: MemoryThrottle,
        items: trio.MemorySendChannel[list[StreamItem]],
        max_frame_bytes: int,
        flow_control_bytes: int = 4 << 20,
        *,
        token: str | None = None,
        max_connections: int = 256,
        handshake_timeout_s: float = 10.0,
    ) -> None:
        self.registry = registry
        self.indexes = tuple(indexes)
        self.snapshots = snapshots
        self.throttle = throttle
        self.items = items
        self.max_frame_bytes = max_frame_bytes
        self.flow_control_bytes = flow_control_bytes
        self.token = token
        self.max_connections = max_connections
        self.handshake_timeout_s = handshake_timeout_s
        # Rolls the index back (set by the daemon): connection id, {vbucket: rollback seqno}.
        self.rollback: Callable[[int, dict[int, int]], Awaitable[None]] | None = None
        # Records the source the store indexes (set by the daemon; blocking: a synced write).
        self.record_source: Callable[[str], None] | None = None
        self._ids = itertools.count(1)
        self._open = trio.Event()
        self._open.set()
        self._live: dict[int, trio.CancelScope] = {}
        self._closed_one = trio.Event()  # set (and replaced) whenever a connection ends
        self._kick: tuple[ErrorCode, str] | None = None
        # Indexes being built, by index name (shared with the catalog; the indexes of one build
        # share it), and the build connections, by their build's name.
        self.builds: dict[str, IndexBuild] = {}
        self._build_conns: dict[int, str] = {}
        self._build_kicks: dict[int, tuple[ErrorCode, str]] = {}

    def close_connections(self, code: ErrorCode, message: str, keep: int | None = None) -> None:
        """Stop accepting and close every connection (but `keep`) with an error frame saying why."""
        self._open = trio.Event()
        self._kick = (code, message)
        closing = [c for c in self._live if c != keep and c not in self._build_conns]
        log.info("closing %d router connections (%s): %s", len(closing), code.name, message)
        for conn_id in closing:
            self._live[conn_id].cancel()

    def close_builds(self, name: str, code: ErrorCode, message: str) -> None:
        """Close the build connections of build `name` with an error frame saying why."""
        for conn_id, building in list(self._build_conns.items()):
            if building == name:
                self._build_kicks[conn_id] = (code, message)
                self._live[conn_id].cancel()

    @property
    def connected(self) -> int:
        """Open maintenance connections (build streams are not counted)."""
        return len(self._live) - len(self._build_conns)

    async def wait_connected(self, at_most: int) -> None:
        """Until at most `at_most` maintenance connections are open (after close_connections)."""
        while self.connected > at_most:
            await self._closed_one.wait()

    def building(self) -> tuple[str, ...]:
        """The builds whose streams routers should open, by name (one per build, naming its
        indexes: `build.stream_name`)."""
        names = (build.name for build in self.builds.values() if build.state != "merged")
        return tuple(dict.fromkeys(names))

    def reopen(self, indexes: Sequence[p.IndexDefinition] | None = None) -> None:
        """Accept connections again, handshaking with these index definitions (by default the
        same): those whose keys maintenance records carry, active or being built."""
        if indexes is not None:
            self.indexes = tuple(indexes)
        self._kick = None
        self._open.set()

    async def handle(self, stream: trio.abc.Stream) -> None:
        """The task of one connection (given to trio.serve_tcp, or serve_ssl_over_tcp with
        TLS); one over `max_connections` gets TOO_MANY_CONNECTIONS and is closed. A connection
        counts from its accept until its socket is closed, waiting for `_open` included."""
        reg = self.registry
        if reg.connections >= self.max_connections:
            reg.errors += 1
            message = (
                f"{reg.connections} router connections are open, the most this node takes "
                "(limits.max_feed_connections)"
            )
            log.warning(
                "router %s refused: %s (%s)",
                _peer(stream),
                message,
                ErrorCode.TOO_MANY_CONNECTIONS.name,
            )
            try:
                await _send_error(stream, trio.Lock(), ErrorCode.TOO_MANY_CONNECTIONS, message)
            finally:
                with trio.move_on_after(1) as cleanup:
                    cleanup.shield = True
                    await stream.aclose()
            return
        reg.connections += 1
        try:
            await self._open.wait()
            conn_id = next(self._ids)
            with trio.CancelScope() as scope:
                self._live[conn_id] = scope
                try:
                    await self._handle(stream, conn_id)
                finally:
                    del self._live[conn_id]
                    self._build_conns.pop(conn_id, None)
                    self._build_kicks.pop(conn_id, None)
                    self._closed_one.set()
                    self._closed_one = trio.Event()
        finally:
            reg.connections -= 1

    async def _handle(self, stream: trio.abc.Stream, conn_id: int) -> None:
        conn = Connection(conn_id, self.registry, len(self.indexes), self.token)
        peer = _peer(stream)
        reg = self.registry
        reg.connections_total += 1
        send_lock = trio.Lock()

        async def refuse(code: ErrorCode, message: str) -> None:
            await _send_error(stream, send_lock, code, message)

        try:
            async with self.items.clone() as items, trio.open_nursery() as nursery:
                try:
                    await self._read(stream, conn, items, send_lock, nursery, peer)
                except ProtocolError as exc:
                    reg.errors += 1
                    log.warning("router %s refused: %s (%s)", peer, exc.message, exc.code.name)
                    await refuse(exc.code, exc.message)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                    if conn.handshake is None and isinstance(exc.__cause__, ssl.SSLError):
                        reg.errors += 1
                        why = exc.__cause__
                        log.warning("router %s refused: TLS handshake failed: %s", peer, why)
                    else:
                        log.info("router %s disconnected: %s", peer, exc)
                except trio.Cancelled:
                    code, message = (
                        self._build_kicks.get(conn.conn_id)
                        or (None if conn.conn_id in self._build_conns else self._kick)
                        or (ErrorCode.SHUTTING_DOWN, "the indexer is shutting down")
                    )
                    await refuse(code, message)
                    raise
                except Exception as exc:
                    # A bug must cost this connection only, never the daemon or other routers.
                    log.exception("router %s: internal error", peer)
                    await refuse(ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}")
                nursery.cancel_scope.cancel()
        finally:
            conn.release()
            with trio.move_on_after(1) as cleanup:
                cleanup.shield = True
                await stream.aclose()

    async def _read(
        self,
        stream: trio.abc.Stream,
        conn: Connection,
        items: trio.MemorySendChannel[list[StreamItem]],
        send_lock: trio.Lock,
        nursery: trio.Nursery,
        peer: str,
    ) -> None:
        decoder = p.FrameDecoder(self.max_frame_bytes)
        reg = self.registry
        throttle = self.throttle
        barriers = Barriers(self.snapshots, stream, send_lock, nursery)
        credit = 0  # bytes taken into the pipeline and not yet returned to the router
        build: IndexBuild | None = None  # set when this is a build stream
        # TLS handshake and HANDSHAKE frame by then, or the connection is closed.
        handshake_by = trio.current_time() + self.handshake_timeout_s
        while True:
            if conn.handshake is None:  # a handshake is small: read it even while throttled
                with trio.move_on_at(handshake_by) as waiting:
                    data = await stream.receive_some(RECEIVE_BYTES)
                if waiting.cancelled_caught:
                    raise ProtocolError(
                        ErrorCode.BAD_HANDSHAKE,
                        f"no HANDSHAKE within {self.handshake_timeout_s:g} s of connecting "
                        "(limits.handshake_timeout_ms)",
                    )
            else:
                if throttle.paused:
                    reg.throttle_waits += 1
                    await throttle.wait_open()
                data = await stream.receive_some(RECEIVE_BYTES)
            if not data:
                decoder.close()
                log.info("router %s closed the connection", peer)
                return
            unread = decoder.buffered + len(data)
            decoder.feed(data)
            accepted: list[StreamItem] = []
            try:
                while True:
                    messages = decoder.messages()
                    if not messages:
                        break
                    for message in messages:
                        reg.frames += 1
                        if type(message) is p.Barrier and conn.handshake is not None:
                            barriers.add(message.cookie, conn)
                            continue
                        was_new = conn.handshake is None
                        item = conn.accept(message)
                        if item is not None:
                            accepted.append(item)
                        if was_new and conn.handshake is not None:
                            if conn.new_source is not None:
                                await self._take_source(conn, peer)
                            if conn.handshake.build:
                                build = self._start_build_stream(conn)
                                await self._reply_build(stream, conn, build, send_lock, peer)
                                continue
                            rolled_back = await self._check_history(conn)
                            await self._reply(stream, conn, send_lock, nursery, peer, rolled_back)
            finally:
                # Frames before a bad one are valid: hand them on before the error goes out.
                if accepted:
                    if build is None:
                        await items.send(accepted)
                    else:  # the build writer takes mutations and snapshot markers
                        wanted = [
                            i for i in accepted if type(i) in (p.MutationBatch, p.SnapshotMarker)
                        ]
                        if wanted:
                            await build.accept(wanted)  # type: ignore[arg-type]
            # Credit goes back once frames are in the pipeline, in steps, not per frame.
            credit += unread - decoder.buffered
            handshake = conn.handshake
            flow_control = handshake is not None and handshake.flow_control
            # Credit in quarter-window steps, and at once while a frame is incomplete: the
            # router may be holding its rest back for want of window.
            if (
                flow_control
                and credit
                and (credit >= self.flow_control_bytes // 4 or decoder.buffered)
            ):
                async with send_lock:
                    await stream.send_all(p.encode(p.BufferAck(credit)))
                credit = 0

    async def _take_source(self, conn: Connection, peer: str) -> None:
        """Record the source a handshake claimed, before any of its mutations can land; one
        that takes the node over (--adopt-source) first drops everything of the old one."""
        assert conn.handshake is not None and conn.new_source is not None
        reg = self.registry
        router = conn.handshake.router or "unnamed"
        new, old = conn.new_source, conn.replaces
        try:
            if old is not None:
                log.warning(
                    "router %s (%s) takes this node over (--adopt-source): dropping every index "
                    "entry of %s to index %s",
                    peer,
                    router,
                    p.describe_source(old),
                    p.describe_source(new),
                )
                if self.rollback is None:
                    raise ProtocolError(ErrorCode.INTERNAL, "rollback is not available")
                await self.rollback(conn.conn_id, {vb: 0 for vb, on in enumerate(reg.owned) if on})
                reg.failover_logs.clear()  # the old source's histories mean nothing now
            if self.record_source is not None:
                await trio.to_thread.run_sync(self.record_source, new)
        except BaseException:
            if reg.source == new:  # not recorded: the next handshake decides again
                reg.source = old
                reg.adopt_source = reg.adopt_source or old is not None
            raise
        log.info("router %s (%s): this node indexes %s", peer, router, p.describe_source(new))

    def _start_build_stream(self, conn: Connection) -> IndexBuild:
        """A build handshake: the connection streams into the build it names from now on."""
        assert conn.handshake is not None
        name = conn.handshake.build
        build = self.builds.get(name.split(",")[0])
        if build is None or build.name != name or build.state == "merged":
            raise ProtocolError(ErrorCode.BUILD_DONE, f"no build of {name!r} is running")
        # Peer routers (shards) each build their own vbuckets: several build streams of one
        # build are fine as long as their vbuckets are disjoint, as for maintenance streams.
        conn.registry = build.registry
        conn.claim_vbuckets(conn.handshake, f"the build of {name!r} has a build stream")
        self._build_conns[conn.conn_id] = name
        conn.nkeys = len(build.indexes)
        return build

    async def _reply_build(
        self,
        stream: trio.abc.Stream,
        conn: Connection,
        build: IndexBuild,
        send_lock: trio.Lock,
        peer: str,
    ) -> None:
        assert conn.handshake is not None
        registry = build.registry
        owned = tuple(vb for vb, flag in enumerate(registry.owned) if flag)
        wanted = [vb for vb in conn.handshake.vbuckets if 0 <= vb < len(registry.owned)]
        restart = tuple(
            p.VbucketPosition(vb, registry.received[vb], 0) for vb in wanted if registry.owned[vb]
        )
        reply = p.HandshakeReply(
            tuple(index.definition for index in build.indexes),
            len(registry.owned),
            owned,
            restart,
            self.max_frame_bytes,
            {},
            self.flow_control_bytes if conn.handshake.flow_control else 0,
        )
        async with send_lock:
            await stream.send_all(p.encode(reply))
        log.info(
            "router %s (%s) opened the build stream of %s from seqno sum %d",
            peer,
            conn.handshake.router or "unnamed",
            build.name,
            sum(registry.received),
        )

    async def _check_history(self, conn: Connection) -> set[int]:
        """Compare the router's failover logs with the index's; roll back if history diverged.

        Returns the vbuckets rolled back. The router's logs then become the index's: what the
        index holds (after any rollback) is part of the router's history.
        """
        assert conn.handshake is not None
        reg = self.registry
        remote = {
            vb: history
            for vb, history in conn.handshake.failover_logs.items()
            if vb < len(reg.owned) and reg.owned[vb]
        }
        needs = {}
        for vb, history in remote.items():
            local = reg.failover_logs.get(vb)
            if local is not None:
                seqno = rollback_seqno(local, reg.received[vb], history)
                if seqno is not None:
                    needs[vb] = seqno
        if needs:
            log.warning(
                "router %s: history of %d vbuckets diverged (e.g. vbucket %d: back to seqno %d)",
                conn.handshake.router or "unnamed",
                len(needs),
                *next(iter(needs.items())),
            )
            if self.rollback is None:
                raise ProtocolError(ErrorCode.INTERNAL, "rollback is not available")
            await self.rollback(conn.conn_id, needs)
        reg.failover_logs.update(remote)
        return set(needs)

    async def _reply(
        self,
        stream: trio.abc.Stream,
        conn: Connection,
        send_lock: trio.Lock,
        nursery: trio.Nursery,
        peer: str,
        rolled_back: set[int],
    ) -> None:
        assert conn.handshake is not None
        owned = tuple(vb for vb, flag in enumerate(self.registry.owned) if flag)
        persisted = self.snapshots.persisted
        # A running daemon writes everything it received: a router that reconnects (an index
        # created or dropped, a dropped connection) resumes from there, not from the persisted
        # snapshot seconds behind, nor from the readable one, which would make it read the
        # difference back from its log (memory has moved past it). After a restart received
        # is the persisted snapshot; what a crash loses past it, the next restart asks again.
        received = self.registry.received
        stable = self.snapshots.stable
        vbuuids = (persisted if stable is None else stable.timestamp).vbuuids
        wanted = [vb for vb in conn.handshake.vbuckets if 0 <= vb < len(self.registry.owned)]
        reply = p.HandshakeReply(
            self.indexes,
            len(self.registry.owned),
            owned,
            tuple(p.VbucketPosition(vb, received[vb], vbuuids[vb]) for vb in wanted),
            self.max_frame_bytes,
            {vb: persisted.seqnos[vb] for vb in sorted(rolled_back)},
            self.flow_control_bytes if conn.handshake.flow_control else 0,
            self.building(),
        )
        async with send_lock:
            await stream.send_all(p.encode(reply))
        log.info(
            "router %s (%s) connected: %d vbuckets asked, %d owned here",
            peer,
            conn.handshake.router or "unnamed",
            len(wanted),
            sum(1 for vb in wanted if self.registry.owned[vb]),
        )
        nursery.start_soon(self._send_acks, stream, conn, send_lock)

    async def _send_acks(
        self, stream: trio.abc.Stream, conn: Connection, send_lock: trio.Lock
    ) -> None:
        """Tell the router each time a persisted snapshot moves any of its vbuckets."""
        sent: dict[int, int] = {}
        while True:
            await self.snapshots.wait_changed()
            ts = self.snapshots.persisted
            moved = [vb for vb in conn.vbuckets if sent.get(vb) != ts.seqnos[vb]]
            if not moved:
                continue
            for vb in moved:
                sent[vb] = ts.seqnos[vb]
            try:
                async with send_lock:
                    await stream.send_all(p.encode(p.Ack(ts.positions(sorted(moved)))))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return


class Barriers:
    """The barriers of one connection: each answered once what preceded it is readable."""

    MAX_PENDING = 1024

    def __init__(
        self,
        snapshots: SnapshotStore,
        stream: trio.abc.Stream,
        send_lock: trio.Lock,
        nursery: trio.Nursery,
    ) -> None:
        self.snapshots = snapshots
        self.stream = stream
        self.send_lock = send_lock
        self.nursery = nursery
        self.pending = 0

    def add(self, cookie: int, conn: Connection) -> None:
        """Note what the connection has sent on each of its vbuckets; answer when readable."""
        if self.pending >= self.MAX_PENDING:
            raise ProtocolError(
                ErrorCode.PROTOCOL, f"more than {self.MAX_PENDING} barriers waiting for an answer"
            )
        received = conn.registry.received
        targets = [(vb, received[vb]) for vb in sorted(conn.vbuckets)]
        self.pending += 1
        self.nursery.start_soon(self._answer, cookie, targets)

    async def _answer(self, cookie: int, targets: list[tuple[int, int]]) -> None:
        try:
            snapshot = await self.snapshots.wait_covering(targets)
        except RolledBackError:
            return  # the connection is being closed with ROLLBACK: routers handshake again
        finally:
            self.pending -= 1
        vbuuids = snapshot.timestamp.vbuuids
        reply = p.BarrierReply(
            cookie,
            self.snapshots.persisted.covers(targets),
            tuple(p.VbucketPosition(vb, seqno, vbuuids[vb]) for vb, seqno in targets),
        )
        try:
            async with self.send_lock:
                await self.stream.send_all(p.encode(reply))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


async def _send_error(
    stream: trio.abc.Stream, send_lock: trio.Lock, code: ErrorCode, message: str
) -> None:
    """Send an ERROR frame, best effort within 2 s: the router may already be gone."""
    with trio.move_on_after(2) as scope:
        scope.shield = True
        try:
            async with send_lock:
                await stream.send_all(p.encode(p.Error(code, message)))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass


def _peer(stream: trio.abc.Stream) -> str:
    """HOST:PORT of the router, through a TLS layer if there is one."""
    transport: Any = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
    try:
        host, port = transport.socket.getpeername()[:2]
        return f"{host}:{port}"
    except (AttributeError, OSError):
        return "unknown"
