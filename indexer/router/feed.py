"""A router feed: streams documents to an indexer and waits for them to be persisted.

`StreamEncoder` is the sans-IO part: it turns documents into frames (vbucket by CRC32 of the id,
seqnos per vbucket in input order, index keys and partial-index conditions evaluated here so the
daemon never parses documents). `feed` moves those frames over TCP and reads acks. Because
seqnos follow input order, replaying the same input after a restart skips exactly what the
indexer reported as persisted.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import trio

from indexer import protocol as p
from indexer.keys import KeyEncodingError, index_key
from indexer.router.documents import Document, vbucket_of
from indexer.where import WhereError, matches, parse_where

BATCH_RECORDS = 512
SEND_BYTES = 256 * 1024


class FeedError(Exception):
    """The feed cannot go on; the message is one line for the user."""

    def __init__(self, message: str, code: p.ErrorCode | None = None) -> None:
        super().__init__(message)
        self.code = code


MAX_RECONNECTS = 20


def default_vbuuid(vbucket: int) -> int:
    """The vbuuid of a vbucket's history for a router without failovers: stable across runs."""
    return zlib.crc32(b"vbuuid:%d" % vbucket) | 1 << 32


class StreamEncoder:
    """Documents in, frames out (sans-IO): batches per vbucket, each after its snapshot marker."""

    def __init__(self, reply: p.HandshakeReply, batch_records: int = BATCH_RECORDS) -> None:
        self.num_vbuckets = reply.num_vbuckets
        self.paths = [index.keys for index in reply.indexes]
        self.nkeys = len(self.paths)
        try:
            self.wheres = [
                None if index.where is None else parse_where(index.where) for index in reply.indexes
            ]
        except WhereError as exc:
            raise FeedError(f"the indexer sent a bad where: {exc}") from None
        self.partial = any(where is not None for where in self.wheres)
        self.restart = [0] * reply.num_vbuckets
        for position in reply.restart:
            self.restart[position.vbucket] = position.seqno
        self.seqnos = [0] * reply.num_vbuckets
        self.batch_records = batch_records
        # Keep a whole frame (records, batch header, frame header) under the indexer's maximum.
        self.batch_bytes = min(reply.max_frame_bytes - 64, SEND_BYTES)
        self.pending: dict[int, list[bytes]] = {}
        self.pending_bytes: dict[int, int] = {}
        self.first: dict[int, int] = {}
        self.begun: set[int] = set()
        self.sent = 0
        self.skipped = 0

    def add(self, document: Document) -> list[bytes]:
        """Frames that are ready after this document (often none)."""
        docid = document.docid.encode()
        vb = vbucket_of(docid, self.num_vbuckets)
        seqno = self.seqnos[vb] + 1
        self.seqnos[vb] = seqno
        if seqno <= self.restart[vb]:
            self.skipped += 1
            return []
        body = document.body
        try:
            if body is None:
                keys: tuple[bytes, ...] = (b"",) * self.nkeys
            elif self.partial:
                # A document a partial index's condition is not TRUE for gets the empty key,
                # which removes its entry there, like a missing leading field.
                keys = tuple(
                    index_key(body, paths) if matches(where, body) else b""
                    for paths, where in zip(self.paths, self.wheres, strict=True)
                )
            else:
                keys = tuple(index_key(body, paths) for paths in self.paths)
        except (KeyEncodingError, RecursionError) as exc:
            raise FeedError(f"document {document.docid!r}: {exc}") from None
        record = p.encode_record(p.Mutation(seqno, docid, keys, body is None))
        if len(record) > self.batch_bytes:
            raise FeedError(f"document {document.docid!r}: its index keys exceed a frame")
        pending = self.pending.get(vb)
        if pending is None:
            pending = self.pending[vb] = []
            self.pending_bytes[vb] = 0
            self.first[vb] = seqno
        pending.append(record)
        self.pending_bytes[vb] += len(record)
        self.sent += 1
        if len(pending) >= self.batch_records or self.pending_bytes[vb] >= self.batch_bytes:
            return self._frames(vb)
        return []

    def _frames(self, vb: int) -> list[bytes]:
        records = self.pending.pop(vb)
        del self.pending_bytes[vb]
        first = self.first.pop(vb)
        frames = []
        if vb not in self.begun:
            self.begun.add(vb)
            frames.append(p.encode(p.StreamBegin(vb, default_vbuuid(vb))))
        frames.append(p.encode(p.SnapshotMarker(vb, first, self.seqnos[vb])))
        frames.append(p.encode_mutations(vb, self.nkeys, records))
        return frames

    def finish(self) -> list[bytes]:
        """Frames of every batch still pending."""
        frames = []
        for vb in sorted(self.pending):
            frames.extend(self._frames(vb))
        return frames

    def targets(self) -> dict[int, int]:
        """Per vbucket streamed, the seqno an ack must reach for everything to be persisted."""
        return {vb: self.seqnos[vb] for vb in self.begun}


