"""Rows as input lines (indexer/spark/rows.py): types, nulls, the doc and delete columns; and
which router a row goes to (indexer/spark/writer.py)."""

from __future__ import annotations

import datetime
import decimal
import http.server
import json
import threading
import zlib
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from indexer.spark.options import IndexerSourceError
from indexer.spark.rows import BadRow, RowShape, iso_timestamps, lines_of, rows_of
from indexer.spark.writer import WriterOptions, find_owners
from tests.budget import examples


def struct(**fields: DataType) -> StructType:
    return StructType([StructField(name, t) for name, t in fields.items()])


SCHEMA = struct(
    id=StringType(),
    n=LongType(),
    at=TimestampType(),
    day=DateType(),
    price=DecimalType(10, 2),
    raw=BinaryType(),
    tags=ArrayType(StringType()),
    props=MapType(StringType(), struct(a=IntegerType(), b=StringType())),
    who=struct(name=StringType(), age=IntegerType()),
    gone=BooleanType(),
)


def document(line: bytes) -> Any:
    return json.loads(line)


def test_types_map_to_json_and_nulls_are_left_out() -> None:
    shape = RowShape.of(SCHEMA, "id", "gone", None, keep_nulls=False)
    row = {
        "id": "a",
        "n": 7,
        "at": datetime.datetime(2025, 3, 4, 5, 6, 7, 8, tzinfo=datetime.UTC),
        "day": datetime.date(2025, 3, 4),
        "price": decimal.Decimal("12.50"),
        "raw": b"\x00\xff",
        "tags": ["x", None],
        "props": [("k", {"a": 1, "b": None}), ("z", None)],  # Arrow gives maps as pairs
        "who": {"name": None, "age": 3},
        "gone": False,
    }
    assert document(shape.line(row)) == {
        "id": "a",
        "doc": {
            "n": 7,
            "at": "2025-03-04T05:06:07.000008+00:00",
            "day": "2025-03-04",
            "price": 12.5,
            "raw": "AP8=",
            "tags": ["x", None],
            "props": {"k": {"a": 1}},
            "who": {"age": 3},
        },
    }
    assert document(shape.line({**row, "n": None, "gone": None}))["doc"].get("n", "missing") == (
        "missing"
    )
    assert document(shape.line({**row, "gone": True})) == {"id": "a", "deleted": True}


def test_nulls_kept_when_asked() -> None:
    shape = RowShape.of(SCHEMA, "id", None, None, keep_nulls=True)
    line = document(shape.line({"id": 5, "n": None, "who": {"name": None, "age": 1}}))
    assert line["id"] == 5
    assert line["doc"]["n"] is None and line["doc"]["who"] == {"name": None, "age": 1}
    assert "gone" in line["doc"]  # without a delete column, it is a field like the others


def test_a_doc_column_is_the_document() -> None:
    schema = struct(id=StringType(), body=StringType(), s=struct(x=IntegerType()))
    text = RowShape.of(schema, "id", None, "body", False)
    assert text.line({"id": "a", "body": ' {"x": 1} '}) == b'{"id":"a","doc":{"x": 1}}\n'
    with pytest.raises(BadRow, match="not a JSON object"):
        text.line({"id": "a", "body": "[1]"})
    as_struct = RowShape.of(schema, "id", None, "s", False)
    assert document(as_struct.line({"id": "a", "s": {"x": None}})) == {"id": "a", "doc": {}}
    with pytest.raises(BadRow, match="give JSON text, a struct or a map"):
        RowShape.of(struct(id=StringType(), n=IntegerType()), "id", None, "n", False)


def test_bad_rows_say_why_and_name_the_id() -> None:
    shape = RowShape.of(struct(id=StringType(), x=DoubleType()), "id", None, None, False)
    rows = [{"id": "ok", "x": 1.0}, {"id": "nan", "x": float("nan")}, {"id": None, "x": 1.0}]
    lines = lines_of(shape, rows)
    assert lines[0].line is not None and lines[0].docid == "ok"
    assert lines[1].line is None and "row with id 'nan'" in lines[1].error
    assert "NaN and Infinity have no JSON form" in lines[1].error
    assert lines[2].line is None and "is null" in lines[2].error
    with pytest.raises(BadRow, match="string or an integer"):
        shape.line({"id": 1.5})
    with pytest.raises(BadRow, match="no column 'key'"):
        RowShape.of(SCHEMA, "key", None, None, False)


