"""Failover and rollback with a real daemon: a source loses history, the index follows it.

The router here is a small blocking client over a real TCP socket that speaks the protocol
with failover logs, over a source kept as a list of mutations per vbucket (the model).
"""

from __future__ import annotations

import random
import socket
import threading
import time
from collections import deque
from typing import Any

import httpx

from indexer import protocol as p
from indexer.keys import index_key
from indexer.router.documents import Document, vbucket_of
from tests.e2e.conftest import INDEXES, Daemon, dump, model

NUM_VBUCKETS = 1024
VBUCKETS = (11, 222, 333)
FAST_PERSIST = {"snapshots": {"persist_interval_ms": 100, "in_memory_interval_ms": 20}}


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
            body = (
                None
                if self.rng.random() < 0.1
                else {
                    "address": {"city": self.rng.choice(["Oslo", "Rome", "Lima", "Kyiv"])},
                    "age": self.rng.randint(18, 90),
                }
            )
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
    """One connection: handshake with the source's failover logs, stream what the daemon lacks."""

    def __init__(self, daemon: Daemon, source: Source, wait_reply: bool = True) -> None:
        host, port = daemon.address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=60)
        self.decoder = p.FrameDecoder()
        self.queue: deque[p.Message] = deque()
        self.source = source
        logs = {vb: tuple(source.logs[vb]) for vb in VBUCKETS}
        self.sock.sendall(p.encode(p.Handshake("test-router", NUM_VBUCKETS, VBUCKETS, logs)))
        if not wait_reply:
            return
        reply = self.next()
        assert isinstance(reply, p.HandshakeReply), reply
        self.reply = reply
        self.restart = {r.vbucket: r.seqno for r in reply.restart}
        self.acked = {vb: self.restart[vb] for vb in VBUCKETS}  # restart = persisted

    def next(self) -> p.Message:
        while not self.queue:
            self.queue.extend(self.decoder.messages())
            if not self.queue:
                data = self.sock.recv(1 << 16)
                assert data, "the daemon closed the connection"
                self.decoder.feed(data)
        return self.queue.popleft()

    def stream(self) -> None:
        paths = [index.keys for index in self.reply.indexes]
        for vb in VBUCKETS:
            start = self.restart[vb] + 1
            end = self.source.high(vb)
            self.sock.sendall(p.encode(p.StreamBegin(vb, self.source.logs[vb][0][0])))
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
            self.sock.sendall(p.encode(p.SnapshotMarker(vb, start, end)))
            self.sock.sendall(p.encode_mutations(vb, len(paths), records))

    def wait_persisted(self) -> None:
        """Until ACKs say every vbucket's history is persisted."""
        deadline = time.monotonic() + 60
        while any(self.acked[vb] < self.source.high(vb) for vb in VBUCKETS):
            assert time.monotonic() < deadline, f"not persisted: {self.acked}"
            message = self.next()
            assert isinstance(message, p.Ack), message
            for position in message.positions:
                if position.vbucket in self.acked:
                    self.acked[position.vbucket] = position.seqno

    def close(self) -> None:
        self.sock.close()


def feed(daemon: Daemon, source: Source) -> Router:
    router = Router(daemon, source)
    router.stream()
    router.wait_persisted()
    router.close()
    return router


def indexes_equal_model(daemon: Daemon, source: Source) -> None:
    assert daemon.stop() == 0
    for name, paths in INDEXES.items():
        assert dump(daemon, name) == model(source.surviving(), paths), name


def test_failover_rolls_back_to_a_recovery_point(daemon_factory: Any) -> None:
    daemon = daemon_factory(**FAST_PERSIST).start()
    source = Source(1)
    for _ in range(3):
        for vb in VBUCKETS:
            source.write(vb, 100)
        feed(daemon, source)
        time.sleep(0.3)  # a persisted snapshot (recovery point) per round
    # vbucket 11's replica had only 180 of its 300 seqnos; it takes over and goes on.
    source.failover(11, 180)
    source.write(11, 40)
    source.write(222, 10)
    router = feed(daemon, source)
    assert set(router.reply.rollback) == {11}  # the vbucket whose history diverged
    assert router.restart[11] <= 180
    assert router.restart[11] >= 100, "a recovery point at or after round 1 was kept"
    assert router.restart[222] < 300  # the whole index went back to that point
    assert "rolled back to recovery point" in daemon.log()
    # The same history again: nothing to roll back.
    again = Router(daemon, source)
    assert again.reply.rollback == {}
    again.close()
    indexes_equal_model(daemon, source)


def test_failover_older_than_every_recovery_point_rolls_back_to_zero(
    daemon_factory: Any,
) -> None:
    daemon = daemon_factory(snapshots={"persist_interval_ms": 100, "recovery_points": 2}).start()
    source = Source(2)
    for _ in range(4):
        for vb in VBUCKETS:
            source.write(vb, 50)
        feed(daemon, source)
        time.sleep(0.3)
    source.failover(222, 20)  # older than both kept points (>= 150)
    source.write(222, 30)
    router = feed(daemon, source)
    assert router.restart == dict.fromkeys(VBUCKETS, 0)
    assert "rolled back to zero" in daemon.log()
    indexes_equal_model(daemon, source)
    # A history with nothing in common (a new source) also goes back to zero, and a restart
    # keeps the result.
    daemon.start()
    source.failover(333, 0, forget_all=True)
    source.write(333, 25)
    router = feed(daemon, source)
    assert router.restart == dict.fromkeys(VBUCKETS, 0)
    indexes_equal_model(daemon, source)


def test_a_scan_waiting_across_a_rollback_gets_a_clear_error(daemon_factory: Any) -> None:
    daemon = daemon_factory(**FAST_PERSIST).start()
    source = Source(3)
    for vb in VBUCKETS:
        source.write(vb, 80)
    feed(daemon, source)
    answers: list[httpx.Response] = []

    def scan() -> None:
        answers.append(
            httpx.get(
                daemon.url + "/indexes/by_age/count",
                params={"consistency": "at_plus", "at_plus": '{"11": 1000}', "timeout": "30"},
                timeout=60,
            )
        )

    waiting = threading.Thread(target=scan)
    waiting.start()
    time.sleep(0.5)
    source.failover(11, 30)
    source.write(11, 5)
    feed(daemon, source)
    waiting.join(60)
    assert answers and answers[0].status_code == 409, answers
    assert "rolled back" in answers[0].json()["error"]
    indexes_equal_model(daemon, source)


def test_killed_during_a_rollback_the_index_still_ends_equal_to_the_model(
    daemon_factory: Any,
) -> None:
    daemon = daemon_factory(**FAST_PERSIST).start()
    source = Source(4, docids_per_vbucket=4000)
    for _ in range(2):
        for vb in VBUCKETS:
            source.write(vb, 6000)
        feed(daemon, source)
        time.sleep(0.3)
    for attempt, delay in enumerate((0.0, 0.02, 0.04, 0.06, 0.1)):
        # Each failover loses thousands of mutations: the rollback takes tens of milliseconds,
        # and the kill lands before, during or after it.
        source.failover(333, source.high(333) - 1500 - attempt)
        for vb in VBUCKETS:
            source.write(vb, 2000)
        router = Router(daemon, source, wait_reply=False)  # the handshake starts the rollback
        time.sleep(delay)
        daemon.kill()
        router.close()
        daemon.start()
        feed(daemon, source)
    indexes_equal_model(daemon, source)
