"""The operator's commands: `dump` (a stopped node's store) and the HTTP API's clients (stats,
list-indexes, scan, count, health, create-index, build-index, drop-index, compact)."""

from __future__ import annotations

import json
import ssl
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from indexer.client import index_path

if TYPE_CHECKING:
    pass
from indexer.cli.common import (
    DIR,
    FILE,
    JSON_OUTPUT_OPTION,
    SERVE_CONFIG_HELP,
    Api,
    ApiOptions,
    _call,
    _client_security,
    _config,
    _data_dir,
    _get_json,
    _http_error,
    _index_name,
    api_options,
    fail,
    print_lines,
)


@click.command()
@click.argument("name")
@click.option(
    "--data-dir", type=DIR, metavar="DIR", help="A stopped node's data (default: server.data_dir)."
)
@click.option("--config", "config_file", type=FILE, metavar="FILE", help=SERVE_CONFIG_HELP)
def dump(name: str, data_dir: Path | None, config_file: Path | None) -> None:
    """Print index NAME as JSONL in index order, from a store no daemon holds.

    Examples:

    \b
      indexer dump by_city --data-dir data
      indexer dump by_age --config my.toml | head
    """
    from indexer.dump import dump_lines
    from indexer.keys import KeyEncodingError
    from indexer.storage import StoreError, StoreLockedError

    _index_name(name)
    config = _config(config_file, data_dir=_data_dir(data_dir))
    try:
        out = sys.stdout
        for line in dump_lines(config.server.data_dir, name):
            out.write(line + "\n")
    except StoreLockedError as exc:
        fail(f"cannot dump while a daemon runs: {exc}")
    except (StoreError, KeyEncodingError) as exc:
        fail(str(exc))
    except BrokenPipeError:
        sys.stderr.close()


@click.command()
@api_options
@JSON_OUTPUT_OPTION
def stats(
    daemon: ApiOptions,
    as_json: bool,
) -> None:
    """Print the daemon's statistics (GET /stats): one figure per line, named by its path in
    the JSON answer (like queues[0].stalls), or with --json the answer itself.

    Examples:

    \b
      indexer stats --url http://127.0.0.1:9102
      indexer stats --json | jq .persisted
    """
    import json

    api = daemon.connect()
    answer = _get_json(api, "/stats")
    if as_json:
        click.echo(json.dumps(answer, indent=2))
        return
    rows = list(_figures(answer))
    width = max((len(name) for name, _ in rows), default=0)
    for name, value in rows:
        click.echo(f"{name:<{width}}  {value}")


def _figures(value: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """The figures of a JSON answer as (path, text) rows: objects' keys joined with dots, the
    items of lists of objects numbered, lists of numbers on one row."""
    if isinstance(value, dict) and value:
        for key, inner in value.items():
            yield from _figures(inner, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list) and any(isinstance(v, dict | list) for v in value):
        for i, inner in enumerate(value):
            yield from _figures(inner, f"{path}[{i}]")
    else:
        yield path, _figure(value)


def _figure(value: Any) -> str:
    """A JSON scalar (or a list of them) as the stats table shows it."""
    if value is None or value == {} or value == []:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list):
        return ", ".join(_figure(v) for v in value)
    return str(value)


@click.command()
@api_options
@click.option(
    "--data-dir",
    type=DIR,
    metavar="DIR",
    help="Compact this data directory in-process instead (no daemon may hold it).",
)
def compact(
    daemon: ApiOptions,
    data_dir: Path | None,
) -> None:
    """Compact the store of a running daemon (POST /compact), or of a data directory no daemon
    holds; prints the bytes on disk before and after as JSON.

    Examples:

    \b
      indexer compact --url http://127.0.0.1:9102
      indexer compact --data-dir data
    """
    import json

    data_dir = _data_dir(data_dir)
    if data_dir is None:
        api = daemon.connect()
        response = _call(api, "POST", "/compact", timeout=None)
        if response.status_code != 200:
            _http_error(response)
        click.echo(json.dumps(response.json()))
        return
    if daemon.url is not None:
        fail("give --url or --data-dir, not both", 2)
    from indexer.compaction import compact_store
    from indexer.storage import IndexStore, StoreError, StoreLockedError

    try:
        with IndexStore(data_dir, create=False) as store:
            result = compact_store(store, "requested")
    except StoreLockedError as exc:
        fail(f"cannot compact in-process while a daemon runs (use --url): {exc}")
    except StoreError as exc:
        fail(str(exc))
    click.echo(json.dumps(result.as_dict()))


