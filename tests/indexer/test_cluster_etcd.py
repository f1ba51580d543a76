"""The cluster map in etcd without a server: addresses, the gateway's requests and answers,
and rebalancing (indexer/cluster/etcd.py, indexer/cluster/store.py)."""

from __future__ import annotations

import base64
import json

import pytest

from indexer.cluster.etcd import (
    EtcdError,
    EtcdLocation,
    key_values,
    prefix_end,
    put_if_request,
    watch_events,
)
from indexer.cluster.failover import promoted
from indexer.cluster.map import (
    ClusterMap,
    ClusterMapError,
    ClusterNode,
    cluster_map_from,
    parse_cluster_map,
    vbucket_ranges,
)
from indexer.cluster.store import handed_over, map_document, planned, rebalanced


def test_a_cluster_address_names_its_endpoints_and_prefix() -> None:
    found = EtcdLocation.parse("etcd://10.0.0.1:2379,10.0.0.2:2379/indexer/prod/")
    assert found.endpoints == ("http://10.0.0.1:2379", "http://10.0.0.2:2379")
    assert found.key("map") == b"/indexer/prod/map"
    assert str(found) == "etcd://10.0.0.1:2379,10.0.0.2:2379/indexer/prod"


@pytest.mark.parametrize(
    "text",
    ["http://h:1/x", "etcd://h:1", "etcd://h:1/", "etcd:///x", "etcd://h/x", "etcd://h:1/a b"],
)
def test_bad_cluster_addresses_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        EtcdLocation.parse(text)


def test_a_change_of_the_map_compares_its_revision() -> None:
    first = put_if_request(b"/p/map", b"{}", 0)
    assert (
        first["compare"][0]["target"] == "CREATE" and first["compare"][0]["create_revision"] == "0"
    )
    later = put_if_request(b"/p/map", b"{}", 42)
    assert later["compare"][0] == {
        "key": base64.b64encode(b"/p/map").decode(),
        "result": "EQUAL",
        "target": "MOD",
        "mod_revision": "42",
    }
    assert prefix_end(b"/p/nodes/") == b"/p/nodes0"


def test_answers_and_watch_lines_decode() -> None:
    kv = {"key": base64.b64encode(b"k").decode(), "value": base64.b64encode(b"v").decode()}
    body = {"kvs": [{**kv, "mod_revision": "7", "lease": "9"}]}
    assert key_values(body)[0] == (b"k", b"v", 7, 9)
    line = json.dumps(
        {"result": {"header": {"revision": "8"}, "events": [{"type": "DELETE", "kv": kv}]}}
    )
    revision, events = watch_events(line)
    assert revision == 8 and events[0].deleted and events[0].kv.key == b"k"
    with pytest.raises(EtcdError, match="canceled"):
        watch_events(json.dumps({"result": {"canceled": True, "cancel_reason": "compacted"}}))


def node(name: str, vbuckets: range | tuple[int, ...], of: str | None = None) -> ClusterNode:
    return ClusterNode(name, ("127.0.0.1", 1), ("127.0.0.1", 2), tuple(vbuckets), of)


def test_a_rebalance_shares_evenly_and_moves_few() -> None:
    before = ClusterMap(1024, (node("a", range(512)), node("b", range(512, 1024)), node("c", ())))
    after = rebalanced(before, ["a", "b", "c"])
    sizes = {n.name: len(n.vbuckets) for n in after.nodes}
    assert sorted(sizes.values()) == [341, 341, 342]
    assert set(after.node("a").vbuckets) <= set(range(512))
    moved = sum(
        1 for n in after.nodes for vb in n.vbuckets if vb not in before.node(n.name).vbuckets
    )
    assert moved == sizes["c"]  # only what the new node takes
    gone = rebalanced(after, ["a", "b"])  # c leaves: its vbuckets go to the others
    assert [n.name for n in gone.nodes] == ["a", "b"]
    assert sorted(vb for n in gone.nodes for vb in n.vbuckets) == list(range(1024))


def test_the_map_etcd_holds_reads_back_as_the_same_map() -> None:
    cluster = ClusterMap(
        16, (node("a", (0, 1, 2, 5, 6, 9)), node("b", (3, 4, 7, 8, *range(10, 16))))
    )
    assert vbucket_ranges((0, 1, 2, 5, 6, 9)) == ["0-2", "5-6", "9-9"]
    assert cluster_map_from(json.loads(map_document(cluster)), "etcd") == cluster


