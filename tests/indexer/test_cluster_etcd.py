"""The cluster map in etcd without a server: addresses, the gateway's requests and answers,
and rebalancing (indexer/cluster/etcd.py, indexer/cluster/store.py)."""

from __future__ import annotations

import base64
import json
import time

import pytest

from indexer.cluster.etcd import (
    EtcdError,
    EtcdLocation,
    key_values,
    prefix_end,
    put_if_request,
    watch_events,
)
from indexer.cluster.failover import failed_over
from indexer.cluster.map import (
    ClusterMap,
    ClusterMapError,
    ClusterNode,
    cluster_map_from,
    parse_cluster_map,
    vbucket_ranges,
)
from indexer.cluster.standing import ClusterStanding
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


def node(
    name: str, vbuckets: range | tuple[int, ...], replicas: range | tuple[int, ...] = ()
) -> ClusterNode:
    return ClusterNode(
        name, ("127.0.0.1", 1), ("127.0.0.1", 2), tuple(vbuckets), replicas=tuple(replicas)
    )


def replica_counts(cluster: ClusterMap) -> list[int]:
    """How many replicas each vbucket has, checking that none is on its active node."""
    counts = [0] * cluster.num_vbuckets
    for n in cluster.nodes:
        assert not set(n.replicas) & set(n.vbuckets), n.name
        for vb in n.replicas:
            counts[vb] += 1
    return counts


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


def test_replicas_are_vbuckets_of_other_nodes_and_replica_of_is_their_shorthand() -> None:
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
    assert cluster.node("a2").replicas == (0, 1, 2, 3) and cluster.node("a2").vbuckets == ()
    assert cluster.node("a2").receives == (0, 1, 2, 3) and cluster.num_replicas == 1
    assert [n.name for n in cluster.active_nodes] == ["a", "b"] and cluster.owner(1).name == "a"
    assert [n.name for n in cluster.replica_holders(2)] == ["a2"] and not cluster.replica_holders(5)
    assert cluster_map_from(json.loads(map_document(cluster)), "etcd") == cluster
    for bad, message in (
        (text.replace('replica_of = "a"', 'replica_of = "z"'), "not another node"),
        (text + 'vbuckets = ["0-3"]\n', "holds the vbuckets of nodes.a"),
        (text.replace('vbuckets = ["4-7"]', 'vbuckets = ["4-7"]\nreplicas = [5]'), "another node"),
        ("num_replicas = 3\n" + text, "num_replicas: a whole number from 0 to 2"),
    ):
        with pytest.raises(ClusterMapError, match=message):
            parse_cluster_map(bad)


def test_a_rebalance_places_replicas_evenly_off_their_active_node_and_moves_few() -> None:
    two = rebalanced(ClusterMap(1024, (node("a", range(1024)), node("b", ()))), ["a", "b"], 1)
    assert replica_counts(two) == [1] * 1024 and two.num_replicas == 1
    assert set(two.node("a").replicas) == set(two.node("b").vbuckets)
    three = rebalanced(ClusterMap(1024, (*two.nodes, node("c", ())), 1), ["a", "b", "c"])
    assert replica_counts(three) == [1] * 1024
    assert sorted(len(n.replicas) for n in three.nodes) == [341, 341, 342]
    assert rebalanced(three, ["a", "b", "c"]) == three  # nothing to move
    kept = sum(len(set(n.replicas) & set(two.node(n.name).replicas)) for n in two.nodes)
    assert kept >= 1024 - 342 * 2  # the replicas a and b keep
    both = rebalanced(three, ["a", "b", "c"], 2)
    assert replica_counts(both) == [2] * 1024
    with pytest.raises(ClusterMapError, match="2 replicas of each vbucket need 3 nodes"):
        rebalanced(two, ["a", "b"], 2)


