"""The stream rules of a connection, driven without sockets."""

from __future__ import annotations

import pytest

from indexer import protocol as p
from indexer.protocol import ErrorCode, ProtocolError
from indexer.streams import Connection, StreamRegistry

N = 16


def mutations(vb: int, seqnos: list[int], nkeys: int = 1) -> p.MutationBatch:
    records = [p.encode_record(p.Mutation(s, b"d%d" % s, (b"\x02",) * nkeys)) for s in seqnos]
    decoder = p.FrameDecoder()
    decoder.feed(p.encode_mutations(vb, nkeys, records))
    [batch] = decoder.messages()
    assert isinstance(batch, p.MutationBatch)
    return batch


def connection(
    registry: StreamRegistry | None = None,
    conn_id: int = 1,
    owned: range = range(8),
    asks: tuple[int, ...] = tuple(range(N)),
) -> Connection:
    registry = registry or StreamRegistry(list(owned), [0] * N)
    conn = Connection(conn_id, registry, nkeys=1)
    assert conn.accept(p.Handshake("r", N, asks)) is None
    return conn


def refused(conn: Connection, message: p.Message) -> ErrorCode:
    with pytest.raises(ProtocolError) as info:
        conn.accept(message)
    return info.value.code


def test_handshake_comes_first_and_once() -> None:
    conn = Connection(1, StreamRegistry(range(N), [0] * N), nkeys=1)
    assert refused(conn, p.StreamBegin(0, 1)) is ErrorCode.BAD_HANDSHAKE
    conn = connection()
    assert refused(conn, p.Handshake("r", N, ())) is ErrorCode.BAD_HANDSHAKE


def test_handshake_with_another_vbucket_count_is_refused() -> None:
    conn = Connection(1, StreamRegistry(range(N), [0] * N), nkeys=1)
    assert refused(conn, p.Handshake("r", 1024, ())) is ErrorCode.BAD_HANDSHAKE


def test_the_first_source_is_claimed_and_another_refused_before_anything_else() -> None:
    registry = StreamRegistry(range(N), [0] * N)
    first = Connection(1, registry, nkeys=1)
    assert first.accept(p.Handshake("a", N, (), source="aaaa")) is None
    assert (first.new_source, first.replaces, registry.source) == ("aaaa", None, "aaaa")
    same = Connection(2, registry, nkeys=1)
    assert same.accept(p.Handshake("a2", N, (), source="aaaa")) is None
    assert same.new_source is None  # nothing to record
    for other in ("bbbb", ""):  # "" is the stateless feed's identity
        conn = Connection(3, registry, nkeys=1)
        with pytest.raises(ProtocolError) as info:
            conn.accept(p.Handshake("b", N, (), {0: ((5, 0),)}, source=other))
        assert info.value.code is ErrorCode.SOURCE_MISMATCH
        assert "source log aaaa" in info.value.message and "--adopt-source" in info.value.message
        assert conn.handshake is None and registry.source == "aaaa"
    assert registry.failover_logs == {}  # nothing of the refused handshakes was used


def test_adopt_source_lets_one_other_source_take_over() -> None:
    registry = StreamRegistry(range(N), [0] * N, source="aaaa", adopt_source=True)
    build = Connection(1, registry, nkeys=1)
    with pytest.raises(ProtocolError):  # a build stream never takes a node over
        build.accept(p.Handshake("b", N, (), build="by_age", source="bbbb"))
    conn = Connection(2, registry, nkeys=1)
    assert conn.accept(p.Handshake("b", N, (), source="bbbb")) is None
    assert (conn.new_source, conn.replaces, registry.source) == ("bbbb", "aaaa", "bbbb")
    assert not registry.adopt_source  # spent
    assert refused(Connection(3, registry, nkeys=1), p.Handshake("a", N, (), source="aaaa")) is (
        ErrorCode.SOURCE_MISMATCH
    )


