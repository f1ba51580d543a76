"""One indexer node's stream from the long-running router: memory first, the source log when behind.

Each connection is a consumer of the router's `MutationManager`, with a cursor per vbucket at the
restart seqno of the handshake. A cursor that memory serves reads whole snapshots from it. A
cursor registered below what memory holds, or dropped because memory ran over its cap, gets a
`Backfill`: a backfill task reads the source log for it, in chunks, into a bounded queue; the
sender streams the chunks and then rejoins memory at the seqno reached. Vbuckets that keep up go
on reading memory meanwhile. The queue's bound is what keeps a slow indexer from making the router
read the whole log into memory.

`NodeCursors` is the sans-IO part (cursors in, frames out); `follow_memory` moves the frames.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AsyncExitStack, suppress
from dataclasses import dataclass
from typing import NoReturn

import trio

from indexer import protocol as p
from indexer.router.documents import Document, encode_document
from indexer.router.source.log import SourceLog
from indexer.router.source.mutations import (
    Backfill,
    BackfillRequired,
    Item,
    MutationError,
    MutationManager,
    Snapshot,
)
from indexer.router.source.recent import RecentDocuments
from indexer.router.source.visibility import BarrierTurn, Visibility
from indexer.router.streams.build_encoder import BuildEncoder, build_encoder
from indexer.router.streams.chunks import (
    BackfillChunk,
    EncodedChunk,
    RawChunk,
    read_backfill_chunks,
    read_chunks,
    read_raw_chunk,
    snapshot_frames,
)
from indexer.router.streams.feed import (
    DEFER_S,
    END_TIMEOUT_S,
    FeedError,
    FeedSecurity,
    FeedSettings,
    Peer,
    connect_and_run,
    exchange_handshake,
    send_chunks,
)
from indexer.router.streams.records import (
    BATCH_RECORDS,
    SEND_BYTES,
    RecordEncoder,
    batch_bytes,
    record_frames,
)
from indexer.router.streams.shared_frames import SharedFrames

log = logging.getLogger("indexer.router")

BACKFILL_CHUNK_ITEMS = 2048
"""Versions read from the source log per worker-thread call, over as many vbuckets as fit. The
thread holds the GIL while it parses them (a build's thread only reads stored bytes: its
encoder process parses), so a larger call keeps the event loop waiting longer: calls of 8,192
parsed versions made a router under a 10k/s feed fall seconds behind its input."""

BACKFILL_QUEUE_CHUNKS = 4
"""Chunks read ahead of the sender per connection: the bound of the backfill queue."""

SNAPSHOTS_PER_TURN = 4
"""Memory snapshots one vbucket sends before the next vbucket's turn."""

DEFERRING_SEND_BYTES = 32 * 1024
"""A deferring stream sends in smaller pieces, so the stream it gives way to waits less."""


MAX_DEFER_S = 0.25
"""Longest a build stream waits in one go: a router that cannot keep up with its input would
otherwise starve the build for as long as the input lasts."""

BUILD_TURN_S = 0.05
"""How long a build that waited `MAX_DEFER_S` then goes on regardless: at least a sixth of a
saturated router's time goes to builds, so they always move. Whether that is enough for a large
build to catch up under a sustained feed depends on the feed (docs/performance.md)."""


class MaintenanceFirst:
    """`defer` for a node's build streams: true while the router has input waiting to be
    appended, or the node's maintenance stream has mutations in memory still to send, so an
    initial build never holds back keeping the indexes current; but after `MAX_DEFER_S` of
    waiting the build gets a turn of `BUILD_TURN_S`, so it still moves. Never while the
    maintenance stream is not connected: the node may be merging a build and wait for it."""

    def __init__(
        self, mm: MutationManager, consumer: str, input_waiting: Callable[[], bool]
    ) -> None:
        self.mm = mm
        self.consumer = consumer
        self.input_waiting = input_waiting
        self.vbuckets: list[int] = []  # the node's, set when its maintenance stream connects
        self._waiting_since: float | None = None
        self._turn_until = -math.inf

    def __call__(self) -> bool:
        now = trio.current_time()
        if now < self._turn_until or not self._maintenance_busy():
            self._waiting_since = None
            return False
        if self._waiting_since is None:
            self._waiting_since = now
        elif now - self._waiting_since >= MAX_DEFER_S:
            self._waiting_since = None
            self._turn_until = now + BUILD_TURN_S
            return False
        return True

    def _maintenance_busy(self) -> bool:
        pending = self.mm.pending
        consumer = self.consumer
        if self.vbuckets:
            try:
                pending(consumer, self.vbuckets[0])
            except MutationError:
                # The maintenance stream is reconnecting (its node created or dropped an
                # index): nothing of it can be sent meanwhile, so the build need not give way.
                return False
        return self.input_waiting() or any(pending(consumer, vb) for vb in self.vbuckets)


