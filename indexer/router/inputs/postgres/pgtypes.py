"""PostgreSQL values as JSON: one conversion for every path a row takes (the initial copy, the
change stream, a read of one row), so that the same row gives the same document whichever path
brought it (sans-IO, pure).

Every path reads a value in its text output form, the one the type's output function prints
(what pgoutput sends, and what the copy selects by calling that function), on connections with
`SESSION_OPTIONS`, so the forms do not depend on the server's or the user's defaults:
timestamps with a time zone in UTC, dates in ISO style, intervals as ISO-8601 durations, bytea
in hex. A type is described once (`PgType`, from the catalog: domains resolve to their base
type, arrays to their element type) and each column gets its converter once.

What each type becomes is the README's table ("PostgreSQL types as JSON"). No conversion gives a
value an index key cannot hold (the input rule: no NaN, no infinity, no number beyond a
double): such numbers become their text, as strings.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import orjson

from indexer.router.documents import (
    MAX_DEPTH,
    DocumentError,
    depth_exceeds,
    json_loads,
    loads_document,
)

__all__ = [
    "SESSION_OPTIONS",
    "TYPE_QUERY",
    "PgType",
    "PgTypeError",
    "TypeCatalog",
    "converter",
    "parse_array",
]

SESSION_OPTIONS: Final = (
    "-c DateStyle=ISO -c IntervalStyle=iso_8601 -c TimeZone=UTC -c extra_float_digits=1 "
    "-c bytea_output=hex"
)
"""Settings of every connection that reads values (copy, stream, row reads): fixed text forms."""

TYPE_QUERY: Final = (
    "SELECT oid, typtype, typbasetype, typelem, typdelim, typoutput::regproc::text "
    "FROM pg_type WHERE oid = ANY(%s)"
)
"""The catalog rows `TypeCatalog.resolve` reads: one per type oid asked for."""


class PgTypeError(ValueError):
    """A value that is not its type's text form, or that no document can hold; one line."""


# What a type's values become (the kinds of PgType).
BOOL, INT, FLOAT, NUMERIC, JSON = "bool", "int", "float", "numeric", "json"
TIMESTAMP, TIMESTAMPTZ, TIMETZ, TEXT, ARRAY = "timestamp", "timestamptz", "timetz", "text", "array"


@dataclass(frozen=True, slots=True)
class PgType:
    """How a type's text form becomes JSON: its kind, and for an array its element's type and
    the delimiter between elements (`,` for every built-in type but box)."""

    kind: str
    element: PgType | None = None
    delimiter: str = ","


_SCALARS: Final[dict[int, str]] = {
    16: BOOL, 20: INT, 21: INT, 23: INT, 26: INT, 700: FLOAT, 701: FLOAT, 1700: NUMERIC,
    114: JSON, 3802: JSON, 1114: TIMESTAMP, 1184: TIMESTAMPTZ, 1266: TIMETZ,
}  # fmt: skip
# Arrays of built-in types, by element: known without a catalog (the unit tests, and fewer
# queries); any other type oid is looked up.
_BUILTIN_ARRAYS: Final[dict[int, int]] = {
    1000: 16, 1005: 21, 1007: 23, 1016: 20, 1028: 26, 1021: 700, 1022: 701, 1231: 1700,
    199: 114, 3807: 3802, 1115: 1114, 1185: 1184, 1270: 1266, 1182: 1082, 1183: 1083,
    1187: 1186, 1009: 25, 1015: 1043, 1014: 1042, 2951: 2950, 1001: 17, 1003: 19,
}  # fmt: skip
_BUILTIN_TEXT: Final = frozenset({17, 18, 19, 25, 1042, 1043, 1082, 1083, 1186, 2950})


def builtin(oid: int) -> PgType | None:
    """A built-in type known without the catalog; None for any other."""
    kind = _SCALARS.get(oid)
    if kind is not None:
        return PgType(kind)
    if oid in _BUILTIN_TEXT:
        return PgType(TEXT)
    element = _BUILTIN_ARRAYS.get(oid)
    if element is not None:
        inner = builtin(element)
        assert inner is not None
        return PgType(ARRAY, inner)
    return None


