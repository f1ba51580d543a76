"""Index key expressions: parsing, canonical text, errors with positions, N1QL evaluation."""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from indexer.config import DefinitionError, index_definition
from indexer.expressions import (
    ExpressionError,
    KeyExtractor,
    evaluate,
    normalize_keys,
    parse_key,
)
from indexer.keys import MISSING, decode_key, encode_key, split_entries


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("age", "age"),
        ("address.zip", "address.zip"),
        ("desc", "desc"),  # a plain path keeps its text, even a keyword
        ("lower( name )", "LOWER(name)"),
        ("upper(name) desc", "UPPER(name) DESC"),
        ("age ASC", "age"),
        ("`end` DESC", "`end` DESC"),
        ("length(name)", "LENGTH(name)"),
        ("a + b * 2", "a + (b * 2)"),
        ("(a + b) * 2", "(a + b) * 2"),
        ("a - -1", "a - -1"),
        ("-(a + 1)", "-(a + 1)"),
        ("meta().ID", "META().id"),
        ("distinct array v for v in tags end", "DISTINCT ARRAY v FOR v IN tags END"),
        (
            "ALL ARRAY lower(c.name) FOR c IN children END DESC",
            "ALL ARRAY LOWER(c.name) FOR c IN children END DESC",
        ),
        ("price * 1.5 % 7", "(price * 1.5) % 7"),
        ("LOWER('it''s')".replace("''", "\\'"), 'LOWER("it\'s")'),
    ],
)
def test_canonical_text(text: str, canonical: str) -> None:
    assert str(parse_key(text)) == canonical
    assert str(parse_key(canonical)) == canonical


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("LOWER(", "found the end at position 7"),
        ("a +", "found the end at position 4"),
        ("a b", "found 'b' at position 3"),
        ("LOWER(a))", "found ')' at position 9"),
        ("TRIM(a)", "found '(' at position 5"),
        ("META().key", "expected META().id, found 'key' at position 8"),
        ("a # b", "unexpected character '#' at position 3"),
        ("DISTINCT ARRAY v FOR v IN v END", "cannot use the variable 'v'"),
        ("DISTINCT ARRAY v FOR v IN tags", "expected END, found the end"),
        ("DISTINCT v FOR v IN tags END", "expected ARRAY after DISTINCT or ALL"),
        ("'open", "unterminated string at position 1"),
        ("", "empty key expression"),
    ],
)
def test_errors_point_at_the_position(text: str, message: str) -> None:
    with pytest.raises(ExpressionError, match=re.escape(message)):
        parse_key(text)


def test_index_rules() -> None:
    with pytest.raises(ExpressionError, match="keys 1 and 2 are both array keys"):
        normalize_keys(["DISTINCT ARRAY v FOR v IN a END", "ALL ARRAY w FOR w IN b END"])
    with pytest.raises(ExpressionError, match="key 2 is the constant 3"):
        normalize_keys(["a", "3"])
    with pytest.raises(ExpressionError, match=r"key 2 \('LOWER\('\)"):
        normalize_keys(["a", "LOWER("])


def test_definitions() -> None:
    primary = index_definition("#primary", None, None, True)
    assert primary.keys == ("META().id",) and primary.primary
    assert index_definition("by_id", None, None, True).primary
    with pytest.raises(DefinitionError, match="keys: a primary index has none"):
        index_definition("p", ["a"], None, True)
    with pytest.raises(DefinitionError, match="#primary names a primary index"):
        index_definition("#primary", ["a"], None, None)
    with pytest.raises(DefinitionError, match="name: a letter"):
        index_definition("#other", None, None, True)
    d = index_definition("t", ["distinct array t for t in tags end", "age desc"], None, None)
    assert d.keys == ("DISTINCT ARRAY t FOR t IN tags END", "age DESC")
    assert (d.array_key, d.desc, d.primary) == (0, (False, True), False)
    with pytest.raises(DefinitionError, match=r"keys: key 1 \('LOWER\(x'\): expected"):
        index_definition("t", ["LOWER(x"], None, None)