@click.command("list-indexes")
@api_options
@JSON_OUTPUT_OPTION
def list_indexes(
    daemon: ApiOptions,
    as_json: bool,
) -> None:
    """List the indexes, one per line: name, keys, state (with a build's progress), entries and
    condition, separated by tabs; or with --json the answer of GET /indexes.

    Examples:

    \b
      indexer list-indexes --url http://127.0.0.1:9102
      indexer list-indexes --json | jq -r '.indexes[].name'
    """
    api = daemon.connect()
    answer = _get_json(api, "/indexes")
    if as_json:
        click.echo(json.dumps(answer, indent=2))
        return
    for index in answer["indexes"]:
        state = index["state"]
        if "build" in index:
            state += f" {index['build']['percent']:g}%"
        line = f"{index['name']}\t{','.join(index['keys'])}\t{state}\t{index['entries']}"
        click.echo(line + (f"\tWHERE {index['where']}" if index.get("where") else ""))


def query_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add the options of a scan's or a count's query: the range and the consistency."""
    options = (
        click.option(
            "--eq", metavar="JSON", help="The key (or a prefix of it, as a list) to match."
        ),
        click.option(
            "--low", metavar="JSON", help="The lower bound (a value, or a list: a key prefix)."
        ),
        click.option(
            "--high", metavar="JSON", help="The upper bound (a value, or a list: a key prefix)."
        ),
        click.option(
            "--spans",
            metavar="JSON",
            help="Several ranges in one scan, read in index order, each entry once: "
            '[{"eq": V}, {"low": V, "high": V, "inclusion": "both"}, ...].',
        ),
        click.option(
            "--inclusion",
            type=click.Choice(["both", "low", "high", "neither"]),
            default="both",
            show_default=True,
            help="Which of the bounds --low and --high are in the range.",
        ),
        click.option(
            "--consistency",
            type=click.Choice(["any", "request_plus"]),
            default="any",
            show_default=True,
            help="any: the latest readable snapshot at once; request_plus: wait for one holding "
            "everything the daemon had received when asked.",
        ),
        click.option(
            "--at-plus",
            "at_plus",
            metavar="JSON",
            help='Wait for a snapshot covering {"vbucket": seqno, ...}, or the line '
            "`indexer feed --wait visible` prints (session consistency).",
        ),
        click.option(
            "--timeout",
            type=click.FloatRange(0),
            metavar="SECONDS",
            default=120,
            show_default=True,
            help="How long the daemon may wait for the snapshot asked for (then HTTP 504).",
        ),
    )
    for option in reversed(options):
        command = option(command)
    return command


def _query_params(
    eq: str | None,
    low: str | None,
    high: str | None,
    spans: str | None,
    inclusion: str,
    consistency: str,
    at_plus: str | None,
    timeout: float,
) -> dict[str, Any]:
    """The query string of `query_options`' values; exit 2 when they are not JSON or clash."""
    if eq is not None and (low is not None or high is not None):
        fail("give --eq or --low/--high, not both", 2)
    if spans is not None and (eq is not None or low is not None or high is not None):
        fail("give --spans or --eq/--low/--high, not both", 2)
    params: dict[str, Any] = {"consistency": consistency, "timeout": timeout}
    if spans is None:
        params["inclusion"] = inclusion
    for key, value in (("eq", eq), ("low", low), ("high", high), ("spans", spans)):
        if value is not None:
            try:
                json.loads(value)
            except ValueError:
                fail(f"--{key}: not JSON: {value}", 2)
            params[key] = value
    if at_plus is not None:
        try:
            vector = json.loads(at_plus)
        except ValueError:
            fail(f"--at-plus: not JSON: {at_plus}", 2)
        if isinstance(vector, dict) and set(vector) == {"at_plus"}:
            vector = vector["at_plus"]
        params["consistency"] = "at_plus"
        params["at_plus"] = json.dumps(vector)
    return params