class TypeCatalog:
    """Type oids as PgTypes: built-in ones at once, others from the server's catalog rows
    (`TYPE_QUERY`), asked for through a function given to `resolve`."""

    def __init__(self) -> None:
        self._rows: dict[int, tuple[str, int, int, str, str]] = {}
        self._types: dict[int, PgType] = {}

    def missing(self, oids: Iterable[int]) -> list[int]:
        """The oids neither built in nor read from the catalog yet."""
        return sorted({o for o in oids if o not in self._types and builtin(o) is None})

    def resolve(
        self, oids: Iterable[int], query: Callable[[list[int]], Sequence[Sequence[Any]]]
    ) -> None:
        """Read what is missing of `oids` (and of their base and element types) with `query`
        (it runs TYPE_QUERY with the list; blocking in the caller's thread)."""
        wanted = [o for o in self.missing(oids) if o not in self._rows]
        while wanted:
            for oid, typtype, base, element, delimiter, output in query(wanted):
                self._rows[int(oid)] = (str(typtype), int(base), int(element), str(delimiter),
                                        str(output))  # fmt: skip
            unknown = [o for o in wanted if o not in self._rows]
            if unknown:
                raise PgTypeError(f"type oid {unknown[0]} is not in the server's catalog")
            refers = {r[1] for r in map(self._rows.__getitem__, wanted)} | {
                r[2] for r in map(self._rows.__getitem__, wanted)
            }
            wanted = [o for o in self.missing(refers - {0}) if o not in self._rows]

    def get(self, oid: int) -> PgType:
        """The type of `oid`: resolved before, or built in; any other is text."""
        known = self._types.get(oid)
        if known is not None:
            return known
        found = self._describe(oid, 0)
        self._types[oid] = found
        return found

    def _describe(self, oid: int, depth: int) -> PgType:
        row = self._rows.get(oid)
        if row is None:
            return builtin(oid) or PgType(TEXT)
        typtype, base, element, _, output = row
        if depth > 32:
            raise PgTypeError(f"type oid {oid}: domains nested too deep")
        if typtype == "d":  # a domain: its base type's values, printed by the same function
            return self._describe(base, depth + 1)
        if output == "array_out" and element:
            inner = self._describe(element, depth + 1)
            element_row = self._rows.get(element)
            delimiter = "," if element_row is None else element_row[3]
            return PgType(ARRAY, inner, delimiter)
        known = builtin(oid)  # an enum, a range, a composite...: its text
        return known or PgType(TEXT)


# ---------------------------------------------------------------------------------------------
# Conversions of one value's text form

_LONG_DIGITS: Final = re.compile(r"\d{19}")  # an integer orjson may read as a double
_SPECIAL_NUMBERS: Final = frozenset({"NaN", "Infinity", "-Infinity"})


def _bool(text: str) -> bool:
    if text == "t":
        return True
    if text == "f":
        return False
    raise PgTypeError(f"{text!r} is not a boolean's text form (t or f)")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise PgTypeError(f"{text[:40]!r} is not an integer") from None


def _float(text: str) -> float | str:
    """A double, or NaN and the infinities as their names."""
    if text in _SPECIAL_NUMBERS:
        return text
    try:
        value = float(text)
    except ValueError:
        raise PgTypeError(f"{text[:40]!r} is not a number") from None
    return value if math.isfinite(value) else text


def _numeric(text: str) -> int | float | str:
    """An integer when written without a point, else a double; NaN, the infinities and what is
    beyond a double as their text."""
    if text in _SPECIAL_NUMBERS:
        return text
    if "." not in text and "e" not in text and "E" not in text:
        value = _int(text)
        return value if _fits_double(value) else text
    return _float(text)


def _fits_double(value: int) -> bool:
    if -(1 << 53) <= value <= 1 << 53:
        return True
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _json_float(text: str) -> float | str:
    value = float(text)
    return value if math.isfinite(value) else text


def _json_int(text: str) -> int | str:
    value = int(text)
    return value if _fits_double(value) else text


def _no_constant(name: str) -> Any:
    raise PgTypeError(f"{name} in a JSON value")


def _json(text: str) -> Any:
    """A json or jsonb value, nested; a number beyond a double as its text."""
    if _LONG_DIGITS.search(text) is None:  # orjson reads every number exactly: the fast path
        try:
            value = orjson.loads(text)
        except orjson.JSONDecodeError:
            return _json_checked(text)
        if text.count("[") + text.count("{") > MAX_DEPTH and depth_exceeds(value, MAX_DEPTH):
            raise PgTypeError(f"a JSON value nests deeper than {MAX_DEPTH} levels")
        return value
    return _json_checked(text)


