"""The feed's answers (indexer/http/changes.py: rows built in columns, a chunk at a time) on
a real LevelDB directory, for array, expression and plain indexes: replayed, the history's
rows give the hand-written model's entries, and the Arrow and NDJSON answers are exactly
those rows, in order."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.changes import ChangeHistory, ChangeRow, ChangeToken
from indexer.http.changes import ChangeRows, change_schema
from indexer.keys import MISSING, decode_key
from indexer.router.documents import Document
from indexer.router.streams.records import RecordEncoder
from indexer.scans import Row, column_value
from indexer.storage import IndexStore, StoredIndex
from indexer.timestamps import StabilityTimestamp
from tests.workers.test_array_flush import DEFS, DOCS, expected, norm
from workers.flush import BackIndexCache, IndexWriter

VBUCKETS = 3
EVENTS = st.lists(
    st.tuples(st.sampled_from(["d1", "d2", "d3", "d4", "d5"]), st.one_of(st.none(), DOCS)),
    min_size=1,
    max_size=30,
)


class ArrowSink:
    def __init__(self) -> None:
        self.batches: list[pa.RecordBatch] = []

    def write_batch(self, batch: pa.RecordBatch) -> None:
        self.batches.append(batch)


def answers(
    history: ChangeHistory, store: IndexStore, index: StoredIndex, since: int, until: int
) -> tuple[list[ChangeRow], list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows of `read`, and the NDJSON and Arrow answers of the same read."""
    token = ChangeToken(history.history_id, since)
    source = store.snapshot()
    try:
        rows = list(history.read(index, token, until, source)[0])
        lines: list[dict[str, Any]] = []
        answer = ChangeRows(
            index, history.history_id, records=history.read_records(index, token, until, source)[0]
        )
        while (body := answer.ndjson()) is not None:
            lines += [json.loads(line) for line in body.decode().splitlines()]
        assert answer.sent == len(rows)
        kinds = ["json"] * len(index.definition.keys)
        sink = ArrowSink()
        answer = ChangeRows(
            index, history.history_id, records=history.read_records(index, token, until, source)[0]
        )
        schema = change_schema(index, kinds)
        while answer.arrow(schema, kinds, sink):
            pass
        table = pa.Table.from_batches(sink.batches, schema=schema)
        return rows, lines, table.to_pylist()
    finally:
        source.close()


@settings(max_examples=60, deadline=None)
@given(st.lists(EVENTS, min_size=1, max_size=4))
def test_feed_answers_are_the_history_rows_and_replay_to_the_model(
    tmp_path_factory: Any, flushes: list[list[tuple[str, Any]]]
) -> None:
    tmp_path: Path = tmp_path_factory.mktemp("store")
    encoder = RecordEncoder(DEFS)
    with IndexStore(tmp_path) as store:
        indexes = store.ensure_indexes(DEFS)
        cache = BackIndexCache(1000, len(indexes))
        writer = IndexWriter(store, indexes, cache, history=True)
        history = ChangeHistory(store, VBUCKETS)
        seqnos = [0] * VBUCKETS
        stamp = StabilityTimestamp(tuple(seqnos), (0,) * VBUCKETS)
        first = history.write_mark(stamp, store.all_indexes())
        docs: dict[str, dict[str, Any] | None] = {}
        for events in flushes:
            records, vbuckets = [], []
            for docid, body in events:
                vb = int(docid[1:]) % VBUCKETS  # a document's vbucket is its id's
                seqnos[vb] += 1
                records.append(encoder.record(seqnos[vb], Document(docid, body))[4:])
                vbuckets.append(vb)
                docs[docid] = body
            writer.apply(records, vbuckets)
            stamp = StabilityTimestamp(tuple(seqnos), (0,) * VBUCKETS)
            last = history.write_mark(stamp, store.all_indexes())
        for index in indexes:
            name = index.definition.name
            count, desc = len(index.definition.keys), index.definition.desc
            rows, lines, arrow = answers(history, store, index, first.number, last.number)
            # Replayed from nothing, the rows give the model's entries.
            entries: set[tuple[str, bytes]] = set()
            for row in rows:
                entry = (norm(decode_key(row.key, count, desc=desc)[0]), row.docid)
                if row.op == "delete":
                    assert entry in entries, (name, row)
                    entries.remove(entry)
                else:
                    assert entry not in entries, (name, row)
                    entries.add(entry)
            want = {
                (key, docid.encode())
                for docid, keys in expected(docs, name).items()
                for key in keys
            }
            assert entries == want, name
            # The answers are those rows, in order.
            json_rows = []
            arrow_rows = []
            for row in rows:
                values = decode_key(row.key, count, desc=desc)[0]
                snapshot = f"{history.history_id}.{row.snapshot}"
                as_row = Row(values, row.docid.decode()).as_json()
                json_rows.append({"op": row.op, **as_row, "snapshot": snapshot})
                columns = {
                    path: column_value("json", v)
                    for path, v in zip(index.definition.keys, values, strict=True)
                }
                arrow_rows.append(
                    {"op": row.op, **columns, "id": row.docid.decode(), "snapshot": snapshot}
                )
            assert lines == json.loads(json.dumps(json_rows)), name
            assert arrow == arrow_rows, name
            assert MISSING not in [v for r in arrow_rows for v in r.values()]
