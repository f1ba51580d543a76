"""PostgreSQL values as JSON, from their text output forms, without a server (the e2e type
matrix checks the same conversions against a real one, on the copy and on the stream)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from indexer.router.documents import loads_document
from indexer.router.inputs.postgres.pgtypes import (
    ARRAY,
    TEXT,
    TYPE_QUERY,
    PgType,
    PgTypeError,
    TypeCatalog,
    builtin,
    converter,
    parse_array,
)


def convert(oid: int, text: str) -> Any:
    pgtype = builtin(oid)
    assert pgtype is not None, oid
    return converter(pgtype)(text)


@pytest.mark.parametrize(
    ("oid", "text", "value"),
    [
        (16, "t", True),
        (16, "f", False),
        (21, "-32768", -32768),
        (23, "-42", -42),
        (20, "9223372036854775807", 9223372036854775807),
        (700, "1.1", 1.1),
        (701, "1.5", 1.5),
        (701, "-0", -0.0),
        (701, "1e+308", 1e308),
        (701, "NaN", "NaN"),
        (701, "Infinity", "Infinity"),
        (700, "-Infinity", "-Infinity"),
        (1700, "12", 12),
        (1700, "12.50", 12.5),
        (1700, "-0.000001", -0.000001),
        (1700, "NaN", "NaN"),
        (1700, "Infinity", "Infinity"),
        (1700, "-Infinity", "-Infinity"),
        (1700, "1" + "0" * 400, "1" + "0" * 400),  # beyond a double: its text
        (1700, "123456789012345678901234567890", 123456789012345678901234567890),
        (3802, '{"a": [1, {"b": null}]}', {"a": [1, {"b": None}]}),
        (114, "[1, 2]", [1, 2]),
        (114, '"just a string"', "just a string"),
        (3802, '{"big": 1' + "0" * 400 + "}", {"big": "1" + "0" * 400}),
        (3802, '{"x": 1e400, "y": 2.5}', {"x": "1e400", "y": 2.5}),
        (1184, "2026-01-02 03:04:05.5+00", "2026-01-02T03:04:05.5+00:00"),
        (1184, "2026-01-02 03:04:05-05:30", "2026-01-02T03:04:05-05:30"),
        (1184, "infinity", "infinity"),
        (1184, "0044-03-15 10:00:00+00 BC", "0044-03-15 10:00:00+00 BC"),
        (1114, "2026-01-02 03:04:05", "2026-01-02T03:04:05"),
        (1114, "-infinity", "-infinity"),
        (1266, "10:00:00+05:30", "10:00:00+05:30"),
        (1266, "10:00:00.25-03", "10:00:00.25-03:00"),
        (1083, "23:59:59.999999", "23:59:59.999999"),
        (1082, "2026-01-02", "2026-01-02"),
        (1186, "P1Y2M3DT4H5M6.5S", "P1Y2M3DT4H5M6.5S"),
        (17, "\\x00ff", "\\x00ff"),
        (1042, "ab   ", "ab   "),
        (25, "plain text", "plain text"),
        (2950, "0e6f8d2a-0000-4000-8000-000000000000", "0e6f8d2a-0000-4000-8000-000000000000"),
        (1009, '{a,"b c",NULL,"q\\"x","NULL",""}', ["a", "b c", None, 'q"x', "NULL", ""]),
        (1007, "{1,2,NULL}", [1, 2, None]),
        (1007, "{}", []),
        (1007, "{{1,NULL},{3,4}}", [[1, None], [3, 4]]),
        (1007, "[0:1]={5,6}", [5, 6]),
        (1000, "{t,f,NULL}", [True, False, None]),
        (1022, "{NaN,1.5,-Infinity}", ["NaN", 1.5, "-Infinity"]),
        (3807, '{"{\\"a\\": 1}",NULL}', [{"a": 1}, None]),
        (1185, '{"2026-01-02 03:04:05+00"}', ["2026-01-02T03:04:05+00:00"]),
        (1009, '{{{"a,b"}},{{"}"}}}', [[["a,b"]], [["}"]]]),
    ],
)
def test_values_become_json(oid: int, text: str, value: object) -> None:
    got = convert(oid, text)
    assert got == value and type(got) is type(value)


def test_no_conversion_gives_a_value_an_index_key_cannot_hold() -> None:
    """The input rule: what the router stores must parse back as a valid input document."""
    import json

    for oid, text in [(701, "NaN"), (700, "Infinity"), (1700, "1" + "0" * 400),
                      (3802, '{"x": 1e400}'), (1022, "{NaN,Infinity}")]:  # fmt: skip
        value = convert(oid, text)
        assert loads_document(json.dumps({"v": value})) == {"v": value}
        assert not (isinstance(value, float) and not math.isfinite(value))


@pytest.mark.parametrize(
    ("oid", "text", "message"),
    [
        (16, "true", "not a boolean's text form"),  # a cast to text, not the output form
        (23, "4.5", "not an integer"),
        (701, "many", "not a number"),
        (3802, "{", "not JSON"),
        (3802, "[" * 200 + "]" * 200, "nests deeper than 128"),
        (1007, "{1,2", "not an array literal"),
        (1007, '{"1}', "not an array literal"),
        (1007, "1,2", "not an array literal"),
    ],
)
def test_what_is_not_a_types_text_form_is_an_error(oid: int, text: str, message: str) -> None:
    with pytest.raises(PgTypeError, match=message):
        convert(oid, text)


def test_the_catalog_resolves_domains_enums_and_arrays_of_them() -> None:
    rows = {
        # oid: (oid, typtype, typbasetype, typelem, typdelim, typoutput)
        90001: (90001, "d", 23, 0, ",", "int4out"),  # a domain over int4
        90002: (90002, "d", 90001, 0, ",", "int4out"),  # a domain over that domain
        90003: (90003, "b", 0, 90001, ",", "array_out"),  # an array of the domain
        90004: (90004, "e", 0, 0, ",", "enum_out"),  # an enum
        90005: (90005, "b", 0, 90004, ",", "array_out"),
        90006: (90006, "b", 0, 603, ";", "array_out"),  # box[]: ';' between elements
        603: (603, "b", 0, 0, ";", "box_out"),
        90007: (90007, "d", 1007, 0, ",", "array_out"),  # a domain over int4[]
    }
    asked: list[list[int]] = []

    def query(oids: list[int]) -> list[tuple[Any, ...]]:
        asked.append(oids)
        return [rows[o] for o in oids if o in rows]

    catalog = TypeCatalog()
    catalog.resolve([90002, 90003, 90005, 90006, 90007, 16], query)
    assert asked[0] == [90002, 90003, 90005, 90006, 90007]  # built-in types are not asked for
    assert catalog.get(90002) == PgType("int")
    assert catalog.get(90003) == PgType(ARRAY, PgType("int"))
    assert catalog.get(90005) == PgType(ARRAY, PgType(TEXT))
    assert catalog.get(90006) == PgType(ARRAY, PgType(TEXT), ";")
    assert catalog.get(90007) == PgType(ARRAY, PgType("int"))
    assert converter(catalog.get(90006))("{(1,1),(0,0);(2,2),(1,1)}") == [
        "(1,1),(0,0)",
        "(2,2),(1,1)",
    ]
    assert converter(catalog.get(90002))("7") == 7
    catalog.resolve([90002], query)
    assert len(asked) == 2  # nothing asked again
    with pytest.raises(PgTypeError, match="type oid 99999 is not in the server's catalog"):
        catalog.resolve([99999], query)
    assert "pg_type" in TYPE_QUERY


def test_arrays_parse_by_dimension() -> None:
    assert parse_array('{{"a b",NULL},{"\\\\",c}}') == [["a b", None], ["\\", "c"]]
    assert parse_array("{}") == []
    assert parse_array("{{}}") == [[]]
