"""`indexer cluster`: the cluster map in etcd, changed in transactions (init, add-node,
remove-node, rebalance) and shown with the nodes' registrations (status)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import click

from indexer.cli.common import fail

CLUSTER_HELP = "The cluster: etcd://HOST:PORT[,HOST:PORT...]/PREFIX."
cluster_option = click.option("--cluster", "where", metavar="URL", required=True, help=CLUSTER_HELP)


def _etcd_map(where: str) -> Any:
    from indexer.cluster.etcd import EtcdLocation
    from indexer.cluster.store import EtcdMap

    try:
        return EtcdMap(EtcdLocation.parse(where))
    except ValueError as exc:
        fail(f"--cluster: {exc}", 2)


def _change(where: str, make: Any) -> None:
    """Write a change of the map in a transaction and say what the map is now."""
    from indexer.cluster.etcd import EtcdError
    from indexer.cluster.map import ClusterMapError

    etcd_map = _etcd_map(where)
    try:
        cluster, revision = etcd_map.change(make)
    except (ClusterMapError, EtcdError) as exc:
        fail(str(exc))
    nodes = ", ".join(f"{n.name} ({len(n.vbuckets)} vbuckets)" for n in cluster.nodes)
    click.echo(f"map of {where} at revision {revision}: {nodes}")


@click.group()
def cluster() -> None:
    """The cluster map in etcd: what each node owns. Each change is one transaction on the
    map's revision; daemons, routers and readers watch the map and follow it.

    Examples:

    \b
      indexer cluster init --cluster etcd://127.0.0.1:2379/indexer --from cluster.toml
      indexer cluster status --cluster etcd://127.0.0.1:2379/indexer --json
    """


@cluster.command()
@cluster_option
@click.option(
    "--from",
    "from_file",
    metavar="FILE",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    required=True,
    help="A cluster map file (TOML, as --cluster-map takes) to start from.",
)
def init(where: str, from_file: Path) -> None:
    """Create the cluster's map from a map file (refused if the cluster has one).

    Examples:

    \b
      indexer cluster init --cluster etcd://127.0.0.1:2379/indexer --from cluster.toml
    """
    from indexer.cluster.map import ClusterMapError, load_cluster_map

    try:
        wanted = load_cluster_map(from_file)
    except ClusterMapError as exc:
        fail(str(exc), 2)

    def make(now: Any) -> Any:
        if now is not None:
            raise ClusterMapError(
                f"{where} has a map already: change it with add-node, remove-node or rebalance"
            )
        return wanted

    _change(where, make)


@cluster.command("add-node")
@cluster_option
@click.argument("name")
@click.option("--feed", required=True, metavar="HOST:PORT", help="Where routers reach the node.")
@click.option("--http", required=True, metavar="HOST:PORT", help="The node's HTTP API.")
@click.option(
    "--replica-of",
    metavar="NAME",
    help="Hold every vbucket this node is active for as a replica (streamed to it by the "
    "routers), to take them over if that node's lease expires. `rebalance --replicas N` "
    "places replicas evenly instead.",
)
def add_node(where: str, name: str, feed: str, http: str, replica_of: str | None) -> None:
    """Add a node: it owns nothing yet (`rebalance` gives it its share of active vbuckets and
    replicas), or with --replica-of it holds another node's vbuckets as a replica.

    Examples:

    \b
      indexer cluster add-node --cluster etcd://h:2379/x c --feed h3:9105 --http h3:9102
      indexer cluster add-node --cluster etcd://h:2379/x a2 --replica-of a --feed h4:9105 \\
          --http h4:9102
    """
    from indexer.cluster.map import NODE_NAME, ClusterMapError, ClusterNode, _address

    if not NODE_NAME.match(name):
        fail(f"{name!r}: a node name is a letter then letters, digits, _ or -", 2)
    try:
        node = ClusterNode(name, _address(feed, "--feed"), _address(http, "--http"), ())
    except ClusterMapError as exc:
        fail(str(exc), 2)

    def make(now: Any) -> Any:
        if now is None:
            raise ClusterMapError(f"{where}: no map yet (indexer cluster init)")
        if any(n.name == name for n in now.nodes):
            raise ClusterMapError(f"{where}: node {name!r} is in the map already")
        added = node
        if replica_of is not None:
            added = dataclasses.replace(node, replicas=now.node(replica_of).vbuckets)
        return dataclasses.replace(now, nodes=(*now.nodes, added))

    _change(where, make)


def _move_options(command: Any) -> Any:
    """What a change that moves vbuckets takes: how long to wait, and how to ask the nodes."""
    command = click.option(
        "--timeout",
        type=click.FloatRange(0),
        default=600.0,
        show_default=True,
        help="Seconds to wait for the new owners to catch up before the hand-over.",
    )(command)
    return click.option(
        "--config",
        "config_file",
        type=click.Path(dir_okay=False, path_type=Path),
        help="A configuration whose token and TLS the nodes' APIs ask for.",
    )(command)


def _mover(where: str, timeout: float, config_file: Path | None) -> Any:
    from indexer.cli.common import _client_security, _config
    from indexer.cluster.moves import Mover

    config = _config(config_file) if config_file is not None else None
    token, context = _client_security(config, None, None, None)
    return Mover(_etcd_map(where), click.echo, timeout, token, context)


def _moved(where: str, run: Any) -> None:
    from indexer.cluster.etcd import EtcdError
    from indexer.cluster.map import ClusterMapError

    try:
        cluster, revision = run()
    except (ClusterMapError, EtcdError) as exc:
        fail(str(exc))
    nodes = ", ".join(f"{n.name} ({len(n.vbuckets)} vbuckets)" for n in cluster.nodes)
    click.echo(f"map of {where} at revision {revision}: {nodes}")


@cluster.command("remove-node")
@cluster_option
@click.argument("name")
@_move_options
def remove_node(where: str, name: str, timeout: float, config_file: Path | None) -> None:
    """Remove a node: its active vbuckets move to the other nodes, as evenly as it goes, its
    replicas are placed on them again, and it leaves once they have caught up.

    Examples:

    \b
      indexer cluster remove-node --cluster etcd://127.0.0.1:2379/indexer c
    """
    from indexer.cluster.map import ClusterMap, ClusterMapError
    from indexer.cluster.store import rebalanced

    def make(now: ClusterMap) -> ClusterMap:
        now.node(name)  # one line if it is not there
        others = [n.name for n in now.nodes if n.name != name]
        if not others:
            raise ClusterMapError(f"{where}: {name!r} is the last node; the cluster needs one")
        return rebalanced(now, others, min(now.num_replicas, len(others) - 1))

    mover = _mover(where, timeout, config_file)
    _moved(where, lambda: mover.start(make, leaving=[name]))


@cluster.command()
@cluster_option
@_move_options
@click.option("--resume", is_flag=True, help="Wait for a rebalance in progress and finish it.")
@click.option("--abort", is_flag=True, help="Drop a rebalance in progress: nothing moves.")
@click.option(
    "--replicas",
    type=click.IntRange(0),
    help="Replicas of each vbucket, each on another node than its active one (default: as "
    "many as the map has now).",
)
def rebalance(
    where: str,
    timeout: float,
    config_file: Path | None,
    resume: bool,
    abort: bool,
    replicas: int | None,
) -> None:
    """Share the vbuckets and their replicas evenly among the nodes, moving as few as it can,
    without a gap: each vbucket that changes its active node is built on the new one from the
    routers' logs while the old one still answers, and all are handed over in one transaction
    once caught up.

    Examples:

    \b
      indexer cluster rebalance --cluster etcd://127.0.0.1:2379/indexer --replicas 1
    """
    from indexer.cluster.map import ClusterMap
    from indexer.cluster.store import rebalanced

    if resume and abort:
        fail("--resume or --abort: one of the two", 2)
    if replicas is not None and (resume or abort):
        fail("--replicas goes with a new rebalance, not --resume or --abort", 2)
    mover = _mover(where, timeout, config_file)
    if abort:
        _moved(where, mover.abort)
    elif resume:
        _moved(where, mover.finish)
    else:

        def make(now: ClusterMap) -> ClusterMap:
            return rebalanced(now, [n.name for n in now.nodes], replicas)

        _moved(where, lambda: mover.start(make))


@cluster.command()
@cluster_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of lines.")
def status(where: str, as_json: bool) -> None:
    """The map's nodes, their roles, the vbuckets each holds, and whether each is registered
    (alive, with the seconds its lease has left).

    Examples:

    \b
      indexer cluster status --cluster etcd://127.0.0.1:2379/indexer --json
    """
    from indexer.cluster.etcd import EtcdError
    from indexer.cluster.map import ClusterMapError, vbucket_ranges

    etcd_map = _etcd_map(where)
    try:
        found, revision = etcd_map.read()
        members = etcd_map.members()
    except (ClusterMapError, EtcdError) as exc:
        fail(str(exc))
    nodes = {
        node.name: {
            "feed": node.feed_address,
            "http": f"{node.http[0]}:{node.http[1]}",
            "vbuckets": len(node.vbuckets),
            "vbucket_ranges": vbucket_ranges(node.vbuckets),
            "building": len(node.building),
            "building_ranges": vbucket_ranges(node.building),
            "replicas": len(node.replicas),
            "replica_ranges": vbucket_ranges(node.replicas),
            "role": node.role,
            "alive": node.name in members,
            "lease_ttl_s": members.get(node.name, {}).get("lease_ttl_s"),
        }
        for node in found.nodes
    }
    strangers = sorted(set(members) - set(nodes))  # registered, but not in the map
    if as_json:
        answer = {
            "cluster": where,
            "revision": revision,
            "num_vbuckets": found.num_vbuckets,
            "num_replicas": found.num_replicas,
            "nodes": nodes,
            "moves_in_progress": len(found.moves),
            "registered_outside_the_map": strangers,
        }
        click.echo(json.dumps(answer, indent=2))
        return
    click.echo(
        f"{where}: map revision {revision}, {found.num_vbuckets} vbuckets, "
        f"{found.num_replicas} {'replica' if found.num_replicas == 1 else 'replicas'} of each"
    )
    if found.moves:
        click.echo(f"  a rebalance is in progress: {len(found.moves)} vbuckets moving")
    for name, node in nodes.items():
        building = f", building {node['building']}" if node["building"] else ""
        state = f"alive (lease {node['lease_ttl_s']} s)" if node["alive"] else "not registered"
        click.echo(
            f"  {name}: {node['role']}, {node['vbuckets']} vbuckets active, "
            f"{node['replicas']} replicas{building}, "
            f"feed {node['feed']}, http {node['http']}, {state}"
        )
    for name in strangers:
        click.echo(f"  {name}: registered but not in the map")
