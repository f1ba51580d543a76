"""A router speaking the protocol frame by frame over one socket, for any vbuckets, and the
per-vbucket history it streams: for tests that need what the reference router never does
(half frames, ignoring the flow-control window, never reading) or more speed than it has."""

from __future__ import annotations

import random
import socket
import time
from collections import deque

from indexer import protocol as p
from indexer.keys import index_key
from indexer.router.documents import Document
from tests.e2e.conftest import WAIT_S, Daemon
from tests.e2e.stream_client import next_message, random_body

NUM_VBUCKETS = 1024


class History:
    """Documents per vbucket in seqno order (seqno n is `docs[vb][n - 1]`); ids unique per
    vbucket, so the model of all of them does not depend on how vbuckets interleave."""

    def __init__(self, vbuckets: list[int], seed: int, ids_per_vbucket: int = 40) -> None:
        self.rng = random.Random(seed)
        self.ids = ids_per_vbucket
        self.docs: dict[int, list[Document]] = {vb: [] for vb in vbuckets}

    def write(self, vb: int, count: int) -> None:
        for _ in range(count):
            docid = f"v{vb}-d{self.rng.randrange(self.ids)}"
            body = random_body(self.rng)
            self.docs[vb].append(Document(docid, body))

    def high(self, vb: int) -> int:
        return len(self.docs[vb])

    def documents(self) -> list[Document]:
        return [d for docs in self.docs.values() for d in docs]


class FeedClient:
    """A router speaking the protocol on one socket, for any vbuckets, frame by frame."""

    VBUUID = 0x5EED

    def __init__(
        self,
        daemon: Daemon,
        vbuckets: list[int],
        flow_control: bool = True,
        receive_buffer: int | None = None,
    ) -> None:
        self.sock = socket.socket()
        if receive_buffer is not None:  # before connecting: it sets the window TCP offers
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        self.sock.settimeout(60)
        self.sock.connect(("127.0.0.1", daemon.port))
        self.vbuckets = vbuckets
        self.decoder = p.FrameDecoder(1 << 26)
        self.queue: deque[p.Message] = deque()
        self.sent = self.credited = self.window = 0
        handshake = p.Handshake("test-client", NUM_VBUCKETS, tuple(vbuckets), {}, flow_control)
        self.send(p.encode(handshake))
        reply = self.next()
        assert isinstance(reply, p.HandshakeReply), reply
        self.paths = [index.keys for index in reply.indexes]
        self.window = reply.flow_control_bytes
        self.restart = {r.vbucket: r.seqno for r in reply.restart}
        self.acked = dict(self.restart)

    def next(self) -> p.Message:
        return next_message(self.sock, self.decoder, self.queue)

    def pump(self) -> None:
        """Read one message and take in what it says (credit, acks)."""
        message = self.next()
        if isinstance(message, p.BufferAck):
            self.credited += message.nbytes
        elif isinstance(message, p.Ack):
            for position in message.positions:
                self.acked[position.vbucket] = position.seqno
        else:
            raise AssertionError(f"unexpected {message}")

    def send(self, data: bytes) -> None:
        """Send within the flow-control window (reading credit as needed)."""
        if self.window:
            while self.sent - self.credited + len(data) > self.window:
                self.pump()
        self.sock.sendall(data)
        self.sent += len(data)

    def begin(self, vb: int) -> bytes:
        return p.encode(p.StreamBegin(vb, self.VBUUID))

    def snapshot(self, history: History, vb: int, start: int, end: int) -> list[bytes]:
        """A marker for seqnos `start..end` and their MUTATIONS frames."""
        frames = [p.encode(p.SnapshotMarker(vb, start, end))]
        records = []
        for seqno in range(start, end + 1):
            doc = history.docs[vb][seqno - 1]
            keys = (
                (b"",) * len(self.paths)
                if doc.body is None
                else tuple(index_key(doc.body, paths) for paths in self.paths)
            )
            records.append(
                p.encode_record(p.Mutation(seqno, doc.docid.encode(), keys, doc.body is None))
            )
        for i in range(0, len(records), 200):
            frames.append(p.encode_mutations(vb, len(self.paths), records[i : i + 200]))
        return frames

    def resume(self, history: History) -> None:
        """Stream every vbucket from the daemon's restart position to the history's end, and
        wait for the acknowledgements of all of it."""
        for vb in self.vbuckets:
            self.send(self.begin(vb))
            if history.high(vb) > self.restart[vb]:
                for frame in self.snapshot(history, vb, self.restart[vb] + 1, history.high(vb)):
                    self.send(frame)
        deadline = time.monotonic() + WAIT_S
        while any(self.acked.get(vb, 0) < history.high(vb) for vb in self.vbuckets):
            assert time.monotonic() < deadline, "not acknowledged in time"
            self.pump()

    def close(self) -> None:
        self.sock.close()