@dataclass(frozen=True)
class FeedSettings:
    """How a feed behaves, whatever its documents."""

    wait_persisted: bool = True
    router_name: str = "indexer-feed"
    progress: Callable[[int], None] | None = None
    num_vbuckets: int = 1024


@dataclass(frozen=True)
class FeedResult:
    sent: int
    skipped: int
    vbuckets: int
    persisted: bool


class _Peer:
    """The indexer side of the connection: decodes its frames, tracks acks."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.decoder = p.FrameDecoder(64 << 20)
        self.acked: dict[int, int] = {}
        self.changed = trio.Event()

    async def next_message(self) -> p.Message:
        while True:
            try:
                messages = self.decoder.messages()
            except p.ProtocolError as exc:
                raise FeedError(f"the indexer sent a bad frame: {exc.message}") from None
            if messages:
                # Replies come one at a time during the handshake; later, acks are handled below.
                first, rest = messages[0], messages[1:]
                for message in rest:
                    self._handle(message)
                return first
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
            self.changed.set()
            self.changed = trio.Event()

    async def read_acks(self) -> None:
        while True:
            self._handle(await self.next_message())


async def feed(
    host: str,
    port: int,
    documents: Iterable[Document] | Callable[[], Iterable[Document]],
    *,
    wait_persisted: bool = True,
    router_name: str = "indexer-feed",
    progress: Callable[[int], None] | None = None,
    num_vbuckets: int = 1024,
) -> FeedResult:
    """Stream `documents` to the indexer at host:port; with `wait_persisted`, return only once
    an ack says everything sent is in a persisted snapshot.

    Given a callable that makes the documents afresh, the feed reconnects when the indexer's
    indexes change (INDEXES_CHANGED): it handshakes again, learns the new index keys, and
    resumes from the restart timestamp.
    """
    settings = FeedSettings(wait_persisted, router_name, progress, num_vbuckets)
    for _ in range(MAX_RECONNECTS):
        source = documents() if callable(documents) else documents
        try:
            return await _feed_once(host, port, source, settings)
        except FeedError as exc:
            if exc.code is not p.ErrorCode.INDEXES_CHANGED or not callable(documents):
                raise
    raise FeedError(f"the indexer changed its indexes {MAX_RECONNECTS} times during the feed")


async def _feed_once(
    host: str, port: int, documents: Iterable[Document], settings: FeedSettings
) -> FeedResult:
    try:
        stream = await trio.open_tcp_stream(host, port)
    except OSError as exc:
        raise FeedError(f"cannot connect to the indexer at {host}:{port}: {exc}") from None
    async with stream:
        peer = _Peer(stream)
        try:
            try:
                return await _run(stream, peer, documents, settings)
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
    stream: trio.SocketStream, peer: _Peer, documents: Iterable[Document], settings: FeedSettings
) -> FeedResult:
    # Ask for every vbucket; the reply says which this node owns and where each resumes.
    n = settings.num_vbuckets
    handshake = p.Handshake(settings.router_name, n, tuple(range(n)))
    progress = settings.progress
    await stream.send_all(p.encode(handshake))
    reply = await peer.next_message()
    if isinstance(reply, p.Error):
        peer._handle(reply)
    if not isinstance(reply, p.HandshakeReply):
        raise FeedError(f"expected a handshake reply, got {type(reply).__name__}")
    encoder = StreamEncoder(reply)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(peer.read_acks)
        out: list[bytes] = []
        size = 0
        count = 0
        for document in documents:
            count += 1
            frames = encoder.add(document)
            if frames:
                out.extend(frames)
                size += sum(len(f) for f in frames)
                if size >= SEND_BYTES:
                    await stream.send_all(b"".join(out))
                    out.clear()
                    size = 0
                    if progress is not None:
                        progress(count)
                        count = 0
        out.extend(encoder.finish())
        if out:
            await stream.send_all(b"".join(out))
        if progress is not None and count:
            progress(count)
        targets = encoder.targets()
        persisted = False
        if settings.wait_persisted:
            while any(peer.acked.get(vb, 0) < seqno for vb, seqno in targets.items()):
                await peer.changed.wait()
            persisted = True
        ends = [p.encode(p.StreamEnd(vb, default_vbuuid(vb))) for vb in sorted(encoder.begun)]
        if ends:
            await stream.send_all(b"".join(ends))
        nursery.cancel_scope.cancel()
    return FeedResult(encoder.sent, encoder.skipped, len(targets), persisted)
