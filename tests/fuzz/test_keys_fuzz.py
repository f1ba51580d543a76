"""Property-based fuzzing of the index key encoding (indexer/keys.py), beyond what
tests/indexer/test_keys.py covers.

Here: text over every code point (object keys too), values that collate equal written in other
Python types, the integer range edges near 2**1023, adjacent doubles, nesting depth, and damaged
composite keys and index entries.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexer.keys import (
    MISSING,
    KeyEncodingError,
    collate,
    decode_key,
    decode_value,
    encode_key,
    encode_value,
    entry_tail,
    split_entry,
)
from tests.budget import examples
from tests.indexer.test_keys import bytes_cmp, sign

FUZZ = settings(
    max_examples=examples(120), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
SOME = settings(
    max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# ---------------------------------------------------------------------------------------------
# Strategies

# Every code point: lone surrogates, NUL, the ends of the BMP and astral planes.
wide_chars = st.one_of(
    st.characters(exclude_categories=()),
    st.sampled_from(["\x00", "\x7f", "\x80", "\ud7ff", "\ud800", "\udfff", "\ue000", "\uffff"]),
    st.sampled_from(["\U00010000", "\U0001f600", "\U0010ffff"]),
)
wide_text = st.text(wide_chars, max_size=8)
finite_floats = st.floats(allow_nan=False, allow_infinity=False)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**64), 2**64), finite_floats, wide_text
)
# Characters where code point order and UTF-16 order differ, and the escaped NUL.
TRICKY = "\x00a\x7f\x80\ud7ff\ud800\udfff\ue000\uffff\U00010000\U0010ffff"
tricky_objects = st.dictionaries(
    st.text(TRICKY, max_size=3), st.one_of(st.none(), st.integers(0, 2)), min_size=1, max_size=5
)
wide_values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(wide_text, children, max_size=4),
    ),
    max_leaves=10,
)


class Count(int):
    """An int subclass (as IntEnum and numpy-free wrappers make)."""

    __slots__ = ()


class Ratio(float):
    """A float subclass."""

    __slots__ = ()


class Name(str):
    """A str subclass."""

    __slots__ = ()


@st.composite
def variant(draw: st.DrawFn, value: Any) -> Any:
    """A value equal to `value` under collation, written with other Python types: ints as
    floats and back, -0.0, tuples, subclasses, other dict insertion orders."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        choices: list[Any] = [value]
        if abs(value) <= 2**53:
            choices.append(float(value))
        if value == 0:
            choices.append(-0.0)
        choices.append(Count(value))
        return draw(st.sampled_from(choices))
    if isinstance(value, float):
        choices = [value, Ratio(value)]
        if value.is_integer():
            choices += [int(value), -0.0 if value == 0 else value]
        return draw(st.sampled_from(choices))
    if isinstance(value, str):
        return draw(st.sampled_from([value, Name(value)]))
    if isinstance(value, list):
        items = [draw(variant(v)) for v in value]
        return draw(st.sampled_from([items, tuple(items)]))
    assert isinstance(value, dict)
    pairs = [(k, draw(variant(v))) for k, v in value.items()]
    pairs = draw(st.permutations(pairs))
    return draw(st.sampled_from([dict(pairs), OrderedDict(pairs)]))


def representable(x: int) -> bool:
    """Whether an int can be an index key: below 2**1023 in size, or exactly a double."""
    try:
        d = float(x)
    except OverflowError:
        return False
    return abs(x) < 2**1023 or int(d) == x


# Ints near the edges of the encodable range: 2**1023 and 2**1024, exact doubles and between.
edge_ints = st.one_of(
    st.integers(2**1020, 2**1025),
    st.builds(lambda k, d: k * 2**971 + d, st.integers(2**51, 2**53), st.integers(-3, 3)),
    st.builds(lambda e, d: 2**e + d, st.integers(1018, 1025), st.integers(-(2**60), 2**60)),
).flatmap(lambda x: st.sampled_from([x, -x]))


# ---------------------------------------------------------------------------------------------
# Order and round trip over the whole character range


@FUZZ
@given(wide_values, wide_values)
def test_byte_order_is_collation_order_for_any_text(a: Any, b: Any) -> None:
    """memcmp of the encodings equals collate, for values over the whole character range."""
    assert bytes_cmp(encode_value(a), encode_value(b)) == collate(a, b)


@FUZZ
@given(wide_values)
def test_any_text_round_trips(value: Any) -> None:
    """Decoding gives a collation-equal value that encodes to the same bytes."""
    data = encode_value(value)
    decoded, end = decode_value(data)
    assert end == len(data)
    assert collate(decoded, value) == 0
    assert encode_value(decoded) == data


@FUZZ
@given(tricky_objects, tricky_objects)
def test_objects_keyed_by_any_text_order_and_round_trip(
    a: dict[str, Any], b: dict[str, Any]
) -> None:
    """Object fields are sorted by code point, not UTF-16 order, on both sides."""
    assert bytes_cmp(encode_value(a), encode_value(b)) == collate(a, b)
    for value in (a, b):
        assert decode_value(encode_value(value))[0] == value


@FUZZ
@given(st.lists(wide_text, min_size=2, max_size=6))
def test_text_orders_by_code_point_lone_surrogates_included(texts: list[str]) -> None:
    """Strings sort by code point: surrogates between U+D7FF and U+E000, astral last."""
    by_bytes = sorted(texts, key=encode_value)
    by_code_points = sorted(texts, key=lambda t: [ord(c) for c in t])
    assert by_bytes == by_code_points


# ---------------------------------------------------------------------------------------------
# Equal under collation means equal bytes, whatever the Python types