def test_a_stream_in_order_is_accepted() -> None:
    conn = connection()
    assert conn.accept(p.StreamBegin(3, 99)) == p.StreamBegin(3, 99)
    assert conn.accept(p.SnapshotMarker(3, 1, 3)) == p.SnapshotMarker(3, 1, 3)
    batch = mutations(3, [1, 2, 3])
    assert conn.accept(batch) is batch
    assert conn.registry.received[3] == 3


def test_unowned_vbucket_is_not_my_slice() -> None:
    conn = connection(owned=range(8))
    assert refused(conn, p.StreamBegin(12, 1)) is ErrorCode.NOT_MY_SLICE
    assert refused(conn, mutations(12, [1])) is ErrorCode.NOT_MY_SLICE


def test_mutation_without_stream_begin_or_marker() -> None:
    conn = connection()
    assert refused(conn, mutations(2, [1])) is ErrorCode.STREAM_NOT_BEGUN
    conn.accept(p.StreamBegin(2, 1))
    assert refused(conn, mutations(2, [1])) is ErrorCode.OUT_OF_SNAPSHOT


def test_seqno_backwards_within_a_frame_and_across_frames() -> None:
    conn = connection()
    conn.accept(p.StreamBegin(1, 1))
    conn.accept(p.SnapshotMarker(1, 1, 10))
    assert refused(conn, mutations(1, [1, 3, 2])) is ErrorCode.SEQNO_BACKWARDS
    # Nothing of the refused frame was recorded: 1..3 are still acceptable.
    assert conn.registry.received[1] == 0
    conn.accept(mutations(1, [1, 3]))
    assert refused(conn, mutations(1, [3])) is ErrorCode.SEQNO_BACKWARDS
    assert refused(conn, p.SnapshotMarker(1, 2, 20)) is ErrorCode.SEQNO_BACKWARDS


def test_mutations_outside_the_marker() -> None:
    conn = connection()
    conn.accept(p.StreamBegin(1, 1))
    conn.accept(p.SnapshotMarker(1, 5, 6))
    assert refused(conn, mutations(1, [5, 6, 7])) is ErrorCode.OUT_OF_SNAPSHOT
    # The marker moved the stream to 5: an earlier seqno goes backwards.
    assert refused(conn, mutations(1, [4])) is ErrorCode.SEQNO_BACKWARDS


def test_key_count_must_match_the_indexes() -> None:
    conn = connection()
    conn.accept(p.StreamBegin(1, 1))
    conn.accept(p.SnapshotMarker(1, 1, 1))
    assert refused(conn, mutations(1, [1], nkeys=2)) is ErrorCode.BAD_MUTATION


def test_one_connection_per_vbucket_until_released() -> None:
    registry = StreamRegistry(range(N), [0] * N)
    first = connection(registry, 1, asks=())
    second = connection(registry, 2, asks=())
    first.accept(p.StreamBegin(4, 1))
    assert refused(second, p.StreamBegin(4, 1)) is ErrorCode.STREAM_EXISTS
    first.release()
    assert second.accept(p.StreamBegin(4, 1)) == p.StreamBegin(4, 1)


def test_a_handshake_claims_its_vbuckets_and_a_claim_on_them_is_refused() -> None:
    registry = StreamRegistry(range(N), [0] * N)
    low = connection(registry, 1, asks=(0, 1, 2))
    high = connection(registry, 2, asks=(3, 4))  # disjoint: both served
    assert refused(low, p.SnapshotMarker(1, 1, 1)) is ErrorCode.STREAM_NOT_BEGUN  # claimed only
    overlapping = Connection(3, registry, nkeys=1)
    assert refused(overlapping, p.Handshake("r", N, (2, 5))) is ErrorCode.STREAM_EXISTS
    assert overlapping.handshake is None and registry.owner[5] is None  # nothing of it used
    assert refused(connection(registry, 4, asks=()), p.StreamBegin(3, 1)) is (
        ErrorCode.STREAM_EXISTS
    )
    low.release()
    assert connection(registry, 5, asks=(2, 5)).claimed == {2, 5}
    high.release()


