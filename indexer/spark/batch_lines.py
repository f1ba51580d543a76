"""A batch's input lines built a column at a time in Arrow, byte for byte the lines the per-row
path (`rows.RowShape.line`) writes, for the schemas most DataFrames have.

The per-row path makes a Python dict of every row and a line of every dict: 10-12 µs a row of
a plain schema, on the cores the router, the daemon and Spark's JVM share. Here each column
becomes its JSON text in one Arrow kernel (or one orjson call for floats), and the lines are
concatenated from the columns' texts. Whatever this does not cover exactly gives None, and the
batch takes the per-row path, which also says what is wrong with a bad row: a type other than
strings, integers, booleans, floats, UTC or naive microsecond timestamps, structs of those and
lists of those without floats; a doc column; a NaN or an infinity; an id that is null, empty,
not ASCII or holds a character JSON escapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from indexer.spark.rows import RowShape, iso_timestamps


def _bytes_of(strings: pa.Array) -> np.ndarray:
    """The UTF-8 bytes behind a string column (a slice's neighbours too: enough for a check
    that may only say "look closer")."""
    data = strings.buffers()[2]
    return np.empty(0, np.uint8) if data is None else np.frombuffer(data, np.uint8)


class Text(NamedTuple):
    """Each row's JSON text of a value: `opening + values + closing`, null where the value is."""

    opening: str
    values: pa.Array
    closing: str = ""

    def joined(self) -> pa.Array:
        """The texts as one string column (nulls stay null)."""
        if not self.opening and not self.closing:
            return self.values
        return pc.binary_join_element_wise(self.opening, self.values, self.closing, "")


def _null_where(mask: pa.Array, text: pa.Array) -> pa.Array:
    return pc.if_else(mask, pa.scalar(None, pa.string()), text)


def _string(strings: pa.Array) -> Text:
    """JSON strings of a string column, byte for byte as orjson writes them."""
    raw = _bytes_of(strings)
    if (raw < 0x20).any():  # a control character: orjson's own escapes, per value
        quoted = [None if v is None else orjson.dumps(v) for v in strings.to_pylist()]
        return Text("", pa.array(quoted, pa.binary()).cast(pa.string()))
    if ((raw == 0x22) | (raw == 0x5C)).any():
        strings = pc.replace_substring(pc.replace_substring(strings, "\\", "\\\\"), '"', '\\"')
    return Text('"', strings, '"')


def _floats(values: pa.Array) -> Text | None:
    """JSON numbers of a float column as orjson writes them (one call for the column); None if
    one is NaN or infinite (a bad row, which the per-row path reports)."""
    if len(values) == 0:
        return Text("", pa.array([], pa.string()))
    if pc.any(pc.invert(pc.is_finite(values))).as_py():  # null: none but nulls
        return None
    numbers = orjson.dumps(values.to_pylist())[1:-1].split(b",")
    return Text("", pa.array(numbers, pa.binary(), mask=values.is_null()).cast(pa.string()))


def _value(
    values: pa.Array, keep_nulls: bool, nested: bool = False, in_list: bool = False
) -> Text | None:
    """Each value's JSON text, or None if not covered exactly. `nested`: inside a struct or a
    list; `in_list`: a list's items."""
    kind = values.type
    if pa.types.is_timestamp(kind):
        # Nested, a datetime is written by orjson itself on the per-row path.
        text = None if nested else iso_timestamps(values)
        return None if text is None else _string(text)
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return _string(values)
    if pa.types.is_integer(kind) or pa.types.is_boolean(kind):
        return Text("", values.cast(pa.string()))
    if pa.types.is_floating(kind) and not pa.types.is_float16(kind):
        # Floats inside structs and lists take the standard library's writer on the per-row path.
        return None if nested else _floats(values)
    if pa.types.is_struct(kind):
        if in_list:
            return None
        names = [kind.field(i).name for i in range(kind.num_fields)]
        if len(set(names)) != len(names):
            return None
        fields = values.flatten()  # children as the struct's rows see them, its slice applied
        body = _members(names, fields, keep_nulls, len(values), nested=True)
        if body is None:
            return None
        return Text("{", _null_where(values.is_null(), body.concatenated()), "}")
    if pa.types.is_list(kind):
        if in_list:
            return None
        items = _value(values.values, keep_nulls, nested=True, in_list=True)
        if items is None:
            return None
        item_text = pc.fill_null(items.joined(), "null")  # a null item is written as null
        # The list's offsets into its whole child (a sliced list's too); nulls applied after,
        # Arrow refusing a mask beside sliced offsets.
        lists = pa.ListArray.from_arrays(values.offsets, item_text)
        return Text("[", _null_where(values.is_null(), pc.binary_join(lists, ",")), "]")
    return None