@click.command()
@click.argument("name")
@api_options
@query_options
@click.option(
    "--limit", type=click.IntRange(0), metavar="N", help="Print N entries at most (the first)."
)
@click.option(
    "--all",
    "all_pages",
    is_flag=True,
    help="Read every page of --limit N entries (default 10000), each from the same snapshot, "
    "following the token each full page gives.",
)
@click.option("--offset", type=click.IntRange(0), metavar="N", help="Skip the first N entries.")
@click.option(
    "--fields",
    metavar="NAME",
    help="Print only these key paths and id, comma-separated (like age,id), in that order.",
)
@click.option(
    "--order",
    type=click.Choice(["asc", "desc"]),
    default="asc",
    show_default=True,
    help="Index order, or the reverse (desc: the last entries first).",
)
@click.option(
    "--cluster-map",
    type=FILE,
    metavar="FILE",
    help="Scan every node of this cluster map and merge the rows in index order.",
)
@click.option(
    "--cluster",
    metavar="URL",
    help="The same, with the map in etcd: etcd://HOST:PORT[,HOST:PORT...]/PREFIX.",
)
def scan(
    name: str,
    daemon: ApiOptions,
    eq: str | None,
    low: str | None,
    high: str | None,
    spans: str | None,
    inclusion: str,
    consistency: str,
    at_plus: str | None,
    limit: int | None,
    all_pages: bool,
    offset: int | None,
    fields: str | None,
    order: str,
    timeout: float,
    cluster_map: Path | None,
    cluster: str | None,
) -> None:
    """Print index NAME's entries (JSONL, index order) from the running daemon, or from every
    node of a cluster map.

    Examples:

    \b
      indexer scan by_city --low '"Berlin"' --high '"Oslo"' --limit 10
      indexer scan by_age --order desc --all --limit 1000 > by_age.jsonl
    """
    import httpx

    _index_name(name)
    params = _query_params(eq, low, high, spans, inclusion, consistency, at_plus, timeout)
    if all_pages and limit is None:
        limit = DEFAULT_PAGE
    if limit is not None:
        params["limit"] = limit
    if offset:
        params["offset"] = offset
    if fields is not None:
        params["fields"] = fields
    if order == "desc":
        params["order"] = "desc"
    if cluster_map is not None and cluster is not None:
        fail("--cluster-map or --cluster: one of the two", 2)
    where: Path | str | None = cluster_map if cluster_map is not None else cluster
    if where is not None:
        if daemon.url is not None:
            fail("give --url or --cluster-map, not both", 2)
        if order == "desc" or offset or all_pages or fields is not None:
            fail("--order desc, --offset, --all and --fields read one daemon, not a cluster map", 2)
        # The nodes' addresses come from the map; a configuration gives its token and TLS.
        config = _config(daemon.config_file) if daemon.config_file is not None else None
        bearer, context = _client_security(config, daemon.token, daemon.token_file, daemon.tls_ca)
        _scan_cluster(where, name, params, timeout + 30, bearer, context)
        return
    api = daemon.connect()
    base = api.base
    try:
        while True:
            token = print_lines(api, index_path(name, "scan"), params, timeout + 30)
            if not all_pages or token is None:
                return
            # The next page: the same range, from the token's snapshot and place.
            params = {k: v for k, v in params.items() if k in PAGE_PARAMS}
            params["next"] = token
    except httpx.HTTPError as exc:
        fail(f"cannot reach the daemon at {base}: {exc}")
    except BrokenPipeError:
        sys.stderr.close()


DEFAULT_PAGE = 10_000  # entries per page of `indexer scan --all`
# What a next page asks again: the range, the page's size and what its rows hold.
PAGE_PARAMS = ("eq", "low", "high", "spans", "inclusion", "limit", "fields")


def _scan_cluster(
    path: Path | str,
    name: str,
    params: dict[str, Any],
    timeout: float,
    token: str | None,
    ssl_context: ssl.SSLContext | None,
) -> None:
    import json

    from indexer.cluster.map import ClusterMapError
    from indexer.cluster.scan import ClusterScanError, scan_the_cluster

    try:
        with scan_the_cluster(
            path, name, params, timeout, token=token, ssl_context=ssl_context
        ) as rows:
            out = sys.stdout
            for row in rows:
                out.write(json.dumps(row, ensure_ascii=False, separators=(", ", ": ")) + "\n")
    except ClusterMapError as exc:
        fail(str(exc), 2)
    except ClusterScanError as exc:
        fail(str(exc))
    except BrokenPipeError:
        sys.stderr.close()