def test_build_streams_of_one_index_claim_disjoint_vbuckets() -> None:
    """Shards each build their own vbuckets of an index: as the reader's build handshake does,
    a build connection claims in the build's registry (not the maintenance one)."""
    maintenance = StreamRegistry(range(N), [0] * N)
    build = StreamRegistry(range(N), [0] * N)

    def build_connection(conn_id: int, asks: tuple[int, ...]) -> Connection:
        conn = Connection(conn_id, maintenance, nkeys=1)
        handshake = p.Handshake("r", N, asks, build="by_zip")
        assert conn.accept(handshake) is None
        conn.registry = build
        conn.claim_vbuckets(handshake, "index 'by_zip' has a build stream")
        return conn

    low = build_connection(1, (0, 1, 2))
    high = build_connection(2, (3, 4))
    assert maintenance.owner == [None] * N  # the maintenance stream's claims are untouched
    with pytest.raises(ProtocolError) as info:
        build_connection(3, (2, 5))
    assert info.value.code is ErrorCode.STREAM_EXISTS and "by_zip" in info.value.message
    assert build.owner[5] is None
    low.release()
    assert build_connection(4, (2, 5)).claimed == {2, 5}
    high.release()


def test_resent_mutations_at_or_below_what_was_received_are_skipped() -> None:
    registry = StreamRegistry(range(N), [0] * N)
    first = connection(registry, 1)
    first.accept(p.StreamBegin(6, 1))
    first.accept(p.SnapshotMarker(6, 1, 4))
    first.accept(mutations(6, [1, 2, 3, 4]))
    first.release()
    # A reconnecting router resends from its restart point (here 2): only 5 and 6 are new.
    again = connection(registry, 2)
    again.accept(p.StreamBegin(6, 1))
    assert again.accept(p.SnapshotMarker(6, 3, 4)) is None  # wholly received already
    assert again.accept(mutations(6, [3, 4])) is None
    again.accept(p.SnapshotMarker(6, 5, 6))
    kept = again.accept(mutations(6, [5, 6]))
    assert isinstance(kept, p.MutationBatch) and kept.seqnos == [5, 6]
    assert registry.duplicates == 2


def test_partially_resent_batch_keeps_only_new_records() -> None:
    registry = StreamRegistry(range(N), [3] * N)  # persisted up to 3 everywhere
    conn = connection(registry)
    conn.accept(p.StreamBegin(0, 1))
    conn.accept(p.SnapshotMarker(0, 2, 5))
    kept = conn.accept(mutations(0, [2, 3, 4, 5]))
    assert isinstance(kept, p.MutationBatch)
    assert kept.seqnos == [4, 5]
    assert [m.seqno for m in kept.mutations()] == [4, 5]


def test_markers_do_not_overlap() -> None:
    conn = connection()
    conn.accept(p.StreamBegin(1, 1))
    conn.accept(p.SnapshotMarker(1, 5, 10))
    conn.accept(mutations(1, [5, 6]))
    assert refused(conn, p.SnapshotMarker(1, 7, 12)) is ErrorCode.SEQNO_BACKWARDS
    assert conn.accept(p.SnapshotMarker(1, 11, 12)) == p.SnapshotMarker(1, 11, 12)


def test_a_vbucket_first_streamed_after_the_handshake_gets_its_branch_as_history() -> None:
    registry = StreamRegistry(list(range(8)), [0] * N, {2: ((7, 0),)})
    conn = connection(registry)
    conn.accept(p.StreamBegin(3, 99))
    conn.accept(p.StreamBegin(2, 8))
    # A later failover of vbucket 3 is compared against branch 99 from seqno 0; the history
    # vbucket 2 already had is the handshake's business, not a stream's.
    assert registry.failover_logs == {2: ((7, 0),), 3: ((99, 0),)}
