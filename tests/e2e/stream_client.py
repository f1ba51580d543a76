"""A small blocking router for end-to-end tests: a source with failover logs, over real TCP.

The source is a list of mutations per vbucket (the model of its history); the router speaks the
protocol directly, so tests can send what the reference router never would at a chosen moment.
"""

from __future__ import annotations

import random
import socket
import time
from collections import deque

from indexer import protocol as p
from indexer.keys import index_key
from indexer.router.documents import Document, vbucket_of
from tests.e2e.conftest import INDEXES, Daemon, dump, model

NUM_VBUCKETS = 1024
VBUCKETS = (11, 222, 333)
FAST_PERSIST = {"snapshots": {"persist_interval_ms": 100, "in_memory_interval_ms": 20}}


def next_message(
    sock: socket.socket, decoder: p.FrameDecoder, queue: deque[p.Message]
) -> p.Message:
    """The next message from the daemon: one decoded earlier, else read until one is whole."""
    while not queue:
        queue.extend(decoder.messages())
        if not queue:
            data = sock.recv(1 << 16)
            assert data, "the daemon closed the connection"
            decoder.feed(data)
    return queue.popleft()


def random_body(rng: random.Random) -> dict[str, object] | None:
    """A document of the test indexes' shape, or None (a delete) one time in ten."""
    if rng.random() < 0.1:
        return None
    return {
        "address": {"city": rng.choice(["Oslo", "Rome", "Lima", "Kyiv"])},
        "age": rng.randint(18, 90),
    }


class Source:
    """Documents per vbucket in seqno order, and each vbucket's failover log (newest first)."""

    def __init__(self, seed: int, docids_per_vbucket: int = 60) -> None:
        self.rng = random.Random(seed)
        self.history: dict[int, list[Document]] = {vb: [] for vb in VBUCKETS}
        self.logs: dict[int, list[tuple[int, int]]] = {
            vb: [(self.rng.getrandbits(63), 0)] for vb in VBUCKETS
        }
        self.docids: dict[int, list[str]] = {vb: [] for vb in VBUCKETS}
        i = 0
        while any(len(ids) < docids_per_vbucket for ids in self.docids.values()):
            docid = f"doc-{i}"
            vb = vbucket_of(docid.encode(), NUM_VBUCKETS)
            if vb in self.docids:
                self.docids[vb].append(docid)
            i += 1

    def write(self, vb: int, count: int) -> None:
        for _ in range(count):
            docid = self.rng.choice(self.docids[vb])
            body = random_body(self.rng)
            self.history[vb].append(Document(docid, body))

    def failover(self, vb: int, at: int, forget_all: bool = False) -> None:
        """A replica that had seqnos up to `at` takes over; the rest of the history is lost."""
        del self.history[vb][at:]
        kept = [] if forget_all else [(u, s) for u, s in self.logs[vb] if s <= at]
        self.logs[vb] = [(self.rng.getrandbits(63), at), *kept]

    def high(self, vb: int) -> int:
        return len(self.history[vb])

    def surviving(self) -> list[Document]:
        return [d for vb in VBUCKETS for d in self.history[vb]]


