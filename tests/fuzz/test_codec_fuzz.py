"""Property-based fuzzing of the wire codec (indexer/protocol.py).

Every message type round-trips through `encode` and a `FrameDecoder` fed in arbitrary pieces, and
arbitrary or damaged bytes only ever give messages or a `ProtocolError`, whatever the chunking.
"""

from __future__ import annotations

import itertools
import json
import math
import struct
import time
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from indexer import protocol as p
from indexer.protocol import ErrorCode, FrameDecoder, MessageType, ProtocolError
from tests.budget import examples

FUZZ = settings(
    max_examples=examples(120), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
SOME = settings(
    max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

HEADER = struct.Struct(">IBB")
SMALL_MAX = 512  # a frame limit the fuzzed lengths actually reach

# Frames whose payload has exactly one encoding: decoding then encoding gives the bytes back.
BINARY = (
    p.StreamBegin,
    p.StreamEnd,
    p.SnapshotMarker,
    p.MutationBatch,
    p.Ack,
    p.Barrier,
    p.BufferAck,
)


def frame(mtype: int, payload: bytes, version: int = p.VERSION) -> bytes:
    """A frame with a correct length field around any payload."""
    return HEADER.pack(len(payload) + 2, version, mtype) + payload


def normal(message: p.Message) -> Any:
    """A comparable form: a batch by its content, since its payload layout differs once decoded."""
    if isinstance(message, p.MutationBatch):
        return ("batch", message.vbucket, message.nkeys, message.seqnos, message.mutations())
    return message


@dataclass(frozen=True)
class Outcome:
    """What a decoder made of a byte stream: messages, then the first error and the close error."""

    messages: list[Any]
    error: ErrorCode | None
    at_close: ErrorCode | None


def run(chunks: list[bytes], max_frame: int = p.DEFAULT_MAX_FRAME_BYTES) -> Outcome:
    """Feed chunks as separate receives, draining after each; any non-ProtocolError escapes."""
    decoder = FrameDecoder(max_frame)
    out: list[Any] = []
    error: ErrorCode | None = None
    for chunk in chunks:
        decoder.feed(chunk)
        try:
            while batch := decoder.messages():
                out.extend(normal(m) for m in batch)
        except ProtocolError as exc:
            error = exc.code
            break
        # Only one incomplete frame is ever held back, and never more than the limit allows
        # (a handshake's limit is at least MAX_HANDSHAKE_BYTES).
        assert decoder.buffered <= max(max_frame, p.MAX_HANDSHAKE_BYTES) + 3
    at_close: ErrorCode | None = None
    if error is None:
        try:
            decoder.close()
        except ProtocolError as exc:
            at_close = exc.code
    return Outcome(out, error, at_close)


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    """data cut at the given offsets (taken modulo its length, in any order)."""
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


# ---------------------------------------------------------------------------------------------
# Strategies

u16 = st.integers(0, 2**16 - 1)
u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
json_ints = st.integers(-(2**70), 2**70)
# JSON text: any code point, lone surrogates included (JSON escapes them).
json_text = st.text(
    st.one_of(st.characters(exclude_categories=()), st.sampled_from('\x00\ud800\udfff"\\é€😀')),
    max_size=12,
)
# Text of ERROR frames: UTF-8 encodable (the daemon's own messages).
utf8_text = st.text(max_size=40)
positions = st.builds(p.VbucketPosition, u16, u64, u64)


@st.composite
def failover_logs(draw: st.DrawFn, num_vbuckets: int) -> dict[int, tuple[tuple[int, int], ...]]:
    """Valid failover logs: 1 to 25 (vbuuid, seqno) entries per vbucket, newest (highest) first."""
    vbs = draw(st.lists(st.integers(0, num_vbuckets - 1), max_size=4, unique=True))
    logs = {}
    for vb in vbs:
        seqnos = sorted(draw(st.lists(u64, min_size=1, max_size=p.MAX_FAILOVER_ENTRIES)))
        uuids = draw(st.lists(u64, min_size=len(seqnos), max_size=len(seqnos)))
        logs[vb] = tuple(zip(uuids, reversed(seqnos), strict=True))
    return logs


handshakes = st.integers(1, 4096).flatmap(
    lambda n: st.builds(
        p.Handshake,
        json_text,
        st.just(n),
        st.lists(json_ints, max_size=6).map(tuple),
        failover_logs(n),
        st.booleans(),
        json_text,
    )
)
index_definitions = st.builds(
    p.IndexDefinition,
    json_text,
    st.lists(json_text, max_size=4).map(tuple),
    st.none() | json_text,
)
handshake_replies = st.builds(
    p.HandshakeReply,
    st.lists(index_definitions, max_size=4).map(tuple),
    json_ints,
    st.lists(json_ints, max_size=6).map(tuple),
    st.lists(st.builds(p.VbucketPosition, json_ints, json_ints, json_ints), max_size=4).map(tuple),
    json_ints,
    st.dictionaries(json_ints, json_ints, max_size=4),
    json_ints,
    st.lists(json_text, max_size=3).map(tuple),
)


@st.composite
def mutations(draw: st.DrawFn, nkeys: int) -> list[p.Mutation]:
    """Records of one batch: increasing seqnos, non-empty docids, deletes without keys."""
    seqnos = sorted(draw(st.lists(u64, max_size=8, unique=True)))
    out = []
    for seqno in seqnos:
        deleted = draw(st.booleans())
        docid = draw(st.binary(min_size=1, max_size=40))
        if deleted or nkeys == 0:
            keys: tuple[bytes, ...] = (b"",) * nkeys
        else:
            keys = tuple(draw(st.lists(st.binary(max_size=30), min_size=nkeys, max_size=nkeys)))
        out.append(p.Mutation(seqno, docid, keys, deleted))
    return out


@st.composite
def mutation_batches(draw: st.DrawFn) -> p.MutationBatch:
    """A batch as the reader queues it: records without their length field, back to back."""
    nkeys = draw(st.one_of(st.integers(0, 5), st.just(p.MAX_KEYS)))
    records = [p.encode_record(m)[4:] for m in draw(mutations(nkeys))]
    starts = [sum(len(r) for r in records[:i]) for i in range(len(records))]
    return p.MutationBatch(
        draw(u16),
        nkeys,
        b"".join(records),
        [p.parse_record(r, nkeys).seqno for r in records],
        starts,
        [len(r) for r in records],
    )


messages: st.SearchStrategy[p.Message] = st.one_of(
    handshakes,
    handshake_replies,
    st.builds(p.StreamBegin, u16, u64),
    st.builds(p.StreamEnd, u16, u64),
    st.builds(p.SnapshotMarker, u16, u64, u64),
    mutation_batches(),
    st.builds(p.Ack, st.lists(positions, max_size=5).map(tuple)),
    st.builds(p.Barrier, u64),
    st.builds(p.BarrierReply, u64, st.booleans(), st.lists(positions, max_size=5).map(tuple)),
    st.builds(p.BufferAck, u64),
    st.builds(p.Error, st.sampled_from(ErrorCode), utf8_text),
)
cut_points = st.lists(st.integers(0, 2**16), max_size=12)


# ---------------------------------------------------------------------------------------------
# Round trips


@FUZZ
@given(messages)
def test_every_message_round_trips(message: p.Message) -> None:
    """encode then decode gives the message back, and encoding it again the same bytes."""
    data = p.encode(message)
    outcome = run([data])
    assert outcome == Outcome([normal(message)], None, None)
    [decoded] = run_messages(data)
    assert p.encode(decoded) == data


def run_messages(data: bytes) -> list[p.Message]:
    """The messages of a stream that must decode cleanly."""
    decoder = FrameDecoder()
    decoder.feed(data)
    out = decoder.messages()
    decoder.close()
    return out


@FUZZ
@given(st.lists(messages, min_size=1, max_size=8), cut_points)
def test_a_stream_split_anywhere_gives_every_message_as_soon_as_it_is_whole(
    sent: list[p.Message], cuts: list[int]
) -> None:
    """Receives end anywhere: each frame comes out on the receive that completes it, in order."""
    frames = [p.encode(m) for m in sent]
    stream = b"".join(frames)
    ends = [sum(len(f) for f in frames[: i + 1]) for i in range(len(frames))]
    decoder = FrameDecoder()
    got: list[Any] = []
    fed = 0
    for chunk in split(stream, cuts):
        decoder.feed(chunk)
        fed += len(chunk)
        got.extend(normal(m) for m in decoder.messages())
        # Every frame wholly received is delivered at once; nothing of a partial one is.
        whole = sum(1 for end in ends if end <= fed)
        assert len(got) == whole
        assert decoder.buffered == fed - (ends[whole - 1] if whole else 0)
    decoder.close()
    assert got == [normal(m) for m in sent]


@FUZZ
@given(st.lists(messages, min_size=1, max_size=6), st.integers(0, 2**16), cut_points)
def test_a_truncated_stream_gives_the_whole_frames_then_fails_at_close(
    sent: list[p.Message], cut: int, cuts: list[int]
) -> None:
    """A connection closing mid-frame: the whole frames before, then PROTOCOL at close."""
    frames = [p.encode(m) for m in sent]
    stream = b"".join(frames)
    cut %= len(stream)
    ends = [sum(len(f) for f in frames[: i + 1]) for i in range(len(frames))]
    whole = sum(1 for end in ends if end <= cut)
    outcome = run(split(stream[:cut], cuts))
    on_boundary = cut == 0 or cut in ends
    assert outcome == Outcome(
        [normal(m) for m in sent[:whole]], None, None if on_boundary else ErrorCode.PROTOCOL
    )


# ---------------------------------------------------------------------------------------------
# Random and damaged bytes


def canonical(message: p.Message, data: bytes) -> None:
    """A decoded frame says exactly what its bytes say: nothing ignored, nothing invented."""
    if isinstance(message, p.MutationBatch):
        # Built again from the parsed mutations, not from the record bytes it keeps.
        parsed = message.mutations()
        records = [p.encode_record(m) for m in parsed]
        assert p.encode_mutations(message.vbucket, message.nkeys, records) == data
        assert [m.seqno for m in parsed] == message.seqnos
        for m in parsed:
            assert m.docid and len(m.keys) == message.nkeys
            assert not (m.deleted and any(m.keys))
    if isinstance(message, BINARY):
        assert p.encode(message) == data
    elif isinstance(message, p.BarrierReply):  # flags other than bit 0 are ignored
        assert p.encode(message) == data[:14] + bytes([data[14] & 1]) + data[15:]
    elif isinstance(message, p.Handshake | p.HandshakeReply):
        assert run_messages(p.encode(message)) == [message]


def check_stream(data: bytes, cuts: list[int], max_frame: int) -> Outcome:
    """Whole or in chunks, the same outcome; each message decoded is canonical for its frame."""
    whole = run([data], max_frame)
    assert run(split(data, cuts), max_frame) == whole
    decoder = FrameDecoder(max_frame)
    decoder.feed(data)
    pos = 0
    try:
        while batch := decoder.messages():
            for message in batch:
                (length,) = struct.unpack_from(">I", data, pos)
                canonical(message, data[pos : pos + 4 + length])
                pos += 4 + length
    except ProtocolError:
        pass
    return whole


frame_like = st.builds(
    frame,
    st.one_of(st.sampled_from(MessageType), st.integers(0, 255)),
    st.binary(max_size=80),
    st.one_of(st.just(p.VERSION), st.integers(0, 255)),
)


@FUZZ
@given(
    st.one_of(st.binary(max_size=400), st.lists(frame_like, max_size=5).map(b"".join)),
    cut_points,
    st.sampled_from([SMALL_MAX, p.DEFAULT_MAX_FRAME_BYTES]),
)
def test_random_bytes_give_messages_or_a_protocol_error(
    data: bytes, cuts: list[int], max_frame: int
) -> None:
    """Arbitrary bytes and frame-shaped junk: messages or a ProtocolError, whatever the chunking."""
    check_stream(data, cuts, max_frame)


def damage(draw: st.DrawFn, data: bytearray) -> None:
    """One random change: a bit flip, a byte, a wrong u32 (length or count), bytes cut or added."""
    kind = draw(st.sampled_from(["flip", "byte", "u32", "truncate", "insert", "delete"]))
    if not data:
        kind = "insert"
    at = draw(st.integers(0, len(data) if kind == "insert" else len(data) - 1))
    if kind == "flip":
        data[at] ^= 1 << draw(st.integers(0, 7))
    elif kind == "byte":
        data[at] = draw(st.integers(0, 255))
    elif kind == "u32":
        current = int.from_bytes(data[at : at + 4].ljust(4, b"\0"), "big")
        how = draw(st.sampled_from(["extreme", "any", "near"]))
        if how == "extreme":
            value = draw(st.sampled_from([0, 1, 2, 3, 2**31, 2**32 - 1]))
        elif how == "any":
            value = draw(u32)
        else:
            value = (current + draw(st.integers(-3, 3))) % 2**32
        data[at : at + 4] = value.to_bytes(4, "big")
    elif kind == "truncate":
        del data[at:]
    elif kind == "insert":
        data[at:at] = draw(st.binary(min_size=1, max_size=8))
    else:
        del data[at : at + draw(st.integers(1, 8))]


@st.composite
def damaged_streams(draw: st.DrawFn) -> bytes:
    """Valid frames, damaged inside a payload (frame length kept right) or anywhere in the stream
    (frame lengths and headers too)."""
    frames = draw(
        st.lists(st.one_of(messages.map(p.encode), damaged_batches()), min_size=1, max_size=5)
    )
    for _ in range(draw(st.integers(0, 3))):
        i = draw(st.integers(0, len(frames) - 1))
        payload = bytearray(frames[i][6:])
        damage(draw, payload)
        frames[i] = frame(frames[i][5], bytes(payload))
    data = bytearray(b"".join(frames))
    for _ in range(draw(st.integers(0 if len(frames) > 1 else 1, 3))):
        damage(draw, data)
    return bytes(data)


@st.composite
def odd_records(draw: st.DrawFn, nkeys: int) -> bytearray:
    """A record whose lengths all agree but which breaks one content rule: an unknown op, an
    empty docid, or a delete carrying a key."""
    rule = draw(st.sampled_from(["op", "docid", "delete"]))
    docid = b"" if rule == "docid" else draw(st.binary(min_size=1, max_size=6))
    keys = draw(st.lists(st.binary(max_size=6), min_size=nkeys, max_size=nkeys))
    op = p.OP_UPSERT
    if rule == "op":
        op = draw(st.sampled_from([0, 3, 4, 255]))
    elif rule == "delete":
        op = p.OP_DELETE
        keys = [*keys[:-1], b"k"] if keys else []
    layout = p.record_layout(nkeys)
    body = docid + b"".join(keys)
    head = layout.pack(layout.size - 4 + len(body), draw(u64), op, len(docid), *map(len, keys))
    return bytearray(head + body)


@st.composite
def damaged_batches(draw: st.DrawFn) -> bytes:
    """A MUTATIONS frame with an odd record among good ones, or with fields of its header or
    records made wrong: count, nkeys, record length, op, docid and key lengths, extra bytes."""
    nkeys = draw(st.integers(0, 3))
    records = [bytearray(p.encode_record(m)) for m in draw(mutations(nkeys))]
    odd = draw(st.booleans())
    if odd:
        records.insert(draw(st.integers(0, len(records))), draw(odd_records(nkeys)))
    count, keys_field = len(records), nkeys
    tail = b""
    for _ in range(0 if odd else draw(st.integers(1, 3))):
        what = draw(
            st.sampled_from(["count", "nkeys", "length", "op", "docid", "key", "tail", "stretch"])
        )
        delta = draw(st.sampled_from([-2, -1, 1, 2, 7]))
        if what == "count":
            count = (count + delta) % 2**32
        elif what == "nkeys":
            keys_field = (keys_field + delta) % 256
        elif what == "tail" or not records:
            tail += draw(st.binary(min_size=1, max_size=24))
        else:
            record = draw(st.sampled_from(records))
            if what == "op":
                record[12] = draw(st.sampled_from([0, 1, 2, 3, 255]))
                continue
            if what == "stretch":  # bytes past the docid and keys, counted in the length
                extra = draw(st.binary(min_size=1, max_size=4))
                record += extra
                length = int.from_bytes(record[:4], "big") + len(extra)
                record[:4] = length.to_bytes(4, "big")
                continue
            offset, size = {"length": (0, 4), "docid": (13, 2)}.get(what, (15, 4))
            if what == "key":
                if not nkeys:
                    continue
                offset += 4 * draw(st.integers(0, nkeys - 1))
            value = int.from_bytes(record[offset : offset + size], "big") + delta
            record[offset : offset + size] = (value % 256**size).to_bytes(size, "big")
    header = struct.pack(">HIB", draw(u16), count, keys_field)
    return frame(MessageType.MUTATIONS, header + b"".join(records) + tail)


@st.composite
def damaged_payloads(draw: st.DrawFn) -> tuple[int, bytes]:
    """A message type and a damaged payload of that type."""
    data = p.encode(draw(messages))
    payload = bytearray(data[6:])
    for _ in range(draw(st.integers(1, 3))):
        damage(draw, payload)
    return draw(st.one_of(st.just(data[5]), st.integers(0, 255))), bytes(payload)


@FUZZ
@given(damaged_streams(), cut_points, st.sampled_from([SMALL_MAX, p.DEFAULT_MAX_FRAME_BYTES]))
def test_damaged_frames_give_messages_or_a_protocol_error(
    data: bytes, cuts: list[int], max_frame: int
) -> None:
    """Valid streams with bit flips, wrong lengths, cut or added bytes: the same contract."""
    check_stream(data, cuts, max_frame)


@FUZZ
@given(damaged_batches(), cut_points)
def test_damaged_mutation_batches_are_refused_or_say_exactly_what_their_bytes_say(
    data: bytes, cuts: list[int]
) -> None:
    """MUTATIONS with wrong counts, lengths, ops or docids: refused, or decoded canonically."""
    check_stream(data, cuts, p.DEFAULT_MAX_FRAME_BYTES)


@FUZZ
@given(st.one_of(st.tuples(st.integers(0, 255), st.binary(max_size=200)), damaged_payloads()))
def test_decode_payload_of_any_type_raises_only_protocol_errors(case: tuple[int, bytes]) -> None:
    """decode_payload on its own, any type byte with any or damaged payload."""
    mtype, payload = case
    try:
        message = p.decode_payload(mtype, payload)
    except ProtocolError:
        return
    canonical(message, frame(mtype, payload))


# ---------------------------------------------------------------------------------------------
# The frame size limit: absurd lengths are refused from the header, before any payload


def test_the_default_decoder_has_a_frame_limit() -> None:
    """A decoder built without arguments refuses a 4 GiB length from the header."""
    decoder = FrameDecoder()
    assert decoder.max_frame_bytes == p.DEFAULT_MAX_FRAME_BYTES == 1 << 20
    decoder.feed(HEADER.pack(2**32 - 1, p.VERSION, MessageType.MUTATIONS))
    with pytest.raises(ProtocolError) as info:
        decoder.messages()
    assert info.value.code is ErrorCode.FRAME_TOO_LARGE
    assert decoder.buffered == 0


@FUZZ
@given(
    st.integers(2, 1 << 20).flatmap(lambda m: st.tuples(st.just(m), st.integers(m + 1, 2**32 - 1))),
    st.integers(0, 255),
    st.integers(0, 255),
)
def test_a_length_over_the_limit_is_refused_from_the_six_byte_header(
    limit_and_length: tuple[int, int], version: int, mtype: int
) -> None:
    """Any length over the limit is refused once the header is whole, before any payload (a
    handshake's limit is at least MAX_HANDSHAKE_BYTES)."""
    limit, length = limit_and_length
    handshake = mtype in (MessageType.HANDSHAKE, MessageType.HANDSHAKE_REPLY)
    assume(length > (max(limit, p.MAX_HANDSHAKE_BYTES) if handshake else limit))
    decoder = FrameDecoder(limit)
    decoder.feed(HEADER.pack(length, version, mtype)[:5])
    assert decoder.messages() == []  # five bytes: not yet a header
    decoder.feed(bytes([mtype]))
    with pytest.raises(ProtocolError) as info:
        decoder.messages()
    assert info.value.code is ErrorCode.FRAME_TOO_LARGE  # checked before length < 2 and version


def test_a_handshake_over_a_small_frame_limit_is_taken() -> None:
    """A node with small frames still takes a router's handshake of every vbucket."""
    handshake = p.Handshake("r", 1024, tuple(range(1024)), source="ab" * 16)
    data = p.encode(handshake)
    assert len(data) > 4096
    decoder = FrameDecoder(4096)
    decoder.feed(data)
    assert decoder.messages() == [handshake]


@SOME
@given(st.integers(4, 4096), st.sampled_from(ErrorCode))
def test_a_frame_of_exactly_the_limit_is_taken(limit: int, code: ErrorCode) -> None:
    """length == max_frame_bytes is allowed (docs §1), held back until its last byte."""
    payload = struct.pack(">H", code) + b"x" * (limit - 4)
    data = frame(MessageType.ERROR, payload)
    assert len(data) == limit + 4
    decoder = FrameDecoder(limit)
    decoder.feed(data[:-1])
    assert decoder.messages() == []
    assert decoder.buffered == limit + 3
    decoder.feed(data[-1:])
    assert decoder.messages() == [p.Error(code, "x" * (limit - 4))]


def test_absurd_counts_fail_fast() -> None:
    """Counts claiming billions of records or positions cost no more than the bytes present."""
    cases = [
        frame(MessageType.MUTATIONS, struct.pack(">HIB", 1, 2**32 - 1, 0)),
        frame(MessageType.MUTATIONS, struct.pack(">HIB", 1, 2**32 - 1, 255) + b"\0" * 2000),
        frame(MessageType.ACK, struct.pack(">I", 2**32 - 1) + b"\0" * 18),
        frame(MessageType.BARRIER_REPLY, struct.pack(">QBI", 1, 1, 2**32 - 1)),
        frame(MessageType.MUTATIONS, struct.pack(">HIB", 1, 1, 0) + struct.pack(">I", 2**32 - 1)),
    ]
    started = time.monotonic()
    for data in cases:
        assert run([data]).error is not None
    assert time.monotonic() - started < 2.0


def test_a_maximal_frame_of_the_smallest_records_decodes_in_linear_time() -> None:
    """The most records a frame can hold decode in bounded time."""
    record = p.encode_record(p.Mutation(1, b"d", ()))
    count = (p.DEFAULT_MAX_FRAME_BYTES - 2 - 7) // len(record)
    records = [p.encode_record(p.Mutation(i + 1, b"d", ())) for i in range(count)]
    data = p.encode_mutations(7, 0, records)
    assert len(data) - 4 <= p.DEFAULT_MAX_FRAME_BYTES
    started = time.monotonic()
    [batch] = run_messages(data)
    assert time.monotonic() - started < 5.0
    assert isinstance(batch, p.MutationBatch) and len(batch.seqnos) == count


# ---------------------------------------------------------------------------------------------
# The JSON frames: any JSON at all must give a message or a ProtocolError

SUPERSCRIPT_KEY = b'{"num_vbuckets":4,"vbuckets":[],"failover_logs":{"\xc2\xb2":[[1,0]]}}'
INFINITE_COUNT = b'{"indexes":[],"num_vbuckets":1e999,"owned":[],"restart":[]}'
DEEP_NESTING = b'{"num_vbuckets":4,"vbuckets":' + b"[" * 100_000 + b"]" * 100_000 + b"}"

# Text str.isdigit() takes for digits although int() does not (superscripts) or reads it
# differently (Arabic-Indic digits).
DIGIT_LIKE = "0123456789\u00b2\u00b3\u00b9\u0660\u0661\u0663\u0669"
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    json_ints,
    st.integers(),
    st.floats(),  # NaN and the infinities are written as NaN, Infinity (Python's json)
    json_text,
    st.text(DIGIT_LIKE + "-+ x", max_size=4),  # digit-like text, for numeric keys
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.one_of(json_text, st.text(DIGIT_LIKE, max_size=3)), children),
    ),
    max_leaves=16,
)


