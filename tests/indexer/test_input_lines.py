"""An input line's quick parse gives what the checked parse gives, for good and bad lines alike."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.router.documents import Document, DocumentError, parse_line, quick_document
from indexer.router.expiry import with_absolute_expiry
from indexer.router.inputs.lines import parse_lines, parse_numbered
from tests.budget import examples


def checked(number: int, raw: bytes) -> Document | str | None:
    """The line through the checked path only: a document, None (blank) or the error's text."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return f"x:{number}: not UTF-8"
    if not text.strip():
        return None
    try:
        document = parse_line(text, f"x:{number}", raw.strip())
    except DocumentError as exc:
        return str(exc)
    try:
        with_absolute_expiry(document, 0.0)
    except DocumentError as exc:
        return f"x:{number}: {exc}"
    return document


def outcome(number: int, raw: bytes) -> Document | str | None:
    try:
        return parse_numbered(number, raw, "x")
    except DocumentError as exc:
        return str(exc)


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=12,
)
ids = st.one_of(
    st.text(min_size=0, max_size=70),
    st.integers(min_value=-(1 << 66), max_value=1 << 66),
    st.booleans(),
    st.none(),
    st.just("é" * 63),  # 126 bytes
    st.just("𝄞" * 63),  # 252 bytes in 63 characters
    st.just("x" * 251),
)


@st.composite
def lines(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["doc", "doc", "deleted", "other", "text", "deep", "exp"]))
    item: object
    if kind == "doc":
        item = {"id": draw(ids), "doc": draw(st.dictionaries(st.text(max_size=4), values))}
    elif kind == "deleted":
        item = {"id": draw(ids), "deleted": draw(st.sampled_from([True, False, 1, None]))}
    elif kind == "exp":
        exp = draw(st.sampled_from([0, 10, -1, "soon", "2030-01-01", 4_000_000_000, None]))
        item = {"id": draw(ids), "doc": {"_exp": exp, "a": 1}}
    elif kind == "deep":
        depth = draw(st.integers(min_value=100, max_value=140))
        item = {"id": "d", "doc": {"a": json.loads("[" * depth + "]" * depth)}}
    elif kind == "other":
        item = draw(values)
    else:
        return draw(st.binary(max_size=40)) + draw(st.sampled_from([b"", b"\xff", b"{", b" "]))
    text = json.dumps(item, ensure_ascii=draw(st.booleans()))
    pad = draw(st.sampled_from(["", " ", "\t", "\r"]))
    return (pad + text + pad).encode()


@settings(max_examples=examples(200), deadline=None)
@given(lines(), st.integers(min_value=1, max_value=10**6))
def test_a_line_parses_the_same_by_either_path(raw: bytes, number: int) -> None:
    expected = checked(number, raw)
    got = outcome(number, raw)
    assert got == expected
    if isinstance(expected, Document):
        assert isinstance(got, Document) and got.line == expected.line == raw.strip()


def test_the_quick_path_takes_the_common_lines_and_leaves_the_rest() -> None:
    plain = b'{"id":"a","doc":{"age":30,"address":{"city":"Oslo"}}}'
    assert quick_document(plain) == Document("a", {"age": 30, "address": {"city": "Oslo"}})
    assert quick_document(b'{"id":7,"deleted":true}') == Document("7", None)
    for slower in (
        b'{"id":"a","doc":{"n":12345678901234567890}}',  # 19 digits: the standard library's
        b'{"id":"a","doc":{"_exp":10}}',  # expiry checked on the slower path
        b'{"id":"","doc":{}}',
        b'{"id":true,"doc":{}}',
        b'{"id":"' + "é".encode() * 126 + b'","doc":{}}',  # 252 bytes
        b'{"id":"a","doc":' + b"[" * 130 + b"]" * 130 + b"}",
        b'{"id":"a","doc":[]}',
        b"[1]",
        b"{nope",
        b'{"id":"a","doc":{"s":"\xff"}}',
    ):
        assert quick_document(slower) is None, slower


def test_parse_lines_reports_bad_lines_and_keeps_the_rest() -> None:
    numbered = [
        (1, b'{"id":"a","doc":{"age":1}}'),
        (2, b"   "),
        (3, b'{"id":"b","doc":{"n":1e400}}'),
        (4, b'{"id":"c","deleted":true}\r'),
    ]
    documents, errors = parse_lines(numbered, "in")
    assert [d.docid for d in documents] == ["a", "c"]
    assert documents[1].line == b'{"id":"c","deleted":true}'
    assert len(errors) == 1 and errors[0].startswith("in:3: ")
