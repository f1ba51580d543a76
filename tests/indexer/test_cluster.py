"""The cluster map (indexer/cluster/map.py): parsing with clear errors; merging nodes' scans."""

from __future__ import annotations

import random
from itertools import pairwise

import pytest

from indexer.cluster.map import ClusterMapError, merge_rows, parse_cluster_map, row_order
from indexer.keys import collate

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


def test_merged_scans_come_out_in_index_order() -> None:
    # 1, 1.0 and True are equal in Python: the merge's memo of encoded keys keeps them apart.
    keys = [[None], [False], [3], [3.5], ["a"], ["b", 1], [[1]], [{"x": 1}], [10], ["A"]]
    keys += [[1], [True], [1.0], [0], [False, 2]]
    rows = [{"key": k, "id": f"d{i:03d}"} for i, k in enumerate(keys * 3)]
    rows.append({"key": [None], "id": "m", "missing": [0]})  # MISSING sorts first of all
    ordered = sorted(rows, key=row_order)
    assert ordered[0]["id"] == "m"
    assert [r["key"] for r in ordered[1:4]] == [[None]] * 3
    for before, after in pairwise(ordered[1:]):  # N1QL collation
        assert collate(before["key"], after["key"]) <= 0
        if before["key"] == after["key"]:
            assert before["id"] < after["id"]
    rng = random.Random(7)
    nodes: list[list[dict[str, object]]] = [[], [], []]
    for row in rows:
        nodes[rng.randrange(3)].append(row)
    merged = list(merge_rows(sorted(node, key=row_order) for node in nodes))
    assert merged == ordered