DOC = {"name": "Ann", "n": 7, "f": 2.5, "b": True, "tags": ["x", "X", "y", 3], "o": {"k": 1}}


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("LOWER(name)", "ann"),
        ("UPPER(name)", "ANN"),
        ("LENGTH(name)", 3),
        ("LOWER(n)", None),  # not a string: NULL
        ("LOWER(nothing)", MISSING),
        ("LENGTH(o)", None),
        ("n + 1", 8),
        ("n - f", 4.5),
        ("n * f", 17.5),
        ("n / 2", 3.5),
        ("n / 7", 1),
        ("n % 4", 3),
        ("-n % 4", -3),  # the dividend's sign, as N1QL's MOD
        ("f % 2", 0.5),
        ("n / 0", None),  # N1QL: division by zero is NULL
        ("n % 0", None),
        ("n + b", None),  # a boolean is not a number
        ("n + name", None),
        ("n + nothing", MISSING),
        ("-name", None),
        ("-o.k", -1),
        ("META().id", "doc1"),
    ],
)
def test_evaluation_follows_n1ql(text: str, value: Any) -> None:
    key = parse_key(text)
    assert not isinstance(key.value, type(None))
    got = evaluate(key.value, DOC, "doc1")  # type: ignore[arg-type]
    assert got is value if value is MISSING else (got == value and type(got) is type(value))


def _entries(extract: KeyExtractor, doc: Any, nkeys: int) -> list[list[Any]]:
    joined = extract(doc, "d")
    if not joined:
        return []
    return [decode_key(k, nkeys)[0] for k in split_entries(joined)]


def test_array_keys() -> None:
    distinct = KeyExtractor(["DISTINCT ARRAY LOWER(t) FOR t IN tags END", "name"])
    assert _entries(distinct, DOC, 2) == [["x", "Ann"], ["y", "Ann"], [None, "Ann"]]
    every = KeyExtractor(["name", "ALL ARRAY LOWER(t) FOR t IN tags END"])
    assert _entries(every, DOC, 2) == [["Ann", v] for v in ("x", "x", "y", None)]
    fields = KeyExtractor(["DISTINCT ARRAY c.name FOR c IN kids END"])
    kids = {"kids": [{"name": "a"}, {"age": 1}, "z", {"name": "a"}, {"name": "b"}]}
    assert _entries(fields, kids, 1) == [["a"], ["b"]]  # an element without a name: none
    # No array, not an array, or an empty one: in no entry.
    for doc in ({}, {"kids": "a"}, {"kids": []}, {"kids": [{"x": 1}]}):
        assert fields(doc, "d") == b""


def test_scalar_keys_match_encode_key() -> None:
    extract = KeyExtractor(["LOWER(name)", "n * 2", "META().id"])
    assert extract(DOC, "d9") == encode_key(["ann", 14, "d9"])
    assert extract({"n": 1}, "d") == b""  # the leading key is MISSING: not indexed
    assert extract({"name": 5}, "d") == encode_key([None, MISSING, "d"])


NAMES = st.sampled_from(["a", "b", "c.d", "`end`"])
LEAVES = st.one_of(
    NAMES,
    st.integers(0, 99).map(str),
    st.sampled_from(["'s'", '"t"', "META().id", "1.5"]),
)


def _expressions() -> st.SearchStrategy[str]:
    return st.recursive(
        LEAVES,
        lambda inner: st.one_of(
            st.tuples(st.sampled_from(["LOWER", "UPPER", "LENGTH"]), inner).map(
                lambda t: f"{t[0]}({t[1]})"
            ),
            st.tuples(inner, st.sampled_from("+-*/%"), inner).map(
                lambda t: f"({t[0]} {t[1]} {t[2]})"
            ),
            inner.map(lambda e: f"-{e}"),
        ),
        max_leaves=6,
    )


@given(_expressions(), st.booleans())
def test_canonical_text_parses_back_to_itself(text: str, desc: bool) -> None:
    if desc:
        text += " DESC"
    canonical = str(parse_key(text))
    assert str(parse_key(canonical)) == canonical
    doc = {"a": 3, "b": "Bee", "c": {"d": 2.5}, "end": -1}
    left = parse_key(text).value
    right = parse_key(canonical).value
    assert evaluate(left, doc, "id") == evaluate(right, doc, "id")  # type: ignore[arg-type]
