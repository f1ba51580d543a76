"""Paths read from a line (indexer/router/streams/paths.py) against the standard library's full
parse: the same value at every path, or `Unreadable` only where the full parse shows why (a path
through a value that is not an object, a number beyond a double)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer import protocol as p
from indexer.keys import MISSING
from indexer.router.documents import Document, decode_document, encode_document, quick_document
from indexer.router.streams.paths import LinePaths, Unreadable
from indexer.router.streams.records import RecordEncoder
from tests.budget import examples

NAMES = ("a", "b", "c", "_exp", "class", "é")

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),  # beyond 64 bits too: both parse them exactly
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=6),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(NAMES), inner, max_size=4)
    ),
    max_leaves=12,
)
documents = st.dictionaries(st.sampled_from(NAMES), values, max_size=5)
paths = st.lists(
    st.lists(st.sampled_from(NAMES), min_size=1, max_size=3).map(tuple), min_size=1, max_size=5
)
# Numbers as a writer may spell them, read by both parsers from the text.
number_texts = st.from_regex(
    r"-?(0|[1-9][0-9]{0,22})(\.[0-9]{1,22})?([eE][-+]?[0-9]{1,3})?", fullmatch=True
)


def model(line: bytes, steps: tuple[str, ...]) -> Any:
    """The value at a path by the standard library's parse, or MISSING."""
    value: Any = json.loads(line)["doc"]
    for step in steps:
        value = value.get(step, MISSING) if isinstance(value, dict) else MISSING
    return value


def needs_full_parse(line: bytes, all_paths: list[tuple[str, ...]]) -> bool:
    """Whether some path runs through a value that is not an object (where no shorter path
    ends): what `LinePaths` leaves to a full parse."""
    doc = json.loads(line)["doc"]
    ends = set(all_paths)
    for steps in all_paths:
        value = doc
        for i, step in enumerate(steps):
            if steps[:i] in ends and i > 0:
                break  # a shorter path ends here: the value is read whole, then as dicts
            if not isinstance(value, dict):
                return True
            if step not in value:
                break
            value = value[step]
    return False


def same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    return type(a) is type(b) and a == b


@settings(max_examples=examples(150), deadline=None)
@given(documents, paths, st.booleans(), st.booleans())
def test_paths_read_from_the_line_are_the_full_parse_s(
    doc: dict[str, Any], wanted: list[tuple[str, ...]], ascii_only: bool, spaced: bool
) -> None:
    separators = (", ", ": ") if spaced else (",", ":")
    line = json.dumps({"id": "d", "doc": doc}, ensure_ascii=ascii_only, separators=separators)
    raw = line.encode()
    reader = LinePaths(wanted)
    try:
        got = reader.read(raw)
    except Unreadable:
        assert needs_full_parse(raw, wanted), line
        return
    expected = [model(raw, steps) for steps in wanted]
    assert all(same(g, e) for g, e in zip(got, expected, strict=True)), (line, got, expected)


@settings(max_examples=examples(100), deadline=None)
@given(number_texts, st.booleans())
def test_numbers_read_from_the_line_are_the_full_parse_s(text: str, nested: bool) -> None:
    raw = (
        b'{"id":"d","doc":{"a":{"b":%s}}}' if nested else b'{"id":"d","doc":{"a":%s}}'
    ) % text.encode()
    steps = ("a", "b") if nested else ("a",)
    expected = model(raw, steps)
    try:
        (got,) = LinePaths([steps]).read(raw)
    except Unreadable:
        assert isinstance(expected, float) and math.isinf(expected), text
        return
    assert same(got, expected), (text, got, expected)


def test_a_path_through_a_value_that_is_not_an_object_takes_the_full_parse() -> None:
    reader = LinePaths([("a", "b")])
    for doc in (b'"x"', b"null", b"[1]", b"3"):
        with pytest.raises(Unreadable):
            reader.read(b'{"id":"d","doc":{"a":%s}}' % doc)
    assert reader.read(b'{"id":"d","doc":{"b":1}}') == [MISSING]
    assert reader.read(b'{"id":"d","doc":{"a":{"c":1}}}') == [MISSING]