def members(*names: str) -> st.SearchStrategy[dict[str, Any]]:
    """JSON objects using the given member names (each present or not) and some others."""
    return st.builds(
        lambda known, other: {**other, **known},
        st.fixed_dictionaries({}, optional={n: json_values for n in names}),
        st.dictionaries(json_text, json_values, max_size=2),
    )


handshake_bodies = st.one_of(
    members("router", "num_vbuckets", "vbuckets", "flow_control", "failover_logs", "build"),
    st.builds(
        lambda n, keys, entries: {
            "num_vbuckets": n,
            "vbuckets": [],
            "failover_logs": {k: entries for k in keys},
        },
        st.integers(1, 64),
        st.lists(st.text(DIGIT_LIKE, min_size=1, max_size=3), max_size=3),
        st.lists(st.lists(st.one_of(u64, json_values), min_size=2, max_size=2), max_size=3),
    ),
)
reply_bodies = st.one_of(
    members(
        "max_frame_bytes",
        "indexes",
        "num_vbuckets",
        "owned",
        "restart",
        "rollback",
        "flow_control_bytes",
        "builds",
    ),
    st.builds(
        lambda number, other: {
            "indexes": [{"name": "i", "keys": ["a"]}],
            "num_vbuckets": number,
            "owned": [],
            "restart": [[0, other, 0]],
            "rollback": {"0": other},
        },
        st.one_of(st.floats(), json_ints),
        st.one_of(st.floats(), json_ints),
    ),
)