@click.command()
@click.argument("name")
@api_options
@query_options
@click.option(
    "--group-by",
    type=click.IntRange(0),
    metavar="N",
    default=0,
    show_default=True,
    help="Group by the first N keys of the index (0: one group of every entry).",
)
@click.option(
    "--aggregates",
    metavar="NAME",
    default="count",
    show_default=True,
    help="Comma-separated: count, and count_distinct, min, max, sum, avg of a key (its path, "
    "its text or its column name), like count,avg(age).",
)
def aggregate(
    name: str,
    daemon: ApiOptions,
    eq: str | None,
    low: str | None,
    high: str | None,
    spans: str | None,
    inclusion: str,
    consistency: str,
    at_plus: str | None,
    timeout: float,
    group_by: int,
    aggregates: str,
) -> None:
    """Print aggregates of index NAME computed in the daemon, one JSON line per group in index
    order (GET /indexes/NAME/aggregate).

    Examples:

    \b
      indexer aggregate by_city --group-by 1 --aggregates count,avg(age)
      indexer aggregate by_age --aggregates 'count,min(age),max(age)' --low 18
    """
    _index_name(name)
    params = _query_params(eq, low, high, spans, inclusion, consistency, at_plus, timeout)
    params.update(group_by=group_by, aggregates=aggregates)
    response = _call(
        daemon.connect(), "GET", index_path(name, "aggregate"), params=params, timeout=timeout + 30
    )
    if response.status_code != 200:
        _http_error(response)
    sys.stdout.write(response.text)


@click.command()
@click.argument("name")
@click.argument("docid", metavar="ID")
@api_options
@click.option(
    "--consistency",
    type=click.Choice(["any", "request_plus"]),
    default="any",
    show_default=True,
    help="any: the latest readable snapshot at once; request_plus: wait for one holding "
    "everything the daemon had received when asked.",
)
def lookup(name: str, docid: str, daemon: ApiOptions, consistency: str) -> None:
    """Print the entries document ID has in index NAME (JSONL, as a scan prints them), read from
    the back index (GET /indexes/NAME/docs/ID); nothing when it is not in the index.

    Examples:

    \b
      indexer lookup by_city user::42
      indexer lookup by_age user::42 --consistency request_plus
    """
    from urllib.parse import quote

    _index_name(name)
    path = index_path(name, "docs", quote(docid, safe=""))
    answer = _get_json(daemon.connect(), path, {"consistency": consistency}, 150)
    for entry in answer["entries"]:
        click.echo(json.dumps(entry, ensure_ascii=False, separators=(", ", ": ")))


@click.command()
@click.argument("name")
@api_options
@query_options
def count(
    name: str,
    daemon: ApiOptions,
    eq: str | None,
    low: str | None,
    high: str | None,
    spans: str | None,
    inclusion: str,
    consistency: str,
    at_plus: str | None,
    timeout: float,
) -> None:
    """Print the number of index NAME's entries, of all or of a range (GET
    /indexes/NAME/count).

    Examples:

    \b
      indexer count by_age --consistency request_plus
      indexer count by_age --low 18 --high 30 --inclusion low
    """
    _index_name(name)
    params = _query_params(eq, low, high, spans, inclusion, consistency, at_plus, timeout)
    # The daemon answers 504 after `timeout`: the client waits a little longer.
    answer = _get_json(daemon.connect(), index_path(name, "count"), params, timeout + 30)
    click.echo(answer["count"])


@click.command()
@api_options
@click.option(
    "--timeout",
    type=click.FloatRange(0, min_open=True),
    metavar="SECONDS",
    default=10.0,
    show_default=True,
    help="How long to wait for the answer.",
)
def health(daemon: ApiOptions, timeout: float) -> None:
    """Exit 0 when the daemon answers GET /health (it is ready), else 1 with one line saying
    why (unreachable, or starting).

    Examples:

    \b
      indexer health --url http://127.0.0.1:9102
      until indexer health 2>/dev/null; do sleep 1; done
    """
    from indexer.client import error_text

    api = daemon.connect()
    response = _call(api, "GET", "/health", timeout=timeout)
    if response.status_code != 200:
        reason = error_text(response.content)
        fail(f"the daemon at {api.base} is not healthy: HTTP {response.status_code}: {reason}")
    click.echo(f"{api.base}: ok")


WAIT_TIMEOUT_OPTION = click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    metavar="SECONDS",
    default=3600.0,
    show_default=True,
    help="How long --wait waits at most.",
)