def stored_bytes(item: Item) -> bytes:
    """A Mutation Manager item as the source log stores it (a delete has no payload there)."""
    if item.payload is None:
        return encode_document(Document(item.docid.decode(), None))
    return item.payload


class NodeCursors:
    """One connection's cursors (sans-IO): memory snapshots and backfill chunks in, frames out.

    Every vbucket gets a cursor at its restart seqno, so vbuckets first written after the
    handshake are streamed too. `requests` collects the backfills to start. With `keep`, memory
    keeps what follows the restart seqnos, and then what follows each acknowledged seqno, for
    this consumer's next connection (MutationManager.keep).
    """

    def __init__(
        self,
        reply: p.HandshakeReply,
        source: SourceLog,
        mm: MutationManager,
        consumer: str,
        batch_records: int = BATCH_RECORDS,
        recent: RecentDocuments | None = None,
        keep: bool = False,
        shared: SharedFrames | None = None,
    ) -> None:
        self.source = source
        self.recent = recent
        self.shared = shared
        self.mm = mm
        self.consumer = consumer
        self.records = RecordEncoder(reply.indexes, reply.max_frame_bytes)
        self.batch_bytes = batch_bytes(reply)
        self.batch_records = batch_records
        # What decides a snapshot's frames besides its items: nodes that agree share them.
        self.encoding = (reply.indexes, reply.max_frame_bytes, self.batch_bytes, batch_records)
        self.begun: set[int] = set()
        self.backfilling: dict[int, Backfill] = {}
        self.requests: list[Backfill] = []
        self.sent = 0
        self.backfilled = 0
        self.superseded = 0  # versions a backfill read and left out: a later one followed
        self.skipped = 0
        restart = {position.vbucket: position.seqno for position in reply.restart}
        # Only what the node owns: a vbucket of another node would get NOT_MY_SLICE.
        self.vbuckets = sorted(vb for vb in reply.owned if source.owns(vb))
        try:
            for vb in self.vbuckets:
                seqno = restart.get(vb, 0)
                if seqno > mm.high_seqno(vb):
                    raise FeedError(
                        f"vbucket {vb}: the indexer holds seqno {seqno} but the source log ends"
                        f" at {mm.high_seqno(vb)}: it has history this log does not"
                    )
                self.skipped += seqno
                backfill = mm.register(consumer, vb, seqno)
                if backfill is not None:
                    self._start_backfill(backfill)
                if keep:
                    mm.keep(consumer, vb, seqno)
        except BaseException:
            mm.unregister_consumer(consumer)
            raise
        self._owned = frozenset(self.vbuckets)

    def close(self) -> None:
        """The connection is gone: its cursors stop pinning memory (what it keeps stays)."""
        self.mm.unregister_consumer(self.consumer)

    def acknowledged(self, ack: p.Ack) -> None:
        """The node acknowledged these seqnos: memory need keep only what follows them."""
        for position in ack.positions:
            if position.vbucket in self._owned:
                self.mm.keep(self.consumer, position.vbucket, position.seqno)

    def take_requests(self) -> list[Backfill]:
        requests, self.requests = self.requests, []
        return requests

    def _start_backfill(self, backfill: Backfill) -> None:
        self.backfilling[backfill.vbucket] = backfill
        self.requests.append(backfill)

    def memory_snapshots(self) -> Iterator[tuple[int, Snapshot]]:
        """(vbucket, snapshot) of what memory holds for every cursor it serves, vbuckets in
        turn, each cursor moved past what it yields."""
        mm = self.mm
        for vb in self.vbuckets:
            if vb in self.backfilling or not mm.pending(self.consumer, vb):
                continue
            try:
                snapshots = mm.read(self.consumer, vb, SNAPSHOTS_PER_TURN)
            except BackfillRequired as exc:  # dropped over the memory cap since the last turn
                self._start_backfill(exc.backfill)
                continue
            for snapshot in snapshots:
                yield vb, snapshot

    def memory_chunks(self) -> Iterator[tuple[list[bytes], int]]:
        """(frames, items) of `memory_snapshots`, encoded once for every node that shares
        this one's encoding (`shared`)."""
        shared = self.shared
        for vb, snapshot in self.memory_snapshots():
            self.sent += len(snapshot.items)
            key = (self.encoding, vb, self.source.vbuuid(vb), snapshot.start, snapshot.end)
            pieces = shared.get(key) if shared is not None else None
            if pieces is None:
                pieces = record_frames(
                    self.records.nkeys,
                    self.batch_bytes,
                    self.batch_records,
                    vb,
                    snapshot.start,
                    snapshot.end,
                    self._records(vb, snapshot.items),
                )
                if shared is not None:
                    shared.put(key, pieces)
            yield from self._begin(vb, pieces)

    def memory_stored(self) -> list[RawChunk]:
        """`memory_snapshots` as stored versions, for an encoder process."""
        out = []
        for vb, snapshot in self.memory_snapshots():
            versions = [(item.seqno, stored_bytes(item)) for item in snapshot.items]
            out.append(RawChunk(vb, snapshot.start, snapshot.end, versions, False, len(versions)))
        return out

    def encoded_chunks(self, encoded: Sequence[EncodedChunk]) -> Iterator[tuple[list[bytes], int]]:
        """(frames, items) of memory snapshots an encoder process encoded."""
        for chunk in encoded:
            self.sent += chunk.kept
            yield from self._begin(chunk.vbucket, chunk.pieces)

    def _records(self, vb: int, items: Sequence[Item]) -> list[bytes]:
        """The record of each item: from its document parsed at its append if still at hand,
        else from its payload."""
        records = self.records
        found = self.recent.documents(vb, items) if self.recent is not None else None
        if found is None or not any(document is not None for document in found):
            return records.stored_records(items)
        return [
            records.record(item.seqno, document, item.docid)
            if document is not None
            else records.stored_records((item,))[0]
            for item, document in zip(items, found, strict=True)
        ]

    def backfill_chunks(
        self, chunk: BackfillChunk | EncodedChunk
    ) -> Iterator[tuple[list[bytes], int]]:
        """(frames, items) of a backfill chunk; after its last one the cursor rejoins memory."""
        if type(chunk) is EncodedChunk:
            self.backfilled += chunk.kept
            self.superseded += chunk.read - chunk.kept
            if chunk.kept:
                yield from self._begin(chunk.vbucket, chunk.pieces)
        else:
            assert type(chunk) is BackfillChunk
            self.backfilled += len(chunk.versions)
            self.superseded += chunk.read - len(chunk.versions)
            if chunk.versions:
                yield from self._snapshot_frames(
                    chunk.vbucket, chunk.start, chunk.end, chunk.versions
                )
        if chunk.last:
            del self.backfilling[chunk.vbucket]
            following = self.mm.rejoin(self.consumer, chunk.vbucket, chunk.end)
            if following is not None:  # memory moved on meanwhile: backfill on
                self._start_backfill(following)

    def _snapshot_frames(
        self, vb: int, start: int, end: int, versions: Sequence[tuple[int, Document]]
    ) -> Iterator[tuple[list[bytes], int]]:
        """STREAM_BEGIN for the vbucket's first, then `snapshot_frames`."""
        pieces = snapshot_frames(
            self.records, self.batch_bytes, self.batch_records, vb, start, end, versions
        )
        return self._begin(vb, pieces)

    def _begin(
        self, vb: int, pieces: Iterable[tuple[list[bytes], int]]
    ) -> Iterator[tuple[list[bytes], int]]:
        """The pieces of a snapshot, STREAM_BEGIN ahead of them if the vbucket is not begun."""
        if vb not in self.begun:
            self.begun.add(vb)
            yield [p.encode(p.StreamBegin(vb, self.source.vbuuid(vb)))], 0
        yield from pieces

    def ends(self) -> list[bytes]:
        """STREAM_END of every vbucket begun."""
        return [p.encode(p.StreamEnd(vb, self.source.vbuuid(vb))) for vb in sorted(self.begun)]


