"""`indexer changes`: print an index's change feed, and with --follow keep printing it."""

from __future__ import annotations

import sys

import click

from indexer.cli.common import ApiOptions, _index_name, api_options, fail, print_lines
from indexer.client import index_path

FOLLOW_WAIT_S = 30.0  # how long one request of --follow waits for a new persisted snapshot


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
def changes(name: str, daemon: ApiOptions, since: str, limit: int | None, follow: bool) -> None:
    """Print the changes of index NAME between persisted snapshots as JSONL: op (insert or
    delete), key, id and the snapshot each belongs to. The token to read on from goes to
    stderr after each answer ("next: TOKEN").

    Examples:

    \b
      indexer changes by_city --since latest --follow
      indexer changes by_age --since 3f9a01c2.41 > changes.jsonl
    """
    import httpx

    _index_name(name)
    api = daemon.connect()
    token = since
    try:
        while True:
            params: dict[str, str | int] = {"since": token}
            if limit is not None and token not in ("snapshot", "0"):
                params["limit"] = limit
            if follow and token not in ("snapshot", "0", "latest"):
                params["wait"] = int(FOLLOW_WAIT_S)
            after = print_lines(api, index_path(name, "changes"), params, FOLLOW_WAIT_S + 60)
            if after is None:
                fail("the daemon gave no token to read on from")
            print(f"next: {after}", file=sys.stderr, flush=True)
            more = after.count(".") == 4  # part way through an interval: a page follows
            token = after
            if not follow and not more:
                return
    except httpx.HTTPError as exc:
        fail(f"cannot reach the daemon at {api.base}: {exc}")
    except KeyboardInterrupt:
        return
    except BrokenPipeError:
        sys.stderr.close()
