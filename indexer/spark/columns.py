"""Columns of a read: Spark types of the index's key positions, value conversion, and the
filters pushed into a key range."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import (
    EqualTo,
    Filter,
    GreaterThan,
    GreaterThanOrEqual,
    IsNotNull,
    LessThan,
    LessThanOrEqual,
)
from pyspark.sql.types import (
    BooleanType,
    ByteType,
    DataType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructField,
    StructType,
)

from indexer.keys import MISSING, encode_key
from indexer.scans import AFTER_PREFIX, KeyRange, column_names, column_value
from indexer.spark.options import IndexerSourceError

JSON_TEXT = "indexer.json_text"  # field metadata marking a column of JSON text (the default)


@dataclass(frozen=True)
class Column:
    """One output column: where its value comes from and how it is converted."""

    name: str
    position: int  # -1: the document id, else the key component
    path: str  # the key path ("" for the id)
    kind: str  # "id", "json" (JSON text), or a converted kind: string, boolean, integral, ...
    arrow: Any  # the pyarrow type Spark expects
    inferred: bool = False  # typed from what the index held (not a schema the user gave)


_INT_BITS = {"byte": 8, "short": 16, "integer": 32, "long": 64}
_KINDS: dict[type[DataType], str] = {
    StringType: "string",
    BooleanType: "boolean",
    ByteType: "byte",
    ShortType: "short",
    IntegerType: "integer",
    LongType: "long",
    FloatType: "float",
    DoubleType: "double",
}
_NUMERIC = ("byte", "short", "integer", "long", "float", "double")


def default_schema(keys: Sequence[str]) -> StructType:
    """`id` then one STRING column of JSON text per key path (dots become underscores)."""
    names = _key_column_names(keys)
    fields = [StructField("id", StringType(), False)]
    fields += [StructField(n, StringType(), True, metadata={JSON_TEXT: True}) for n in names]
    return StructType(fields)


_SPARK_TYPES: dict[str, type[DataType]] = {
    "string": StringType,
    "boolean": BooleanType,
    "long": LongType,
    "double": DoubleType,
}
SERVER_KINDS = ("json", "string", "boolean", "long", "double")  # kinds a scan sends typed


def typed_schema(keys: Sequence[str], kinds: Sequence[str]) -> StructType:
    """`id` then one column per key path of the kind the index's values there have (a column
    kind of `indexer.scans.column_kind`): JSON text where they are of several types."""
    names = _key_column_names(keys)
    fields = [StructField("id", StringType(), False)]
    for name, kind in zip(names, kinds, strict=True):
        if kind == "json":
            fields.append(StructField(name, StringType(), True, metadata={JSON_TEXT: True}))
        else:
            fields.append(StructField(name, _SPARK_TYPES[kind](), True, metadata={INFERRED: kind}))
    return StructType(fields)


INFERRED = "indexer.inferred"  # field metadata: the type came from what the index held
_FITS = {"long": {"integer"}, "double": {"integer", "number"}, "string": {"string"}}
_FITS["boolean"] = {"boolean"}


def fits(kind: str, types: set[str]) -> bool:
    """Whether every value of these JSON types fits a column of `kind` (JSON text takes all)."""
    present = types - {"missing", "null"}
    return kind not in _FITS or present <= _FITS[kind]


def server_kinds(columns: Sequence[Column], count: int) -> list[str]:
    """The kind a scan sends each key position in: the column's own where the server makes it,
    else JSON text (converted here, row by row)."""
    kinds = ["json"] * count
    for column in columns:
        if column.position >= 0 and column.kind in SERVER_KINDS:
            kinds[column.position] = column.kind
    return kinds


def _key_column_names(keys: Sequence[str]) -> list[str]:
    names = column_names(keys)
    if len(set(names)) != len(names) or "id" in names:
        raise IndexerSourceError(
            f"key paths {list(keys)} give clashing column names {names} (or one named id)"
        )
    return names


def plan_columns(schema: StructType, keys: Sequence[str]) -> list[Column]:
    """Map each field of the read schema to the id or a key component, checking its type."""
    from pyspark.sql.pandas.types import to_arrow_type

    names = _key_column_names(keys)
    out = []
    for field in schema.fields:
        arrow = to_arrow_type(field.dataType, timezone="UTC")
        if field.name == "id":
            if not isinstance(field.dataType, StringType):
                given = field.dataType.simpleString()
                raise IndexerSourceError(f"column id is a STRING, not {given}")
            out.append(Column("id", -1, "", "id", arrow))
            continue
        if field.name not in names:
            raise IndexerSourceError(
                f"no column {field.name!r} in the index: its columns are id, {', '.join(names)}"
            )
        position = names.index(field.name)
        if field.metadata.get(JSON_TEXT) and isinstance(field.dataType, StringType):
            kind = "json"
        else:
            found = _KINDS.get(type(field.dataType))
            if found is None:
                supported = "STRING, BOOLEAN, TINYINT, SMALLINT, INT, BIGINT, FLOAT, DOUBLE"
                raise IndexerSourceError(
                    f"column {field.name}: {field.dataType.simpleString()} is not supported "
                    f"({supported})"
                )
            kind = found
        inferred = field.metadata.get(INFERRED) == kind
        out.append(Column(field.name, position, keys[position], kind, arrow, inferred))
    return out


def convert(kind: str, value: Any) -> Any:
    """A JSON value as a column of `kind` holds it; None when it does not fit."""
    if value is MISSING or value is None:
        return None
    if kind in ("json", "string", "boolean", "double"):
        return column_value(kind, value)  # as the daemon converts them for typed scans
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if kind == "float":
        try:
            return struct.unpack("f", struct.pack("f", value))[0]
        except (OverflowError, struct.error):
            return None
    if isinstance(value, float):
        if not value.is_integer():
            return None
        value = int(value)
    bits = _INT_BITS[kind]
    return value if -(1 << (bits - 1)) <= value < (1 << (bits - 1)) else None


def from_server(batch: Any, columns: Sequence[Column]) -> list[Any]:
    """The arrays of a server batch (the id, a column per key path of the kind asked for:
    `server_kinds`) as the read schema's `columns` want them."""
    arrays = []
    for column in columns:
        if column.kind == "id":
            array = batch.column("id")
        else:
            array = batch.column(column.path)
            if column.kind not in SERVER_KINDS:  # sent as JSON text, converted here
                values = [
                    None if t is None else convert(column.kind, json.loads(t))
                    for t in array.to_pylist()
                ]
                array = pa.array(values, type=column.arrow)
        if array.type != column.arrow:
            array = array.cast(column.arrow)
        arrays.append(array)
    return arrays