class Wakeup:
    """An event that can be set any number of times and waited on again after each wake."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def set(self) -> None:
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()
        self._event = trio.Event()


async def _backfill(
    source: SourceLog,
    requests: trio.MemoryReceiveChannel[Backfill],
    chunks: trio.MemorySendChannel[BackfillChunk | EncodedChunk],
    wakeup: Wakeup,
    max_items: int,
    defer: Callable[[], bool] | None = None,
    encoder: BuildEncoder | None = None,
) -> None:
    """Read the source log for the backfill requests into the bounded chunk queue.

    Requests are served together, up to `max_items` versions per worker-thread call: after a
    reconnect hundreds of vbuckets may each need a few versions, and one call per vbucket would
    keep the last of them waiting for all the others. A deferring stream reads only while
    `defer()` is false: its reads compete for the GIL with what it gives way to. With an
    `encoder`, versions are read as stored and that process parses and encodes them.
    """
    pending: deque[tuple[Backfill, int]] = deque()  # (request, the seqno reached so far)
    while True:
        if not pending:
            backfill = await requests.receive()
            pending.append((backfill, backfill.after))
        while True:
            try:
                backfill = requests.receive_nowait()
            except trio.WouldBlock:
                break
            pending.append((backfill, backfill.after))
        while defer is not None and defer():
            await trio.sleep(DEFER_S)
        wanted = list(pending)
        read: Sequence[BackfillChunk | EncodedChunk]
        if encoder is None:
            read = await trio.to_thread.run_sync(read_backfill_chunks, source, wanted, max_items)
        else:
            stored = await trio.to_thread.run_sync(
                read_chunks, read_raw_chunk, source, wanted, max_items
            )
            read = await encoder.encode(stored)
        for (backfill, _), chunk in zip(wanted, read, strict=False):
            pending.popleft()
            await chunks.send(chunk)
            wakeup.set()
            if not chunk.last:  # more of this vbucket after the others' turn
                pending.append((backfill, chunk.end))


async def _forward_appends(
    next_change: Callable[[], trio.Event], wakeup: Wakeup, first: trio.Event
) -> None:
    """Wake the stream at every append, from the one `first` stands for: taken before the
    stream first looks at memory, so an append in between is not missed."""
    change = first
    while True:
        await change.wait()
        wakeup.set()
        change = next_change()


@dataclass
class NodeProgress:
    """What `/stats` shows of one node's connection."""

    connected: bool = False
    sent: int = 0
    backfilled: int = 0
    superseded: int = 0
    backfilling: int = 0
    connections: int = 0
    last_error: str = ""  # why the last connection failed or ended ("" if none did)
    stopped: bool = False  # refused for good (another source): not retried


