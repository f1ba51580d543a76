"""The sharded router's pipe codec and its input routing, without processes (sans-IO)."""

from __future__ import annotations

import json
from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from indexer.router.documents import DocumentError, LineSplitter, parse_line, routing_id
from indexer.router.pipe import MessageReader, PipeError
from indexer.router.shards.dispatch import plain_ids, resume_point
from indexer.router.shards.layout import ShardLayout
from indexer.router.shards.messages import (
    ACK,
    HELLO,
    LINES,
    InputPosition,
    LineBatch,
    decode_hello,
    decode_lines,
    encode_hello,
    encode_json,
    encode_lines,
)


def test_the_splitter_counts_bytes_and_lines_across_reads() -> None:
    text = b'{"id":"a"}\n\n{"id":"bb"}\n{"id":"c"}'
    for cut in range(len(text) + 1):
        splitter = LineSplitter()
        lines = splitter.feed(text[:cut])
        assert (splitter.offset, splitter.line) == (
            text[:cut].rfind(b"\n") + 1,
            text[:cut].count(b"\n"),
        )
        lines += splitter.feed(text[cut:]) + splitter.finish()
        assert lines == [b'{"id":"a"}', b"", b'{"id":"bb"}', b'{"id":"c"}']
        assert (splitter.offset, splitter.line) == (len(text), 4)
    resumed = LineSplitter(12, 2)
    assert resumed.feed(text[12:]) == [b'{"id":"bb"}']
    assert (resumed.offset, resumed.line) == (24, 3)


@given(
    st.text(max_size=30),
    st.integers(0, 1 << 40),
    st.integers(0, 1 << 40),
    st.lists(st.tuples(st.integers(0, (1 << 32) - 1), st.binary(max_size=50).map(
        lambda b: b.replace(b"\n", b"")))),
)  # fmt: skip
def test_a_batch_of_lines_survives_the_pipe_in_any_pieces(
    key: str, start: int, start_line: int, lines: list[tuple[int, bytes]]
) -> None:
    indexes = [i for i, _ in lines]
    batch = LineBatch(key, start, start + 99, start_line, start_line + 7, indexes,
                      [line for _, line in lines])  # fmt: skip
    wire = encode_lines(batch) + encode_json(ACK, {"appended": 1})
    reader = MessageReader()
    got = []
    for i in range(0, len(wire), 7):
        reader.feed(wire[i : i + 7])
        while (message := reader.next()) is not None:
            got.append(message)
    assert [kind for kind, _ in got] == [LINES, ACK]
    decoded = decode_lines(got[0][1])
    assert (decoded.key, decoded.start, decoded.end) == (key, start, start + 99)
    assert list(decoded.indexes) == indexes and list(decoded.lines) == batch.lines
    assert decoded.numbered() == [(start_line + 1 + i, line) for i, line in lines]
    assert decoded.position == InputPosition(key, start + 99, start_line + 7)


def test_a_malformed_batch_is_a_pipe_error() -> None:
    body = encode_lines(LineBatch("k", 0, 5, 0, 1, [0], [b"abc"]))[5:]
    with pytest.raises(PipeError):
        decode_lines(body[:-5])  # shorter than its count
    with pytest.raises(PipeError):
        decode_lines(body + b"\nx")  # one line more than its count
    with pytest.raises(PipeError):
        decode_lines(body[:10])


def test_hello_and_positions() -> None:
    position = InputPosition("f.jsonl|7|0", 100, 3)
    (kind, body) = _one(encode_hello("http://127.0.0.1:1", position, 42))
    assert kind == HELLO
    assert decode_hello(body) == ("http://127.0.0.1:1", position, 42)
    assert InputPosition.decode(position.encode()) == position
    assert InputPosition.decode(b"not json") is None

    def piece(key: str, start: int, end: int) -> LineBatch:
        return LineBatch(key, start, end, 0, 0, [], [])

    assert position.holds(piece("f.jsonl|7|0", 50, 100))
    assert not position.holds(piece("f.jsonl|7|0", 100, 150))
    assert not position.holds(piece("f.jsonl|7|1", 0, 50))  # another generation: all new
    assert position.overlaps(piece("f.jsonl|7|0", 50, 150))
    assert not position.overlaps(piece("f.jsonl|7|0", 100, 150))