@click.command("create-index")
@click.argument("name")
@click.option(
    "--keys",
    metavar="PATHS",
    help="The keys, comma-separated: field paths or expressions such as LOWER(name), "
    "age DESC or DISTINCT ARRAY t FOR t IN tags END.",
)
@click.option(
    "--primary",
    is_flag=True,
    help="A primary index: every document by its id (META().id), no --keys; GSI names it #primary.",
)
@click.option(
    "--where", metavar="CONDITION", help='A condition for a partial index, like "age >= 18".'
)
@click.option(
    "--defer",
    is_flag=True,
    help="Only define it (state deferred, holding nothing) until `indexer build-index` builds "
    "it, with other deferred indexes in one pass over the data.",
)
@click.option(
    "--wait",
    is_flag=True,
    help="Wait until the index is active, with a progress bar while it is built.",
)
@WAIT_TIMEOUT_OPTION
@api_options
def create_index(
    name: str,
    keys: str | None,
    primary: bool,
    where: str | None,
    defer: bool,
    wait: bool,
    timeout: float,
    daemon: ApiOptions,
) -> None:
    """Create index NAME on a running daemon. Over data already streamed it is built first
    (state building, then catchup) and becomes active once caught up; with --defer it waits
    (state deferred) for build-index.

    Examples:

    \b
      indexer create-index by_tag --keys "DISTINCT ARRAY t FOR t IN tags END,age DESC" --wait
      indexer create-index adults --keys age --where "age >= 18" --defer
    """
    _index_name(name)
    if defer and wait:
        fail("give --defer or --wait, not both: a deferred index is built by build-index", 2)
    if (keys is None) == (not primary):
        fail("give --keys, or --primary for a primary index", 2)
    api = daemon.connect()
    body: dict[str, Any] = {"name": name}
    if primary:
        body["primary"] = True
    else:
        assert keys is not None
        body["keys"] = [k.strip() for k in keys.split(",") if k.strip()]
    if where is not None:
        body["where"] = where
    if defer:
        body["defer_build"] = True
    response = _call(api, "POST", "/indexes", body=body, timeout=120)
    if response.status_code != 201:
        _http_error(response)
    created = response.json()
    condition = f" WHERE {created['where']}" if created.get("where") else ""
    click.echo(
        f"created {created['name']}({', '.join(created['keys'])}){condition}: {created['state']}"
    )
    if wait and created["state"] != "active":
        _wait_built(api, name, timeout)


@click.command("build-index")
@click.argument("names", nargs=-1, required=True, metavar="NAME...")
@click.option(
    "--wait",
    is_flag=True,
    help="Wait until the indexes are active, with a progress bar while they are built.",
)
@WAIT_TIMEOUT_OPTION
@api_options
def build_index(
    names: tuple[str, ...],
    wait: bool,
    timeout: float,
    daemon: ApiOptions,
) -> None:
    """Build deferred indexes (created with create-index --defer) on a running daemon, all in
    one pass over the data on one build stream (POST /indexes/_build); prints their states.

    Examples:

    \b
      indexer build-index by_zip by_name adults --wait
      indexer build-index by_zip --url http://127.0.0.1:9102
    """

    for name in names:
        _index_name(name)
    api = daemon.connect()
    response = _call(api, "POST", "/indexes/_build", body={"indexes": list(names)}, timeout=120)
    if response.status_code not in (200, 202):
        _http_error(response)
    for entry in response.json()["indexes"]:
        click.echo(f"{entry['name']}: {entry['state']}")
    if wait:
        deadline = time.monotonic() + timeout
        for name in names:
            _wait_built(api, name, max(deadline - time.monotonic(), 0.0))


def _wait_built(api: Api, name: str, timeout: float) -> None:
    """Poll the index's state, showing its build progress, until it is active."""

    deadline = time.monotonic() + timeout
    shown = 0
    with click.progressbar(length=100, label=f"building {name}", file=sys.stderr) as bar:
        while True:
            indexes = {i["name"]: i for i in _get_json(api, "/indexes")["indexes"]}
            entry = indexes.get(name)
            if entry is None:
                fail(f"index {name} is gone (dropped during its build?)")
            if entry["state"] == "active":
                bar.update(100 - shown)
                break
            percent = int(entry.get("build", {}).get("percent", 0))
            if percent > shown:
                bar.update(percent - shown)
                shown = percent
            if time.monotonic() > deadline:
                fail(f"index {name} is still {entry['state']} after {timeout:g} s")
            time.sleep(0.2)
    click.echo(f"{name}: active")


@click.command("drop-index")
@click.argument("name")
@api_options
def drop_index(
    name: str,
    daemon: ApiOptions,
) -> None:
    """Drop index NAME on a running daemon and delete its entries.

    Examples:

    \b
      indexer drop-index by_zip
      indexer drop-index by_zip --url http://127.0.0.1:9102
    """
    _index_name(name)
    api = daemon.connect()
    response = _call(api, "DELETE", index_path(name), timeout=600)
    if response.status_code != 204:
        _http_error(response)
    click.echo(f"dropped {name}")
