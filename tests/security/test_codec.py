"""Sans-IO parts of the protections: the handshake token in the codec, the frame size limit in
the decoder, and the reader's token check, all without sockets."""

from __future__ import annotations

import json
import struct

import pytest

from indexer import protocol as p
from indexer.protocol import ErrorCode, FrameDecoder, ProtocolError
from indexer.streams import Connection, StreamRegistry
from tests.security.conftest import TOKEN, WRONG_TOKEN

HEADER = struct.Struct(">IBB")


def handshake_frame(body: dict[str, object]) -> bytes:
    payload = json.dumps(body).encode()
    return HEADER.pack(len(payload) + 2, p.VERSION, p.MessageType.HANDSHAKE) + payload


def decode_one(frame: bytes) -> p.Message:
    decoder = FrameDecoder()
    decoder.feed(frame)
    (message,) = decoder.messages()
    return message


def test_the_token_round_trips_and_is_absent_from_reprs() -> None:
    sent = p.Handshake("r", 1024, (1, 2), {1: ((7, 0),)}, True, "", TOKEN)
    got = decode_one(p.encode(sent))
    assert got == sent and isinstance(got, p.Handshake) and got.token == TOKEN
    assert TOKEN not in repr(sent)


def test_a_handshake_without_token_is_the_frame_daemons_before_tokens_read() -> None:
    frame = p.encode(p.Handshake("r", 1024, (5,)))
    body = json.loads(frame[6:])
    assert body == {"router": "r", "num_vbuckets": 1024, "vbuckets": [5]}
    # An older router's handshake (no token member) decodes to the empty token.
    old = decode_one(handshake_frame({"router": "old", "num_vbuckets": 16, "vbuckets": [0]}))
    assert isinstance(old, p.Handshake) and old.token == ""
    # Unknown members stay ignored, so a newer router's extra members do no harm either.
    newer = {"router": "n", "num_vbuckets": 16, "vbuckets": [], "token": TOKEN, "later": 1}
    assert decode_one(handshake_frame(newer)) == p.Handshake("n", 16, (), token=TOKEN)


@pytest.mark.parametrize("token", [42, None, ["x"], "t" * (p.MAX_TOKEN_CHARS + 1)])
def test_a_malformed_token_is_a_bad_handshake(token: object) -> None:
    body = {"router": "r", "num_vbuckets": 16, "vbuckets": [], "token": token}
    with pytest.raises(ProtocolError) as info:
        decode_one(handshake_frame(body))
    assert info.value.code is ErrorCode.BAD_HANDSHAKE
    assert "token" in info.value.message


def test_the_new_error_codes_cross_the_wire() -> None:
    for code in (ErrorCode.UNAUTHORIZED, ErrorCode.TOO_MANY_CONNECTIONS):
        assert decode_one(p.encode(p.Error(code, "why"))) == p.Error(code, "why")
    assert (ErrorCode.UNAUTHORIZED, ErrorCode.TOO_MANY_CONNECTIONS) == (16, 17)


def test_an_oversized_frame_is_refused_from_its_header_and_nothing_is_buffered() -> None:
    decoder = FrameDecoder(max_frame_bytes=4096)
    decoder.feed(HEADER.pack(4097, p.VERSION, p.MessageType.MUTATIONS))
    with pytest.raises(ProtocolError) as info:
        decoder.messages()
    assert info.value.code is ErrorCode.FRAME_TOO_LARGE
    assert "4097" in info.value.message and "4096" in info.value.message
    assert decoder.buffered == 0
    decoder.feed(b"\0" * 100_000)  # the payload that follows is dropped, never collected
    assert decoder.buffered == 0
    with pytest.raises(ProtocolError):
        decoder.messages()


def test_a_frame_of_exactly_the_maximum_is_accepted() -> None:
    body = {"router": "r", "num_vbuckets": 16, "vbuckets": []}
    frame = handshake_frame(body)
    decoder = FrameDecoder(max_frame_bytes=len(frame) - 4)
    decoder.feed(frame)
    assert decoder.messages() == [p.Handshake("r", 16, ())]


def test_good_frames_before_an_oversized_one_still_come_out() -> None:
    decoder = FrameDecoder(max_frame_bytes=1024)
    begin = p.encode(p.StreamBegin(3, 9))
    decoder.feed(begin + HEADER.pack(1 << 30, p.VERSION, p.MessageType.MUTATIONS))
    assert decoder.messages() == [p.StreamBegin(3, 9)]
    with pytest.raises(ProtocolError) as info:
        decoder.messages()
    assert info.value.code is ErrorCode.FRAME_TOO_LARGE


def connection(token: str | None) -> Connection:
    return Connection(1, StreamRegistry(range(16), [0] * 16), nkeys=1, token=token)


def test_the_reader_refuses_a_missing_or_wrong_token_before_anything_else() -> None:
    for given, text in (("", "requires a token"), (WRONG_TOKEN, "token is wrong")):
        conn = connection(TOKEN)
        # A wrong vbucket count too: the token is checked first, so an unauthenticated peer
        # learns nothing about the node.
        with pytest.raises(ProtocolError) as info:
            conn.accept(p.Handshake("r", 999, (0,), token=given))
        assert info.value.code is ErrorCode.UNAUTHORIZED
        assert text in info.value.message and TOKEN not in info.value.message
        assert conn.handshake is None
        # Still no handshake: whatever follows is refused, nothing is taken.
        with pytest.raises(ProtocolError) as info:
            conn.accept(p.StreamBegin(0, 1))
        assert info.value.code is ErrorCode.BAD_HANDSHAKE


def test_the_reader_accepts_the_right_token_and_any_when_none_is_set() -> None:
    conn = connection(TOKEN)
    assert conn.accept(p.Handshake("r", 16, (0,), token=TOKEN)) is None
    assert conn.handshake is not None
    assert conn.accept(p.StreamBegin(0, 1)) == p.StreamBegin(0, 1)
    open_node = connection(None)
    open_node.accept(p.Handshake("r", 16, (0,), token=WRONG_TOKEN))
    assert open_node.handshake is not None


def test_tokens_are_compared_whole() -> None:
    assert p.token_matches(TOKEN, TOKEN)
    assert not p.token_matches(TOKEN[:-1], TOKEN)
    assert not p.token_matches(TOKEN + "x", TOKEN)
    assert not p.token_matches("", TOKEN)
