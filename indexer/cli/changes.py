"""`indexer changes`: print an index's change feed, and with --follow keep printing it."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import click

from indexer.cli.common import (
    FILE,
    Api,
    ApiOptions,
    _client_security,
    _config,
    _index_name,
    api_options,
    fail,
    print_lines,
)
from indexer.client import index_path

FOLLOW_WAIT_S = 30.0  # how long one request of --follow waits for a new persisted snapshot
FOLLOW_POLL_S = 1.0  # how often --follow asks the nodes of a map when nothing was new


@click.command()
@click.argument("name")
@api_options
@click.option(
    "--since",
    metavar="TOKEN",
    default="snapshot",
    show_default=True,
    help="Where to start: a token the feed gave (it prints each on stderr), 'snapshot' (every "
    "entry at the latest persisted snapshot as an insert, then the changes) or 'latest' "
    "(only what changes from now on).",
)
@click.option(
    "--limit", type=click.IntRange(1), metavar="N", help="Rows per request (default: all)."
)
@click.option(
    "--follow",
    "-f",
    is_flag=True,
    help="Keep printing changes as snapshots are persisted, like tail -f (Ctrl-C stops).",
)
@click.option(
    "--cluster-map",
    type=FILE,
    metavar="FILE",
    help="Read every node of this cluster map (each keeps its own history): tokens are "
    "vectors NODE:TOKEN,... of the nodes' tokens.",
)
@click.option(
    "--cluster",
    metavar="URL",
    help="The same, with the map in etcd: etcd://HOST:PORT[,HOST:PORT...]/PREFIX.",
)
def changes(
    name: str,
    daemon: ApiOptions,
    since: str,
    limit: int | None,
    follow: bool,
    cluster_map: Path | None,
    cluster: str | None,
) -> None:
    """Print the changes of index NAME between persisted snapshots as JSONL: op (insert or
    delete), key, id and the snapshot each belongs to. The token to read on from goes to
    stderr after each answer ("next: TOKEN").

    Examples:

    \b
      indexer changes by_city --since latest --follow
      indexer changes by_age --cluster-map cluster.toml > changes.jsonl
    """
    import httpx

    from indexer.changes import encode_cluster_token

    _index_name(name)
    if cluster_map is not None and cluster is not None:
        fail("--cluster-map or --cluster: one of the two", 2)
    where: Path | str | None = cluster_map if cluster_map is not None else cluster
    answered: dict[str, str] = {}  # node -> the vbuckets it answers for, where it holds others
    if where is None:
        apis = {"": daemon.connect()}
    else:
        if daemon.url is not None:
            fail("give --url or --cluster-map, not both", 2)
        apis, answered = _node_apis(where, daemon)
    tokens = _start(since, apis)
    api = next(iter(apis.values()))
    try:
        while True:
            moved = False
            for node, api in apis.items():
                # One daemon alone waits for a new snapshot; of several, none waits for one.
                wait = follow and len(apis) == 1
                for after in _pages(api, name, tokens[node], limit, wait, answered.get(node)):
                    moved = moved or after != tokens[node]
                    tokens[node] = after
                    told = tokens[""] if "" in tokens else encode_cluster_token(tokens)
                    print(f"next: {told}", file=sys.stderr, flush=True)
            if not follow:
                return
            if not moved and len(apis) > 1:
                time.sleep(FOLLOW_POLL_S)
    except httpx.HTTPError as exc:
        fail(f"cannot reach the daemon at {api.base}: {exc}")
    except KeyboardInterrupt:
        return
    except BrokenPipeError:
        sys.stderr.close()


def _node_apis(path: Path | str, daemon: ApiOptions) -> tuple[dict[str, Api], dict[str, str]]:
    """An Api per active node of the map, with the token and TLS of the options; and for each
    node that holds other vbuckets too (replicas, moves), the vbuckets it is to answer for."""
    from indexer.cluster.map import ClusterMapError, vbucket_ranges
    from indexer.cluster.store import load_map

    try:
        cluster = load_map(path)
    except ClusterMapError as exc:
        fail(str(exc), 2)
    config = _config(daemon.config_file) if daemon.config_file is not None else None
    bearer, context = _client_security(config, daemon.token, daemon.token_file, daemon.tls_ca)
    verify = context if context is not None else True
    apis = {
        n.name: Api(n.base_url(context is not None), bearer, verify) for n in cluster.active_nodes
    }
    answered = {
        n.name: ",".join(vbucket_ranges(n.vbuckets))
        for n in cluster.active_nodes
        if n.receives != n.vbuckets
    }
    return apis, answered


def _start(since: str, apis: dict[str, Api]) -> dict[str, str]:
    """Each node's token to start from: `since` for one daemon; for a map, a start word for
    every node, or the node's part of a cluster's token."""
    from indexer.changes import ChangeTokenError, decode_cluster_token

    if len(apis) == 1 and "" in apis:
        return {"": since}
    if since in ("snapshot", "0", "latest"):
        return {node: since for node in apis}
    try:
        parts = decode_cluster_token(since)
    except ChangeTokenError as exc:
        fail(f"--since: {exc}", 2)
    unknown = sorted(set(parts) - set(apis))
    if unknown:
        fail(f"--since names nodes the cluster map does not have: {', '.join(unknown)}", 2)
    return {node: parts.get(node, "snapshot") for node in apis}


def _pages(
    api: Api, name: str, token: str, limit: int | None, wait: bool, vbuckets: str | None = None
) -> Iterator[str]:
    """Print a daemon's changes from `token` to its latest persisted snapshot, in pages of
    `limit` (waiting for a new snapshot first if `wait`; of `vbuckets` alone if given); the
    token after each page."""
    in_start = token in ("snapshot", "0") or ".s." in token
    while True:
        params: dict[str, str | int] = {"since": token}
        if vbuckets is not None:
            params["vbuckets"] = vbuckets
        if limit is not None and token != "latest":
            params["limit"] = limit  # the snapshot start in pages too
        if wait and token not in ("snapshot", "0", "latest"):
            params["wait"] = int(FOLLOW_WAIT_S)
        after = print_lines(api, index_path(name, "changes"), params, FOLLOW_WAIT_S + 60)
        if after is None:
            fail(f"the daemon at {api.base} gave no token to read on from")
        yield after
        if after.count(".") == 1:  # a snapshot's token: this read is at its end...
            if not in_start:
                return
            in_start = False  # ...of a snapshot start: the changes after it follow
        token = after  # part way through a start or an interval: a page follows
