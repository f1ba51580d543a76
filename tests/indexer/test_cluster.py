"""The cluster map (indexer/cluster/map.py): parsing with clear errors; merging nodes' scans
(indexer/cluster/scan.py)."""

from __future__ import annotations

import json
import random
from itertools import pairwise

import pytest

from indexer.cluster.map import ClusterMapError, parse_cluster_map
from indexer.cluster.scan import (
    RowRun,
    merge_runs,
    ndjson_batches,
    orders_of,
    resume_entry,
    row_order,
)
from indexer.keys import collate, entry_tail

TWO = """
num_vbuckets = 8
[nodes.a]
feed = "127.0.0.1:9105"
http = "127.0.0.1:9102"
vbuckets = ["0-3"]
[nodes.b]
feed = "127.0.0.1:9205"
http = "127.0.0.1:9202"
vbuckets = [4, 5, "6-7"]
"""


def test_a_map_gives_each_vbucket_one_node() -> None:
    cluster = parse_cluster_map(TWO)
    assert [n.name for n in cluster.nodes] == ["a", "b"]
    assert cluster.node("b").vbuckets == (4, 5, 6, 7)
    assert cluster.owner(3).name == "a" and cluster.owner(6).url == "http://127.0.0.1:9202"
    assert cluster.node("a").feed_address == "127.0.0.1:9105"
    with pytest.raises(ClusterMapError, match="no node named 'c'"):
        cluster.node("c")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (('vbuckets = ["0-3"]', 'vbuckets = ["0-4"]'), "vbucket 4 is also in nodes.a"),
        (('vbuckets = ["0-3"]', 'vbuckets = ["0-2"]'), "1 vbuckets have no node (the first: 3)"),
        (('vbuckets = ["0-3"]', 'vbuckets = ["0-9"]'), "'0-9' is outside 0-7"),
        (('feed = "127.0.0.1:9105"', 'feed = "nowhere"'), "nodes.a.feed: 'nowhere'"),
        (('http = "127.0.0.1:9102"\n', ""), "nodes.a.http: missing"),
        (("[nodes.a]", "[nodes.1a]"), "a node name is a letter"),
        (("num_vbuckets = 8", "num_vbuckets = 0"), "num_vbuckets: a whole number"),
        (("num_vbuckets = 8", "num_vbuckets = 8\nextra = 1"), "extra: unknown key"),
        (("num_vbuckets = 8", "num_vbuckets = ["), "not valid TOML"),
    ],
)
def test_a_bad_map_is_refused_naming_the_key(change: tuple[str, str], message: str) -> None:
    with pytest.raises(ClusterMapError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_cluster_map(TWO.replace(*change), "map.toml")


def runs_of(rows: list[dict[str, object]], rng: random.Random, collated: bool) -> list[RowRun]:
    """A node's answer as the merge reads it: runs of random lengths (some empty), each row's
    collation sent by the node (`collated`) or left for the merge to encode."""
    copies = [dict(r) for r in rows]
    if collated:
        for row in copies:
            row["collation"] = row_order(row)[0].hex() + " " + str(row["id"])
    runs = []
    while copies:
        n = rng.randrange(0, 6)
        part, copies = copies[:n], copies[n:]
        runs.append(RowRun(part, orders_of(part)))
    return runs


def merged(runs: list[list[RowRun]], reverse: bool = False) -> list[dict[str, object]]:
    return [row for run in merge_runs((iter(r) for r in runs), reverse) for row in run.rows]


@pytest.mark.parametrize("collated", [True, False])
def test_merged_scans_come_out_in_index_order(collated: bool) -> None:
    # 1, 1.0 and True are equal in Python, but not in the index's collation.
    keys = [[None], [False], [3], [3.5], ["a"], ["b", 1], [[1]], [{"x": 1}], [10], ["A"]]
    keys += [[1], [True], [1.0], [0], [False, 2], ["ab"], ["a", None], [-1e300], [2**70]]
    rows = [{"key": k, "id": f"d{i:03d}"} for i, k in enumerate(keys * 3)]
    rows += [{"key": ["a"], "id": i} for i in ("", "d", "d\x00", "dé", "d\U0001f600", "e")]
    rows.append({"key": [None], "id": "m", "missing": [0]})  # MISSING sorts first of all
    ordered = sorted(rows, key=row_order)
    assert ordered[0]["id"] == "m"
    assert [r["key"] for r in ordered[1:4]] == [[None]] * 3
    for before, after in pairwise(ordered[1:]):  # N1QL collation
        assert collate(before["key"], after["key"]) <= 0
        if before["key"] == after["key"]:
            assert str(before["id"]).encode() < str(after["id"]).encode()
    for seed in range(20):
        rng = random.Random(seed)
        nodes: list[list[dict[str, object]]] = [[] for _ in range(rng.randrange(1, 5))]
        for row in rows:
            nodes[rng.randrange(len(nodes))].append(row)
        forward = [runs_of(sorted(n, key=row_order), rng, collated) for n in nodes]
        assert merged(forward) == ordered, seed
        backward = [runs_of(sorted(n, key=row_order, reverse=True), rng, collated) for n in nodes]
        assert merged(backward, reverse=True) == ordered[::-1], seed


def test_a_rows_order_gives_back_its_entry() -> None:
    row: dict[str, object] = {"key": ["Oslo", 30], "id": "dé", "collation": ""}
    row["collation"] = row_order(row)[0].hex() + " dé"
    (order,) = orders_of([row])
    assert "collation" not in row
    assert resume_entry(order) == row_order(row)[0] + entry_tail("dé".encode())


def test_ndjson_batches_decode_lines_split_anywhere() -> None:
    rows = [{"key": [i, "x" * (i % 7), None], "id": f"d{i}"} for i in range(200)]
    rows.append({"key": ["\ud800"], "id": "lone surrogate"})  # msgspec refuses it; json not
    text = "".join(json.dumps(r) + "\n" for r in rows).encode()
    rng = random.Random(3)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(1, 40)))
        chunks = [text[a:b] for a, b in pairwise([0, *cuts, len(text)])]
        batches = list(ndjson_batches(chunks))
        assert all(batches) and [r for b in batches for r in b] == rows
    assert list(ndjson_batches([b'{"key": [1], "id": "a"}'])) == [[{"key": [1], "id": "a"}]]