def test_duplicate_fields_read_as_the_full_parse_reads_them_the_last_one() -> None:
    raw = b'{"id":"d","doc":{"a":{"b":1},"a":{"c":2}},"doc":{"a":{"b":3,"b":4}}}'
    assert LinePaths([("a", "b"), ("a",)]).read(raw) == [4, {"b": 4}]


@settings(max_examples=examples(80), deadline=None)
@given(documents, st.booleans())
def test_a_document_kept_in_its_line_has_the_keys_of_its_parsed_body(
    doc: dict[str, Any], ascii_only: bool
) -> None:
    doc.pop("_exp", None)  # a line with an _exp takes the checked path, parsed
    raw = json.dumps({"id": "d", "doc": doc}, ensure_ascii=ascii_only).encode()
    lazy = quick_document(raw)
    if lazy is None:
        return  # a value the quick path leaves to the checked one (a long integer, say)
    assert lazy.unparsed_line == raw
    encoder = RecordEncoder(
        [
            p.IndexDefinition("one", ("a",)),
            p.IndexDefinition("two", ("b.c", "a")),
            p.IndexDefinition("three", ("class.a.b", "a.b")),
        ]
    )
    parsed = Document("d", json.loads(raw)["doc"])
    assert encoder.keys(lazy) == encoder.keys(parsed)
    steps = [("a",), ("b", "c"), ("class", "a", "b"), ("a", "b")]
    # The keys did not parse it, unless a path runs through a value that is not an object.
    assert (lazy.unparsed_line is None) == needs_full_parse(raw, steps)
    assert lazy == parsed and lazy.body == doc


def test_a_stored_document_decodes_without_its_body_until_asked() -> None:
    stored = decode_document(b'{"id":7,"doc":{"a":1,"_exp":12}}')
    assert stored.docid == "7" and stored.unparsed_line is not None and stored.has_expiry
    assert stored.body == {"a": 1, "_exp": 12} and stored.unparsed_line is None
    gone = decode_document(encode_document(Document("x", None)))
    assert gone.deleted and gone.body is None and gone.docid == "x"
    escaped = decode_document(b'{"id":"e","doc":{"\\u005fexp":5}}')
    assert escaped.has_expiry  # an escape that spells _exp is parsed to be sure
    plain = decode_document(b'{"id":"p","doc":{"expires":5}}')
    assert not plain.has_expiry and plain.unparsed_line is not None


def test_a_stored_version_that_is_not_strict_json_decodes_as_before() -> None:
    """A log written before the input checks may hold NaN or Infinity (json.dumps writes them)."""
    value = encode_document(Document("n", {"age": float("nan"), "b": float("inf")}))
    stored = decode_document(value)
    assert stored.docid == "n" and stored.body is not None
    assert math.isnan(stored.body["age"]) and stored.body["b"] == float("inf")
    with pytest.raises(Unreadable):
        LinePaths([("age",)]).read(value)  # the keys then come from the parsed body


@pytest.mark.parametrize(
    "text",
    [r"\ud800\u0041", r"\ud800", r"\udc00", r"\ud83d\ud83d", r"\ud83d\ude00", r"x\u0000y", r"\/"],
)
def test_escapes_read_as_the_full_parse_or_take_it(text: str) -> None:
    """Lone surrogates (which the checked input path takes, as the standard library does)
    leave the read to the full parse; other escapes read as it does."""
    raw = b'{"id":"d","doc":{"a":"%s"}}' % text.encode()
    expected = json.loads(raw)["doc"]["a"]
    try:
        (got,) = LinePaths([("a",)]).read(raw)
    except Unreadable:
        assert any(0xD800 <= ord(c) <= 0xDFFF for c in expected)
        return
    assert got == expected