@FUZZ
@given(st.data(), wide_values)
def test_values_equal_under_collation_encode_identically(data: st.DataObject, value: Any) -> None:
    """1 and 1.0, -0.0 and 0, tuples and lists, subclasses, field order: one encoding."""
    other = data.draw(variant(value))
    assert collate(value, other) == 0
    assert encode_value(other) == encode_value(value)
    assert encode_key([other, MISSING, other]) == encode_key([value, MISSING, value])


# ---------------------------------------------------------------------------------------------
# Numbers at the edges


@FUZZ
@given(edge_ints, edge_ints)
def test_ints_at_the_range_edges_encode_iff_representable_and_keep_order(x: int, y: int) -> None:
    """Near 2**1023 and 2**1024: an int is refused exactly when it is not an index key."""
    encoded = {}
    for n in (x, y):
        try:
            encoded[n] = encode_value(n)
        except KeyEncodingError:
            assert not representable(n), n
            continue
        assert representable(n), n
        decoded, _ = decode_value(encoded[n])
        assert type(decoded) is int and decoded == n
    if x in encoded and y in encoded:
        assert bytes_cmp(encoded[x], encoded[y]) == sign(x - y) == collate(x, y)


@FUZZ
@given(finite_floats)
def test_adjacent_doubles_and_the_ints_around_them_are_in_order(f: float) -> None:
    """A double, the next one up, and the ints next to an integral double sort in order."""
    up = math.nextafter(f, math.inf)
    chain: list[int | float] = [f]
    if math.isfinite(up):
        chain.append(up)
    if f.is_integer():  # ints one below and above the double, and the double's own int
        chain = sorted({*chain, int(f) - 1, int(f), int(f) + 1}, key=lambda v: (v, type(v) is int))
    for a, b in itertools.pairwise(chain):
        if representable_number(a) and representable_number(b):
            assert bytes_cmp(encode_value(a), encode_value(b)) == collate(a, b) == sign_of(a, b)


def representable_number(v: int | float) -> bool:
    """Whether a number can be encoded (every finite float can)."""
    return isinstance(v, float) or representable(v)


def sign_of(a: int | float, b: int | float) -> int:
    """The numeric order of a and b, as -1, 0 or 1."""
    return (a > b) - (a < b)


# ---------------------------------------------------------------------------------------------
# Nesting depth: an error, never a crash, and what encodes also decodes


def nested(depth: int, kind: str) -> Any:
    """1 inside `depth` lists or one-field objects."""
    value: Any = 1
    for _ in range(depth):
        value = [value] if kind == "list" else {"k": value}
    return value


@SOME
@given(st.integers(1, 4000), st.sampled_from(["list", "object"]))
def test_deep_values_encode_and_decode_or_fail_cleanly(depth: int, kind: str) -> None:
    """Deep values encode or raise KeyEncodingError (not RecursionError); what encodes decodes."""
    value = nested(depth, kind)
    try:
        data = encode_value(value)
    except KeyEncodingError:
        assert depth > 100  # ordinary documents are far shallower
        return
    decoded, end = decode_value(data)  # a key the encoder wrote must be readable
    assert end == len(data)
    assert encode_value(decoded) == data


@SOME
@given(st.integers(1, 4000), st.sampled_from(["list", "object"]))
def test_deeply_nested_bytes_decode_or_fail_cleanly(depth: int, kind: str) -> None:
    """Deep encodings decode or raise KeyEncodingError (not RecursionError)."""
    opener = b"\x07" if kind == "list" else b"\x08\x00\x00\x00\x01\x06k\x00\x00"
    data = opener * depth + encode_value(1) + b"\x00" * depth
    try:
        value, end = decode_value(data)
    except KeyEncodingError:
        assert depth > 100
        return
    assert end == len(data)
    try:
        again = encode_value(value)
    except KeyEncodingError:
        # The encoder spends two stack frames per object level, the decoder one: objects
        # nested between the two limits decode but cannot be encoded again.
        assert kind == "object" and depth > 100
        return
    assert again == data


# ---------------------------------------------------------------------------------------------
# Damaged composite keys and index entries

components = st.one_of(st.just(MISSING), wide_values)


@st.composite
def damaged_keys(draw: st.DrawFn) -> tuple[bytes, int]:
    """An encoded composite key (maybe with an entry tail) with a few bytes changed or cut."""
    values = draw(st.lists(components, min_size=1, max_size=4))
    data = bytearray(encode_key(values))
    if draw(st.booleans()):
        data += entry_tail(draw(st.binary(max_size=8)))
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(data) - 1))
        how = draw(st.sampled_from(["byte", "cut", "insert"]))
        if how == "byte":
            data[at] = draw(st.integers(0, 255))
        elif how == "cut":
            del data[at:]
            if not data:
                break
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=3))
    count = draw(st.one_of(st.just(len(values)), st.integers(0, 5)))
    return bytes(data), count


@FUZZ
@given(st.one_of(damaged_keys(), st.tuples(st.binary(max_size=40), st.integers(0, 5))))
def test_damaged_composite_keys_fail_cleanly_or_are_canonical(case: tuple[bytes, int]) -> None:
    """decode_key and split_entry on damaged input: KeyEncodingError, or exactly the bytes read."""
    data, count = case
    try:
        values, end = decode_key(data, count)
    except KeyEncodingError:
        pass
    else:
        assert len(values) == count
        assert encode_key(values) == data[:end]
    try:
        values, docid = split_entry(data, count)
    except KeyEncodingError:
        return
    assert encode_key(values) + entry_tail(docid) == data
