"""pgoutput messages and column values, decoded without a server (the e2e tests use a real one)."""

from __future__ import annotations

import struct

import pytest

from indexer.router.pgoutput import (
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
    convert_value,
    decode_message,
    format_lsn,
    parse_lsn,
    row_document,
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


@pytest.mark.parametrize(
    ("oid", "text", "value"),
    [
        (16, "t", True),
        (16, "f", False),
        (23, "-42", -42),
        (20, "9007199254740993", 9007199254740993),
        (701, "1.5", 1.5),
        (701, "NaN", None),
        (1700, "12", 12),
        (1700, "12.50", 12.5),
        (1700, "1e3", 1000.0),
        (3802, '{"a": [1, {"b": null}]}', {"a": [1, {"b": None}]}),
        (114, "[1, 2]", [1, 2]),
        (1184, "2026-01-02 03:04:05.5+00", "2026-01-02T03:04:05.5+00:00"),
        (1184, "2026-01-02 03:04:05-05:30", "2026-01-02T03:04:05-05:30"),
        (1114, "2026-01-02 03:04:05", "2026-01-02T03:04:05"),
        (1082, "2026-01-02", "2026-01-02"),
        (25, "plain text", "plain text"),
        (1009, '{a,"b c",NULL,"q\\"x"}', ["a", "b c", None, 'q"x']),
        (1007, "{1,2,NULL}", [1, 2, None]),
        (2950, "0e6f8d2a-0000-4000-8000-000000000000", "0e6f8d2a-0000-4000-8000-000000000000"),
    ],
)
def test_values_become_json(oid: int, text: str, value: object) -> None:
    got = convert_value(oid, text)
    assert got == value and type(got) is type(value)


def test_rows_and_lsns() -> None:
    relation = decode_message(RELATION)
    assert isinstance(relation, Relation)
    assert row_document(relation, ("a", '{"x": 1}', None)) == {
        "id": "a",
        "doc": {"x": 1},
        "age": None,
    }
    kept = row_document(relation, ("a", UNCHANGED, "3"), {"doc": {"x": 2}})
    assert kept == {"id": "a", "doc": {"x": 2}, "age": 3}
    with pytest.raises(PgOutputError, match="a row of 2 values"):
        row_document(relation, ("a", None))
    assert parse_lsn("16/B374D848") == (0x16 << 32) | 0xB374D848
    assert format_lsn(parse_lsn("16/B374D848")) == "16/B374D848"
    with pytest.raises(PgOutputError, match="not an LSN"):
        parse_lsn("nope")
    with pytest.raises(PgOutputError, match="more than one dimension"):
        convert_value(1007, "{{1,2},{3,4}}")
