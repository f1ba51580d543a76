"""Spark rows as the router's input lines: how a row becomes a document or a delete.

The id column gives the document id (a string or an integer). With a delete column, a row whose
value there is true is a delete. With a doc column, its value is the document: JSON text taken
as it is, or a struct or map. Otherwise the row's other columns form the document. Spark's
types map to JSON: structs and maps are objects, arrays are arrays, timestamps and dates are
ISO-8601 strings, decimals are numbers, binary is base64 text. A null is left out of the object
it is in (as es-hadoop does), unless `nulls="keep"` writes it as null. NaN and the infinities
have no JSON form: such a row is a bad row.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import orjson
import pyarrow as pa
from pyspark.sql.types import ArrayType, DataType, DoubleType, FloatType, MapType, StructType

Convert = Callable[[Any], Any]


class BadRow(ValueError):
    """A row that cannot be a line of the input: the message says why."""


def _default(value: Any) -> Any:
    """JSON for the values json does not know: timestamps, dates, decimals, binary."""
    if isinstance(value, datetime.datetime | datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode("ascii")
    raise TypeError(f"a {type(value).__name__} has no JSON form")


def _converter(data_type: DataType, keep_nulls: bool) -> Convert | None:
    """What turns a value of this type (as Arrow's to_pylist gives it) into its JSON value,
    or None when nothing needs doing (json and `_default` take it as it is)."""
    if isinstance(data_type, StructType):
        fields = [(f.name, _converter(f.dataType, keep_nulls)) for f in data_type.fields]
        if keep_nulls and all(c is None for _, c in fields):
            return None

        def struct(value: Any) -> Any:
            if value is None:
                return None
            out: dict[str, Any] = {}
            for name, convert in fields:
                item = value.get(name)
                if item is None:
                    if keep_nulls:
                        out[name] = None
                    continue
                out[name] = item if convert is None else convert(item)
            return out

        return struct
    if isinstance(data_type, MapType):
        convert_value = _converter(data_type.valueType, keep_nulls)

        def mapping(value: Any) -> Any:
            if value is None:
                return None
            pairs = value.items() if isinstance(value, dict) else value  # Arrow: (key, value)
            out: dict[str, Any] = {}
            for key, item in pairs:
                if item is None and not keep_nulls:
                    continue
                if item is not None and convert_value is not None:
                    item = convert_value(item)
                out[str(key)] = item
            return out

        return mapping
    if isinstance(data_type, ArrayType):
        convert_item = _converter(data_type.elementType, keep_nulls)
        if convert_item is None:
            return None

        def array(value: Any) -> Any:
            if value is None:
                return None
            return [None if item is None else convert_item(item) for item in value]

        return array
    return None


def _holds_float(data_type: DataType) -> bool:
    """Whether a value of this type may hold a float anywhere in it."""
    if isinstance(data_type, FloatType | DoubleType):
        return True
    if isinstance(data_type, StructType):
        return any(_holds_float(f.dataType) for f in data_type.fields)
    if isinstance(data_type, MapType):
        return _holds_float(data_type.valueType)
    if isinstance(data_type, ArrayType):
        return _holds_float(data_type.elementType)
    return False


@dataclass(frozen=True)
class RowShape:
    """How the rows of one schema become lines: which column is what, and the converters."""

    id_column: str
    delete_column: str | None
    doc_column: str | None
    keep_nulls: bool
    columns: tuple[tuple[str, Convert | None], ...]  # the document's columns (no doc column)
    doc_convert: Convert | None  # of the doc column when it is a struct or map
    # orjson (5x the stdlib's speed) writes NaN as null: it serves a schema whose floats are
    # all top-level columns, checked here (`floats`); others take the stdlib, which refuses NaN.
    floats: tuple[str, ...] = ()
    fast: bool = True

    @classmethod
    def of(
        cls,
        schema: StructType,
        id_column: str,
        delete_column: str | None,
        doc_column: str | None,
        keep_nulls: bool,
    ) -> RowShape:
        names = schema.fieldNames()
        for option, column in (("id", id_column), ("delete", delete_column), ("doc", doc_column)):
            if column is not None and column not in names:
                raise BadRow(f"{option}: no column {column!r}; the columns are {', '.join(names)}")
        left_out = {id_column, delete_column}
        columns = tuple(
            (f.name, _converter(f.dataType, keep_nulls))
            for f in schema.fields
            if f.name not in left_out
        )
        doc_convert = None
        if doc_column is not None:
            doc_type = schema[doc_column].dataType
            if not isinstance(doc_type, StructType | MapType) and doc_type.typeName() != "string":
                raise BadRow(
                    f"doc: column {doc_column!r} is {doc_type.simpleString()}: give JSON text, "
                    "a struct or a map"
                )
            doc_convert = _converter(doc_type, keep_nulls)
        body = [f for f in schema.fields if f.name not in left_out]
        floats = tuple(f.name for f in body if isinstance(f.dataType, FloatType | DoubleType))
        fast = doc_column is None and not any(
            _holds_float(f.dataType) for f in body if f.name not in floats
        )
        return cls(
            id_column, delete_column, doc_column, keep_nulls, columns, doc_convert, floats, fast
        )

    def docid(self, row: dict[str, Any]) -> str | int:
        """The row's document id (BadRow if it has none that the router takes)."""
        value = row.get(self.id_column)
        if value is None:
            raise BadRow(f"the id column {self.id_column!r} is null")
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise BadRow(f"the id must be a string or an integer, not {type(value).__name__}")
        if value == "":
            raise BadRow("the id is empty")
        return value

    def line(self, row: dict[str, Any]) -> bytes:
        """The input line of one row (BadRow: why it cannot be one)."""
        docid = json.dumps(self.docid(row))
        document: Any
        if self.delete_column is not None and row.get(self.delete_column):
            return b'{"id":%s,"deleted":true}\n' % docid.encode()
        if self.doc_column is not None:
            value = row.get(self.doc_column)
            if value is None:
                raise BadRow(f"the doc column {self.doc_column!r} is null")
            if isinstance(value, str):  # JSON text: the router checks it is an object
                text = value.strip()
                if not text.startswith("{"):
                    raise BadRow(f"the doc column {self.doc_column!r} is not a JSON object")
                return b'{"id":%s,"doc":%s}\n' % (docid.encode(), text.encode())
            document = value if self.doc_convert is None else self.doc_convert(value)
        else:
            document = {}
            for name, convert in self.columns:
                value = row.get(name)
                if value is None:
                    if self.keep_nulls:
                        document[name] = None
                    continue
                document[name] = value if convert is None else convert(value)
        try:
            if self.fast:
                for name in self.floats:
                    value = document.get(name)
                    if value is not None and not math.isfinite(value):
                        raise ValueError(name)
                body = orjson.dumps(document, default=_default)
            else:
                text = json.dumps(
                    document, default=_default, allow_nan=False, separators=(",", ":")
                )
                body = text.encode()
        except ValueError:
            raise BadRow("NaN and Infinity have no JSON form: replace or drop them") from None
        except TypeError as exc:
            raise BadRow(str(exc)) from None
        return b'{"id":%s,"doc":%s}\n' % (docid.encode(), body)


class RowLine(NamedTuple):
    """A row as the writer sends it: its line and id, or (line None) why it is a bad row."""

    line: bytes | None
    docid: str
    error: str = ""


def lines_of(shape: RowShape, rows: Sequence[dict[str, Any]]) -> list[RowLine]:
    """The line of each row, in order; a bad row's error names its id."""
    out = []
    for row in rows:
        try:
            docid = str(shape.docid(row))
            out.append(RowLine(shape.line(row), docid))
        except BadRow as exc:
            value = row.get(shape.id_column)
            out.append(
                RowLine(None, "" if value is None else str(value), f"row with id {value!r}: {exc}")
            )
    return out


# Arrow time zones whose datetimes print "+00:00" (what `datetime.isoformat` gives for them).
_UTC_ZONES = frozenset({"UTC", "Etc/UTC", "+00:00", "Z", "GMT", "Etc/GMT", "Universal", "Zulu"})
_EPOCH = datetime.datetime(1970, 1, 1)
_FIRST_US = (datetime.datetime.min - _EPOCH) // datetime.timedelta(microseconds=1)
_LAST_US = (datetime.datetime.max - _EPOCH) // datetime.timedelta(microseconds=1)


def iso_timestamps(array: pa.Array) -> pa.Array | None:
    """A column of microsecond timestamps (naive or UTC) as the ISO-8601 strings the per-value
    path writes (`datetime.isoformat`: no fraction when it is zero), made in numpy; None for any
    other column. A datetime per value took 5 us, more than the rest of a row's line."""
    kind = array.type
    if not pa.types.is_timestamp(kind) or kind.unit != "us":
        return None
    if kind.tz is None:
        suffix = ""
    elif kind.tz in _UTC_ZONES:
        suffix = "+00:00"
    else:
        return None
    micros = array.cast(pa.int64())
    low, high = pa.compute.min_max(micros).values()
    if low.is_valid and (low.as_py() < _FIRST_US or high.as_py() > _LAST_US):
        return None  # beyond what a datetime holds: the per-value path says so
    nulls = array.is_null().to_numpy(zero_copy_only=False)
    values = micros.fill_null(0).to_numpy().astype("datetime64[us]")
    whole = values.astype("datetime64[s]")
    text = np.where(
        values == whole,
        np.datetime_as_string(whole, unit="s"),
        np.datetime_as_string(values, unit="us"),
    )
    if suffix:
        text = np.char.add(text, suffix)
    return pa.array(text, type=pa.string(), mask=nulls)


def rows_of(batch: pa.RecordBatch) -> list[dict[str, Any]]:
    """The rows of an Arrow batch as `lines_of` takes them, timestamps already ISO text."""
    columns = list(batch.columns)
    changed = False
    for i, column in enumerate(columns):
        text = iso_timestamps(column)
        if text is not None:
            columns[i] = text
            changed = True
    if changed:
        batch = pa.RecordBatch.from_arrays(columns, names=batch.schema.names)
    rows: list[dict[str, Any]] = batch.to_pylist()
    return rows