_OPS: dict[type[Filter], str] = {
    EqualTo: "eq",
    GreaterThan: "gt",
    GreaterThanOrEqual: "ge",
    LessThan: "lt",
    LessThanOrEqual: "le",
}
_ARROW_OPS: dict[str, Callable[[Any, Any], Any]] = {
    "eq": pc.equal,
    "gt": pc.greater,
    "ge": pc.greater_equal,
    "lt": pc.less,
    "le": pc.less_equal,
}


def _type_byte(value: Any) -> bytes:
    return encode_key([value])[:1]


# Encoded keys of one JSON type form one contiguous block (N1QL collation ranks the types).
_BLOCKS: dict[str, tuple[bytes, bytes]] = {
    "boolean": (_type_byte(False), _type_byte(0)),
    "number": (_type_byte(0), _type_byte("")),
    "string": (_type_byte(""), _type_byte([])),
}


def _literal_fits(kind: str, value: Any) -> bool:
    if kind in ("json", "string"):
        return isinstance(value, str)
    if kind == "boolean":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind in ("float", "double"):
        if isinstance(value, int):
            return abs(value) < 1 << 1023
        return isinstance(value, float) and math.isfinite(value)
    return isinstance(value, int) and kind in _INT_BITS


def accepts(column: Column, f: Filter) -> tuple[str, Any] | None:
    """The (op, literal) the reader applies for filter `f` on the leading key, or None."""
    if isinstance(f, IsNotNull):
        return ("notnull", None)
    op = _OPS.get(type(f))
    value: Any = getattr(f, "value", None)
    if op is None or not _literal_fits(column.kind, value):
        return None
    if column.kind == "json":
        # JSON text orders unlike the index (9 < 10 but "9" > "10"): equality only.
        if op != "eq":
            return None
        try:
            encode_key([json.loads(value)])
        except ValueError:  # not JSON, or not a key value (NaN): Spark finds no row either
            return None
    return (op, value)


def filter_range(kind: str, pushed: Sequence[tuple[str, Any]]) -> KeyRange:
    """Encoded bounds holding every entry whose leading value can pass all `pushed` filters."""
    if not pushed:
        return KeyRange()
    lows: list[bytes] = []
    highs: list[bytes] = []
    block = "number" if kind in _NUMERIC else kind
    if block in _BLOCKS:  # a converted column is null outside its JSON type: no match there
        lows.append(_BLOCKS[block][0])
        highs.append(_BLOCKS[block][1])
    for op, value in pushed:
        if op == "notnull":
            continue
        if block == "number":
            # A number encodes as 0x05 + its nearest double + a suffix, so the 9-byte prefix of
            # a double bounds every number rounding to it. FLOAT rounds coarser: widen by an ulp.
            low = high = float(value)
            if kind == "float":
                margin = max(abs(low) * 2.0**-23, 2.0**-149)
                low, high = low - margin, high + margin
            lo = encode_key([low])[:9]
            hi = encode_key([high])[:9] + AFTER_PREFIX
            if op in ("gt", "ge"):
                lows.append(lo)
            elif op in ("lt", "le"):
                highs.append(hi)
            else:
                lows.append(lo)
                highs.append(hi)
            continue
        p = encode_key([json.loads(value) if kind == "json" else value])
        if op == "eq":
            lows.append(p)
            highs.append(p + AFTER_PREFIX)
        elif op == "gt":
            lows.append(p + AFTER_PREFIX)
        elif op == "ge":
            lows.append(p)
        elif op == "lt":
            highs.append(p)
        else:
            highs.append(p + AFTER_PREFIX)
    return KeyRange(max(lows) if lows else None, min(highs) if highs else None)


def intersect(a: KeyRange, b: KeyRange) -> KeyRange | None:
    """The common part of two ranges, or None when it is empty."""
    starts = [s for s in (a.start, b.start) if s is not None]
    stops = [s for s in (a.stop, b.stop) if s is not None]
    start = max(starts) if starts else None
    stop = min(stops) if stops else None
    if start is not None and stop is not None and start >= stop:
        return None
    return KeyRange(start, stop)


def apply_filters(batch: Any, index: int, pushed: Sequence[tuple[str, Any]]) -> Any:
    """Rows of the batch whose column `index` passes every pushed filter, as Spark would say."""
    if not pushed or batch.num_rows == 0:
        return batch
    column = batch.column(index)
    mask = None
    for op, value in pushed:
        if op == "notnull":
            test = pc.is_valid(column)
        else:
            test = _ARROW_OPS[op](column, pa.scalar(value, type=column.type))
        mask = test if mask is None else pc.and_kleene(mask, test)
    return batch.filter(mask)  # null in the mask drops the row, like a SQL WHERE