def _one(wire: bytes) -> tuple[int, bytes]:
    reader = MessageReader()
    reader.feed(wire)
    message = reader.next()
    assert message is not None and reader.next() is None
    return message


ids = st.one_of(st.text(min_size=1, max_size=20), st.integers(-(1 << 40), 1 << 40))


@given(ids, st.booleans(), st.dictionaries(st.sampled_from(["id", "x", "doc"]), st.integers()))
def test_the_routing_id_is_the_id_the_shard_parses(
    docid: str | int, ascii_only: bool, extra: dict[str, int]
) -> None:
    item = {"id": docid, "doc": extra}
    line = json.dumps(item, ensure_ascii=ascii_only, separators=(",", ":")).encode()
    try:
        parsed = parse_line(line.decode(), "x", line).docid.encode()
    except DocumentError:
        return
    assert routing_id(line) == parsed


def test_lines_without_an_id_have_no_route() -> None:
    for line in (b"not json", b"[1]", b'{"doc":{}}', b'{"id":true}', b'{"id":""}'):
        assert routing_id(line) is None
    assert routing_id(b'{"id":"a","doc":{},"id":"b"}') == b"b"  # the last one, as parsed


def test_layout_ranges_cover_every_vbucket_once() -> None:
    for n, k in ((1024, 2), (1024, 3), (7, 7), (10, 4)):
        layout = ShardLayout("x", n, k)
        ranges = layout.ranges()
        assert ranges[0][0] == 0 and ranges[-1][1] == n - 1
        assert all(a[1] + 1 == b[0] for a, b in pairwise(ranges))
        owners = layout.owners()
        assert all(ranges[owners[vb]][0] <= vb <= ranges[owners[vb]][1] for vb in range(n))


class _Held:
    def __init__(self, position: InputPosition | None) -> None:
        self.position = position


def test_the_parent_resumes_at_the_earliest_shard_and_cuts_where_the_others_are() -> None:
    base = "f|1"
    at = {n: InputPosition(f"{base}|0", n, n // 100) for n in (300, 500, 700)}
    shards = [_Held(at[500]), _Held(at[300]), _Held(at[700])]
    assert resume_point(shards, base, 1000) == (at[300], [500, 700])  # type: ignore[arg-type]
    # One shard never saw this input: everything from the start, cut where the others are.
    shards.append(_Held(None))
    assert resume_point(shards, base, 1000) == (  # type: ignore[arg-type]
        InputPosition(f"{base}|0", 0, 0),
        [300, 500, 700],
    )
    # A file shorter than the shards hold was truncated: a new generation, from the start.
    shards.pop()
    assert resume_point(shards, base, 600) == (InputPosition(f"{base}|1", 0, 0), [])  # type: ignore[arg-type]
    # The latest generation wins; a shard still on an older one starts it from the beginning.
    shards = [_Held(InputPosition(f"{base}|2", 50, 1)), _Held(InputPosition(f"{base}|1", 90, 2))]
    assert resume_point(shards, base, 1000) == (InputPosition(f"{base}|2", 0, 0), [50])  # type: ignore[arg-type]


line_texts = st.one_of(
    st.builds(lambda d: json.dumps({"id": d, "doc": {"a": 1}}, separators=(",", ":")), ids),
    st.builds(lambda d: json.dumps({"id": d}, ensure_ascii=False, separators=(",", ":")), ids),
    st.builds(lambda d: json.dumps({"id": d, "doc": {"id": 1}}), ids),
    st.builds(lambda d: json.dumps({"id": d, "deleted": True}), ids),
    st.just('{"id":"a","doc":{"id":"b"}}'),
    st.just('{"id":"a\\"b"}'),
    st.just(' {"id":"x"}'),
    st.just(""),
)


@given(st.lists(line_texts, min_size=1, max_size=6))
def test_ids_found_without_a_parse_are_the_parsed_ones(texts: list[str]) -> None:
    lines = [text.encode() for text in texts]
    found = plain_ids(lines)
    if found is not None:
        assert found == [routing_id(line) for line in lines]
    for prefix in ('{"id":"', '{"id": "'):
        if all(t.startswith(prefix) and "\\" not in t and t.count('"id"') == 1 for t in texts):
            assert found is not None
