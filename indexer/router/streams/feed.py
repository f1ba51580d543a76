"""A router feed: streams documents to an indexer and waits for them to be persisted.

The sans-IO part turns documents into frames with `records.py` (`RecordEncoder`, `Batcher`),
fed by the encoders of `encoders.py` (an input's documents, or a router's source log). `feed` and
`feed_log` move those frames over TCP and read acks; `follow_log` keeps its connection and
streams a live log's appends as they come. The connection code here (`connect_and_run`,
`exchange_handshake`, `send_chunks`, `Peer`) is the node streams' too (`node_stream.py`). Every
connection uses its settings' `FeedSecurity`: the indexer's shared token in the handshake, TLS
when it has a context.
"""

from __future__ import annotations

import dataclasses
import logging
import ssl
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import suppress
from dataclasses import dataclass, field
from typing import NoReturn, Protocol, TypeVar

import trio

from indexer import protocol as p
from indexer.router.documents import Document
from indexer.router.source.log import SourceLog
from indexer.router.streams.encoders import LogEncoder, StreamEncoder
from indexer.router.streams.records import (
    SEND_BYTES,
)
from indexer.router.streams.records import FeedError as FeedError  # where its users import it from

_T = TypeVar("_T")

log = logging.getLogger("indexer.router")


MAX_RECONNECTS = 20


@dataclass(frozen=True)
class FeedSecurity:
    """How a feed proves itself to the indexer (`token`, sent in the handshake; "" = none) and
    checks the indexer (TLS with `ssl_context`; None = plain TCP). The token is kept out of
    reprs."""

    token: str = field(default="", repr=False)
    ssl_context: ssl.SSLContext | None = None


@dataclass(frozen=True)
class FeedSettings:
    """How a feed behaves, whatever its documents."""

    wait_persisted: bool = True
    router_name: str = "indexer-feed"
    progress: Callable[[int], None] | None = None
    num_vbuckets: int = 1024
    # Called with (vbucket, seqno) for each vbucket the indexer says it rolled back.
    on_rollback: Callable[[int, int], None] | None = None
    # Wait, with a barrier, until everything sent is readable (session consistency).
    wait_visible: bool = False
    # Ask for flow control: keep within the indexer's window of unacknowledged bytes.
    flow_control: bool = True
    # The indexer's token and how its TLS certificate is checked.
    security: FeedSecurity = field(default_factory=FeedSecurity)


@dataclass(frozen=True)
class FeedResult:
    sent: int
    skipped: int
    vbuckets: int
    persisted: bool
    # With wait_visible: per vbucket, the seqno a scan's at_plus must reach to see this feed.
    visible_at: dict[int, int] | None = None


