"""A state machine drives a real daemon over TCP with random feed sequences and checks it against
a model of the protocol (docs/protocol.md).

The router side is a raw-socket client: stream begins and ends, snapshot markers, mutation frames
(new mutations and resends of earlier seqnos), barriers, reconnects, and invalid frames. The model
says which mutations the daemon holds and which are visible (in complete snapshots); after every
barrier the daemon's scans must equal it, and every invalid frame must get its error code and
leave the daemon serving. One daemon serves the whole run: each example streams vbuckets that no
earlier example used, so its index rows are its own.
"""

from __future__ import annotations

import functools
import itertools
import json
import select
import socket
import struct
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
from hypothesis import HealthCheck, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from indexer import protocol as p
from indexer.keys import index_key
from indexer.protocol import ErrorCode
from indexer.router.documents import Document, vbucket_of
from tests.budget import examples
from tests.e2e.conftest import Daemon, free_port, model, write_config

pytestmark = pytest.mark.e2e

NUM_VBUCKETS = 1024
VBUCKETS_PER_EXAMPLE = 3
DOCIDS_PER_VBUCKET = 4
WAIT_S = 30.0
ERROR_WAIT_S = 10.0
FAST_SNAPSHOTS = {"in_memory_interval_ms": 20, "persist_interval_ms": 100}
INDEX_NAMES = ("by_city", "by_age")
HEADER = struct.Struct(">IBB")  # length, version, type
NOT_BEGUN = ErrorCode.STREAM_NOT_BEGUN
NOT_MINE = ErrorCode.NOT_MY_SLICE
OUTSIDE = ErrorCode.OUT_OF_SNAPSHOT
BACKWARDS = ErrorCode.SEQNO_BACKWARDS
BAD = ErrorCode.BAD_MUTATION
BAD_HANDSHAKE = ErrorCode.BAD_HANDSHAKE
PROTOCOL = ErrorCode.PROTOCOL
MACHINE_SETTINGS = settings(
    max_examples=examples(25),
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

# Document bodies: present, missing and null fields, and values of every collation type.
BODIES: list[dict[str, Any]] = [
    {"address": {"city": "Oslo"}, "age": 30},
    {"address": {"city": "Rome"}, "age": 41.5},
    {"address": {"city": "Oslo"}, "age": "thirty"},
    {"address": {"city": None}, "age": [1, 2]},
    {"address": {"city": "Lima"}},
    {"age": 30},
    {"age": None},
    {"other": True},
]


def vbuuid_of(vb: int) -> int:
    """The vbuuid this test streams vbucket `vb` with."""
    return 0x5EED_0000 + vb


@functools.cache
def docids_by_vbucket() -> dict[int, list[str]]:
    """Document ids that hash to each vbucket, as a router must send them (docs §3)."""
    found: dict[int, list[str]] = {vb: [] for vb in range(NUM_VBUCKETS)}
    missing = NUM_VBUCKETS
    for i in itertools.count():
        docid = f"doc-{i}"
        ids = found[vbucket_of(docid.encode(), NUM_VBUCKETS)]
        if len(ids) < DOCIDS_PER_VBUCKET:
            ids.append(docid)
            missing -= len(ids) == DOCIDS_PER_VBUCKET
            if not missing:
                return found
    raise AssertionError("unreachable")


# An invalid frame: what it breaks, a maker (drawing what it needs), the expected error code.
Refusal = tuple[str, Callable[[st.DataObject], bytes], ErrorCode]


def constant(frame: bytes) -> Callable[[st.DataObject], bytes]:
    """A frame maker that draws nothing."""
    return lambda data: frame


def not_owned(make: Callable[[int], bytes]) -> Callable[[st.DataObject], bytes]:
    """A frame maker for a vbucket beyond num_vbuckets."""
    return lambda data: make(data.draw(st.integers(NUM_VBUCKETS, 2**16 - 1), label="vbucket"))


def with_filler(make: Callable[[bytes], bytes]) -> Callable[[st.DataObject], bytes]:
    """A frame maker around random payload bytes."""
    return lambda data: make(data.draw(st.binary(max_size=16), label="payload"))


def record_frame(vb: int, nkeys: int, mutation: p.Mutation) -> bytes:
    """A MUTATIONS frame of one record."""
    return p.encode_mutations(vb, nkeys, [p.encode_record(mutation)])


class FeedDaemon:
    """The daemon of the whole run; it is started again (fresh data) only once every vbucket
    has been used by an example. One HTTP client serves every example's scans and /stats calls
    (a client per request would build its TLS context each time, most of a step's time)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.daemon: Daemon | None = None
        self.unused: list[int] = []
        self.starts = 0
        self.http = httpx.Client(timeout=WAIT_S)

    def take(self, count: int) -> tuple[Daemon, list[int]]:
        """The daemon and `count` vbuckets no example has streamed on it."""
        if self.daemon is None or len(self.unused) < count:
            self.start()
        assert self.daemon is not None and self.daemon.running, "the daemon is gone"
        taken, self.unused = self.unused[:count], self.unused[count:]
        return self.daemon, taken

    def start(self) -> None:
        """A daemon on fresh data, fast snapshots, few workers (the machine has two cores)."""
        self.stop()
        self.starts += 1
        port = free_port()
        config = write_config(
            self.root / f"indexer{self.starts}.toml",
            self.root / f"data{self.starts}",
            port,
            snapshots=dict(FAST_SNAPSHOTS),
            pipeline={"workers": 2},
        )
        self.daemon = Daemon(config, self.root / f"daemon{self.starts}.log", port).start()
        self.unused = list(range(NUM_VBUCKETS))

    def stop(self) -> None:
        """Stop the daemon with SIGTERM; it must exit cleanly."""
        if self.daemon is not None and self.daemon.running:
            assert self.daemon.stop() == 0, self.daemon.log()[-4000:]
        self.daemon = None

    def close(self) -> None:
        """Stop the daemon, then close the HTTP client."""
        try:
            self.stop()
        finally:
            self.http.close()


@pytest.fixture(scope="module")
def feed_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FeedDaemon]:
    """One daemon for the module's examples, stopped cleanly (exit status 0) at the end."""
    pool = FeedDaemon(tmp_path_factory.mktemp("feed-model"))
    yield pool
    pool.close()


class Link:
    """One router connection over a raw socket: frames out, decoded frames in."""

    def __init__(self, daemon: Daemon) -> None:
        self.sock = socket.create_connection(("127.0.0.1", daemon.port), timeout=WAIT_S)
        self.decoder = p.FrameDecoder(64 << 20)  # the daemon's own frames have no size limit
        self.inbox: deque[p.Message] = deque()
        self.eof = False

    def send(self, *frames: bytes) -> None:
        """Send frames back to back."""
        self.sock.sendall(b"".join(frames))

    def _receive(self, timeout: float | None) -> bool:
        """Take what the daemon sent into the inbox; False if nothing came within `timeout`."""
        if timeout is not None and not select.select([self.sock], [], [], timeout)[0]:
            return False
        data = self.sock.recv(1 << 16)
        if not data:
            self.eof = True
            self.decoder.close()
            return True
        self.decoder.feed(data)
        self.inbox.extend(self.decoder.messages())
        return True

    def next(self) -> p.Message | None:
        """The next message, waiting for it; None once the daemon has closed the connection."""
        while not self.inbox:
            if self.eof:
                return None
            self._receive(None)
        return self.inbox.popleft()

    def arrived(self) -> list[p.Message]:
        """Messages the daemon has already sent, without waiting."""
        while not self.eof and self._receive(0):
            pass
        out = list(self.inbox)
        self.inbox.clear()
        return out

    def close(self) -> None:
        """Close the socket (an abrupt close if the daemon still reads)."""
        self.sock.close()


@dataclass(repr=False)
class Vbucket:
    """One vbucket: the router's history, what the daemon holds, this connection's stream."""

    number: int
    docids: list[str]
    # The router's source: each seqno ever used denotes one mutation, forever (docs §3).
    history: dict[int, Document] = field(default_factory=dict)
    high: int = 0  # the highest seqno given a mutation
    restart: int = 0  # from the latest HANDSHAKE_REPLY
    # The daemon, as the protocol defines it: mutations handed on, snapshot boundaries.
    received: int = 0  # highest seqno taken (a resend at or below it is skipped)
    applied: list[tuple[int, Document]] = field(default_factory=list)
    pipeline_end: int = 0  # end of the last marker taken
    pipeline_last: int = 0  # seqno of the last mutation taken
    stable: int = 0  # every mutation taken at or below it is in a complete snapshot
    persisted: int = 0  # highest persisted seqno the daemon has told of (ACK, restart)
    # The stream on the current connection.
    begun: bool = False
    last: int = 0  # highest seqno of the stream, or the marker's start - 1
    marker_end: int = -1  # -1: no marker since STREAM_BEGIN

    def take_marker(self, start: int, end: int) -> None:
        """A valid marker: it starts a snapshot and closes the previous one (docs §2.4)."""
        self.last = start - 1
        self.marker_end = end
        if end > self.received:  # else skipped as a resend (docs §8)
            if self.pipeline_end > self.stable:
                self.stable = max(self.pipeline_last, self.stable)
            self.pipeline_end = end

    def take_mutations(self, seqnos: Sequence[int]) -> None:
        """A valid frame of mutations: those above `received` are new to the daemon."""
        self.last = seqnos[-1]
        new = [s for s in seqnos if s > self.received]
        if not new:
            return
        self.received = seqnos[-1]
        self.applied += [(s, self.history[s]) for s in new]
        self.pipeline_last = new[-1]
        if self.pipeline_last >= self.pipeline_end:  # the snapshot's last mutation
            self.stable = self.pipeline_last

    def visible(self) -> list[Document]:
        """The mutations scans must show: those in complete snapshots, in seqno order."""
        return [doc for seqno, doc in self.applied if seqno <= self.stable]

    def __repr__(self) -> str:
        return f"vbucket {self.number}"


class FeedMachine(RuleBasedStateMachine):
    """Random feed sequences against a model of the daemon (see the module docstring)."""

    pool: ClassVar[FeedDaemon]

    def __init__(self) -> None:
        super().__init__()
        self.daemon, numbers = self.pool.take(VBUCKETS_PER_EXAMPLE)
        self.http = self.pool.http
        ids = docids_by_vbucket()
        self.vbs = [Vbucket(vb, ids[vb]) for vb in numbers]
        self.cookies = itertools.count(1)
        self.link: Link | None = None
        self.connection_vbs: set[int] = set()  # vbuckets begun on this connection (barriers)
        self.indexes: tuple[p.IndexDefinition, ...] = ()
        self.connect(self.vbs)

    # -----------------------------------------------------------------------------------------
    # Connections

    def connect(self, begin: Sequence[Vbucket]) -> None:
        """Open a connection and handshake (the reply's restart positions are checked), then
        begin the streams of `begin`, as a router resuming does (docs §8)."""
        link = Link(self.daemon)
        numbers = tuple(v.number for v in self.vbs)
        link.send(p.encode(p.Handshake("fuzz-router", NUM_VBUCKETS, numbers)))
        reply = link.next()
        assert isinstance(reply, p.HandshakeReply), reply
        assert {i.name for i in reply.indexes} == set(INDEX_NAMES)
        assert reply.num_vbuckets == NUM_VBUCKETS and len(reply.owned) == NUM_VBUCKETS
        assert [r.vbucket for r in reply.restart] == list(numbers)
        for v, position in zip(self.vbs, reply.restart, strict=True):
            # A running daemon resumes a router from what it received (docs §8).
            assert v.persisted <= position.seqno == v.received, (v, position)
            v.persisted = v.restart = position.seqno
            v.begun = False
        self.indexes = reply.indexes
        self.link = link
        self.connection_vbs = set()
        for v in begin:
            self.begin(v)

    def take_in(self, messages: list[p.Message]) -> None:
        """What the daemon sent on its own: ACKs only, never more than is stable."""
        mine = {v.number: v for v in self.vbs}
        for message in messages:
            assert isinstance(message, p.Ack), f"unexpected {message}"
            for position in message.positions:
                v = mine.get(position.vbucket)
                if v is not None:
                    assert position.seqno <= v.stable, (position, v.stable)
                    v.persisted = max(v.persisted, position.seqno)

    def lost(self) -> None:
        """The connection is gone: its streams are released (docs §7)."""
        for v in self.vbs:
            v.begun = False
        self.link = None

    def live(self) -> Link:
        """The current connection (there is always one between steps)."""
        assert self.link is not None
        return self.link

    def expect_error(self, link: Link, code: ErrorCode) -> None:
        """The daemon answers with an ERROR frame of `code`, then closes the connection."""
        link.sock.settimeout(ERROR_WAIT_S)  # the daemon answers at once; do not wait long
        while True:
            message = link.next()
            assert message is not None, f"closed without an ERROR frame (expected {code.name})"
            if isinstance(message, p.Error):
                assert message.code is code, (message, code)
                break
            if link is self.link:
                self.take_in([message])
        assert link.next() is None, "the daemon sent more after its ERROR frame"
        link.close()

    def wait_released(self) -> None:
        """Until the daemon has dropped every connection of this example."""
        deadline = time.monotonic() + WAIT_S
        while True:
            stats = self.http.get(self.daemon.url + "/stats").json()
            if stats["reader"]["connections"] == 0:
                return
            assert time.monotonic() < deadline, "the daemon keeps a closed connection"
            time.sleep(0.01)

    # -----------------------------------------------------------------------------------------
    # Frames

    def records(self, seqnos: Sequence[int], v: Vbucket) -> list[bytes]:
        """Records of the history's mutations, keyed for the indexes the handshake listed."""
        out = []
        for seqno in seqnos:
            doc = v.history[seqno]
            if doc.body is None:
                keys: tuple[bytes, ...] = (b"",) * len(self.indexes)
            else:
                keys = tuple(index_key(doc.body, index.keys) for index in self.indexes)
            deleted = doc.body is None
            out.append(p.encode_record(p.Mutation(seqno, doc.docid.encode(), keys, deleted)))
        return out

    def new_document(self, data: st.DataObject, v: Vbucket) -> Document:
        """A new mutation: an upsert of one of the bodies, or a delete."""
        docid = data.draw(st.sampled_from(v.docids), label="docid")
        body = data.draw(st.one_of(st.none(), st.sampled_from(BODIES)), label="body")
        return Document(docid, body)

    # -----------------------------------------------------------------------------------------
    # Valid rules

    def begun(self) -> list[Vbucket]:
        """The vbuckets this connection streams."""
        return [v for v in self.vbs if v.begun]

    def usable(self, v: Vbucket) -> list[int]:
        """Seqnos a frame may carry next: inside the marker, after the stream's last, either
        a resend of the router's history or new (above its newest: gaps are never filled)."""
        if not v.begun or v.marker_end < 0:
            return []
        return [s for s in range(v.last + 1, v.marker_end + 1) if s in v.history or s > v.high]

    def begin(self, v: Vbucket) -> None:
        """STREAM_BEGIN: the stream's ordering state starts over (docs §2.3)."""
        self.live().send(p.encode(p.StreamBegin(v.number, vbuuid_of(v.number))))
        v.begun, v.last, v.marker_end = True, 0, -1
        self.connection_vbs.add(v.number)

    @rule(data=st.data())
    def stream_begin(self, data: st.DataObject) -> None:
        """STREAM_BEGIN, for a new stream or again on a begun one (it restarts the stream)."""
        self.begin(data.draw(st.sampled_from(self.vbs), label="vbucket"))

    @precondition(lambda self: self.begun())
    @rule(
        data=st.data(),
        anchor=st.sampled_from(["stream", "restart", "high"]),
        gap=st.integers(0, 2),
        size=st.integers(1, 5),
    )
    def snapshot_marker(self, data: st.DataObject, anchor: str, gap: int, size: int) -> None:
        """A marker after the stream's last seqno: next to it, from the restart position (a
        resend, docs §8), or after the router's newest mutation."""
        v = data.draw(st.sampled_from(self.begun()), label="vbucket")
        self.marker(v, anchor, gap, size)

    def marker(self, v: Vbucket, anchor: str, gap: int, size: int) -> None:
        """Send a valid SNAPSHOT_MARKER of `size` seqnos, `gap` after the anchor."""
        after = max(v.last, v.marker_end, 0)
        base = {"stream": after, "restart": max(after, v.restart), "high": max(after, v.high)}
        start = base[anchor] + 1 + gap
        end = start + size - 1
        self.live().send(p.encode(p.SnapshotMarker(v.number, start, end)))
        v.take_marker(start, end)

    @precondition(lambda self: self.begun())
    @rule(
        data=st.data(),
        anchor=st.sampled_from(["stream", "restart", "high"]),
        size=st.integers(1, 5),
    )
    def whole_snapshot(self, data: st.DataObject, anchor: str, size: int) -> None:
        """A marker and every mutation up to its end in one frame: a complete snapshot."""
        v = data.draw(st.sampled_from(self.begun()), label="vbucket")
        self.marker(v, anchor, 0, size)
        self.send_mutations(data, v, self.usable(v), 1)

    @precondition(lambda self: any(self.usable(v) for v in self.vbs))
    @rule(data=st.data(), frames=st.integers(1, 2))
    def mutations(self, data: st.DataObject, frames: int) -> None:
        """Mutations inside the current snapshot, resent or new, some seqnos skipped, in one or
        two frames."""
        v = data.draw(st.sampled_from([v for v in self.vbs if self.usable(v)]), label="vbucket")
        usable = self.usable(v)
        keep = data.draw(st.lists(st.booleans(), min_size=len(usable), max_size=len(usable)))
        chosen = [s for s, k in zip(usable, keep, strict=True) if k] or usable[:1]
        self.send_mutations(data, v, chosen, frames)

    def send_mutations(
        self, data: st.DataObject, v: Vbucket, chosen: list[int], frames: int
    ) -> None:
        """Frames of the mutations at `chosen` seqnos: the history's, or new ones made now."""
        if not chosen:
            return
        for seqno in chosen:
            if seqno not in v.history:
                v.history[seqno] = self.new_document(data, v)
                v.high = seqno
        cut = data.draw(st.integers(1, len(chosen))) if frames == 2 else len(chosen)
        for part in (chosen[:cut], chosen[cut:]):
            if part:
                records = self.records(part, v)
                self.live().send(p.encode_mutations(v.number, len(self.indexes), records))
                v.take_mutations(part)

    @precondition(lambda self: self.begun())
    @rule(data=st.data(), end=st.booleans())
    def stream_end_or_empty_frame(self, data: st.DataObject, end: bool) -> None:
        """STREAM_END, or a MUTATIONS frame of no records (valid, does nothing; docs §2.5)."""
        v = data.draw(st.sampled_from(self.begun()), label="vbucket")
        if end:
            self.live().send(p.encode(p.StreamEnd(v.number, vbuuid_of(v.number))))
            v.begun = False
        else:
            self.live().send(p.encode_mutations(v.number, len(self.indexes), []))

    def barrier_answerable(self) -> bool:
        """A barrier waits for its vbuckets' snapshots to complete (docs §2.8): send one only
        when every mutation taken on them is in a complete snapshot."""
        return all(v.stable >= v.received for v in self.vbs if v.number in self.connection_vbs)

    @precondition(lambda self: self.barrier_answerable())
    @rule()
    def barrier(self) -> None:
        """Once answered, everything sent is readable: the scans must equal the model."""
        mine = self.answered_barrier()
        # What the barrier covers is visible at once; all of this example with at_plus.
        self.check_scans(mine, "any", None)
        vector = {str(v.number): v.stable for v in self.vbs}
        self.check_scans(self.vbs, "at_plus", json.dumps(vector))

    def answered_barrier(self) -> list[Vbucket]:
        """Send a barrier and check its answer: the seqnos taken on each vbucket begun on this
        connection. Returns those vbuckets."""
        cookie = next(self.cookies)
        self.live().send(p.encode(p.Barrier(cookie)))
        message = self.answer()
        assert message.cookie == cookie
        mine = sorted(
            (v for v in self.vbs if v.number in self.connection_vbs), key=lambda v: v.number
        )
        expected = [
            (v.number, v.received, vbuuid_of(v.number) if v.received else None) for v in mine
        ]
        got = [(q.vbucket, q.seqno, q.vbuuid if q.seqno else None) for q in message.positions]
        assert got == expected
        return mine

    def answer(self) -> p.BarrierReply:
        """The next BARRIER_REPLY, taking in the ACKs before it."""
        while True:
            message = self.live().next()
            assert message is not None, "the daemon closed the connection instead of answering"
            if isinstance(message, p.BarrierReply):
                return message
            self.take_in([message])

    def check_scans(self, vbs: Sequence[Vbucket], consistency: str, at_plus: str | None) -> None:
        """Every index, scanned at `consistency`, holds the model's rows of these vbuckets."""
        numbers = {v.number for v in vbs}
        documents = [doc for v in vbs for doc in v.visible()]
        params = {"consistency": consistency, "timeout": str(WAIT_S)}
        if at_plus is not None:
            params["at_plus"] = at_plus
        for index in self.indexes:
            answer = self.http.get(f"{self.daemon.url}/indexes/{index.name}/scan", params=params)
            assert answer.status_code == 200, answer.text
            rows = [json.loads(line) for line in answer.text.splitlines() if line]
            got = [r for r in rows if vbucket_of(r["id"].encode(), NUM_VBUCKETS) in numbers]
            assert got == model(documents, list(index.keys)), (index.name, consistency)

    @rule(data=st.data(), how=st.sampled_from(["graceful", "abrupt", "cut"]))
    def disconnect(self, data: st.DataObject, how: str) -> None:
        """The router closes the connection: half-closed (waiting for the daemon's close),
        dropped, or half-closed inside a frame (PROTOCOL). Then it resumes (see `end`)."""
        self.end(data, how)

    @rule(data=st.data())
    def invalid_stream_frame(self, data: st.DataObject) -> None:
        """A frame breaking the stream rules: its ERROR code, then the close (see `end`)."""
        self.end(data, "stream error")

    @rule(data=st.data())
    def invalid_frame(self, data: st.DataObject) -> None:
        """A malformed or misdirected frame: its ERROR code, then the close (see `end`)."""
        self.end(data, "frame error")

    def end(self, data: st.DataObject, how: str) -> None:
        """The connection ends as `how` says; nothing of an invalid frame is applied. Then the
        router connects again and resumes some of its streams."""
        link = self.live()
        self.take_in(link.arrived())
        if how == "graceful":
            link.sock.shutdown(socket.SHUT_WR)
            while (message := link.next()) is not None:
                self.take_in([message])
        elif how == "abrupt":
            link.close()
        elif how in ("stream error", "frame error"):
            errors = self.stream_errors() if how == "stream error" else self.frame_errors()
            what, make, code = data.draw(st.sampled_from(errors), label="invalid")
            note(f"invalid frame: {what}, expecting {code.name}")
            link.send(make(data))
            self.expect_error(link, code)
        else:  # part of a frame, then a half-close: PROTOCOL, told on the half-open connection
            cut = data.draw(st.integers(1, 9), label="cut")
            link.send(p.encode(p.SnapshotMarker(self.vbs[0].number, 1, 1))[:cut])
            link.sock.shutdown(socket.SHUT_WR)
            self.expect_error(link, ErrorCode.PROTOCOL)
        link.close()
        self.lost()
        self.wait_released()
        resume = data.draw(st.lists(st.booleans(), min_size=len(self.vbs), max_size=len(self.vbs)))
        self.connect([v for v, yes in zip(self.vbs, resume, strict=True) if yes])

    # -----------------------------------------------------------------------------------------
    # Invalid frames: each gets its error code, nothing of it is applied, the daemon goes on

    def stream_errors(self) -> list[Refusal]:
        """Frames that break the stream rules in the current state (docs §6)."""
        nkeys = len(self.indexes)
        makers: list[Refusal] = []
        for v in self.vbs:
            vb = v.number
            if not v.begun:
                makers += [
                    (
                        "marker, not begun",
                        constant(p.encode(p.SnapshotMarker(vb, 1, 1))),
                        NOT_BEGUN,
                    ),
                    ("end, not begun", constant(p.encode(p.StreamEnd(vb, 0))), NOT_BEGUN),
                    (
                        "empty frame, not begun",
                        constant(p.encode_mutations(vb, nkeys, [])),
                        NOT_BEGUN,
                    ),
                    ("mutation, not begun", constant(self.mutation_frame(v, [1])), NOT_BEGUN),
                ]
                continue
            makers += [
                ("wrong nkeys", functools.partial(self.wrong_nkeys, v), ErrorCode.BAD_MUTATION),
                ("marker start > end", functools.partial(self.inverted_marker, v), PROTOCOL),
                ("outside the snapshot", functools.partial(self.outside_snapshot, v), OUTSIDE),
            ]
            if max(v.last, v.marker_end) >= 1:
                makers.append(
                    ("marker backwards", functools.partial(self.marker_back, v), BACKWARDS)
                )
            if v.marker_end >= 0:
                makers.append(("seqno twice", functools.partial(self.seqno_twice, v), BACKWARDS))
            if v.marker_end >= 0 and v.last >= 1:
                makers.append(("seqno backwards", functools.partial(self.seqno_back, v), BACKWARDS))
        return makers

    def frame_errors(self) -> list[Refusal]:
        """Frames refused whatever the stream state: bad headers, records, vbuckets, types."""
        nkeys = len(self.indexes)
        vb = self.vbs[0].number
        keys = (b"\x02",) + (b"",) * (nkeys - 1)
        return [
            ("begin, not owned", not_owned(lambda o: p.encode(p.StreamBegin(o, 1))), NOT_MINE),
            (
                "marker, not owned",
                not_owned(lambda o: p.encode(p.SnapshotMarker(o, 1, 1))),
                NOT_MINE,
            ),
            ("end, not owned", not_owned(lambda o: p.encode(p.StreamEnd(o, 1))), NOT_MINE),
            ("frame, not owned", not_owned(lambda o: p.encode_mutations(o, nkeys, [])), NOT_MINE),
            (
                "delete with a key",
                constant(record_frame(vb, nkeys, p.Mutation(1, b"d", keys, True))),
                BAD,
            ),
            ("empty docid", constant(record_frame(vb, nkeys, p.Mutation(1, b"", keys))), BAD),
            (
                "second handshake",
                constant(p.encode(p.Handshake("r", NUM_VBUCKETS, ()))),
                BAD_HANDSHAKE,
            ),
            ("ACK", constant(p.encode(p.Ack(()))), PROTOCOL),
            ("ERROR", constant(p.encode(p.Error(ErrorCode.INTERNAL, "x"))), PROTOCOL),
            ("reply", constant(p.encode(p.HandshakeReply((), NUM_VBUCKETS, (), ()))), PROTOCOL),
            ("BUFFER_ACK", constant(p.encode(p.BufferAck(1))), PROTOCOL),
            ("BARRIER_REPLY", constant(p.encode(p.BarrierReply(1, False, ()))), PROTOCOL),
            ("version", with_filler(lambda f: HEADER.pack(len(f) + 2, 7, 3) + f), PROTOCOL),
            ("length < 2", constant(HEADER.pack(1, p.VERSION, 3)), PROTOCOL),
            (
                "unknown type",
                with_filler(lambda f: HEADER.pack(len(f) + 2, p.VERSION, 200) + f),
                PROTOCOL,
            ),
            # Refused from the header: the payload is never sent.
            (
                "too large",
                constant(HEADER.pack(2**32 - 1, p.VERSION, 6)),
                ErrorCode.FRAME_TOO_LARGE,
            ),
        ]

    def wrong_nkeys(self, v: Vbucket, data: st.DataObject) -> bytes:
        """Records with another number of keys than there are indexes (even none)."""
        nkeys = data.draw(st.sampled_from([0, 1, 3]), label="nkeys")
        return p.encode_mutations(v.number, nkeys, [])

    def inverted_marker(self, v: Vbucket, data: st.DataObject) -> bytes:
        """A marker whose start is after its end."""
        start = data.draw(st.integers(2, 2**63), label="start")
        return p.encode(p.SnapshotMarker(v.number, start, start - 1))

    def outside_snapshot(self, v: Vbucket, data: st.DataObject) -> bytes:
        """Before any marker of the stream, or past the marker's end."""
        seqno = max(v.marker_end, v.last) + 1 + data.draw(st.one_of(st.just(0), st.integers(0, 3)))
        return self.mutation_frame(v, [seqno])

    def marker_back(self, v: Vbucket, data: st.DataObject) -> bytes:
        """A marker not starting after the stream's last seqno and previous marker."""
        after = max(v.last, v.marker_end)
        start = data.draw(st.one_of(st.just(after), st.integers(1, after)), label="start")
        return p.encode(p.SnapshotMarker(v.number, start, start + data.draw(st.integers(0, 4))))

    def seqno_twice(self, v: Vbucket, data: st.DataObject) -> bytes:
        """One seqno twice in a frame: the second is not above the first."""
        seqno = data.draw(st.integers(v.last + 1, max(v.last + 1, v.marker_end)), label="seqno")
        return self.mutation_frame(v, [seqno, seqno])

    def seqno_back(self, v: Vbucket, data: st.DataObject) -> bytes:
        """A seqno at or below the stream's last one."""
        seqno = data.draw(st.one_of(st.just(v.last), st.integers(1, v.last)), label="seqno")
        return self.mutation_frame(v, [seqno])

    def mutation_frame(self, v: Vbucket, seqnos: list[int]) -> bytes:
        """A MUTATIONS frame that must be refused (its records never join the history)."""
        keys = tuple(index_key(BODIES[0], index.keys) for index in self.indexes)
        records = [p.encode_record(p.Mutation(s, v.docids[0].encode(), keys)) for s in seqnos]
        return p.encode_mutations(v.number, len(self.indexes), records)

    @rule(
        data=st.data(),
        kind=st.sampled_from(
            ["stream exists", "not first", "other num_vbuckets", "not json", "array", "no num"]
        ),
    )
    def other_connection(self, data: st.DataObject, kind: str) -> None:
        """A second connection that breaks a rule (a HANDSHAKE or STREAM_BEGIN claiming a
        vbucket this connection streams, a bad HANDSHAKE): refused, and this connection goes
        on untouched. With no stream to collide with, "stream exists" sends a first frame
        that is not a HANDSHAKE."""
        other = Link(self.daemon)
        try:
            if kind == "stream exists" and self.begun() and self.barrier_answerable():
                self.answered_barrier()  # the daemon has taken this connection's begins
                v = data.draw(st.sampled_from(self.begun()), label="vbucket")
                # Claimed in the handshake: refused there, before anything of it is used.
                other.send(p.encode(p.Handshake("other-router", NUM_VBUCKETS, (v.number,))))
                self.expect_error(other, ErrorCode.STREAM_EXISTS)
                # Not claimed, then begun: refused at the STREAM_BEGIN.
                late = Link(self.daemon)
                try:
                    late.send(p.encode(p.Handshake("late-router", NUM_VBUCKETS, ())))
                    assert isinstance(late.next(), p.HandshakeReply)
                    late.send(p.encode(p.StreamBegin(v.number, 1)))
                    self.expect_error(late, ErrorCode.STREAM_EXISTS)
                finally:
                    late.close()
                return
            body = {
                "other num_vbuckets": b'{"num_vbuckets":512,"vbuckets":[]}',
                "not json": b'{"num_vbuckets":1024,',
                "array": b"[1024]",
                "no num": b'{"router":"r","vbuckets":[]}',
            }.get(kind)
            if body is None:  # the first frame is not a HANDSHAKE
                other.send(p.encode(p.StreamBegin(self.vbs[0].number, 1)))
            else:
                other.send(HEADER.pack(len(body) + 2, p.VERSION, p.MessageType.HANDSHAKE) + body)
            self.expect_error(other, ErrorCode.BAD_HANDSHAKE)
        finally:
            other.close()

    # -----------------------------------------------------------------------------------------
    # Always

    @invariant()
    def daemon_serves(self) -> None:
        """The daemon is up; whatever it sent meanwhile is only ACKs, within the model."""
        assert self.daemon.running, self.daemon.log()[-4000:]
        if self.link is not None:
            self.take_in(self.link.arrived())

    def teardown(self) -> None:
        """Close the connection; the daemon must be up and have logged no internal error."""
        if self.link is not None:
            self.link.close()
            self.link = None
        assert self.daemon.running, self.daemon.log()[-4000:]
        assert self.http.get(self.daemon.url + "/health").status_code == 200
        log = self.daemon.log()
        assert "internal error" not in log and "Traceback" not in log, log[-4000:]
        self.wait_released()


def test_the_daemon_follows_the_feed_protocol_model(feed_daemon: FeedDaemon) -> None:
    """Random feed sequences, one shared daemon, fresh vbuckets per example."""
    FeedMachine.pool = feed_daemon
    run_state_machine_as_test(FeedMachine, settings=MACHINE_SETTINGS)