class StatsServer:
    """A router's `GET /stats` as JSON, served on 127.0.0.1 from a thread."""

    def __init__(self, stats: dict[str, Any]) -> None:
        body = json.dumps(stats).encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def stats(vbuckets: str | None, shards: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"source": {"vbuckets": 1024}, "vbuckets": vbuckets}
    if shards is not None:
        out["shards"] = shards
    return out


def test_rows_go_to_the_router_or_shard_that_owns_their_vbucket() -> None:
    shards = [
        {"vbuckets": "vbuckets 0-511", "url": "http://127.0.0.1:1"},  # same host: direct
        {"vbuckets": "vbuckets 512-1023", "url": "http://10.9.9.9:2"},  # elsewhere: the parent
    ]
    sharded = StatsServer(stats(None, shards))
    low, high = (
        StatsServer(stats("vbuckets 0-255,768-1023")),
        StatsServer(stats("vbuckets 256-767")),
    )
    try:
        owners = find_owners(WriterOptions((sharded.url,), "id"))
        ids = {vb: f"d{n}" for n in range(5000) for vb in [zlib.crc32(b"d%d" % n) % 1024]}
        assert owners.target(ids[3], 0) == "http://127.0.0.1:1"
        assert owners.target(ids[700], 0) == sharded.url
        peers = find_owners(WriterOptions((low.url, high.url), "id"))
        assert peers.target(ids[3], 0) == low.url and peers.target(ids[900], 5) == low.url
        assert peers.target(ids[300], 0) == high.url
        both = find_owners(WriterOptions((low.url, sharded.url), "id"))
        assert {both.target(ids[3], task) for task in range(4)} == {low.url, "http://127.0.0.1:1"}
        with pytest.raises(IndexerSourceError, match="no router given owns 512 vbuckets"):
            find_owners(WriterOptions((low.url,), "id"))
    finally:
        for server in (sharded, low, high):
            server.close()


_FIRST = datetime.datetime(1, 1, 1)
_LAST = datetime.datetime(9999, 12, 31, 23, 59, 59, 999999)


@settings(max_examples=examples(100), deadline=None)
@given(
    st.lists(
        st.one_of(
            st.none(),
            st.datetimes(min_value=_FIRST, max_value=_LAST),
            st.datetimes(min_value=_FIRST, max_value=_LAST).map(lambda d: d.replace(microsecond=0)),
        ),
        max_size=30,
    ),
    st.sampled_from([None, "UTC", "Etc/UTC", "+00:00"]),
)
def test_timestamps_made_in_numpy_are_the_per_value_isoformat(
    values: list[datetime.datetime | None], zone: str | None
) -> None:
    kind = pa.timestamp("us", tz=zone)
    aware = [
        None if v is None else v if zone is None else v.replace(tzinfo=datetime.UTC) for v in values
    ]
    array = pa.array(aware, type=kind)
    text = iso_timestamps(array)
    assert text is not None
    # The model: each value as Arrow gives it to Python, written as the per-value path does.
    expected = [None if v is None else v.isoformat() for v in array.to_pylist()]
    assert text.to_pylist() == expected


def test_other_time_zones_and_units_keep_the_per_value_path() -> None:
    when = [datetime.datetime(2025, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)]
    assert iso_timestamps(pa.array(when, type=pa.timestamp("us", tz="Europe/Paris"))) is None
    assert iso_timestamps(pa.array(when, type=pa.timestamp("ns", tz="UTC"))) is None
    assert iso_timestamps(pa.array([1, 2])) is None


def test_rows_of_a_batch_give_the_lines_of_its_python_rows() -> None:
    seen = [datetime.datetime(2025, 1, 2, 3, 4, 5, 600, tzinfo=datetime.UTC), None]
    batch = pa.RecordBatch.from_pydict(
        {
            "id": ["a", "b"],
            "seen": pa.array(seen, type=pa.timestamp("us", tz="UTC")),
            "age": [3, None],
        }
    )
    shape = RowShape.of(
        struct(id=StringType(), seen=TimestampType(), age=IntegerType()), "id", None, None, False
    )
    assert lines_of(shape, rows_of(batch)) == lines_of(shape, batch.to_pylist())
    assert rows_of(batch)[0]["seen"] == "2025-01-02T03:04:05.000600+00:00"
