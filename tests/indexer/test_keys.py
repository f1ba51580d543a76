"""Tests for indexer.keys: the byte encoding of index keys sorts exactly like N1QL collation."""

from __future__ import annotations

import copy
import functools
import itertools
import math
import pickle
import struct
import sys
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexer.keys import (
    MISSING,
    KeyEncodingError,
    Missing,
    collate,
    decode_key,
    decode_value,
    encode_key,
    encode_value,
    entry_tail,
    field_value,
    index_key,
    split_entry,
)
from tests.budget import examples

FAST = settings(
    max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
MORE = settings(
    max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def sign(x: int) -> int:
    return (x > 0) - (x < 0)


def bytes_cmp(a: bytes, b: bytes) -> int:
    return (a > b) - (a < b)


def lex_collate(a: list[Any], b: list[Any]) -> int:
    """Composite keys: component by component, a prefix first."""
    for x, y in zip(a, b, strict=False):
        c = collate(x, y)
        if c:
            return c
    return sign(len(a) - len(b))


# ---------------------------------------------------------------------------------------------
# Strategies

EDGE_NUMBERS: list[int | float] = [
    0,
    -0.0,
    1,
    -1,
    0.5,
    -0.5,
    1.5,
    -1.5,
    2**53,
    2**53 + 1,
    2**53 - 1,
    float(2**53),
    -(2**53) - 1,
    2**63,
    -(2**63),
    2**64 + 1,
    5e-324,
    -5e-324,
    sys.float_info.min,
    sys.float_info.max,
    -sys.float_info.max,
    2**1023 - 1,
    -(2**1023) + 1,
    2**1022 + 1,
    1e300,
    int(1e300) + 1,
    int(1e300) - 1,
]

# Ints offset from a double by a little or a lot: many share the double and need the suffix.
ints_near_doubles = st.builds(
    lambda f, k: int(f) + k,
    st.floats(min_value=-1e300, max_value=1e300),
    st.one_of(st.integers(-4, 4), st.integers(-(2**80), 2**80)),
)
numbers = st.one_of(
    st.sampled_from(EDGE_NUMBERS),
    st.integers(),
    st.integers(-(2**200), 2**200),
    st.floats(allow_nan=False, allow_infinity=False),
    ints_near_doubles,
)
texts = st.one_of(
    st.text(max_size=6),
    st.text(alphabet="ab\x00\x7f\xe9\u20ac\U0001f600", max_size=4),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
json_values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.text(alphabet="ab\x00\xe9", max_size=2), children, max_size=4),
    ),
    max_leaves=12,
)
# A small pool, so that composite keys often share components.
small_values: st.SearchStrategy[Any] = st.sampled_from(
    [None, False, True, 0, -1, 1, 1.5, "", "a", "a\x00", [], [0], {}]
)
components = st.one_of(st.just(MISSING), small_values, json_values)
keys = st.lists(components, min_size=1, max_size=4)


