"""A partition's read taken over by other nodes (indexer/spark/takeover.py): their batches merged
in index order by the collation column, and the partitions' fields kept in a descending read.
The takeover itself, with a real node killed, is in tests/e2e/test_etcd_cluster.py."""

from __future__ import annotations

import random

import pyarrow as pa

from indexer.keys import encode_key
from indexer.spark.source import IndexerPartition, _in_order
from indexer.spark.takeover import merge_batches, without_collation


def batches_of(rows: list[tuple[bytes, str, int]], rng: random.Random) -> list[pa.RecordBatch]:
    """Rows (collation, docid, value) as record batches of random sizes (some empty): the
    id first, a key column, the collation last, as a scan with collation=hex sends them."""
    out = []
    at = 0
    while at < len(rows) or not out:
        size = rng.choice([0, 1, 2, 5, 17])
        part = rows[at : at + size]
        out.append(
            pa.record_batch(
                [
                    pa.array([r[1] for r in part], pa.string()),
                    pa.array([r[2] for r in part], pa.int64()),
                    pa.array([r[0] for r in part], pa.binary()),
                ],
                names=["id", "age", "collation"],
            )
        )
        at += size
    return out


def test_merged_batches_come_out_in_index_order() -> None:
    values = [None, False, True, -1, 0, 3, 3.5, 2**70, "", "a", "ab", "b", [1], {"x": 1}]
    rows = []
    for i in range(300):
        value = values[i % len(values)]
        docid = random.Random(i).choice(["", "d", "d\x00", "dé", "d\U0001f600", "e"]) + str(i)
        rows.append((encode_key([value, i % 3]), docid, i))
    ordered = sorted(rows, key=lambda r: (r[0], r[1].encode()))
    for seed in range(30):
        rng = random.Random(seed)
        nodes: list[list[tuple[bytes, str, int]]] = [[] for _ in range(rng.randrange(1, 5))]
        for row in rows:
            nodes[rng.randrange(len(nodes))].append(row)
        for reverse in (False, True):
            streams = [
                iter(batches_of(sorted(n, key=lambda r: (r[0], r[1].encode()), reverse=reverse),
                                rng))
                for n in nodes
            ]  # fmt: skip
            out = list(merge_batches(streams, 0, reverse))
            got = [v for b in out for v in b.column("age").to_pylist()]
            want = [r[2] for r in (ordered[::-1] if reverse else ordered)]
            assert got == want, (seed, reverse)
            assert all(b.schema.names == ["id", "age", "collation"] for b in out)
            assert [without_collation(b).schema.names for b in out[:1]] in ([], [["id", "age"]])


def test_a_descending_read_keeps_what_each_partition_answers_for() -> None:
    parts = [
        IndexerPartition(0, None, b"m", "p1", url="http://a", node="a", vbuckets="0-3",
                         mine=frozenset({0, 1}), at_plus={"0": 5, "1": 7}, num_vbuckets=8),
        IndexerPartition(1, b"m", None, "p2", url="http://b", node="b", vbuckets="4-7",
                         mine=frozenset({4}), at_plus={"4": 1}, num_vbuckets=8),
    ]  # fmt: skip
    back = _in_order(list(parts), "desc")
    assert [p.number for p in back] == [0, 1]  # type: ignore[attr-defined]
    for was, now in zip(reversed(parts), back, strict=True):
        assert isinstance(now, IndexerPartition)
        numbered = ("number", "value")
        assert {k: v for k, v in vars(now).items() if k not in numbered} == {
            k: v for k, v in vars(was).items() if k not in numbered
        }
