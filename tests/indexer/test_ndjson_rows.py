"""A scan's NDJSON lines (indexer/http/wire.py), joined by Arrow, against json's text of each
row: keys, missing positions, docids that JSON escapes, projections and collations."""

from __future__ import annotations

import json
import random

import pyarrow as pa
import pytest

from indexer.http.wire import Projection, _ndjson_chunk
from indexer.keys import MISSING
from indexer.scans import EntryBatch


def reference(batch: EntryBatch, projection: Projection) -> bytes:
    """Each row as json writes it, one by one."""
    lines = []
    for code, docid in zip(batch.codes.to_pylist(), batch.docids.to_pylist(), strict=True):
        values = [batch.keys[code][j] for j in projection.positions]
        row: dict[str, object] = {"key": [None if v is MISSING else v for v in values]}
        if projection.collation:
            row["collation"] = batch.collations[code].hex() + " " + docid
        if projection.with_id:
            row["id"] = docid
        missing = [i for i, v in enumerate(values) if v is MISSING]
        if missing:
            row["missing"] = missing
        lines.append(json.dumps(row, ensure_ascii=False) + "\n")
    return "".join(lines).encode()


@pytest.mark.parametrize("tricky", [False, True])
def test_ndjson_lines_equal_json_row_by_row(tricky: bool) -> None:
    rng = random.Random(5)
    keys: list[list[object]] = [["Oslo", 30], ["dé", None], [MISSING, 1.5], ['"q"\\', True]]
    keys += [[{"a": [1, "x"]}, -(2**70)], ["\U0001f600", MISSING]]
    collations = [f"c{i}".encode() for i in range(len(keys))]
    plain = [f"doc{i:05d}" for i in range(2000)] + ["dé", "\U0001f600", " ", ""]
    escaped = ['a"b', "a\\b", "tab\there", "nl\nx", "\x00"]
    for _ in range(10):
        n = rng.randrange(0, 300)
        docids = [rng.choice(plain) for _ in range(n)]
        if tricky and n:
            docids[rng.randrange(n)] = rng.choice(escaped)
        codes = pa.array([rng.randrange(len(keys)) for _ in range(n)], pa.int32())
        batch = EntryBatch(pa.array(docids, pa.string()), codes, keys, collations)
        for projection in (
            Projection((0, 1)),
            Projection((1,), with_id=False),
            Projection((1, 0), collation=True),
            Projection((0,), with_id=False, collation=True),
        ):
            got = _ndjson_chunk(iter([batch]), projection)
            assert got == reference(batch, projection), projection
            assert [json.loads(line) for line in (got or b"").splitlines()] == [
                json.loads(line) for line in reference(batch, projection).splitlines()
            ]
    assert _ndjson_chunk(iter([]), Projection((0,))) is None
