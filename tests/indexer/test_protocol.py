"""The codec alone: bytes in, messages out, and back, without sockets."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from indexer import protocol as p
from indexer.protocol import ErrorCode, FrameDecoder, ProtocolError


def batch(vb: int, mutations: list[p.Mutation], nkeys: int = 2) -> bytes:
    return p.encode_mutations(vb, nkeys, [p.encode_record(m) for m in mutations])


def decode_all(data: bytes, max_frame: int = p.DEFAULT_MAX_FRAME_BYTES) -> list[p.Message]:
    decoder = FrameDecoder(max_frame)
    decoder.feed(data)
    out = decoder.messages()
    decoder.close()
    return out


MESSAGES: list[p.Message] = [
    p.Handshake("router-1", 1024, (0, 1, 1023)),
    p.HandshakeReply(
        (p.IndexDefinition("by_city", ("address.city", "age")),),
        1024,
        (0, 1, 2),
        (p.VbucketPosition(0, 10, 77), p.VbucketPosition(2, 0, 0)),
        65536,
    ),
    p.StreamBegin(5, 2**64 - 1),
    p.StreamEnd(5, 3),
    p.SnapshotMarker(7, 1, 2**63),
    p.Ack((p.VbucketPosition(1, 2, 3), p.VbucketPosition(1023, 2**40, 9))),
    p.Ack(()),
    p.Error(ErrorCode.NOT_MY_SLICE, "vbucket 9 is not owned by this node — é"),
    p.Handshake("r", 1024, (5,), {5: ((2**64 - 1, 120), (7, 0))}, flow_control=True),
    p.Handshake("r", 1024, (5,), source="9f1c2b7e4a5d4c3b8a7f6e5d4c3b2a19"),
    p.HandshakeReply(
        (p.IndexDefinition("by_age", ("age",)),),
        1024,
        (5,),
        (p.VbucketPosition(5, 100, 7),),
        65536,
        rollback={5: 100},
        flow_control_bytes=1 << 20,
    ),
    p.Barrier(2**64 - 1),
    p.BarrierReply(9, True, (p.VbucketPosition(5, 120, 7),)),
    p.BarrierReply(10, False, ()),
    p.BufferAck(123456),
]


@pytest.mark.parametrize(
    ("logs", "why"),
    [
        ([1, 2], "JSON object"),
        ({"x": [[1, 0]]}, "not a vbucket"),
        ({"1024": [[1, 0]]}, "not a vbucket"),
        ({"3": []}, "1 to 25 entries"),
        ({"3": [[1, 0]] * 26}, "1 to 25 entries"),
        ({"3": [[1, -1]]}, "u64"),
        ({"3": [[1, 2**64]]}, "u64"),
        ({"3": [[1, True]]}, "u64"),
        ({"3": [[1, 5, 6]]}, "u64"),
        ({"3": [[1, 0], [2, 5]]}, "newest entry first"),
    ],
)
def test_bad_failover_logs_are_refused(logs: object, why: str) -> None:
    body = json.dumps({"num_vbuckets": 1024, "vbuckets": [3], "failover_logs": logs}).encode()
    with pytest.raises(ProtocolError, match=why) as info:
        decode_all(struct.pack(">IBB", len(body) + 2, 1, p.MessageType.HANDSHAKE) + body)
    assert info.value.code is ErrorCode.BAD_HANDSHAKE


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message: p.Message) -> None:
    assert decode_all(p.encode(message)) == [message]


def test_mutation_batch_round_trip() -> None:
    mutations = [
        p.Mutation(1, b"doc1", (b"\x06a\x00\x00", b"")),
        p.Mutation(5, "dóc".encode(), (b"", b"\x05" + b"\x80" * 9)),
        p.Mutation(9, b"doc1", (b"", b""), deleted=True),
    ]
    [decoded] = decode_all(batch(42, mutations))
    assert isinstance(decoded, p.MutationBatch)
    assert decoded.vbucket == 42
    assert decoded.seqnos == [1, 5, 9]
    assert decoded.mutations() == mutations
    assert p.encode(decoded) == batch(42, mutations)


def test_frames_split_at_every_byte_are_reassembled() -> None:
    stream = b"".join(p.encode(m) for m in MESSAGES) + batch(1, [p.Mutation(1, b"x", (b"", b""))])
    decoder = FrameDecoder()
    out: list[p.Message] = []
    for i in range(len(stream)):
        decoder.feed(stream[i : i + 1])
        out.extend(decoder.messages())
    decoder.close()
    assert out[: len(MESSAGES)] == MESSAGES
    assert len(out) == len(MESSAGES) + 1


def test_frame_over_the_maximum_is_refused_from_its_header() -> None:
    decoder = FrameDecoder(max_frame_bytes=1024)
    decoder.feed(struct.pack(">IBB", 5000, 1, p.MessageType.MUTATIONS))
    with pytest.raises(ProtocolError) as info:
        decoder.messages()
    assert info.value.code is ErrorCode.FRAME_TOO_LARGE


def test_unknown_type_and_version() -> None:
    with pytest.raises(ProtocolError) as info:
        decode_all(struct.pack(">IBB", 2, 1, 99))
    assert info.value.code is ErrorCode.PROTOCOL and "unknown frame type" in info.value.message
    with pytest.raises(ProtocolError) as info:
        decode_all(struct.pack(">IBB", 2, 7, p.MessageType.ACK))
    assert "version" in info.value.message


def test_truncated_frame_at_close() -> None:
    frame = p.encode(p.SnapshotMarker(1, 1, 2))
    decoder = FrameDecoder()
    decoder.feed(frame[:-3])
    assert decoder.messages() == []
    with pytest.raises(ProtocolError, match="closed inside a frame"):
        decoder.close()


def test_good_frames_before_a_bad_one_are_delivered_first() -> None:
    good = p.encode(p.StreamBegin(1, 1)) + p.encode(p.SnapshotMarker(1, 1, 1))
    decoder = FrameDecoder()
    decoder.feed(good + struct.pack(">IBB", 2, 1, 200) + p.encode(p.StreamEnd(1, 1)))
    assert decoder.messages() == [p.StreamBegin(1, 1), p.SnapshotMarker(1, 1, 1)]
    with pytest.raises(ProtocolError):
        decoder.messages()


@pytest.mark.parametrize(
    "mutate",
    [
        lambda b: b[:-1],  # record shorter than its keys
        lambda b: b + b"\x00",  # trailing byte after the records
        lambda b: b[:7] + struct.pack(">I", 3) + b[11:],  # record length too small
    ],
)
def test_malformed_mutation_batches(mutate: object) -> None:
    frame = batch(3, [p.Mutation(1, b"doc", (b"ab", b"c"))])
    payload = frame[6:]
    bad = mutate(payload)  # type: ignore[operator]
    with pytest.raises(ProtocolError):
        decode_all(struct.pack(">IBB", len(bad) + 2, 1, p.MessageType.MUTATIONS) + bad)


def test_delete_with_a_key_is_refused() -> None:
    frame = batch(3, [p.Mutation(1, b"doc", (b"k", b""), deleted=True)])
    with pytest.raises(ProtocolError) as info:
        decode_all(frame)
    assert info.value.code is ErrorCode.BAD_MUTATION


def test_handshake_must_be_json_with_fields() -> None:
    for body in (b"not json", b"[1]", b'{"router": "r"}', b'{"num_vbuckets": 4, "vbuckets": "x"}'):
        with pytest.raises(ProtocolError) as info:
            decode_all(struct.pack(">IBB", len(body) + 2, 1, p.MessageType.HANDSHAKE) + body)
        assert info.value.code is ErrorCode.BAD_HANDSHAKE


@given(st.binary(max_size=200))
def test_random_bytes_raise_only_protocol_errors(data: bytes) -> None:
    decoder = FrameDecoder(max_frame_bytes=4096)
    decoder.feed(data)
    try:
        while decoder.messages():
            pass
        decoder.close()
    except ProtocolError:
        pass


@given(
    st.lists(
        st.tuples(
            st.binary(min_size=1, max_size=30),
            st.lists(st.binary(max_size=40), min_size=3, max_size=3),
            st.booleans(),
        ),
        min_size=1,
        max_size=20,
    )
)
def test_mutation_batches_round_trip(items: list[tuple[bytes, list[bytes], bool]]) -> None:
    mutations = [
        p.Mutation(i + 1, docid, (b"", b"", b"") if deleted else tuple(keys), deleted)
        for i, (docid, keys, deleted) in enumerate(items)
    ]
    [decoded] = decode_all(batch(9, mutations, nkeys=3))
    assert isinstance(decoded, p.MutationBatch)
    assert decoded.mutations() == mutations


def test_empty_docid_is_refused() -> None:
    with pytest.raises(ProtocolError) as info:
        decode_all(batch(3, [p.Mutation(1, b"", (b"", b""))]))
    assert info.value.code is ErrorCode.BAD_MUTATION