class Router:
    """One connection: handshake with the source's failover logs, stream what the daemon lacks.

    With `flow_control`, never more than the daemon's window is sent and not credited back.
    """

    FRAME_RECORDS = 500

    def __init__(
        self,
        daemon: Daemon,
        source: Source,
        wait_reply: bool = True,
        flow_control: bool = False,
    ) -> None:
        host, port = daemon.address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=60)
        self.decoder = p.FrameDecoder()
        self.queue: deque[p.Message] = deque()
        self.source = source
        self.sent = 0  # bytes, the handshake included
        self.credited = 0
        self.most_in_flight = 0
        self.window = 0
        self.barriers: list[p.BarrierReply] = []
        logs = {vb: tuple(source.logs[vb]) for vb in VBUCKETS}
        handshake = p.Handshake("test-router", NUM_VBUCKETS, VBUCKETS, logs, flow_control)
        self.send(p.encode(handshake))
        if not wait_reply:
            return
        reply = self.next()
        assert isinstance(reply, p.HandshakeReply), reply
        self.reply = reply
        self.window = reply.flow_control_bytes
        self.restart = {r.vbucket: r.seqno for r in reply.restart}
        self.acked = {vb: self.restart[vb] for vb in VBUCKETS}  # restart = persisted

    def next(self) -> p.Message:
        return next_message(self.sock, self.decoder, self.queue)

    def pump(self) -> p.Message:
        """The next message, after taking in what it says (credit, acks, barrier answers)."""
        message = self.next()
        if isinstance(message, p.BufferAck):
            self.credited += message.nbytes
        elif isinstance(message, p.Ack):
            for position in message.positions:
                if position.vbucket in self.acked:
                    self.acked[position.vbucket] = position.seqno
        elif isinstance(message, p.BarrierReply):
            self.barriers.append(message)
        else:
            raise AssertionError(f"unexpected {message}")
        return message

    def send(self, frame: bytes) -> None:
        if self.window:
            while self.sent - self.credited + len(frame) > self.window:
                self.pump()
        self.sock.sendall(frame)
        self.sent += len(frame)
        self.most_in_flight = max(self.most_in_flight, self.sent - self.credited)

    def stream(self) -> None:
        paths = [index.keys for index in self.reply.indexes]
        for vb in VBUCKETS:
            start = self.restart[vb] + 1
            end = self.source.high(vb)
            self.send(p.encode(p.StreamBegin(vb, self.source.logs[vb][0][0])))
            if start > end:
                continue
            records = []
            for seqno in range(start, end + 1):
                doc = self.source.history[vb][seqno - 1]
                keys = (
                    (b"",) * len(paths)
                    if doc.body is None
                    else tuple(index_key(doc.body, ps) for ps in paths)
                )
                mutation = p.Mutation(seqno, doc.docid.encode(), keys, doc.body is None)
                records.append(p.encode_record(mutation))
            self.send(p.encode(p.SnapshotMarker(vb, start, end)))
            for i in range(0, len(records), self.FRAME_RECORDS):
                chunk = records[i : i + self.FRAME_RECORDS]
                self.send(p.encode_mutations(vb, len(paths), chunk))

    def barrier(self, cookie: int) -> p.BarrierReply:
        """Send a barrier and wait for its answer."""
        self.send(p.encode(p.Barrier(cookie)))
        deadline = time.monotonic() + 60
        while not any(b.cookie == cookie for b in self.barriers):
            assert time.monotonic() < deadline, "no answer to the barrier"
            self.pump()
        return next(b for b in self.barriers if b.cookie == cookie)

    def wait_persisted(self) -> None:
        """Until ACKs say every vbucket's history is persisted."""
        deadline = time.monotonic() + 60
        while any(self.acked[vb] < self.source.high(vb) for vb in VBUCKETS):
            assert time.monotonic() < deadline, f"not persisted: {self.acked}"
            self.pump()

    def close(self) -> None:
        self.sock.close()


def feed(daemon: Daemon, source: Source) -> Router:
    """Stream what the daemon lacks and wait until it is persisted. A connection closed just
    before may own the vbuckets for a moment more (STREAM_EXISTS): then connect again."""
    deadline = time.monotonic() + 10
    while True:
        try:
            router = Router(daemon, source)
        except AssertionError as exc:
            if "STREAM_EXISTS" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.1)
            continue
        router.stream()
        router.wait_persisted()
        router.close()
        return router


def indexes_equal_model(daemon: Daemon, source: Source) -> None:
    assert daemon.stop() == 0
    for name, paths in INDEXES.items():
        assert dump(daemon, name) == model(source.surviving(), paths), name
