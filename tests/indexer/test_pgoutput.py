"""pgoutput messages, decoded without a server (the e2e tests use a real one)."""

from __future__ import annotations

import struct

import pytest

from indexer.router.inputs.postgres.pgoutput import (
    UNCHANGED,
    Begin,
    Column,
    Commit,
    Delete,
    Insert,
    PgOutputError,
    Relation,
    Truncate,
    Update,
    decode_message,
    format_lsn,
    parse_lsn,
)


def tuple_data(*values: str | None) -> bytes:
    out = struct.pack(">h", len(values))
    for value in values:
        if value is None:
            out += b"n"
        elif value == "<u>":
            out += b"u"
        else:
            raw = value.encode()
            out += b"t" + struct.pack(">i", len(raw)) + raw
    return out


RELATION = (
    b"R" + struct.pack(">I", 16384) + b"public\x00people\x00d" + struct.pack(">h", 3)
    + b"\x01id\x00" + struct.pack(">Ii", 25, -1)
    + b"\x00doc\x00" + struct.pack(">Ii", 3802, -1)
    + b"\x00age\x00" + struct.pack(">Ii", 23, -1)
)  # fmt: skip


def test_messages_of_a_transaction() -> None:
    begin = decode_message(b"B" + struct.pack(">QqI", 0x1_0000_00FF, 1_000_000, 7))
    assert isinstance(begin, Begin) and begin.final_lsn == 0x1_0000_00FF and begin.xid == 7
    assert begin.commit_time.isoformat() == "2000-01-01T00:00:01+00:00"
    relation = decode_message(RELATION)
    assert relation == Relation(
        16384,
        "public",
        "people",
        "d",
        (Column(True, "id", 25), Column(False, "doc", 3802), Column(False, "age", 23)),
    )
    insert = decode_message(b"I" + struct.pack(">I", 16384) + b"N" + tuple_data("a", None, "4"))
    assert insert == Insert(16384, ("a", None, "4"))
    update = decode_message(
        b"U" + struct.pack(">I", 16384) + b"K" + tuple_data("a", None, None)
        + b"N" + tuple_data("b", "<u>", "5")
    )  # fmt: skip
    assert update == Update(16384, ("b", UNCHANGED, "5"), ("a", None, None))
    delete = decode_message(b"D" + struct.pack(">I", 16384) + b"K" + tuple_data("b", None, None))
    assert delete == Delete(16384, ("b", None, None))
    truncate = decode_message(b"T" + struct.pack(">IBII", 2, 0, 16384, 99))
    assert truncate == Truncate((16384, 99))
    commit = decode_message(b"C\x00" + struct.pack(">QQq", 10, 20, 0))
    assert commit == Commit(10, 20, commit.commit_time)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"", "an empty message"),
        (b"B\x00\x00", "ends at byte 3"),
        (b"Z", "unknown message kind 'Z'"),
        (b"I" + struct.pack(">I", 1) + b"X", "without its new row"),
        (b"I" + struct.pack(">I", 1) + b"N" + struct.pack(">h", 1) + b"t\x00\x00\x00\x09ab",
         "runs past the message"),
        (b"R" + struct.pack(">I", 1) + b"public", "a string without its end"),
    ],
)  # fmt: skip
def test_malformed_messages_say_what_is_wrong(payload: bytes, message: str) -> None:
    with pytest.raises(PgOutputError, match=message):
        decode_message(payload)


def test_lsns() -> None:
    assert parse_lsn("16/B374D848") == (0x16 << 32) | 0xB374D848
    assert format_lsn(parse_lsn("16/B374D848")) == "16/B374D848"
    with pytest.raises(PgOutputError, match="not an LSN"):
        parse_lsn("nope")
