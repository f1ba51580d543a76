"""The `indexer` command line: serve, feed, router, dump, and the HTTP API's clients (stats,
list-indexes, scan, count, changes, health, create-index, build-index, drop-index, compact).

Every error ends the command with a non-zero exit and one line on stderr saying what is wrong.
The same thing has the same placeholder in every command's help: FILE, DIR, HOST:PORT, URL,
NAME, N, JSON, SECONDS.
"""

from __future__ import annotations

import click

from indexer.cli.admin import (
    aggregate,
    build_index,
    compact,
    count,
    create_index,
    drop_index,
    dump,
    health,
    list_indexes,
    lookup,
    scan,
    stats,
)
from indexer.cli.changes import changes
from indexer.cli.cluster import cluster
from indexer.cli.feeds import feed, router, shard_state
from indexer.cli.serve import serve


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="indexer", prog_name="indexer", message="%(prog)s %(version)s")
def main() -> None:
    """A secondary-index daemon fed by routers over TCP, persisting to LevelDB.

    Examples:

    \b
      indexer serve --config my.toml
      indexer router --state router --to 127.0.0.1:9105 --jsonl docs.jsonl --follow
    """


for _command in (
    serve,
    feed,
    router,
    shard_state,
    dump,
    stats,
    compact,
    list_indexes,
    scan,
    lookup,
    count,
    aggregate,
    changes,
    health,
    create_index,
    build_index,
    drop_index,
    cluster,
):
    main.add_command(_command)