def normalised(value: Any) -> Any:
    """What decoding should give back: integral numbers as ints, tuples as lists."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list | tuple):
        return [normalised(v) for v in value]
    if isinstance(value, dict):
        return {k: normalised(v) for k, v in value.items()}
    return value


def assert_identical(a: Any, b: Any) -> None:
    """Equal and of the same types all the way down (== alone says 1 == 1.0 == True)."""
    assert type(a) is type(b), (a, b)
    if isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_identical(x, y)
    elif isinstance(a, dict):
        assert sorted(a) == sorted(b)
        for k in a:
            assert_identical(a[k], b[k])
    else:
        assert a == b or (a is MISSING and b is MISSING)


# ---------------------------------------------------------------------------------------------
# Order properties


@MORE
@given(json_values, json_values)
def test_byte_order_matches_collation(a: Any, b: Any) -> None:
    assert bytes_cmp(encode_value(a), encode_value(b)) == collate(a, b)


@FAST
@given(st.lists(st.one_of(small_values, json_values), min_size=2, max_size=8))
def test_sorting_by_bytes_sorts_by_collation(values: list[Any]) -> None:
    encoded = [encode_value(v) for v in values]
    for (x, ex), (y, ey) in itertools.combinations(zip(values, encoded, strict=True), 2):
        assert bytes_cmp(ex, ey) == collate(x, y)
    by_bytes = sorted(values, key=encode_value)
    by_collate = sorted(values, key=functools.cmp_to_key(collate))
    for x, y in zip(by_bytes, by_collate, strict=True):
        assert collate(x, y) == 0


@FAST
@given(
    st.lists(json_values, max_size=3),
    st.lists(json_values, max_size=3),
    st.lists(json_values, max_size=3),
)
def test_arrays_sharing_a_prefix(prefix: list[Any], tail_a: list[Any], tail_b: list[Any]) -> None:
    a, b = prefix + tail_a, prefix + tail_b
    assert bytes_cmp(encode_value(a), encode_value(b)) == collate(a, b)
    assert encode_value(prefix) < encode_value([*prefix, None])


@FAST
@given(
    st.dictionaries(st.sampled_from("abcd"), json_values, max_size=3),
    st.dictionaries(st.sampled_from("abcd"), small_values, max_size=2),
    st.dictionaries(st.sampled_from("abcd"), small_values, max_size=2),
)
def test_objects_sharing_fields(
    common: dict[str, Any], extra_a: dict[str, Any], extra_b: dict[str, Any]
) -> None:
    a, b = {**common, **extra_a}, {**common, **extra_b}
    assert bytes_cmp(encode_value(a), encode_value(b)) == collate(a, b)


@MORE
@given(
    st.floats(min_value=2.0**53, max_value=1e300),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.integers(-(2**70), 2**70),
)
def test_ints_sharing_a_double(f: float, negative: bool, k1: int, k2: int) -> None:
    base = -f if negative else f
    values = [int(base) + k1, int(base) + k2, base, int(base), int(base) + 1, int(base) - 1]
    for x, y in itertools.product(values, repeat=2):
        assert (
            bytes_cmp(encode_value(x), encode_value(y)) == collate(x, y) == sign((x > y) - (x < y))
        )


@MORE
@given(keys, keys)
def test_composite_key_order_is_lexicographic(a: list[Any], b: list[Any]) -> None:
    ka, kb = encode_key(a), encode_key(b)
    assert bytes_cmp(ka, kb) == lex_collate(a, b)
    all_equal = len(a) == len(b) and all(collate(x, y) == 0 for x, y in zip(a, b, strict=True))
    assert (ka == kb) == all_equal


@FAST
@given(
    st.integers(1, 3).flatmap(
        lambda n: st.tuples(
            st.lists(components, min_size=n, max_size=n),
            st.lists(components, min_size=n, max_size=n),
        )
    ),
    st.binary(max_size=6),
    st.binary(max_size=6),
)
def test_entries_sort_by_key_then_docid(
    pair: tuple[list[Any], list[Any]], docid_a: bytes, docid_b: bytes
) -> None:
    a, b = pair
    expected = lex_collate(a, b) or bytes_cmp(docid_a, docid_b)
    assert bytes_cmp(encode_key(a) + docid_a, encode_key(b) + docid_b) == expected


# ---------------------------------------------------------------------------------------------
# Round trips


@MORE
@given(json_values)
def test_round_trip(value: Any) -> None:
    data = encode_value(value)
    decoded, end = decode_value(data)
    assert end == len(data)
    assert collate(decoded, value) == 0
    assert_identical(decoded, normalised(value))
    assert encode_value(decoded) == data


@FAST
@given(json_values, st.binary(max_size=4), st.binary(max_size=4))
def test_decode_at_an_offset(value: Any, before: bytes, after: bytes) -> None:
    data = encode_value(value)
    decoded, end = decode_value(before + data + after, len(before))
    assert end == len(before) + len(data)
    assert_identical(decoded, normalised(value))


@FAST
@given(keys, st.binary(max_size=12))
def test_decode_key_and_split_entry(key: list[Any], docid: bytes) -> None:
    data = encode_key(key)
    values, end = decode_key(data, len(key))
    assert end == len(data)
    assert_identical(values, normalised(key))
    values, rest = split_entry(data + entry_tail(docid), len(key))
    assert_identical(values, normalised(key))
    assert rest == docid


@FAST
@given(
    st.lists(st.tuples(st.integers(0, 3), st.binary(max_size=300).filter(lambda d: b"\0" not in d)))
)
def test_entries_of_one_key_sort_by_docid(rows: list[tuple[int, bytes]]) -> None:
    """The docid length after the docid keeps (key, docid) order for docids without NUL."""
    entries = sorted(encode_key([k]) + entry_tail(d) for k, d in rows)
    assert [split_entry(e, 1) for e in entries] == sorted(([k], d) for k, d in rows)


def test_split_entry_checks_the_tail() -> None:
    entry = encode_key(["a"]) + entry_tail(b"doc")
    with pytest.raises(KeyEncodingError, match="docid"):
        split_entry(entry[:-2] + b"\x00\x05", 1)
    with pytest.raises(KeyEncodingError):
        split_entry(encode_key(["a"]) + b"\x00", 1)


@FAST
@given(json_values)
def test_every_strict_prefix_is_rejected(value: Any) -> None:
    data = encode_value(value)
    for cut in range(len(data)):
        with pytest.raises(KeyEncodingError):
            decode_value(data[:cut])


@st.composite
def corrupted_encodings(draw: st.DrawFn) -> bytes:
    data = bytearray(encode_value(draw(json_values)))
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(data) - 1))
        data[i] = draw(st.integers(0, 255))
    return bytes(data)


@MORE
@given(st.one_of(st.binary(max_size=24), corrupted_encodings()))
def test_decoding_garbage_fails_cleanly_or_is_canonical(data: bytes) -> None:
    try:
        value, end = decode_value(data)
    except KeyEncodingError:
        return
    assert encode_value(value) == data[:end]


# ---------------------------------------------------------------------------------------------
# Examples

ASCENDING_CHAINS = [
    [MISSING, None, False, True, -1e308, -1.5, 0, 1, 1.5, 2, "", "a", [], [None], {}, {"": None}],
    [1, 1.5, 2],
    [-(2**63), -1.5],
    [-(2**63) - 1, -(2**63), -(2**63) + 1],
    [float(2**53), 2**53 + 1, 2**53 + 2],
    [-(2**53) - 2, -(2**53) - 1, -float(2**53)],
    [-sys.float_info.max, -(2**1023) + 1, -1.0e-300, -5e-324, 0, 5e-324, 2**1023 - 1],
    [2**1023 - 1, float(2**1023), sys.float_info.max],
    [int(1e300) - 2**100, int(1e300) - 1, 1e300, int(1e300) + 1, int(1e300) + 2**100],
    ["a", "a\x00", "a\x00\x00", "a\x01", "ab", "b"],
    ["\x7f", "\xe9", "\u20ac", "\ud7ff", "\ud800", "\ue000", "\uffff", "\U0001f600"],
    [[], [None], [1], [1, 0], [1, "a"], [2], ["a"], [[]], [{}]],
    [{}, {"z": 1}, {"a": 1, "b": 1}],
    [{"a": 1}, {"a": 2}, {"a": "x"}, {"b": 0}],
    [{"a": 1, "b": 2}, {"a": 1, "c": 0}, {"a": 2, "b": 0}],
]


@pytest.mark.parametrize("chain", ASCENDING_CHAINS, ids=range(len(ASCENDING_CHAINS)))
def test_ascending_examples(chain: list[Any]) -> None:
    for x, y in itertools.pairwise(chain):
        assert collate(x, y) == -1, (x, y)
        assert encode_value(x) < encode_value(y), (x, y)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (1, 1.0),
        (0, -0.0),
        (0.0, -0.0),
        (2**53, float(2**53)),
        (int(sys.float_info.max), sys.float_info.max),
        ([1, {"a": 2}], [1.0, {"a": 2.0}]),
        ((1, 2), [1, 2]),
    ],
)
def test_equal_values_encode_equal(a: Any, b: Any) -> None:
    assert collate(a, b) == 0
    assert encode_value(a) == encode_value(b)


def test_bool_is_not_a_number() -> None:
    assert encode_value(True) != encode_value(1)
    assert encode_value(True) < encode_value(0) < encode_value(1)
    assert collate(True, 0) == -1


def test_exact_formats() -> None:
    """Pin the on-disk format: these bytes are stored in LevelDB."""
    one = b"\x05" + (struct.unpack(">Q", struct.pack(">d", 1.0))[0] | 1 << 63).to_bytes(8, "big")
    assert encode_value(MISSING) == b"\x01"
    assert encode_value(None) == b"\x02"
    assert encode_value(False) == b"\x03"
    assert encode_value(True) == b"\x04"
    assert encode_value(1) == one + b"\x80"
    assert encode_value(-1.0)[1:9] == bytes(255 - b for b in struct.pack(">d", -1.0))
    assert encode_value(2**53 + 1)[9:] == b"\x81\x01\x01"
    assert encode_value(2**53 + 3)[9:] == b"\x7f\xfe\xfe"  # rounds up to 2**53 + 4
    assert encode_value("a\x00") == b"\x06a\x00\xff\x00\x00"
    assert encode_value([None]) == b"\x07\x02\x00"
    assert encode_value({"b": None, "a": True}) == (
        b"\x08\x00\x00\x00\x02" + b"\x06a\x00\x00\x04" + b"\x06b\x00\x00\x02" + b"\x00"
    )
    assert encode_key([1, MISSING]) == encode_value(1) + b"\x01"


def test_decode_gives_ints_for_integral_numbers() -> None:
    assert_identical(decode_value(encode_value(3.0))[0], 3)
    assert_identical(decode_value(encode_value(-0.0))[0], 0)
    assert_identical(decode_value(encode_value(1e20))[0], 10**20)
    assert_identical(decode_value(encode_value(2.5))[0], 2.5)
    assert_identical(decode_value(encode_value(2**100 + 1))[0], 2**100 + 1)
    assert_identical(decode_value(encode_value(-(2**100) - 1))[0], -(2**100) - 1)


# ---------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize(
    "value",
    [
        math.nan,
        math.inf,
        -math.inf,
        [1, math.nan],
        {"a": math.inf},
        2**1023 + 1,
        -(2**1023) - 1,
        2**1024,
        10**400,
        [MISSING],
        {"a": MISSING},
        {1: "a"},
        b"bytes",
        {1, 2},
        object(),
    ],
    ids=lambda v: type(v).__name__,
)
def test_unencodable_values(value: Any) -> None:
    with pytest.raises(KeyEncodingError):
        encode_value(value)
    with pytest.raises(KeyEncodingError):
        encode_key([None, value])


def test_huge_integral_doubles_are_accepted() -> None:
    # An exact double beyond 2**1023 is a valid JSON number; only inexact ints are refused.
    assert decode_value(encode_value(2**1023))[0] == 2**1023
    assert encode_value(float(2**1023)) == encode_value(2**1023)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x00",
        b"\x09",
        b"\xff",
        b"\x05",
        b"\x05" + b"\x80" * 8,  # no suffix
        b"\x05" + b"\xc0" + b"\x00" * 7 + b"\x99",  # bad suffix byte
        b"\x05" + b"\xff\xf0" + b"\x00" * 6 + b"\x80",  # +inf
        b"\x05" + b"\xff\xf8" + b"\x00" * 6 + b"\x80",  # NaN
        b"\x05" + b"\x7f" + b"\xff" * 7 + b"\x80",  # -0.0 is not canonical
        encode_value(1.5)[:9] + b"\x81\x01\x01",  # int offset from a non-integral double
        encode_value(2**60)[:9] + b"\x81\x00",  # empty offset
        encode_value(2**60)[:9] + b"\x81\x02\x00\x01",  # leading zero
        encode_value(2**60)[:9] + b"\x81\x02\x01\x00",  # offset too big for the double
        encode_value(2**60)[:9] + b"\x81\x05\x01",  # truncated offset
        b"\x06abc",
        b"\x06abc\x00",
        b"\x06abc\x00\x01",  # bad escape
        b"\x06\xff\x00\x00",  # not UTF-8
        b"\x07\x02",
        b"\x07\x01\x00",  # MISSING inside an array
        b"\x08\x00\x00\x00\x01\x06a\x00\x00",  # field value missing
        b"\x08\x00\x00\x00\x01\x06a\x00\x00\x01\x00",  # MISSING as a field value
        b"\x08\x00\x00\x00\x01\x02\x02\x00",  # key not a string
        b"\x08\x00\x00\x00\x01\x06a\x00\x00\x02\x02",  # more fields than the count
        b"\x08\x00\x00\x00\x02\x06b\x00\x00\x02\x06a\x00\x00\x02\x00",  # keys not sorted
        b"\x08\x00\x00",
        b"\x07" * 100_000,  # nested too deeply
    ],
    ids=lambda d: repr(d[:24]),
)
def test_malformed_bytes(data: bytes) -> None:
    with pytest.raises(KeyEncodingError):
        decode_value(data)
    with pytest.raises(KeyEncodingError):
        decode_key(encode_value(None) + data, 2)


def test_decode_key_past_the_end() -> None:
    with pytest.raises(KeyEncodingError):
        decode_key(encode_key([1, "a"]), 3)
    with pytest.raises(KeyEncodingError):
        split_entry(b"", 1)
    with pytest.raises(KeyEncodingError):
        decode_value(encode_value(1), -1)


# ---------------------------------------------------------------------------------------------
# Documents

DOC: dict[str, Any] = {
    "name": "Alice",
    "age": 31,
    "address": {"city": "Paris", "zip": "75001", "geo": {"lat": 48.86}},
    "tags": ["a", "b"],
    "nothing": None,
}


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("name", "Alice"),
        ("age", 31),
        ("address.city", "Paris"),
        ("address.geo.lat", 48.86),
        ("address.geo", {"lat": 48.86}),
        ("nothing", None),
        ("tags", ["a", "b"]),
        ("absent", MISSING),
        ("address.absent", MISSING),
        ("address.zip.more", MISSING),
        ("tags.0", MISSING),
        ("nothing.x", MISSING),
        ("absent.x.y", MISSING),
    ],
)
def test_field_value(path: str, expected: Any) -> None:
    assert_identical(field_value(DOC, path), expected)


def test_field_value_of_a_non_object() -> None:
    assert field_value(None, "a") is MISSING
    assert field_value([1], "a") is MISSING
    assert field_value("abc", "a.b") is MISSING


def test_index_key() -> None:
    assert index_key(DOC, ["address.city", "age"]) == encode_key(["Paris", 31])
    assert index_key(DOC, ["name"]) == encode_value("Alice")
    # null is indexed; a missing leading field is not.
    assert index_key(DOC, ["nothing"]) == encode_value(None)
    assert index_key(DOC, ["absent", "name"]) == b""
    assert index_key(DOC, ["address.absent"]) == b""
    # Trailing missing fields are kept, as MISSING components.
    key = index_key(DOC, ["name", "absent", "address.zip", "address.zip.x"])
    assert key == encode_key(["Alice", MISSING, "75001", MISSING])
    assert decode_key(key, 4)[0] == ["Alice", MISSING, "75001", MISSING]
    with pytest.raises(KeyEncodingError):
        index_key({"a": math.nan}, ["a"])
    with pytest.raises(ValueError):
        index_key(DOC, [])


@FAST
@given(st.dictionaries(st.sampled_from("abc"), json_values, max_size=3))
def test_index_key_matches_field_values(doc: dict[str, Any]) -> None:
    paths = ["a", "b", "c"]
    values = [field_value(doc, p) for p in paths]
    expected = b"" if values[0] is MISSING else encode_key(values)
    assert index_key(doc, paths) == expected


# ---------------------------------------------------------------------------------------------
# MISSING


def test_missing_is_a_singleton() -> None:
    assert Missing() is MISSING
    assert repr(MISSING) == "MISSING"
    assert copy.copy(MISSING) is MISSING
    assert copy.deepcopy([MISSING])[0] is MISSING
    assert pickle.loads(pickle.dumps(MISSING)) is MISSING
    assert collate(MISSING, MISSING) == 0
    assert collate(MISSING, None) == -1
    assert encode_value(MISSING) < encode_value(None)