def decode_json_frame(mtype: MessageType, body: bytes) -> p.Message | None:
    """The message of one JSON frame, or None for a ProtocolError; anything else escapes."""
    try:
        [message] = run_messages(frame(mtype, body))
    except ProtocolError:
        return None
    return message


def dumps(body: dict[str, Any]) -> bytes:
    """JSON text as UTF-8, lone surrogates kept (so they make invalid UTF-8)."""
    return json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")


@FUZZ
@example(SUPERSCRIPT_KEY)
@given(handshake_bodies.map(dumps))
def test_any_handshake_json_gives_a_valid_handshake_or_a_protocol_error(body: bytes) -> None:
    """The daemon decodes this from any peer: a well-typed Handshake, or a ProtocolError."""
    message = decode_json_frame(MessageType.HANDSHAKE, body)
    if message is None:
        return
    assert isinstance(message, p.Handshake)
    assert isinstance(message.router, str) and isinstance(message.build, str)
    assert type(message.num_vbuckets) is int and type(message.flow_control) is bool
    assert all(type(vb) is int for vb in message.vbuckets)
    for vb, log in message.failover_logs.items():
        assert 0 <= vb < message.num_vbuckets and 1 <= len(log) <= p.MAX_FAILOVER_ENTRIES
        assert all(type(v) is int and 0 <= v < 2**64 for entry in log for v in entry)
        assert [s for _, s in log] == sorted((s for _, s in log), reverse=True)


