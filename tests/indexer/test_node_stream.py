"""One node's stream from the router (indexer/router/streams/node_stream.py), without sockets:
a real source log and Mutation Manager in, frames out, decoded and checked against the log."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trio.testing

from indexer import protocol as p
from indexer.keys import index_key
from indexer.router.documents import Document, encode_document
from indexer.router.source.log import SourceLog
from indexer.router.source.mutations import MutationManager
from indexer.router.streams.chunks import read_backfill_chunk
from indexer.router.streams.node_stream import (
    MAX_DEFER_S,
    MaintenanceFirst,
    NodeCursors,
)
from indexer.router.streams.shared_frames import SharedFrames

N = 4
INDEX = p.IndexDefinition("by_age", ("age",))


def reply(restart: dict[int, int] | None = None) -> p.HandshakeReply:
    positions = tuple(p.VbucketPosition(vb, s, 0) for vb, s in sorted((restart or {}).items()))
    return p.HandshakeReply((INDEX,), N, tuple(range(N)), positions, max_frame_bytes=4096)


@pytest.fixture
def source(tmp_path: Path) -> Iterator[SourceLog]:
    with SourceLog(tmp_path / "state", N) as log:
        yield log


def append(source: SourceLog, mm: MutationManager, documents: list[Document]) -> None:
    """What the router's Appender does: the log first, then the manager."""
    before = {vb: source.high_seqno(vb) for vb in range(N)}
    source.append(documents)
    for vb in range(N):
        for seqno, document in source.read(vb, before[vb]):
            payload = None if document.body is None else encode_document(document)
            mm.write(vb, seqno, document.docid.encode(), payload)


class Consumer:
    """An indexer as the frames describe it: per vbucket the last seqno and every doc's key."""

    def __init__(self) -> None:
        self.decoder = p.FrameDecoder()
        self.last = dict.fromkeys(range(N), 0)
        self.marker: dict[int, tuple[int, int]] = {}
        self.keys: dict[bytes, bytes] = {}
        self.begun: set[int] = set()

    def take(self, chunks: Iterator[tuple[list[bytes], int]]) -> int:
        items = 0
        for frames, count in chunks:
            items += count
            for frame in frames:
                self.decoder.feed(frame)
            for message in self.decoder.messages():
                self.check(message)
        return items

    def check(self, message: p.Message) -> None:
        if isinstance(message, p.StreamBegin):
            self.begun.add(message.vbucket)
        elif isinstance(message, p.SnapshotMarker):
            vb = message.vbucket
            assert vb in self.begun
            assert message.start == self.last[vb] + 1, "no gap, nothing twice"
            self.marker[vb] = (message.start, message.end)
            self.last[vb] = message.start - 1
        elif isinstance(message, p.MutationBatch):
            vb = message.vbucket
            end = self.marker[vb][1]
            for record in message.mutations():
                assert self.last[vb] < record.seqno <= end
                self.last[vb] = record.seqno
                self.keys[record.docid] = record.keys[0]
            if self.last[vb] == end:
                del self.marker[vb]
        else:
            raise AssertionError(message)

    def expected(self, source: SourceLog) -> dict[bytes, bytes]:
        out = {}
        for docid, document in source.surviving_documents().items():
            key = b"" if document.body is None else index_key(document.body, INDEX.keys)
            out[docid.encode()] = key
        return out


def docs(start: int, count: int, ids: int = 50, ages: int = 7) -> list[Document]:
    out = []
    for i in range(start, start + count):
        docid = f"d{i % ids}"
        if i % 11 == 0:
            out.append(Document(docid, None))
        else:
            out.append(Document(docid, {"age": i % ages, "pad": "x" * (i % 13)}))
    return out


def backfill_all(cursors: NodeCursors, consumer: Consumer, max_items: int) -> int:
    """Serve every backfill request as the backfill task would, chunk by chunk."""
    served = 0
    while cursors.requests:
        for backfill in cursors.take_requests():
            after = backfill.after
            while True:
                chunk = read_backfill_chunk(
                    cursors.source, backfill.vbucket, after, backfill.until, max_items
                )
                consumer.take(cursors.backfill_chunks(chunk))
                served += 1
                if chunk.last:
                    break
                after = chunk.end
    return served