def _json_checked(text: str) -> Any:
    """`_json` by the standard library, where orjson would read a number inexactly or not at
    all (NaN is not JSON: PostgreSQL never prints it)."""
    try:
        return loads_document(text)
    except DocumentError as exc:
        if "nest deeper" in str(exc):
            raise PgTypeError(f"a JSON value nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:
        raise PgTypeError(f"not JSON: {exc}") from None
    try:  # a number beyond a double: the standard library, with the numbers as text
        return json_loads(
            text, parse_float=_json_float, parse_int=_json_int, parse_constant=_no_constant
        )
    except ValueError as exc:
        raise PgTypeError(f"not JSON: {exc}") from None


def _offset(clock: str) -> str:
    """`10:00:00.5+05:30` or `10:00:00+02` with the offset as ISO-8601 writes it (`+05:30`,
    `+02:00`; one of seconds kept: `+00:53:28`)."""
    for sign in ("+", "-"):
        at = clock.rfind(sign)
        if at > 0:
            offset = clock[at + 1 :]
            return f"{clock[:at]}{sign}{offset}:00" if len(offset) == 2 else clock
    return clock


def _timestamp(text: str) -> str:
    """`2024-05-01 10:00:00.5` as `2024-05-01T10:00:00.5`; infinity and BC dates as printed."""
    if text.endswith((" BC", "infinity")):
        return text
    return text.replace(" ", "T", 1)


def _timestamptz(text: str) -> str:
    if text.endswith((" BC", "infinity")):
        return text
    return _offset(text.replace(" ", "T", 1))


def _text(text: str) -> str:
    return text


_SCALAR_CONVERTERS: Final[Mapping[str, Callable[[str], Any]]] = {
    BOOL: _bool,
    INT: _int,
    FLOAT: _float,
    NUMERIC: _numeric,
    JSON: _json,
    TIMESTAMP: _timestamp,
    TIMESTAMPTZ: _timestamptz,
    TIMETZ: _offset,
    TEXT: _text,
}


def converter(pgtype: PgType) -> Callable[[str], Any]:
    """The function turning a value of this type (its text form, never NULL) into JSON: chosen
    once per column, not per value."""
    if pgtype.kind != ARRAY:
        return _SCALAR_CONVERTERS[pgtype.kind]
    assert pgtype.element is not None
    convert = converter(pgtype.element)
    delimiter = pgtype.delimiter

    def array(text: str) -> list[Any]:
        return _convert_items(parse_array(text, delimiter), convert)

    return array


def _convert_items(items: list[Any], convert: Callable[[str], Any]) -> list[Any]:
    return [
        None
        if item is None
        else _convert_items(item, convert)
        if isinstance(item, list)
        else convert(item)
        for item in items
    ]


def parse_array(text: str, delimiter: str = ",") -> list[Any]:
    """An array literal as array_out prints it, of any dimensions (`{{1,NULL},{3,4}}`, with
    bounds `[0:1]={a,"b c"}`): nested lists of element texts, None for NULL."""
    try:
        start = text.index("=") + 1 if text.startswith("[") else 0
        items, end = _array_at(text, start, delimiter)
    except (IndexError, ValueError):
        raise PgTypeError(f"not an array literal: {text[:40]!r}") from None
    if end != len(text):
        raise PgTypeError(f"not an array literal: {text[:40]!r}")
    return items


def _array_at(text: str, pos: int, delimiter: str) -> tuple[list[Any], int]:
    if text[pos] != "{":
        raise ValueError(pos)
    pos += 1
    out: list[Any] = []
    if text[pos] == "}":
        return out, pos + 1
    stops = (delimiter, "}")
    while True:
        char = text[pos]
        item: Any
        if char == "{":
            item, pos = _array_at(text, pos, delimiter)
        elif char == '"':
            pos += 1
            chars = []
            while True:
                end = min(_find(text, '"', pos), _find(text, "\\", pos))
                chars.append(text[pos:end])
                if text[end] == "\\":
                    chars.append(text[end + 1])
                    pos = end + 2
                else:
                    pos = end + 1
                    break
            item = "".join(chars)
        else:
            end = pos
            while text[end] not in stops:
                end += 1
            raw = text[pos:end]
            item = None if raw == "NULL" else raw
            pos = end
        out.append(item)
        char = text[pos]
        pos += 1
        if char == "}":
            return out, pos
        if char != delimiter:
            raise ValueError(pos)


def _find(text: str, char: str, pos: int) -> int:
    at = text.find(char, pos)
    if at < 0:
        if char == '"':
            raise ValueError(pos)  # an unterminated quote
        return len(text)
    return at