def test_a_replica_holds_its_active_nodes_vbuckets_and_scans_skip_it() -> None:
    text = """num_vbuckets = 8
[nodes.a]
feed = "127.0.0.1:1"
http = "127.0.0.1:2"
vbuckets = ["0-3"]
[nodes.b]
feed = "127.0.0.1:3"
http = "127.0.0.1:4"
vbuckets = ["4-7"]
[nodes.a2]
feed = "127.0.0.1:5"
http = "127.0.0.1:6"
replica_of = "a"
"""
    cluster = parse_cluster_map(text)
    assert cluster.node("a2").vbuckets == (0, 1, 2, 3)
    assert [n.name for n in cluster.active_nodes] == ["a", "b"] and cluster.owner(1).name == "a"
    assert cluster_map_from(json.loads(map_document(cluster)), "etcd") == cluster
    # a rebalance moves a replica with its active node
    moved = rebalanced(ClusterMap(8, (*cluster.nodes, node("c", ()))), ["a", "b", "c"])
    assert moved.node("a2").vbuckets == moved.node("a").vbuckets
    # a failover: a2 is active for a's vbuckets, a is gone, a's other replicas follow a2
    after = promoted(ClusterMap(8, (*cluster.nodes, node("a3", (0, 1, 2, 3), "a"))), "a2", "a")
    assert [n.name for n in after.active_nodes] == ["b", "a2"]
    assert after.node("a3").replica_of == "a2" and "a" not in {n.name for n in after.nodes}
    for bad, message in (
        (text.replace('replica_of = "a"', 'replica_of = "z"'), "not another node"),
        (text + 'vbuckets = ["0-3"]\n', "holds the vbuckets of nodes.a"),
    ):
        with pytest.raises(ClusterMapError, match=message):
            parse_cluster_map(bad)


def test_a_move_is_planned_as_building_then_handed_over_in_one_map() -> None:
    before = ClusterMap(
        1024,
        (
            node("a", range(512)),
            node("b", range(512, 1024)),
            node("c", ()),
            node("a2", range(512), "a"),
        ),
    )
    plan = planned(before, rebalanced(before, ["a", "b", "c"]))
    # Nothing changes owner yet: c receives what it will own, a and b still answer for it.
    assert [n.vbuckets for n in plan.active_nodes] == [n.vbuckets for n in before.active_nodes]
    assert len(plan.node("c").building) == 341 and not plan.node("a").building
    assert plan.node("c").receives == plan.node("c").building
    assert set(plan.node("a").receives) == set(range(512))
    assert {src for src, dst in plan.moves.values()} == {"a", "b"}
    assert {dst for src, dst in plan.moves.values()} == {"c"}
    assert cluster_map_from(json.loads(map_document(plan)), "etcd") == plan  # as etcd holds it
    done = handed_over(plan)
    assert not done.moves and not any(n.building for n in done.nodes)
    assert sorted(len(n.vbuckets) for n in done.active_nodes) == [341, 341, 342]
    assert done.node("a2").vbuckets == done.node("a").vbuckets  # the replica follows
    assert sorted(vb for n in done.active_nodes for vb in n.vbuckets) == list(range(1024))
    # remove-node: c's vbuckets built on a and b, then c leaves with the hand-over
    leave = planned(done, rebalanced(done, ["a", "b"]))
    assert {dst for _, dst in leave.moves.values()} == {"a", "b"}
    with pytest.raises(ClusterMapError, match="still owns"):
        handed_over(ClusterMap(1024, done.nodes), ["c"])
    gone = handed_over(leave, ["c"])
    assert "c" not in {n.name for n in gone.nodes}
    assert sorted(vb for n in gone.active_nodes for vb in n.vbuckets) == list(range(1024))


def test_a_bad_building_list_is_refused_with_its_key() -> None:
    base = {"num_vbuckets": 4, "nodes": {
        "a": {"feed": "h:1", "http": "h:2", "vbuckets": ["0-1"]},
        "b": {"feed": "h:3", "http": "h:4", "vbuckets": ["2-3"]},
    }}  # fmt: skip
    for change, message in (
        ({"a": {"building": ["1-2"]}}, "nodes.a.building: vbucket 1 is in its vbuckets"),
        ({"a": {"building": [2]}, "b": {"building": []}}, None),
        ({"a": {"building": [2]}, "c": {"building": [2]}}, "moving to nodes.a too"),
        ({"r": {"replica_of": "a", "building": [3]}}, "nodes.r.building: a replica"),
    ):
        raw = json.loads(json.dumps(base))
        for name, extra in change.items():
            new = {"feed": "h:5", "http": "h:6"} | (
                {} if "replica_of" in extra else {"vbuckets": []}
            )
            raw["nodes"].setdefault(name, new).update(extra)
        if message is None:
            assert cluster_map_from(raw, "m").moves == {2: ("b", "a")}
        else:
            with pytest.raises(ClusterMapError, match=message):
                cluster_map_from(raw, "m")