def test_memory_then_a_restart_below_memory_backfills_then_rejoins(source: SourceLog) -> None:
    mm = MutationManager(capacity=1 << 30)
    append(source, mm, docs(0, 300, ids=250))
    first = Consumer()
    cursors = NodeCursors(reply(), source, mm, "a")
    assert not cursors.requests  # memory holds everything since 0
    assert first.take(cursors.memory_chunks()) > 0
    assert first.last == {vb: source.high_seqno(vb) for vb in range(N)}
    cursors.close()
    # A restarted manager holds nothing below its start: a node resuming earlier backfills.
    highs = {vb: source.high_seqno(vb) for vb in range(N)}
    mm = MutationManager(capacity=1 << 30, high_seqnos=highs)
    append(source, mm, docs(300, 100, ids=250))
    restart = {vb: highs[vb] // 2 for vb in range(N)}
    second = Consumer()
    second.last = dict(restart)
    for vb in range(N):  # what the node holds: the log up to its restart seqnos
        for seqno, document in source.read(vb):
            if seqno <= restart[vb]:
                body = document.body
                key = b"" if body is None else index_key(body, INDEX.keys)
                second.keys[document.docid.encode()] = key
    cursors = NodeCursors(reply(restart), source, mm, "b")
    assert {b.vbucket for b in cursors.requests} == set(range(N))
    assert second.take(cursors.memory_chunks()) == 0  # every vbucket waits for its backfill
    assert backfill_all(cursors, second, max_items=16) > N
    assert not cursors.backfilling
    second.take(cursors.memory_chunks())
    assert second.last == {vb: source.high_seqno(vb) for vb in range(N)}
    assert second.keys == second.expected(source)
    assert cursors.backfilled > 0 and cursors.sent > 0


@pytest.mark.parametrize("keep", [True, False])
def test_a_reconnect_resumes_from_memory_what_the_node_acknowledged(
    source: SourceLog, keep: bool
) -> None:
    mm = MutationManager(capacity=1 << 30)
    append(source, mm, docs(0, 300, ids=250))
    cursors = NodeCursors(reply(), source, mm, "node", keep=keep)
    assert Consumer().take(cursors.memory_chunks()) > 0  # all sent: memory passed by then
    highs = {vb: source.high_seqno(vb) for vb in range(N)}
    acked = {vb: high // 2 for vb, high in highs.items()}
    cursors.acknowledged(p.Ack(tuple(p.VbucketPosition(vb, s, 0) for vb, s in acked.items())))
    cursors.close()  # the node closed the connection; it had received up to 3/4
    append(source, mm, docs(300, 40, ids=250))
    restart = {vb: highs[vb] * 3 // 4 for vb in range(N)}
    again = NodeCursors(reply(restart), source, mm, "node", keep=keep)
    if not keep:  # the passed snapshots were freed: the rest comes from the log
        assert {b.vbucket for b in again.requests} == set(range(N))
        return
    assert not again.requests
    consumer = Consumer()
    consumer.last = dict(restart)
    consumer.begun = set(range(N))
    assert consumer.take(again.memory_chunks()) > 0  # right after the restart, no gap
    assert consumer.last == {vb: source.high_seqno(vb) for vb in range(N)}


def test_a_cursor_dropped_over_the_cap_reads_the_log_and_nothing_is_lost(
    source: SourceLog,
) -> None:
    mm = MutationManager(capacity=4_000, item_overhead=16)
    fast, slow = Consumer(), Consumer()
    fast_cursors = NodeCursors(reply(), source, mm, "fast")
    slow_cursors = NodeCursors(reply(), source, mm, "slow")
    for round_ in range(6):
        append(source, mm, docs(round_ * 200, 200))
        fast.take(fast_cursors.memory_chunks())
        assert mm.memory <= mm.capacity
    assert mm.stats().cursors_dropped > 0
    slow.take(slow_cursors.memory_chunks())  # finds its cursors dropped
    assert slow_cursors.requests
    backfill_all(slow_cursors, slow, max_items=50)
    slow.take(slow_cursors.memory_chunks())
    expected = fast.expected(source)
    # Deleted documents the consumer never had are not in its keys; compare what exists.
    live = {d: k for d, k in expected.items() if k}
    for consumer in (fast, slow):
        assert consumer.last == {vb: source.high_seqno(vb) for vb in range(N)}
        assert {d: k for d, k in consumer.keys.items() if k} == live


def test_a_restart_ahead_of_the_log_is_refused(source: SourceLog) -> None:
    from indexer.router.streams.feed import FeedError

    mm = MutationManager(capacity=1 << 20)
    append(source, mm, docs(0, 10))
    with pytest.raises(FeedError, match="has history this log does not"):
        NodeCursors(reply({0: 10_000}), source, mm, "a")
    assert all(mm.cursors(vb) == [] for vb in range(N))  # nothing left registered


def test_recent_documents_are_bounded_forgotten_on_failover_and_change_nothing(
    source: SourceLog,
) -> None:
    from indexer.router.source.mutations import Item
    from indexer.router.source.recent import RECENT_APPENDS, RecentDocuments

    recent = RecentDocuments(capacity=3)
    recent.add([(0, 1), (0, 2)], [Document(f"d{i}", {"i": i}) for i in range(2)])
    recent.add([(1, 1), (1, 2)], [Document(f"d{i}", {"i": i}) for i in range(2, 4)])
    # The older append stays while the others hold fewer than the capacity.
    assert recent.get(0, 1) == Document("d0", {"i": 0})
    assert recent.get(1, 2) == Document("d3", {"i": 3}) and recent.get(1, 3) is None
    recent.forget(1)
    assert recent.get(1, 1) is None and recent.get(0, 2) == Document("d1", {"i": 1})
    # The whole latest append stays, however big: the streams read it next.
    recent.add([(2, s) for s in range(1, 6)], [Document(f"e{i}", {"i": i}) for i in range(5)])
    assert recent.get(0, 2) is None and recent.get(2, 1) == Document("e0", {"i": 0})
    items = [Item(s, b"", None) for s in (2, 4, 6)]
    assert recent.documents(2, items) == [Document("e1", {"i": 1}), Document("e3", {"i": 3}), None]
    # Appends of a document each: at most RECENT_APPENDS of them are looked through.
    singles = RecentDocuments()
    for seqno in range(1, RECENT_APPENDS + 2):
        singles.add([(2, seqno)], [Document(f"f{seqno}", {})])
    assert singles.get(2, 1) is None and singles.get(2, 2) == Document("f2", {})
    # An append of unparsed lines is not kept (its payloads are as cheap), unless one is parsed.
    lines = [Document.from_line(f"g{i}", b'{"id":"g%d","doc":{"i":%d}}' % (i, i)) for i in range(2)]
    recent.add([(3, 1), (3, 2)], lines)
    assert recent.get(3, 1) is None
    assert lines[1].body == {"i": 1}
    recent.add([(3, 1), (3, 2)], lines)
    assert recent.get(3, 1) is lines[0] and recent.get(3, 2) is lines[1]
    # Streams with and without the parsed documents at hand send the same frames.
    mm = MutationManager(capacity=1 << 30)
    recent = RecentDocuments()
    before = {vb: source.high_seqno(vb) for vb in range(N)}
    documents = docs(0, 200, ids=150)
    source.append(documents)
    for vb in range(N):
        for seqno, document in source.read(vb, before[vb]):
            payload = None if document.body is None else encode_document(document)
            mm.write(vb, seqno, document.docid.encode(), payload)
            recent.add([(vb, seqno)], [document])
    plain = NodeCursors(reply(), source, mm, "plain")
    cached = NodeCursors(reply(), source, mm, "cached", recent=recent)
    assert list(plain.memory_chunks()) == list(cached.memory_chunks())


def test_backfills_of_many_vbuckets_are_read_together_within_a_budget(
    source: SourceLog,
) -> None:
    from indexer.router.source.mutations import Backfill
    from indexer.router.streams.node_stream import read_backfill_chunks

    mm = MutationManager(capacity=1 << 30)
    append(source, mm, docs(0, 400, ids=400))
    wanted = [(Backfill("a", vb, 0, source.high_seqno(vb)), 0) for vb in range(N)]
    chunks = read_backfill_chunks(source, wanted, max_items=150)
    assert sum(len(c.versions) for c in chunks) == 150  # the budget, over several vbuckets
    assert [c.vbucket for c in chunks] == list(range(len(chunks))) and len(chunks) > 1
    assert all(c.last for c in chunks[:-1]) and not chunks[-1].last  # the budget cut the last
    # Everything read, chunk after chunk per vbucket, with no gap.
    reached = dict.fromkeys(range(N), 0)
    while any(reached[vb] < source.high_seqno(vb) for vb in range(N)):
        todo = [
            (Backfill("a", vb, 0, source.high_seqno(vb)), reached[vb])
            for vb in range(N)
            if reached[vb] < source.high_seqno(vb)
        ]
        for chunk in read_backfill_chunks(source, todo, max_items=50):
            assert chunk.start == reached[chunk.vbucket] + 1
            assert [s for s, _ in chunk.versions] == list(range(chunk.start, chunk.end + 1))
            reached[chunk.vbucket] = chunk.end


def test_build_streams_give_way_to_maintenance_but_are_never_starved() -> None:
    """MaintenanceFirst defers while input waits or maintenance has mutations to send, and
    gives the build a turn of BUILD_TURN_S after every MAX_DEFER_S of waiting."""
    mm = MutationManager(capacity=1 << 20)
    waiting = [True]
    defer = MaintenanceFirst(mm, "node", lambda: waiting[0])
    defer.vbuckets = list(range(N))
    for vb in range(N):
        mm.register("node", vb, 0)
    seen: list[tuple[float, bool]] = []

    async def main() -> None:
        for _ in range(100):  # 1 s of input waiting all along
            seen.append((trio.current_time(), defer()))
            await trio.sleep(0.01)
        waiting[0] = False
        seen.append((trio.current_time(), defer()))  # nothing waits: no deferring
        mm.write(1, 1, b"d", b"{}")  # maintenance has a mutation to send
        await trio.sleep(1)
        seen.append((trio.current_time(), defer()))

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    given = [at for at, deferred in seen[:100] if not deferred]
    share = len(given) / 100
    assert 0.1 < share < 0.25, given  # about BUILD_TURN_S / (MAX_DEFER_S + BUILD_TURN_S)
    assert not any(at < MAX_DEFER_S - 0.011 for at in given)  # first, a wait
    assert seen[100][1] is False and seen[101][1] is True


def test_a_backfill_chunk_sends_each_docid_once_its_latest_version(source: SourceLog) -> None:
    mm = MutationManager(capacity=1 << 30)
    append(source, mm, docs(0, 600, ids=20))
    vb = max(range(N), key=source.high_seqno)
    high = source.high_seqno(vb)
    logged = list(source.read(vb, 0))
    chunk = read_backfill_chunk(source, vb, 0, high, max_items=high)
    assert chunk.read == high and chunk.last and (chunk.start, chunk.end) == (1, high)
    latest = {document.docid: (seqno, document) for seqno, document in logged}
    assert chunk.versions == sorted(latest.values(), key=lambda v: v[0])
    assert len(chunk.versions) < chunk.read  # the docids were rewritten: some left out
    assert chunk.versions[-1][0] == high  # the snapshot's end is sent: it completes the snapshot
    # A budget cuts the range; each piece leaves out only what its own range supersedes.
    half = read_backfill_chunk(source, vb, 0, high, max_items=high // 2)
    assert half.read == high // 2 and not half.last and half.end == logged[high // 2 - 1][0]
    assert half.versions[-1][0] == half.end
    assert {d.docid for _, d in half.versions} == {d.docid for _, d in logged[: high // 2]}


def test_a_build_never_gives_way_while_its_nodes_maintenance_stream_is_not_connected() -> None:
    """During a merge the node stops its maintenance stream and waits for the build: the
    build must not wait for input or for mutations nobody can send meanwhile."""
    mm = MutationManager(capacity=1 << 20)
    defer = MaintenanceFirst(mm, "node", lambda: True)  # input waiting all along
    defer.vbuckets = list(range(N))
    for vb in range(N):
        mm.register("node", vb, 0)

    async def main() -> None:
        assert defer()  # connected, input waiting: the build gives way
        mm.unregister_consumer("node")  # INDEXES_CHANGED: the stream is gone until it reconnects
        for _ in range(50):
            assert not defer()
            await trio.sleep(0.01)
        for vb in range(N):
            mm.register("node", vb, 0)
        assert defer()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_replicas_share_each_snapshots_frames_and_other_definitions_do_not(
    source: SourceLog,
) -> None:
    mm = MutationManager(capacity=1 << 30)
    shared = SharedFrames()
    append(source, mm, docs(0, 300, ids=120))
    first = NodeCursors(reply(), source, mm, "a", shared=shared)
    second = NodeCursors(reply(), source, mm, "b", shared=shared)
    # Another index definition: its own frames, never the shared ones.
    other = p.HandshakeReply(
        (p.IndexDefinition("by_pad", ("pad",)),), N, tuple(range(N)), (), max_frame_bytes=4096
    )
    third = NodeCursors(other, source, mm, "c", shared=shared)
    one, two = Consumer(), Consumer()
    one.take(first.memory_chunks())
    assert shared.hits == 0 and shared.bytes > 0
    two.take(second.memory_chunks())
    assert shared.hits > 0  # the replica encoded nothing itself
    assert one.keys == two.keys == one.expected(source)
    hits = shared.hits
    assert sum(count for _, count in third.memory_chunks()) > 0
    assert shared.hits == hits
    for cursors in (first, second, third):
        cursors.close()
