"""A batch's lines built column-wise (indexer/spark/batch_lines.py) are byte for byte the lines
of the per-row path (indexer/spark/rows.py), on batches of every covered type and of types it
leaves to the per-row path; and it does cover the plain schemas it is there for."""

from __future__ import annotations

import datetime
import json
from typing import Any

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark.sql.pandas.types import from_arrow_schema

from indexer.spark.batch_lines import batch_lines
from indexer.spark.rows import RowShape, lines_of, rows_of
from tests.budget import examples

_FIRST = datetime.datetime(1, 1, 1)
_LAST = datetime.datetime(9999, 12, 31, 23, 59, 59, 999999)
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
PLAIN_TEXT = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=12)
UTC_TIMES = st.datetimes(_FIRST, _LAST, timezones=st.just(datetime.UTC))
FINITE = st.floats(allow_nan=False, allow_infinity=False)

# (Arrow type, values, whether the column-wise path covers it): values may be null.
SCALARS: list[tuple[pa.DataType, st.SearchStrategy[Any], bool]] = [
    (pa.string(), TEXT, True),
    (pa.string(), st.sampled_from(['a"b', "c\\d", "e,f", "é", "\u2028", "\x7f", "}{"]), True),
    (pa.int64(), st.integers(-(2**63), 2**63 - 1), True),
    (pa.int32(), st.integers(-(2**31), 2**31 - 1), True),
    (pa.int16(), st.integers(-(2**15), 2**15 - 1), True),
    (pa.bool_(), st.booleans(), True),
    (pa.float64(), FINITE, True),
    (pa.float32(), st.floats(width=32, allow_nan=False, allow_infinity=False), True),
    (pa.float64(), st.floats(), False),  # NaN and the infinities are bad rows
    (
        pa.timestamp("us", tz="UTC"),
        st.datetimes(_FIRST, _LAST, timezones=st.just(datetime.UTC)),
        True,
    ),
    (pa.timestamp("us"), st.datetimes(_FIRST, _LAST), True),
    (pa.date32(), st.dates(), False),
    (pa.binary(), st.binary(max_size=5), False),
]


@st.composite
def columns(draw: st.DrawFn, covered_only: bool) -> tuple[pa.DataType, list[Any]]:
    """One column's type and values, a tenth null or none at all."""
    choices = [s for s in SCALARS if s[2] or not covered_only]
    kind, values, _ = draw(st.sampled_from(choices))
    shape = draw(st.sampled_from(["scalar", "struct", "list"]))
    # Nested, a timestamp is written by orjson on the per-row path: left to it.
    nests = not pa.types.is_floating(kind) and not (covered_only and pa.types.is_timestamp(kind))
    if shape == "struct" and nests:
        inner = pa.struct([("x", kind), ('y "z"', pa.int64())])
        values = st.fixed_dictionaries(
            {"x": st.none() | values, 'y "z"': st.none() | st.integers(0, 9)}
        )
        kind = inner
    elif shape == "list" and not pa.types.is_floating(kind) and not pa.types.is_timestamp(kind):
        kind = pa.list_(kind)
        values = st.lists(st.none() | values, max_size=4)
    return kind, values


@st.composite
def batches(draw: st.DrawFn, covered_only: bool) -> tuple[pa.RecordBatch, RowShape]:
    """A batch of up to 30 rows (maybe a slice of a longer one) and the shape of its schema."""
    n = draw(st.integers(1, 30))
    extra = draw(st.integers(0, 3))  # rows sliced off the front
    total = n + extra
    if covered_only:
        ids: Any = st.lists(
            PLAIN_TEXT.filter(bool) | st.sampled_from(['q"uote', "back\\slash"]),
            min_size=total,
            max_size=total,
        )
    else:
        ids = st.lists(st.none() | TEXT, min_size=total, max_size=total)
    if draw(st.booleans()):
        id_column = pa.array(draw(ids), pa.string())
    else:
        id_column = pa.array(
            draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=total, max_size=total)),
            pa.int64(),
        )
    arrays = {"id": id_column}
    names = draw(
        st.lists(
            st.text(max_size=6).filter(lambda s: s not in ("id", "gone")), max_size=5, unique=True
        )
    )
    for name in names:
        kind, values = draw(columns(covered_only))
        nulls = draw(st.sampled_from([0.0, 0.1, 0.5, 1.0]))
        data = [None if draw(st.floats(0, 1)) < nulls else draw(values) for _ in range(total)]
        arrays[name] = pa.array(data, kind)
    delete = draw(st.booleans())
    if delete:
        arrays["gone"] = pa.array(
            draw(st.lists(st.none() | st.booleans(), min_size=total, max_size=total)), pa.bool_()
        )
    batch = pa.RecordBatch.from_pydict(arrays).slice(extra)
    keep_nulls = draw(st.booleans())
    schema = from_arrow_schema(batch.schema)
    shape = RowShape.of(schema, "id", "gone" if delete else None, None, keep_nulls)
    return batch, shape


def per_row(shape: RowShape, batch: pa.RecordBatch) -> tuple[list[bytes | None], list[str]]:
    rows = lines_of(shape, rows_of(batch))
    return [r.line for r in rows], [r.docid for r in rows]


@settings(max_examples=examples(100), deadline=None)
@given(batches(covered_only=False))
def test_column_wise_lines_are_the_per_row_lines(case: tuple[pa.RecordBatch, RowShape]) -> None:
    batch, shape = case
    built = batch_lines(shape, batch)
    if built is None:
        return  # the per-row path takes it (a bad row, a type not covered)
    lines, docids = per_row(shape, batch)
    assert None not in lines  # a batch with a bad row is never built column-wise
    assert built == (lines, docids)


@settings(max_examples=examples(70), deadline=None)
@given(batches(covered_only=True))
def test_covered_batches_are_built_column_wise(case: tuple[pa.RecordBatch, RowShape]) -> None:
    batch, shape = case
    built = batch_lines(shape, batch)
    if not shape.fast:
        return  # a float nested in a struct or list: the standard library's writer
    assert built is not None
    assert built == per_row(shape, batch)
    for line in built[0]:
        item = json.loads(line)  # every line is one JSON object of the input's shape
        assert set(item) in ({"id", "doc"}, {"id", "deleted"})


def test_the_plain_schema_of_a_dataframe_is_built_column_wise() -> None:
    batch = pa.RecordBatch.from_pydict(
        {
            "id": ["a", "b", "c"],
            "name": ["Ann", None, 'say "hi"\n'],
            "age": pa.array([30, None, 5], pa.int32()),
            "score": [1.0, 2.5, None],
            "address": pa.array(
                [{"city": "Oslo", "zip": "01"}, None, {"city": None, "zip": "02"}],
                pa.struct([("city", pa.string()), ("zip", pa.string())]),
            ),
            "tags": [["x", None], [], None],
        }
    )
    shape = RowShape.of(from_arrow_schema(batch.schema), "id", None, None, False)
    built = batch_lines(shape, batch)
    assert built is not None
    assert built[1] == ["a", "b", "c"]
    assert [json.loads(line) for line in built[0]] == [
        {"id": "a", "doc": {"name": "Ann", "age": 30, "score": 1.0,
                            "address": {"city": "Oslo", "zip": "01"}, "tags": ["x", None]}},
        {"id": "b", "doc": {"score": 2.5, "tags": []}},
        {"id": "c", "doc": {"name": 'say "hi"\n', "age": 5, "address": {"zip": "02"}}},
    ]  # fmt: skip
    assert built[0][1] == b'{"id":"b","doc":{"score":2.5,"tags":[]}}\n'