def test_a_move_is_planned_as_building_then_handed_over_in_one_map() -> None:
    before = ClusterMap(
        1024,
        (
            node("a", range(512), range(512, 1024)),
            node("b", range(512, 1024), range(512)),
            node("c", ()),
        ),
        1,
    )
    target = rebalanced(before, ["a", "b", "c"])
    plan = planned(before, target)
    # Nothing changes owner yet: c receives what it will own, a and b still answer for it.
    assert [n.vbuckets for n in plan.active_nodes] == [n.vbuckets for n in before.active_nodes]
    assert len(plan.node("c").building) == 341 and not plan.node("a").building
    assert set(plan.node("c").receives) == set(plan.node("c").building) | set(
        plan.node("c").replicas
    )
    assert set(plan.node("a").receives) >= set(range(512))
    assert {src for src, dst in plan.moves.values()} == {"a", "b"}
    assert {dst for src, dst in plan.moves.values()} == {"c"}
    assert cluster_map_from(json.loads(map_document(plan)), "etcd") == plan  # as etcd holds it
    done = handed_over(plan)
    assert not done.moves and not any(n.building for n in done.nodes)
    assert sorted(len(n.vbuckets) for n in done.active_nodes) == [341, 341, 342]
    assert sorted(vb for n in done.active_nodes for vb in n.vbuckets) == list(range(1024))
    assert replica_counts(done) == [1] * 1024  # an old owner keeps what it gave up as a replica
    # remove-node: c's vbuckets built on a and b, then c leaves with the hand-over
    leave = planned(done, rebalanced(done, ["a", "b"]))
    assert {dst for _, dst in leave.moves.values()} == {"a", "b"}
    with pytest.raises(ClusterMapError, match="still owns"):
        handed_over(ClusterMap(1024, done.nodes), ["c"])
    gone = handed_over(leave, ["c"])
    assert "c" not in {n.name for n in gone.nodes}
    assert sorted(vb for n in gone.active_nodes for vb in n.vbuckets) == list(range(1024))
    assert replica_counts(gone) == [1] * 1024


def test_a_failover_makes_the_most_caught_up_live_replica_active() -> None:
    cluster = ClusterMap(
        8,
        (
            node("a", range(4), range(4, 8)),
            node("b", range(4, 8), (0, 1)),
            node("c", (), range(4)),
        ),
        2,
    )
    seqnos = {"b": [5] * 8, "c": [9, 1, 0, 0, 0, 0, 0, 0]}
    after = failed_over(cluster, "a", {"b", "c"}, seqnos)
    assert after.owner(0).name == "c" and after.owner(1).name == "b"  # the higher seqno
    assert after.owner(2).name == "c" == after.owner(3).name  # the one live replica
    # a is fenced: active for nothing, a replica of what it lost (it catches up when back)
    assert after.node("a").vbuckets == () and set(after.node("a").replicas) == set(range(8))
    assert sorted(vb for n in after.active_nodes for vb in n.vbuckets) == list(range(8))
    assert replica_counts(after)[:4] == [2, 2, 1, 1]  # as many as each had
    # with no live replica a vbucket stays where it is
    assert failed_over(cluster, "a", set(), {}) == cluster
    unknown = failed_over(cluster, "a", {"b", "c"}, {"b": None, "c": None})
    assert unknown.owner(0).name == "b"  # equals: the first by name


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


def test_a_node_that_lost_its_lease_is_fenced_until_it_has_read_the_map_again() -> None:
    standing = ClusterStanding("a", ttl_s=2)
    assert standing.fenced() is None
    standing.registered_again()  # the first registration asks for a read of the map too
    standing.map_read(frozenset({1, 2}), time.monotonic())
    assert not standing.reread.is_set() and standing.fenced() is None  # asked once, not again
    # Stopped past its lease: it did not even try to renew, so it cannot tell.
    standing.alive_at = standing.tried_at = time.monotonic() - 5
    assert "has not renewed its cluster lease" in (standing.fenced() or "")
    standing.tried()  # etcd does not answer: it goes on with the map it has
    assert standing.fenced() is None
    standing.lost()  # etcd says the lease is gone
    assert "lost its cluster lease" in (standing.fenced() or "")
    standing.map_read(frozenset({1, 2}), time.monotonic())  # not registered again yet
    assert standing.fenced() is not None
    standing.registered_again()
    standing.map_read(frozenset(), time.monotonic())
    assert standing.fenced() is None and standing.active == frozenset()
