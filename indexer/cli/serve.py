"""`indexer serve`: the daemon."""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import trio

if TYPE_CHECKING:
    pass
from indexer.cli.common import (
    DIR,
    FILE,
    PORT,
    SERVE_CONFIG_HELP,
    _config,
    _data_dir,
    fail,
    log_options,
)
from indexer.routes import DAEMON_ROUTES, routes_help


@click.command(epilog="HTTP routes (server.http_port):\n\n" + routes_help(DAEMON_ROUTES))
@log_options
@click.option("--config", "config_file", metavar="FILE", type=FILE, help=SERVE_CONFIG_HELP)
@click.option("--data-dir", metavar="DIR", type=DIR, help="Overrides server.data_dir.")
@click.option("--feed-port", metavar="PORT", type=PORT, help="Overrides server.feed_port.")
@click.option("--http-port", metavar="PORT", type=PORT, help="Overrides server.http_port.")
@click.option(
    "--cluster-map",
    metavar="FILE",
    type=click.Path(dir_okay=False, path_type=Path),
    help="A cluster map (TOML): take this node's vbuckets and addresses from it (with --node).",
)
@click.option(
    "--cluster",
    metavar="URL",
    help="The cluster's map in etcd (etcd://HOST:PORT[,HOST:PORT...]/PREFIX), in place of "
    "--cluster-map: the node registers there under a lease and watches the map.",
)
@click.option("--node", metavar="NAME", help="This node's name in --cluster-map or --cluster.")
@click.option(
    "--adopt-source",
    is_flag=True,
    help="Let the first router of another source take this node over, dropping every index "
    "entry of the old source (otherwise such a router is refused).",
)
def serve(
    log_level: str | None,
    log_format: str,
    config_file: Path | None,
    data_dir: Path | None,
    feed_port: int | None,
    http_port: int | None,
    cluster_map: Path | None,
    cluster: str | None,
    node: str | None,
    adopt_source: bool,
) -> None:
    """Run the daemon until SIGINT or SIGTERM (then drain, persist and exit 0).

    Examples:

    \b
      indexer serve --config my.toml --data-dir /srv/idx --feed-port 9200
      indexer serve --cluster etcd://127.0.0.1:2379/indexer --node a --log-format json
    """
    from indexer.daemon import StartError
    from indexer.daemon import serve as run_daemon
    from indexer.logs import configure as configure_logging
    from indexer.storage import StoreError

    slice_of: dict[str, Any] = {}
    data_dir = _data_dir(data_dir)
    if cluster_map is not None and cluster is not None:
        fail("--cluster-map or --cluster: one of the two", 2)
    where: Path | str | None = cluster_map if cluster_map is not None else cluster
    if (where is None) != (node is None):
        fail("--node goes with --cluster-map or --cluster", 2)
    if where is not None and node is not None:
        from indexer.cluster.map import ClusterMapError
        from indexer.cluster.store import load_map

        try:
            found = load_map(where)
            entry = found.node(node)
            num = found.num_vbuckets
        except ClusterMapError as exc:
            fail(str(exc), 2)
        slice_of = {
            "host": entry.feed[0],
            "feed_port": entry.feed[1] if feed_port is None else feed_port,
            "http_port": entry.http[1] if http_port is None else http_port,
            "owned_vbuckets": entry.receives,
            "num_vbuckets": num,
            "cluster_map": where,
            "cluster_node": node,
        }
    config = _config(config_file, data_dir=data_dir, feed_port=feed_port, http_port=http_port)
    if slice_of:
        config = dataclasses.replace(config, server=dataclasses.replace(config.server, **slice_of))
    configure_logging(log_level or config.server.log_level, log_format)
    logging.getLogger("indexer.daemon").info(
        "configuration: %s", config_file if config_file else "embedded default"
    )
    try:
        trio.run(functools.partial(run_daemon, config, adopt_source=adopt_source))
    except (StartError, StoreError, OSError, BaseExceptionGroup) as exc:
        fail(_serve_error(exc, (StartError, StoreError)))
    except KeyboardInterrupt:
        fail("interrupted during start-up", 130)


def _serve_error(error: BaseException, known: tuple[type[Exception], ...]) -> str:
    """The line that says why the daemon stopped: trio wraps the error of a task in exception
    groups, one per nursery it leaves. An error of no `known` kind nor an OSError (a bug) is
    raised again, with its traceback."""
    leaves: list[BaseException] = []
    pending = [error]
    while pending:
        exc = pending.pop(0)
        if isinstance(exc, BaseExceptionGroup):
            pending.extend(exc.exceptions)
        else:
            leaves.append(exc)
    for kind in (*known, OSError):
        for leaf in leaves:
            if isinstance(leaf, kind):
                if isinstance(leaf, OSError) and not isinstance(leaf, known):
                    where = f": {leaf.filename}" if leaf.filename else ""
                    return f"{leaf.strerror or leaf}{where}"
                return str(leaf)
    raise error