class Members(NamedTuple):
    """The members of each row's JSON object, as columns to concatenate: `"name":value` with a
    leading comma, "" for a null left out. `cut_first`: the first of a row's members has a
    comma to cut (a member that may be left out leads); else the leading member has none."""

    columns: list[pa.Array]
    cut_first: bool

    def concatenated(self) -> pa.Array:
        """The members as one column: what goes between the object's braces."""
        columns = self.columns
        joined = columns[0] if len(columns) == 1 else pc.binary_join_element_wise(*columns, "")
        return pc.utf8_slice_codeunits(joined, 1) if self.cut_first else joined


def _members(
    names: Sequence[str], columns: Sequence[pa.Array], keep_nulls: bool, rows: int, nested: bool
) -> Members | None:
    """The members of the objects whose fields are `columns`, as the per-row path writes them:
    a null left out (written as null with `keep_nulls`); None if not covered."""
    if not columns:
        return Members([pa.array([""] * rows, pa.string())], cut_first=False)
    cut_first = not keep_nulls and columns[0].null_count > 0
    members = []
    for i, (name, column) in enumerate(zip(names, columns, strict=True)):
        text = _value(column, keep_nulls, nested)
        if text is None:
            return None
        opening = ("," if i or cut_first else "") + orjson.dumps(name).decode() + ":"
        member = pc.binary_join_element_wise(opening + text.opening, text.values, text.closing, "")
        if column.null_count:
            member = pc.fill_null(member, opening + "null" if keep_nulls else "")
        members.append(member)
    return Members(members, cut_first)


def _ids(column: pa.Array) -> tuple[Text, list[str]] | None:
    """The id's JSON text and the docid of every row; None if one is not plainly covered (a
    null or empty id, a bad row; an id json.dumps, the per-row path's, would escape)."""
    if column.null_count:
        return None
    kind = column.type
    if pa.types.is_integer(kind):
        text = column.cast(pa.string())
        return Text("", text), text.to_pylist()
    if not pa.types.is_string(kind) and not pa.types.is_large_string(kind):
        return None
    if len(column) and pc.any(pc.equal(pc.binary_length(column), 0)).as_py():
        return None
    raw = _bytes_of(column)
    if ((raw < 0x20) | (raw > 0x7E)).any():
        return None
    return _string(column), column.to_pylist()


def batch_lines(shape: RowShape, batch: pa.RecordBatch) -> tuple[list[bytes], list[str]] | None:
    """The line and the docid of every row of the batch, or None: then the batch takes the
    per-row path (`rows.lines_of`)."""
    if shape.doc_column is not None or not shape.fast:
        return None
    if len(batch) == 0:
        return [], []
    ids = _ids(batch.column(shape.id_column))
    if ids is None:
        return None
    docid, docids = ids
    names = [name for name, _ in shape.columns]
    columns = [batch.column(name) for name in names]
    members = _members(names, columns, shape.keep_nulls, len(batch), nested=False)
    if members is None:
        return None
    body = [members.concatenated()] if members.cut_first else members.columns
    lines = pc.binary_join_element_wise(
        '{"id":' + docid.opening, docid.values, docid.closing + ',"doc":{', *body, "}}\n", ""
    )
    if shape.delete_column is not None:
        deleted = batch.column(shape.delete_column)
        if not pa.types.is_boolean(deleted.type):
            return None
        gone = pc.binary_join_element_wise(
            '{"id":' + docid.opening, docid.values, docid.closing + ',"deleted":true}\n', ""
        )
        lines = pc.if_else(pc.fill_null(deleted, False), gone, lines)
    return lines.cast(pa.binary()).to_pylist(), docids