async def follow_memory(
    host: str,
    port: int,
    source: SourceLog,
    mm: MutationManager,
    next_change: Callable[[], trio.Event],
    *,
    consumer: str,
    router_name: str = "indexer-router",
    on_rollback: Callable[[int, int], None] | None = None,
    on_connected: Callable[[p.HandshakeReply, int], None] | None = None,
    progress: NodeProgress | None = None,
    backfill_items: int = BACKFILL_CHUNK_ITEMS,
    build: str = "",
    defer: Callable[[], bool] | None = None,
    recent: RecentDocuments | None = None,
    security: FeedSecurity | None = None,
    shared: SharedFrames | None = None,
    visibility: Visibility | None = None,
) -> NoReturn:
    """Stream to the indexer at host:port from the Mutation Manager, backfilling from `source`
    where memory does not reach, until cancelled or a FeedError (one connection, no retry).

    `next_change()` is the event the next write to the manager sets. `on_connected(reply, n)`
    is called after the handshake with the number of vbuckets that start with a backfill.
    With `build`, this is the build stream of that build (one or more indexes, their names
    comma-separated): the node's reply names its indexes only (their keys are the only ones
    computed, in one pass for all of them), and restarts from what the build has. `defer()` is
    asked between pieces sent: while it is true the stream waits (see `Deference`). With
    `visibility`, a maintenance stream sends a barrier when it has sent everything and a request
    waits to be readable (indexer/router/source/visibility.py).
    """
    n = source.num_vbuckets
    settings = FeedSettings(
        router_name=router_name,
        num_vbuckets=n,
        on_rollback=on_rollback,
        security=security or FeedSecurity(),
    )
    vbuckets = source.vbuckets_with_history()
    logs = {vb: source.failover_log(vb) for vb in vbuckets}
    # A peer router asks for its own vbuckets only: a node refuses a claim on a vbucket that
    # another connection streams (STREAM_EXISTS), before anything of it is applied.
    handshake = p.Handshake(
        router_name, n, source.streamed_vbuckets(), logs, build=build, source=source.identity
    )
    stats = progress if progress is not None else NodeProgress()

    async def run(peer: Peer) -> NoReturn:
        reply = await exchange_handshake(peer, handshake, settings)
        try:
            # A maintenance stream resumes after a reconnect from what the node acknowledged:
            # memory keeps what follows for it. A build stream resumes from what it wrote.
            cursors = NodeCursors(
                reply, source, mm, consumer, recent=recent, keep=not build, shared=shared
            )
        except MutationError as exc:
            raise FeedError(f"the indexer's restart positions do not fit the log: {exc}") from None
        wakeup = Wakeup()
        barriers: BarrierTurn | None = None
        if not build:
            peer.on_ack = cursors.acknowledged
            if visibility is not None:  # read-your-writes: barriers when a request waits
                visibility.connected(consumer, cursors.vbuckets)
                barriers = BarrierTurn(visibility, consumer, wakeup.set)
                peer.on_barrier = barriers.answered
        stats.connected = True
        stats.connections += 1
        if on_connected is not None:
            on_connected(reply, len(cursors.backfilling))
        request_send, request_receive = trio.open_memory_channel[Backfill](math.inf)
        chunk_send, chunk_receive = trio.open_memory_channel[BackfillChunk | EncodedChunk](
            BACKFILL_QUEUE_CHUNKS
        )
        idle = False
        try:
            async with AsyncExitStack() as stack:
                encoder = None
                if build:  # a build's versions are parsed and encoded by a process of its own
                    encoder = await stack.enter_async_context(
                        build_encoder(
                            reply.indexes,
                            cursors.batch_bytes,
                            cursors.batch_records,
                            reply.max_frame_bytes,
                        )
                    )
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(peer.read_acks)
                    nursery.start_soon(_forward_appends, next_change, wakeup, next_change())
                    nursery.start_soon(
                        _backfill,
                        source,
                        request_receive,
                        chunk_send,
                        wakeup,
                        backfill_items,
                        defer,
                        encoder,
                    )
                    while True:
                        moved = 0
                        for backfill in cursors.take_requests():
                            request_send.send_nowait(backfill)
                        while True:
                            try:
                                chunk = chunk_receive.receive_nowait()
                            except trio.WouldBlock:
                                break
                            moved += await _send(peer, cursors.backfill_chunks(chunk), defer)
                            moved += 1
                        try:
                            if encoder is None:
                                moved += await _send(peer, cursors.memory_chunks(), defer)
                            else:
                                encoded = await encoder.encode(cursors.memory_stored())
                                moved += await _send(peer, cursors.encoded_chunks(encoded), defer)
                        except MutationError as exc:  # a failover reset the vbucket meanwhile
                            raise FeedError(f"the source changed under the stream: {exc}") from None
                        stats.sent = cursors.sent
                        stats.backfilled = cursors.backfilled
                        stats.superseded = cursors.superseded
                        stats.backfilling = len(cursors.backfilling)
                        if not moved and not cursors.requests:
                            if barriers is not None and (
                                cookie := barriers.due(cursors.sent + cursors.backfilled)
                            ):
                                await peer.send(p.encode(p.Barrier(cookie)))
                            idle = True
                            await wakeup.wait()
                            idle = False
        finally:
            stats.connected = False
            cursors.close()
            # Between whole frames: release the vbuckets in an orderly way (best effort).
            ends = cursors.ends()
            if idle and ends:
                with trio.move_on_after(END_TIMEOUT_S, shield=True):
                    with suppress(Exception):
                        await peer.stream.send_all(b"".join(ends))

    await connect_and_run(host, port, run, settings.security)


async def _send(
    peer: Peer, chunks: Iterator[tuple[list[bytes], int]], defer: Callable[[], bool] | None
) -> int:
    """Send the chunks' frames; how many items they carried. A deferring stream sends smaller
    pieces, so the stream it gives way to waits less."""
    piece = SEND_BYTES if defer is None else DEFERRING_SEND_BYTES
    return await send_chunks(peer, chunks, None, defer, piece)
