"""The router's source log (indexer/router/source/log.py) on a real LevelDB, and the frames the feed
makes of it (LogEncoder)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexer import protocol as p
from indexer.router.documents import Document, parse_line, vbucket_of
from indexer.router.source.log import SourceError, SourceLockedError, SourceLog, record_key
from indexer.router.streams.encoders import LogEncoder
from indexer.router.streams.feed import FeedError, Peer
from indexer.router.streams.records import BATCH_RECORDS

NUM_VBUCKETS = 8


def docid_in(vb: int, n: int = 0, num_vbuckets: int = NUM_VBUCKETS) -> str:
    """The n-th document id (in a fixed enumeration) that falls in vbucket `vb`."""
    found = -1
    for i in range(100_000):
        docid = f"doc{i}"
        if vbucket_of(docid.encode(), num_vbuckets) == vb:
            found += 1
            if found == n:
                return docid
    raise AssertionError("no such id")


def versions(log: SourceLog, vb: int, after: int = 0) -> list[tuple[int, Document]]:
    return list(log.read(vb, after))


def test_append_assigns_seqnos_per_vbucket_and_keeps_every_version(tmp_path: Path) -> None:
    a, b, c = docid_in(1), docid_in(1, 1), docid_in(2)
    docs = [
        Document(a, {"v": 1}),
        Document(c, {"v": 2}),
        Document(a, {"v": 3}),
        Document(b, None),
        Document(a, None),
    ]
    with SourceLog(tmp_path, NUM_VBUCKETS) as log:
        assert log.vbuckets_with_history() == []
        assert log.high_seqno(1) == 0 and log.failover_log(1) == ()
        assert log.append(docs) == 5
        assert log.vbuckets_with_history() == [1, 2]
        assert versions(log, 1) == [(1, docs[0]), (2, docs[2]), (3, docs[3]), (4, docs[4])]
        assert versions(log, 1, after=2) == [(3, docs[3]), (4, docs[4])]
        assert versions(log, 1, after=4) == []
        assert versions(log, 2) == [(1, docs[1])]
        assert versions(log, 3) == []
        assert (log.high_seqno(1), log.high_seqno(2)) == (4, 1)
        # The first use of a vbucket made its failover log: one entry at seqno 0.
        ((vbuuid, start),) = log.failover_log(1)
        assert start == 0 and log.vbuuid(1) == vbuuid and vbuuid != log.vbuuid(2)
        assert log.append([Document(a, {"v": 6})]) == 1
        assert versions(log, 1, after=4) == [(5, Document(a, {"v": 6}))]
        assert log.failover_log(1) == ((vbuuid, 0),)
        assert log.append([]) == 0
        assert log.surviving_documents() == {
            a: Document(a, {"v": 6}),
            b: Document(b, None),
            c: Document(c, {"v": 2}),
        }


def test_documents_keep_their_json_exactly(tmp_path: Path) -> None:
    body = {"n": 2**70, "f": 0.1, "s": "Zürich\u0000", "a": [None, True, {"x": -0.0}], "e": {}}
    with SourceLog(tmp_path, NUM_VBUCKETS) as log:
        log.append([Document("x", body)])
        ((_, got),) = versions(log, vbucket_of(b"x", NUM_VBUCKETS))
        assert got == Document("x", body) and type(got.body["n"]) is int  # type: ignore[index]


def test_a_failed_input_appends_nothing(tmp_path: Path) -> None:
    def documents() -> Any:
        yield Document(docid_in(1), {"v": 1})
        raise ValueError("bad line")

    with SourceLog(tmp_path, NUM_VBUCKETS) as log:
        with pytest.raises(ValueError):
            log.append(documents())
        assert log.vbuckets_with_history() == [] and log.surviving_documents() == {}


def test_clean_failover_keeps_the_history_and_starts_a_branch(tmp_path: Path) -> None:
    a = docid_in(3)
    with SourceLog(tmp_path, NUM_VBUCKETS) as log:
        log.append([Document(a, {"v": i}) for i in range(10)])
        old = log.vbuuid(3)
        vbuuid, seqno = log.failover(3)
        assert seqno == 10 and vbuuid != old
        assert log.failover_log(3) == ((vbuuid, 10), (old, 0))
        assert log.vbuuid(3) == vbuuid and log.high_seqno(3) == 10
        assert [s for s, _ in versions(log, 3)] == list(range(1, 11))
        log.append([Document(a, {"v": 10})])
        assert versions(log, 3, after=10) == [(11, Document(a, {"v": 10}))]
        assert log.failover_log(3) == ((vbuuid, 10), (old, 0))


def test_failover_to_a_seqno_discards_later_history_and_prunes_the_log(tmp_path: Path) -> None:
    a, b = docid_in(5), docid_in(5, 1)
    with SourceLog(tmp_path, NUM_VBUCKETS) as log:
        log.append([Document(a, {"v": i}) for i in range(10)])  # seqnos 1..10
        u0 = log.vbuuid(5)
        u1, _ = log.failover(5)  # branch at 10
        log.append([Document(b, {"v": i}) for i in range(5)])  # 11..15
        u2, _ = log.failover(5, 12)  # branch at 12: 13..15 gone
        assert log.failover_log(5) == ((u2, 12), (u1, 10), (u0, 0))
        assert log.high_seqno(5) == 12
        assert [s for s, _ in versions(log, 5)] == list(range(1, 13))
        assert log.surviving_documents()[b] == Document(b, {"v": 1})
        # Back before the branch at 10: the entries starting above 7 go.
        u3, seqno = log.failover(5, 7)
        assert seqno == 7 and log.failover_log(5) == ((u3, 7), (u0, 0))
        assert b not in log.surviving_documents()
        assert log.surviving_documents()[a] == Document(a, {"v": 6})
        # New writes reuse the seqnos after the branch point.
        log.append([Document(b, None)])
        assert versions(log, 5, after=7) == [(8, Document(b, None))]
        # Back to zero: nothing survives, the vbucket keeps its (new) history.
        u4, _ = log.failover(5, 0)
        assert log.failover_log(5) == ((u4, 0), (u0, 0))
        assert log.high_seqno(5) == 0 and versions(log, 5) == []
        assert log.vbuckets_with_history() == [5] and log.surviving_documents() == {}
        assert len({u0, u1, u2, u3, u4}) == 5


def test_the_failover_log_keeps_at_most_the_entry_cap(tmp_path: Path) -> None:
    a = docid_in(0)
    with SourceLog(tmp_path, NUM_VBUCKETS) as log:
        log.append([Document(a, {})])
        original = log.vbuuid(0)
        made = []
        for i in range(p.MAX_FAILOVER_ENTRIES + 5):
            log.append([Document(a, {"i": i})])
            made.append(log.failover(0))
        entries = log.failover_log(0)
        assert len(entries) == p.MAX_FAILOVER_ENTRIES
        assert entries == tuple(reversed(made))[: p.MAX_FAILOVER_ENTRIES]
        assert original not in {u for u, _ in entries}
        assert [s for _, s in entries] == sorted((s for _, s in entries), reverse=True)


def test_bad_failovers_are_refused_and_change_nothing(tmp_path: Path) -> None:
    with SourceLog(tmp_path, NUM_VBUCKETS) as log:
        log.append([Document(docid_in(2), {}), Document(docid_in(2), {})])
        before = log.failover_log(2)
        with pytest.raises(SourceError, match=r"vbucket 8 is not in 0\.\.7"):
            log.failover(8)
        with pytest.raises(SourceError, match=r"vbucket -1 is not in"):
            log.failover(-1)
        with pytest.raises(SourceError, match="vbucket 4 has no history"):
            log.failover(4)
        with pytest.raises(SourceError, match=r"seqno 3 is not in 0\.\.2"):
            log.failover(2, 3)
        with pytest.raises(SourceError, match=r"seqno -1 is not in"):
            log.failover(2, -1)
        assert log.failover_log(2) == before and log.high_seqno(2) == 2
        with pytest.raises(SourceError, match="vbucket 4 has no history"):
            log.vbuuid(4)


def test_reopening_keeps_everything(tmp_path: Path) -> None:
    a, b = docid_in(6), docid_in(7)
    with SourceLog(tmp_path, NUM_VBUCKETS) as log:
        log.append([Document(a, {"v": i}) for i in range(4)] + [Document(b, {"w": 1})])
        log.failover(6, 2)
        log.append([Document(a, None)])
        state = (
            log.vbuckets_with_history(),
            [log.failover_log(vb) for vb in range(NUM_VBUCKETS)],
            [log.high_seqno(vb) for vb in range(NUM_VBUCKETS)],
            [versions(log, vb) for vb in range(NUM_VBUCKETS)],
            log.surviving_documents(),
        )
    for count in (None, NUM_VBUCKETS):
        with SourceLog(tmp_path, count, create=False) as log:
            assert log.num_vbuckets == NUM_VBUCKETS
            assert state == (
                log.vbuckets_with_history(),
                [log.failover_log(vb) for vb in range(NUM_VBUCKETS)],
                [log.high_seqno(vb) for vb in range(NUM_VBUCKETS)],
                [versions(log, vb) for vb in range(NUM_VBUCKETS)],
                log.surviving_documents(),
            )


def test_open_errors_are_one_clear_line(tmp_path: Path) -> None:
    with SourceLog(tmp_path, NUM_VBUCKETS):
        pass
    with pytest.raises(SourceError, match="has 8 vbuckets, not 1024"):
        SourceLog(tmp_path, 1024)
    with pytest.raises(SourceError, match="no source log in"):
        SourceLog(tmp_path / "elsewhere", create=False)
    assert not (tmp_path / "elsewhere").exists()
    with SourceLog(tmp_path / "new") as log:
        assert log.num_vbuckets == 1024
    with SourceLog(tmp_path), pytest.raises(SourceLockedError, match="held by another process"):
        SourceLog(tmp_path)
    for name in (tmp_path / "source").iterdir():
        if name.name.startswith("MANIFEST"):
            name.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(SourceError, match="cannot open the source log") as caught:
        SourceLog(tmp_path)
    assert "\n" not in str(caught.value)


# --------------------------------------------------------------------------------------------
# Against a plain model: per vbucket, the list of versions in seqno order.

DOCIDS = [f"k{i}" for i in range(12)]
_document = st.builds(
    Document,
    st.sampled_from(DOCIDS),
    st.one_of(st.none(), st.fixed_dictionaries({"v": st.integers(0, 9)})),
)
_operation = st.one_of(
    st.tuples(st.just("append"), st.lists(_document, max_size=12)),
    st.tuples(st.just("failover"), st.integers(0, 3), st.one_of(st.none(), st.floats(0, 1))),
    st.tuples(st.just("reopen")),
    st.tuples(st.just("track")),
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_operation, max_size=25))
def test_random_appends_and_failovers_match_a_list_model(operations: list[Any]) -> None:
    num = 4
    model: dict[int, list[Document]] = {}
    uuids: dict[int, set[int]] = {}
    tracking = False  # latest versions kept (the PostgreSQL input's), from some point on
    with tempfile.TemporaryDirectory() as tmp:
        log = SourceLog(Path(tmp), num)
        try:
            for op in operations:
                if op[0] == "append":
                    assert log.append(op[1]) == len(op[1])
                    for d in op[1]:
                        model.setdefault(vbucket_of(d.docid.encode(), num), []).append(d)
                elif op[0] == "reopen":
                    log.close()
                    log = SourceLog(Path(tmp))
                    assert log.tracks_latest == tracking
                elif op[0] == "track":
                    indexed = log.track_latest_versions()
                    ids = {d.docid for docs in model.values() for d in docs}
                    assert indexed == (0 if tracking else len(ids))
                    tracking = True
                else:
                    _, vb, where = op
                    if vb not in model:
                        with pytest.raises(SourceError):
                            log.failover(vb)
                        continue
                    to = None if where is None else int(where * len(model[vb]))
                    before = log.failover_log(vb)
                    vbuuid, seqno = log.failover(vb, to)
                    assert seqno == (len(model[vb]) if to is None else to)
                    del model[vb][seqno:]
                    kept = tuple(e for e in before if e[1] <= seqno)
                    want = ((vbuuid, seqno), *kept)[: p.MAX_FAILOVER_ENTRIES]
                    assert log.failover_log(vb) == want
                    assert vbuuid not in {u for u, _ in before}
                for vb in range(num):
                    assert log.high_seqno(vb) == len(model.get(vb, []))
                    entries = log.failover_log(vb)
                    assert bool(entries) == (vb in model)
                    assert 0 < len(entries) <= p.MAX_FAILOVER_ENTRIES or vb not in model
                    seqnos = [s for _, s in entries]
                    assert seqnos == sorted(seqnos, reverse=True)
                    assert all(s <= log.high_seqno(vb) for s in seqnos)
                    uuids.setdefault(vb, set()).update(u for u, _ in entries)
            assert log.vbuckets_with_history() == sorted(model)
            for vb, docs in model.items():
                assert versions(log, vb) == list(enumerate(docs, 1))
            latest: dict[str, Document] = {}
            for docs in model.values():
                for d in docs:
                    latest[d.docid] = d
            assert log.surviving_documents() == latest
            ever = {d.docid for op in operations if op[0] == "append" for d in op[1]}
            for docid in ever:
                want_latest = latest.get(docid) if tracking else None
                assert log.latest_version(docid) == want_latest, docid
        finally:
            log.close()


# --------------------------------------------------------------------------------------------
# LogEncoder: the log's history after the restart positions as frames.


def _reply(restart: dict[int, int], num: int = NUM_VBUCKETS) -> p.HandshakeReply:
    indexes = (p.IndexDefinition("by_v", ("v",)), p.IndexDefinition("big", ("v",), "v >= 5"))
    positions = tuple(p.VbucketPosition(vb, seqno, 0) for vb, seqno in restart.items())
    return p.HandshakeReply(indexes, num, tuple(range(num)), positions)


def _decode(frames: list[bytes]) -> list[p.Message]:
    decoder = p.FrameDecoder(64 << 20)
    decoder.feed(b"".join(frames))
    return decoder.messages()


def test_log_encoder_streams_after_the_restart_in_snapshots(tmp_path: Path) -> None:
    n = BATCH_RECORDS + 10
    with SourceLog(tmp_path, NUM_VBUCKETS) as log:
        log.append([Document(docid_in(1, i), {"v": i % 10}) for i in range(n)])
        b = docid_in(4)
        log.append([Document(b, {"v": 7}), Document(b, None), Document(b, {"w": 1})])
        log.failover(4)
        encoder = LogEncoder(_reply({1: 5, 4: 0, 2: 0}), log, chunk_items=300)
        assert encoder.skipped == 5
        chunks = list(encoder.frames())
        assert sum(count for _, count in chunks) == encoder.sent == n - 5 + 3
        messages = _decode([f for frames, _ in chunks for f in frames])
        # Vbuckets take turns, a snapshot of up to 300 versions each: 1, then 4, then 1 again.
        shapes = [
            (type(m).__name__, m.vbucket)
            for m in messages
            if isinstance(m, p.StreamBegin | p.SnapshotMarker | p.MutationBatch)
        ]
        assert shapes == [
            ("StreamBegin", 1),
            ("SnapshotMarker", 1),
            ("MutationBatch", 1),
            ("StreamBegin", 4),
            ("SnapshotMarker", 4),
            ("MutationBatch", 4),
            ("SnapshotMarker", 1),
            ("MutationBatch", 1),
        ]
        begins = {m.vbucket: m.vbuuid for m in messages if isinstance(m, p.StreamBegin)}
        assert begins == {1: log.vbuuid(1), 4: log.vbuuid(4)}
        markers = [(m.vbucket, m.start, m.end) for m in messages if isinstance(m, p.SnapshotMarker)]
        assert markers == [(1, 6, 305), (4, 1, 3), (1, 306, n)]
        batches = [m for m in messages if isinstance(m, p.MutationBatch)]
        assert [m.seqno for m in batches[0].mutations()] == list(range(6, 306))
        assert [m.seqno for m in batches[2].mutations()] == list(range(306, n + 1))
        # A snapshot carries each document once, at its latest version in it (as a backfill).
        four = batches[1].mutations()
        assert [(m.seqno, m.deleted, [bool(k) for k in m.keys]) for m in four] == [
            (3, False, [False, False]),
        ]
        assert encoder.superseded == 2
        assert encoder.targets() == {1: n, 4: 3}
        ends = _decode(encoder.ends())
        assert ends == [p.StreamEnd(1, log.vbuuid(1)), p.StreamEnd(4, log.vbuuid(4))]


def test_log_encoder_sends_nothing_when_the_indexer_has_everything(tmp_path: Path) -> None:
    with SourceLog(tmp_path, NUM_VBUCKETS) as log:
        log.append([Document(docid_in(3), {"v": 1})] * 3)
        encoder = LogEncoder(_reply({3: 3}), log)
        assert list(encoder.frames()) == [] and encoder.targets() == {} and encoder.ends() == []
        assert (encoder.sent, encoder.skipped) == (0, 3)


def test_log_encoder_refuses_an_indexer_ahead_of_the_log(tmp_path: Path) -> None:
    with SourceLog(tmp_path, NUM_VBUCKETS) as log:
        log.append([Document(docid_in(3), {"v": 1})] * 3)
        with pytest.raises(FeedError, match="vbucket 3: the indexer holds seqno 4 but the source"):
            LogEncoder(_reply({3: 4}), log)


async def test_acks_arriving_together_are_applied_in_order() -> None:
    """Two ACKs in one receive: the later one stands (the feed waited forever otherwise)."""
    ours, theirs = trio.testing.memory_stream_pair()
    peer = Peer(ours)  # type: ignore[arg-type]
    acks = [
        p.Ack((p.VbucketPosition(0, seqno, 1), p.VbucketPosition(1, seqno, 1))) for seqno in (0, 7)
    ]
    reply = p.HandshakeReply((), 2, (0, 1), ())
    await theirs.send_all(p.encode(reply))
    assert await peer.next_message() == reply
    await theirs.send_all(b"".join(p.encode(a) for a in acks))
    with trio.move_on_after(1):
        await peer.read_acks()
    assert peer.acked == {0: 7, 1: 7}


@pytest.mark.parametrize(
    "text",
    [
        '{"a": 1.5, "b": [true, null, "x\\u00e9"]}',
        '{"n": NaN, "i": -Infinity}',  # the standard library's extensions
        '{"big": 123456789012345678901234567890}',  # beyond 64 bits
        '{"s": "\\ud800"}',  # a lone surrogate
        '{"dup": 1, "dup": 2}',
    ],
)
def test_fast_json_parses_exactly_as_the_standard_library(text: str) -> None:
    import json
    import math

    from indexer.router.documents import json_loads

    got, want = json_loads(text), json.loads(text)
    assert json.dumps(got) == json.dumps(want)
    if "NaN" in text:
        assert math.isnan(got["n"])
    with pytest.raises(ValueError, match="Expecting"):
        json_loads('{"a": }')


def test_input_lines_are_stored_as_read_and_read_back_as_parsed(tmp_path: Path) -> None:
    """The log keeps an input line's bytes instead of encoding its document again: reading it
    back must give what parsing the line gave, whatever else the line holds."""
    lines = [
        b'{"id": 7, "doc": {"a": 1.5e300, "b": [true, null]}, "note": "extra"}',
        b'{"doc": {"x": "\\u00e9"}, "id": "e"}',
        b'{"id": "d", "deleted": true, "doc": {"ignored": 1}}',
        b'{"id": "k", "deleted": 1, "doc": {"kept": 1}}',  # not `true`: an upsert
    ]
    parsed = [parse_line(line.decode(), "input", line) for line in lines]
    assert [d.line for d in parsed] == lines
    with SourceLog(tmp_path, 1) as log:
        log.append(parsed)
        stored = [document for _, document in log.read(0, 0)]
        assert [log.db.get(record_key(0, seqno)) for seqno in (1, 2, 3, 4)] == lines
    assert stored == parsed
    assert [d.docid for d in stored] == ["7", "e", "d", "k"]
    assert stored[2].body is None and stored[3].body == {"kept": 1}


def test_the_identity_and_a_peers_range_are_fixed_when_the_log_is_made(tmp_path: Path) -> None:
    from indexer.router.source.log import SourceError

    with SourceLog(tmp_path / "a", 16) as log:
        made = log.identity
        assert len(made) == 32 and log.vbuckets is None and log.owns(15)
    with SourceLog(tmp_path / "a") as log:
        assert log.identity == made  # kept, not made again
    with pytest.raises(SourceError, match=f"has source id {made}, not"):
        SourceLog(tmp_path / "a", identity="f" * 32)
    shared = "ab" * 16
    with SourceLog(tmp_path / "peer", 16, identity=shared, vbuckets=(0, 1, 2, 3)) as log:
        assert log.identity == shared and log.streamed_vbuckets() == (0, 1, 2, 3)
        assert log.owns(3) and not log.owns(4)
    with SourceLog(tmp_path / "peer") as log:  # reopened without the options: as made
        assert log.vbuckets == (0, 1, 2, 3)
    with pytest.raises(SourceError, match="owns vbuckets 0-3, not vbuckets 0-7"):
        SourceLog(tmp_path / "peer", vbuckets=tuple(range(8)))
    # A log with history outside a range cannot become a peer of that range.
    with SourceLog(tmp_path / "b", 16) as log:
        log.append([Document(f"d{i}", {"i": i}) for i in range(40)])
    with pytest.raises(SourceError, match="history outside those vbuckets"):
        SourceLog(tmp_path / "b", vbuckets=(0,))


def test_latest_versions_follow_appends_failovers_and_splits(tmp_path: Path) -> None:
    """Where each document's latest version is (the PostgreSQL input reads unchanged TOASTed
    values there): kept by appends, made for what the log held, cut back by a failover."""
    from indexer.router.source.log import split_log

    a, b = docid_in(0, 0), docid_in(0, 1)
    with SourceLog(tmp_path / "s", NUM_VBUCKETS) as log:
        log.append([Document(a, {"v": 1}), Document(b, {"v": 1})])
        assert log.latest_version(a) is None  # not tracked yet
        assert log.track_latest_versions() == 2
        log.append([Document(a, {"v": 2}), Document(b, None)])
        assert log.latest_version(a) == Document(a, {"v": 2})
        assert log.latest_version(b) == Document(b, None)
        log.append([Document(a, {"v": 3})])
        assert log.latest_version(a) == Document(a, {"v": 3})
        log.failover(0, 3)  # cuts a's third version (seqno 5) and b's delete stays (seqno 4)
        assert log.latest_version(a) == Document(a, {"v": 2})
        log.failover(0, 1)  # only a's first version is left
        assert log.latest_version(a) == Document(a, {"v": 1})
        assert log.latest_version(b) is None
        log.append([Document(b, {"v": 9})])  # seqno 2 again, another document
        assert log.latest_version(b) == Document(b, {"v": 9})
        assert log.latest_version(a) == Document(a, {"v": 1})
    halves = [(tmp_path / "x", tuple(range(4))), (tmp_path / "y", tuple(range(4, 8)))]
    split_log(tmp_path / "s", halves)
    with SourceLog(tmp_path / "x", create=False) as half:
        assert half.tracks_latest and half.latest_version(b) == Document(b, {"v": 9})