@FUZZ
@example(INFINITE_COUNT)
@given(reply_bodies.map(dumps))
def test_any_handshake_reply_json_gives_a_reply_or_a_protocol_error(body: bytes) -> None:
    """Routers decode this: a reply with integer numbers, or a ProtocolError."""
    message = decode_json_frame(MessageType.HANDSHAKE_REPLY, body)
    if message is None:
        return
    assert isinstance(message, p.HandshakeReply)
    numbers = [message.num_vbuckets, message.max_frame_bytes, message.flow_control_bytes]
    assert all(type(n) is int for n in numbers)
    assert all(not isinstance(n, float) or math.isfinite(n) for n in numbers)


@pytest.mark.parametrize(
    ("mtype", "body"),
    [
        pytest.param(
            MessageType.HANDSHAKE,
            SUPERSCRIPT_KEY,
            id="failover-key-superscript-digit",
        ),
        pytest.param(
            MessageType.HANDSHAKE_REPLY,
            INFINITE_COUNT,
            id="reply-number-1e999",
        ),
        pytest.param(
            MessageType.HANDSHAKE,
            DEEP_NESTING,
            id="handshake-nested-100000-deep",
        ),
    ],
)
def test_json_frames_fuzzing_found_are_protocol_errors(mtype: MessageType, body: bytes) -> None:
    """Frames within the size limit on which the decoder once raised something else than
    ProtocolError (and lost the good frame before them): a superscript digit as a vbucket,
    an infinite number, JSON nested 100,000 deep."""
    assert len(body) + 2 <= p.DEFAULT_MAX_FRAME_BYTES
    decoder = FrameDecoder()
    decoder.feed(p.encode(p.StreamBegin(1, 1)) + frame(mtype, body))
    assert decoder.messages() == [p.StreamBegin(1, 1)]
    with pytest.raises(ProtocolError) as info:
        decoder.messages()
    assert info.value.code in (ErrorCode.BAD_HANDSHAKE, ErrorCode.PROTOCOL)