class Peer:
    """The indexer side of the connection: decodes its frames, tracks acks."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.decoder = p.FrameDecoder(64 << 20)
        self.acked: dict[int, int] = {}
        self.on_ack: Callable[[p.Ack], None] | None = None  # told of every ACK as it comes
        self.on_barrier: Callable[[p.BarrierReply], None] | None = None  # and of every reply
        self.changed = trio.Event()
        # Decoded and not yet taken, in arrival order: a later ACK must not be undone by an
        # earlier one that came in the same receive.
        self.queue: deque[p.Message] = deque()
        self.window = 0  # flow control: 0 off, else bytes that may be out uncredited
        self.sent = 0
        self.credited = 0
        self.barriers: dict[int, p.BarrierReply] = {}

    async def send(self, data: bytes) -> None:
        """Send, keeping within the flow-control window: as much as it has room for, then wait.

        Sending what fits (not whole chunks) keeps the stream live: the indexer credits every
        complete frame it has, and a frame is never larger than the window.
        """
        view = memoryview(data)
        while view:
            piece = view
            if self.window:
                while (room := self.window - (self.sent - self.credited)) <= 0:
                    await self.changed.wait()
                piece = view[:room]
            await self.stream.send_all(piece)
            self.sent += len(piece)
            view = view[len(piece) :]

    async def next_message(self) -> p.Message:
        while True:
            if self.queue:
                return self.queue.popleft()
            try:
                self.queue.extend(self.decoder.messages())
            except p.ProtocolError as exc:
                raise FeedError(f"the indexer sent a bad frame: {exc.message}") from None
            if self.queue:
                continue
            data = await self.stream.receive_some(1 << 16)
            if not data:
                raise FeedError("the indexer closed the connection")
            self.decoder.feed(data)

    def _handle(self, message: p.Message) -> None:
        if isinstance(message, p.Error):
            raise FeedError(
                f"the indexer refused the feed: {message.code.name}: {message.message}",
                message.code,
            )
        if isinstance(message, p.Ack):
            for position in message.positions:
                self.acked[position.vbucket] = position.seqno
            if self.on_ack is not None:
                self.on_ack(message)
        elif isinstance(message, p.BufferAck):
            self.credited += message.nbytes
        elif isinstance(message, p.BarrierReply):
            if self.on_barrier is not None:
                self.on_barrier(message)
            else:
                self.barriers[message.cookie] = message
        else:
            return
        self.changed.set()
        self.changed = trio.Event()

    async def read_acks(self) -> None:
        while True:
            self._handle(await self.next_message())


# Errors after which the feed handshakes again and resumes from the new restart positions.
RECONNECT_CODES = frozenset(
    {p.ErrorCode.INDEXES_CHANGED, p.ErrorCode.ROLLBACK, p.ErrorCode.SLICE_CHANGED}
)


class _Encoder(Protocol):
    """What the connection needs of an encoder once its frames are out."""

    sent: int
    skipped: int

    def targets(self) -> dict[int, int]: ...

    def ends(self) -> list[bytes]: ...


# A handshake reply in, the encoder and its (frames, documents consumed) chunks out.
_Start = Callable[[p.HandshakeReply], tuple[_Encoder, Iterator[tuple[list[bytes], int]]]]


async def feed(
    host: str,
    port: int,
    documents: Iterable[Document] | Callable[[], Iterable[Document]],
    *,
    wait_persisted: bool = True,
    router_name: str = "indexer-feed",
    progress: Callable[[int], None] | None = None,
    num_vbuckets: int = 1024,
    on_rollback: Callable[[int, int], None] | None = None,
    wait_visible: bool = False,
    flow_control: bool = True,
    security: FeedSecurity | None = None,
) -> FeedResult:
    """Stream `documents` to the indexer at host:port; with `wait_persisted`, return only once
    an ack says everything sent is in a persisted snapshot; with `wait_visible`, once a barrier
    says it is readable (the result's `visible_at` is the at_plus vector of this feed).

    Given a callable that makes the documents afresh, the feed reconnects when the indexer's
    indexes change (INDEXES_CHANGED) or it rolls back (ROLLBACK): it handshakes again, learns
    the new index keys, and resumes from the restart timestamp.
    """
    settings = FeedSettings(
        wait_persisted,
        router_name,
        progress,
        num_vbuckets,
        on_rollback,
        wait_visible,
        flow_control,
        security or FeedSecurity(),
    )
    n = num_vbuckets
    # Ask for every vbucket; the reply says which this node owns and where each resumes.
    handshake = p.Handshake(router_name, n, tuple(range(n)))
    for _ in range(MAX_RECONNECTS):
        source = documents() if callable(documents) else documents

        def start(
            reply: p.HandshakeReply, source: Iterable[Document] = source
        ) -> tuple[_Encoder, Iterator[tuple[list[bytes], int]]]:
            encoder = StreamEncoder(reply)
            return encoder, encoder.frames(source)

        try:
            return await _feed_once(host, port, handshake, start, settings)
        except FeedError as exc:
            if exc.code not in RECONNECT_CODES or not callable(documents):
                raise
    raise FeedError(f"the indexer asked to handshake again {MAX_RECONNECTS} times in one feed")


async def feed_log(
    host: str,
    port: int,
    log: SourceLog,
    *,
    wait_persisted: bool = True,
    router_name: str = "indexer-feed",
    progress: Callable[[int], None] | None = None,
    on_rollback: Callable[[int, int], None] | None = None,
    wait_visible: bool = False,
    flow_control: bool = True,
    security: FeedSecurity | None = None,
) -> FeedResult:
    """Stream what the indexer at host:port lacks of `log`: the handshake carries the failover
    log of every vbucket with history, each stream begins with the current vbuuid and resumes
    after the restart seqno. Reconnects on INDEXES_CHANGED and ROLLBACK.
    """
    n = log.num_vbuckets
    settings = FeedSettings(
        wait_persisted,
        router_name,
        progress,
        n,
        on_rollback,
        wait_visible,
        flow_control,
        security or FeedSecurity(),
    )

    def start(reply: p.HandshakeReply) -> tuple[_Encoder, Iterator[tuple[list[bytes], int]]]:
        encoder = LogEncoder(reply, log)
        return encoder, encoder.frames()

    for _ in range(MAX_RECONNECTS):
        vbuckets = log.vbuckets_with_history()
        logs = {vb: log.failover_log(vb) for vb in vbuckets}
        handshake = p.Handshake(router_name, n, tuple(vbuckets), logs, source=log.identity)
        try:
            return await _feed_once(host, port, handshake, start, settings)
        except FeedError as exc:
            if exc.code not in RECONNECT_CODES:
                raise
    raise FeedError(f"the indexer asked to handshake again {MAX_RECONNECTS} times in one feed")


async def _feed_once(
    host: str, port: int, handshake: p.Handshake, start: _Start, settings: FeedSettings
) -> FeedResult:
    async def run(peer: Peer) -> FeedResult:
        return await _run(peer.stream, peer, handshake, start, settings)

    return await connect_and_run(host, port, run, settings.security)


async def _connect(host: str, port: int, context: ssl.SSLContext | None) -> trio.abc.Stream:
    """A TCP connection to the indexer, with TLS (handshake made, certificate checked) when
    given a context."""
    try:
        tcp = await trio.open_tcp_stream(host, port)
    except OSError as exc:
        raise FeedError(f"cannot connect to the indexer at {host}:{port}: {exc}") from None
    if context is None:
        return tcp
    stream = trio.SSLStream(tcp, context, server_hostname=host, https_compatible=True)
    try:
        await stream.do_handshake()
    except trio.BrokenResourceError as exc:
        await trio.aclose_forcefully(tcp)
        why = exc.__cause__ or exc
        raise FeedError(f"TLS handshake with the indexer at {host}:{port} failed: {why}") from None
    return stream


async def connect_and_run(
    host: str, port: int, run: Callable[[Peer], Awaitable[_T]], security: FeedSecurity
) -> _T:
    """Connect and `run` the conversation; connection failures become a FeedError."""
    stream = await _connect(host, port, security.ssl_context)
    async with stream:
        peer = Peer(stream)
        try:
            try:
                return await run(peer)
            except BaseExceptionGroup as group:
                raise _leaf(group) from None
        except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError) as exc:
            # The indexer may have sent an error frame just before closing: prefer its reason.
            with trio.move_on_after(1):
                try:
                    while True:
                        peer._handle(await peer.next_message())
                except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError):
                    pass
            raise FeedError(f"lost the connection to the indexer: {exc}") from None


def _leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The exception that matters in a nursery's group: a FeedError first, then any other."""
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        else:
            leaves.append(exc)

    walk(group)
    for leaf in leaves:
        if isinstance(leaf, FeedError):
            return leaf
    return leaves[0] if leaves else group


async def _run(
    stream: trio.abc.Stream,
    peer: Peer,
    handshake: p.Handshake,
    start: _Start,
    settings: FeedSettings,
) -> FeedResult:
    reply = await exchange_handshake(peer, handshake, settings)
    encoder, chunks = start(reply)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(peer.read_acks)
        await send_chunks(peer, chunks, settings.progress)
        targets = encoder.targets()
        visible_at = None
        if settings.wait_visible:
            await peer.send(p.encode(p.Barrier(1)))
            while 1 not in peer.barriers:
                await peer.changed.wait()
            visible_at = {pos.vbucket: pos.seqno for pos in peer.barriers[1].positions}
        persisted = False
        if settings.wait_persisted:
            while any(peer.acked.get(vb, 0) < seqno for vb, seqno in targets.items()):
                await peer.changed.wait()
            persisted = True
        ends = encoder.ends()
        if ends:
            await peer.send(b"".join(ends))
        nursery.cancel_scope.cancel()
    return FeedResult(encoder.sent, encoder.skipped, len(targets), persisted, visible_at)


async def exchange_handshake(
    peer: Peer, handshake: p.Handshake, settings: FeedSettings
) -> p.HandshakeReply:
    """Send the handshake (with the token in force, if any), read the reply, report rollbacks
    and open the flow-control window."""
    token = handshake.token or settings.security.token
    handshake = dataclasses.replace(handshake, flow_control=settings.flow_control, token=token)
    await peer.send(p.encode(handshake))  # the window counts the handshake too
    reply = await peer.next_message()
    if isinstance(reply, p.Error):
        peer._handle(reply)
    if not isinstance(reply, p.HandshakeReply):
        raise FeedError(f"expected a handshake reply, got {type(reply).__name__}")
    if settings.on_rollback is not None:
        for vb, seqno in sorted(reply.rollback.items()):
            settings.on_rollback(vb, seqno)
    peer.window = reply.flow_control_bytes
    return reply


async def send_chunks(
    peer: Peer,
    chunks: Iterable[tuple[list[bytes], int]],
    progress: Callable[[int], None] | None,
    defer: Callable[[], bool] | None = None,
    piece_bytes: int = SEND_BYTES,
) -> int:
    """Send the chunks' frames in pieces of about `piece_bytes`, reporting documents consumed;
    how many they were. With `defer`, wait between pieces while it says so (a build stream gives
    way to the maintenance stream of its node)."""
    out: list[bytes] = []
    size = 0
    count = 0
    total = 0
    for frames, consumed in chunks:
        count += consumed
        total += consumed
        if frames:
            out.extend(frames)
            size += sum(len(f) for f in frames)
            if size >= piece_bytes:
                await peer.send(b"".join(out))
                out.clear()
                size = 0
                if progress is not None:
                    progress(count)
                    count = 0
                if defer is not None:
                    await trio.sleep(0)  # the other tasks run between pieces
                    while defer():
                        await trio.sleep(DEFER_S)
    if out:
        await peer.send(b"".join(out))
    if progress is not None and count:
        progress(count)
    return total


DEFER_S = 0.005
"""How long a deferring stream waits before asking again."""


END_TIMEOUT_S = 1.0


async def follow_log(
    host: str,
    port: int,
    log: SourceLog,
    next_change: Callable[[], trio.Event],
    *,
    router_name: str = "indexer-router",
    on_rollback: Callable[[int, int], None] | None = None,
    on_connected: Callable[[p.HandshakeReply, int], None] | None = None,
    security: FeedSecurity | None = None,
) -> NoReturn:
    """Stream `log` to the indexer at host:port like `feed_log`, then keep the connection and
    stream each append as it comes, until cancelled or a FeedError (one connection, no retry).

    `next_change()` is the event the next append to the log sets. `on_connected(reply, n)` is
    called after the handshake with the number of mutations the indexer lacks. Cancelled while
    idle, it ends the streams (STREAM_END) before closing.
    """
    n = log.num_vbuckets
    settings = FeedSettings(
        router_name=router_name,
        num_vbuckets=n,
        on_rollback=on_rollback,
        security=security or FeedSecurity(),
    )
    # Every vbucket, so the restart positions of those first used later are known too.
    vbuckets = log.vbuckets_with_history()
    logs = {vb: log.failover_log(vb) for vb in vbuckets}
    handshake = p.Handshake(router_name, n, tuple(range(n)), logs, source=log.identity)

    async def run(peer: Peer) -> NoReturn:
        reply = await exchange_handshake(peer, handshake, settings)
        changed = next_change()
        encoder = LogEncoder(reply, log)
        if on_connected is not None:
            on_connected(reply, encoder.pending())
        idle = False
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(peer.read_acks)
                while True:
                    await send_chunks(peer, encoder.frames(), None)
                    idle = True
                    await changed.wait()
                    idle = False
                    changed = next_change()
                    encoder.extend()
        finally:
            # Between whole frames: release the vbuckets in an orderly way (best effort).
            ends = encoder.ends()
            if idle and ends:
                with trio.move_on_after(END_TIMEOUT_S, shield=True):
                    with suppress(Exception):
                        await peer.stream.send_all(b"".join(ends))

    await connect_and_run(host, port, run, settings.security)
