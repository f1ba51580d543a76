"""The `indexer` command line: serve, feed, router, dump.

Every error ends the command with a non-zero exit and one line on stderr saying what is wrong.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import click
import trio

from indexer.config import Config, ConfigError, load_config


def fail(message: str, code: int = 1) -> NoReturn:
    click.echo(f"indexer: error: {message}", err=True)
    sys.exit(code)


def _config(config_file: Path | None, **overrides: Any) -> Config:
    try:
        config = load_config(config_file)
    except ConfigError as exc:
        fail(str(exc), 2)
    server = {k: v for k, v in overrides.items() if v is not None}
    if server:
        config = dataclasses.replace(config, server=dataclasses.replace(config.server, **server))
    return config


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="indexer")
def main() -> None:
    """A secondary-index daemon fed by routers over TCP, persisting to LevelDB."""


@main.command()
@click.option("--config", "config_file", type=click.Path(path_type=Path), help="TOML file.")
@click.option("--data-dir", type=click.Path(path_type=Path), help="Overrides server.data_dir.")
@click.option("--feed-port", type=click.IntRange(0, 65535), help="Overrides server.feed_port.")
@click.option("--http-port", type=click.IntRange(0, 65535), help="Overrides server.http_port.")
@click.option(
    "--cluster-map",
    type=click.Path(dir_okay=False, path_type=Path),
    help="A cluster map (TOML): take this node's vbuckets and addresses from it (with --node).",
)
@click.option("--node", help="This node's name in --cluster-map.")
def serve(
    config_file: Path | None,
    data_dir: Path | None,
    feed_port: int | None,
    http_port: int | None,
    cluster_map: Path | None,
    node: str | None,
) -> None:
    """Run the daemon until SIGINT or SIGTERM (then drain, persist and exit 0)."""
    from indexer.daemon import serve as run_daemon
    from indexer.storage import StoreError

    slice_of: dict[str, Any] = {}
    if (cluster_map is None) != (node is None):
        fail("--cluster-map and --node go together", 2)
    if cluster_map is not None and node is not None:
        from indexer.cluster import ClusterMapError, load_cluster_map

        try:
            entry = load_cluster_map(cluster_map).node(node)
            num = load_cluster_map(cluster_map).num_vbuckets
        except ClusterMapError as exc:
            fail(str(exc), 2)
        slice_of = {
            "host": entry.feed[0],
            "feed_port": entry.feed[1] if feed_port is None else feed_port,
            "http_port": entry.http[1] if http_port is None else http_port,
            "owned_vbuckets": entry.vbuckets,
            "num_vbuckets": num,
            "cluster_map": cluster_map,
            "cluster_node": node,
        }
    config = _config(config_file, data_dir=data_dir, feed_port=feed_port, http_port=http_port)
    if slice_of:
        config = dataclasses.replace(config, server=dataclasses.replace(config.server, **slice_of))
    logging.basicConfig(
        level=config.server.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("indexer.daemon").info(
        "configuration: %s", config_file if config_file else "embedded default"
    )
    try:
        trio.run(run_daemon, config)
    except StoreError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot listen on {config.server.host}:{config.server.feed_port}: {exc.strerror}")
    except KeyboardInterrupt:
        fail("interrupted during start-up", 130)


def _address(value: str, allow_zero: bool = False) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not int(not allow_zero) <= int(port) < 65536:
        raise click.BadParameter(f"{value!r} is not HOST:PORT")
    return host, int(port)


APPEND_CHUNK = 50_000  # documents per append to a source log (one synced WriteBatch each)


@main.command()
@click.option("--to", "address", help="The indexer's feed address, HOST:PORT.")
@click.option(
    "--jsonl",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help='Documents, one per line: {"id":..,"doc":{..}} or {"id":..,"deleted":true}.',
)
@click.option("--generate", type=click.IntRange(1), help="Generate this many mutations.")
@click.option("--keys", type=click.IntRange(1), help="Key space of --generate (default N/5).")
@click.option("--delete-ratio", type=click.FloatRange(0, 1), default=0.1, show_default=True)
@click.option("--seed", type=int, default=42, show_default=True)
@click.option(
    "--wait",
    type=click.Choice(["persisted", "visible", "none"]),
    default="persisted",
    show_default=True,
    help="Exit once everything sent is persisted, once it is readable (a barrier; prints the "
    "at_plus vector of this feed on stdout), or at once.",
)
@click.option(
    "--vbuckets",
    type=click.IntRange(1, 65536),
    help="Vbuckets of the key space (default 1024, or the count the --state log was made with).",
)
@click.option(
    "--state",
    type=click.Path(file_okay=False, path_type=Path),
    help="Keep the source's history here: append the input, stream what the indexer lacks.",
)
@click.option(
    "--failover",
    type=int,
    metavar="VB",
    help="Fail vbucket VB of the --state log over (before appending and streaming).",
)
@click.option(
    "--failover-seqno",
    type=int,
    metavar="S",
    help="Where --failover starts the new history (default: the high seqno, losing nothing).",
)
def feed(
    address: str | None,
    jsonl: Path | None,
    generate: int | None,
    keys: int | None,
    delete_ratio: float,
    seed: int,
    wait: str,
    vbuckets: int | None,
    state: Path | None,
    failover: int | None,
    failover_seqno: int | None,
) -> None:
    """Push documents to an indexer through a router feed.

    With --state DIR the router keeps its source on disk: --failover runs first, then the input
    (if any) is appended, then (with --to) the log is streamed from where the indexer stands.
    """
    from indexer.router import Workload, read_jsonl
    from indexer.router import generate as generate_documents
    from indexer.router.documents import Document

    if jsonl is not None and generate is not None:
        fail("give at most one of --jsonl FILE and --generate N", 2)
    if state is None:
        for option, value in (("--failover", failover), ("--failover-seqno", failover_seqno)):
            if value is not None:
                fail(f"{option} needs --state DIR", 2)
        if jsonl is None and generate is None:
            fail("give exactly one of --jsonl FILE and --generate N", 2)
        if address is None:
            fail("give --to HOST:PORT", 2)
    elif failover_seqno is not None and failover is None:
        fail("--failover-seqno needs --failover VB", 2)
    elif address is None and jsonl is None and generate is None and failover is None:
        fail("with --state, give --to HOST:PORT, an input or --failover VB", 2)
    target = None
    if address is not None:
        try:
            target = _address(address)
        except click.BadParameter as exc:
            fail(f"--to: {exc.message}", 2)
    # A factory, so the feed can start over after the indexer's indexes change.
    documents: Callable[[], Iterator[Document]] | None = None
    total = None
    if jsonl is not None:
        path = jsonl
        documents = lambda: read_jsonl(path)  # noqa: E731
    elif generate is not None:
        workload = Workload(generate, keys or 0, delete_ratio, seed)
        documents = lambda: generate_documents(workload)  # noqa: E731
        total = generate
    if state is None:
        assert documents is not None and target is not None
        _feed_input(target, documents, total, wait, vbuckets or 1024)
    else:
        _feed_state(state, target, documents, wait, vbuckets, failover, failover_seqno)


def _progress_bar(total: int | None, label: str) -> Any:
    """A progress bar on a terminal when the total is known (click's needs a length)."""
    if total is not None and sys.stderr.isatty():
        return click.progressbar(length=total, label=label, file=sys.stderr)
    return _NoBar()


def _report(result: Any) -> None:
    state = "persisted" if result.persisted else "visible" if result.visible_at else "sent"
    click.echo(
        f"{result.sent} mutations {state} over {result.vbuckets} vbuckets"
        f" ({result.skipped} already persisted, skipped)",
        err=True,
    )
    if result.visible_at is not None:
        # Session consistency: scans with this at_plus see everything this feed sent.
        vector = {str(vb): seqno for vb, seqno in sorted(result.visible_at.items()) if seqno}
        click.echo(json.dumps({"at_plus": vector}))


def _rolled_back(vbucket: int, seqno: int) -> None:
    click.echo(f"vbucket {vbucket}: the indexer rolled back to seqno {seqno}", err=True)


def _run_feed(run: Callable[[], Awaitable[Any]]) -> Any:
    """Run a feed coroutine; its errors end the command with one line."""
    from indexer.daemon import bulk_gc
    from indexer.router import FeedError, SourceError
    from indexer.router.documents import DocumentError

    try:
        with bulk_gc():  # the feed allocates per document too
            return trio.run(run)
    except (FeedError, DocumentError, SourceError) as exc:
        fail(str(exc))
    except OSError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        fail("interrupted", 130)


def _feed_input(
    target: tuple[str, int],
    documents: Callable[[], Iterator[Any]],
    total: int | None,
    wait: str,
    vbuckets: int,
) -> None:
    """The feed without state: number the input's documents and stream them."""
    from indexer.router import feed as run_feed

    host, port = target
    with _progress_bar(total, "feeding") as bar:

        async def run() -> Any:
            return await run_feed(
                host,
                port,
                documents,
                wait_persisted=wait == "persisted",
                wait_visible=wait == "visible",
                progress=bar.update,
                num_vbuckets=vbuckets,
                on_rollback=_rolled_back,
            )

        result = _run_feed(run)
    _report(result)


def _feed_state(
    state: Path,
    target: tuple[str, int] | None,
    documents: Callable[[], Iterator[Any]] | None,
    wait: str,
    vbuckets: int | None,
    failover: int | None,
    failover_seqno: int | None,
) -> None:
    """The feed with a source log in `state`: fail over, append, stream (each if asked)."""
    from itertools import islice

    from indexer.router import SourceError, SourceLog, feed_log
    from indexer.router.documents import DocumentError

    try:  # only a command that adds documents creates the log
        log = SourceLog(state, vbuckets, create=documents is not None)
    except SourceError as exc:
        fail(str(exc))
    with log:
        if failover is not None:
            try:
                vbuuid, seqno = log.failover(failover, failover_seqno)
            except SourceError as exc:
                fail(str(exc))
            click.echo(
                f"vbucket {failover}: failed over to seqno {seqno} (new vbuuid {vbuuid:#018x})",
                err=True,
            )
        if documents is not None:
            appended = 0
            try:
                source = documents()
                while chunk := list(islice(source, APPEND_CHUNK)):
                    appended += log.append(chunk)
            except (DocumentError, SourceError) as exc:
                fail(f"{exc} ({appended} documents appended before it)")
            except OSError as exc:
                fail(str(exc))
            click.echo(f"appended {appended} documents to the source log in {state}", err=True)
        if target is None:
            return
        host, port = target

        async def run() -> Any:
            return await feed_log(
                host,
                port,
                log,
                wait_persisted=wait == "persisted",
                wait_visible=wait == "visible",
                on_rollback=_rolled_back,
            )

        result = _run_feed(run)
    _report(result)


@main.command()
@click.option(
    "--state",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="The router's source log (created if missing).",
)
@click.option("--to", "targets", multiple=True, help="An indexer node, HOST:PORT (repeat).")
@click.option(
    "--cluster-map",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Stream to the nodes of this cluster map (re-read when it changes) instead of --to.",
)
@click.option(
    "--jsonl",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help='Documents, one per line: {"id":..,"doc":{..}} or {"id":..,"deleted":true}.',
)
@click.option("--follow", is_flag=True, help="Keep reading lines appended to --jsonl (tail -f).")
@click.option("--http", "http_address", help="Serve PUT/DELETE /docs/ID on HOST:PORT.")
@click.option(
    "--vbuckets",
    type=click.IntRange(1, 65536),
    help="Vbuckets of a new --state log (default 1024; an existing log keeps its count).",
)
@click.option("--generate", type=click.IntRange(1), help="Also append N generated mutations.")
@click.option("--keys", type=click.IntRange(1), help="Key space of --generate (default N/5).")
@click.option("--delete-ratio", type=click.FloatRange(0, 1), default=0.1, show_default=True)
@click.option("--seed", type=int, default=42, show_default=True)
@click.option(
    "--rate",
    type=click.FloatRange(min=0, min_open=True),
    help="Generate about this many mutations per second (default: as fast as appended).",
)
@click.option(
    "--memory-mb",
    type=click.FloatRange(0.01, 1 << 20),
    default=256.0,
    show_default=True,
    help="Cap of recent mutations kept in memory; nodes further behind read the source log.",
)
def router(
    state: Path,
    targets: tuple[str, ...],
    jsonl: Path | None,
    follow: bool,
    http_address: str | None,
    vbuckets: int | None,
    generate: int | None,
    keys: int | None,
    delete_ratio: float,
    seed: int,
    rate: float | None,
    memory_mb: float,
    cluster_map: Path | None,
) -> None:
    """Run a router until SIGINT or SIGTERM: append the inputs to the source log in --state and
    stream it to every --to node, then each new document as it comes."""
    from indexer.router import SourceError, SourceLog, Workload
    from indexer.router.service import RouterOptions, run_router

    if follow and jsonl is None:
        fail("--follow needs --jsonl FILE", 2)
    if bool(targets) == (cluster_map is not None):
        fail("give the nodes with --to HOST:PORT or --cluster-map FILE (one of the two)", 2)
    if cluster_map is not None:
        from indexer.cluster import ClusterMapError, load_cluster_map

        try:
            load_cluster_map(cluster_map)
        except ClusterMapError as exc:
            fail(str(exc), 2)
    if rate is not None and generate is None:
        fail("--rate needs --generate N", 2)
    workload = None if generate is None else Workload(generate, keys or 0, delete_ratio, seed)
    addresses = []
    for value in targets:
        try:
            address = _address(value)
        except click.BadParameter as exc:
            fail(f"--to: {exc.message}", 2)
        if address in addresses:
            fail(f"--to: {value} is given twice", 2)
        addresses.append(address)
    http = None
    if http_address is not None:
        try:
            http = _address(http_address, allow_zero=True)  # port 0: any free port
        except click.BadParameter as exc:
            fail(f"--http: {exc.message}", 2)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    options = RouterOptions(
        addresses,
        jsonl,
        follow,
        http,
        memory_bytes=int(memory_mb * (1 << 20)),
        generate=workload,
        rate=rate,
        cluster_map=cluster_map,
    )
    try:
        log = SourceLog(state, vbuckets)
    except SourceError as exc:
        fail(str(exc))
    with log:
        try:
            trio.run(run_router, log, options)
        except OSError as exc:
            fail(str(exc))
        except KeyboardInterrupt:
            fail("interrupted during start-up", 130)


class _NoBar:
    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: int) -> None:
        return None


@main.command()
@click.argument("name")
@click.option("--data-dir", type=click.Path(path_type=Path), help="Default: server.data_dir.")
@click.option("--config", "config_file", type=click.Path(path_type=Path), help="TOML file.")
def dump(name: str, data_dir: Path | None, config_file: Path | None) -> None:
    """Print index NAME as JSONL in index order, from a store no daemon holds."""
    from indexer.dump import dump_lines
    from indexer.keys import KeyEncodingError
    from indexer.storage import StoreError, StoreLockedError

    config = _config(config_file, data_dir=data_dir)
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


def _http_url(url: str | None, config_file: Path | None) -> str:
    if url:
        return url.rstrip("/")
    server = _config(config_file).server
    return f"http://{server.host}:{server.http_port}"


def _http_error(response: Any) -> NoReturn:
    try:
        message = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        message = response.text.strip()[:200]
    fail(f"HTTP {response.status_code}: {message}")


def _get_json(url: str, path: str, **params: Any) -> Any:
    import httpx

    try:
        response = httpx.get(url + path, params=params, timeout=30)
    except httpx.HTTPError as exc:
        fail(f"cannot reach the daemon at {url}: {exc}")
    if response.status_code != 200:
        _http_error(response)
    return response.json()


URL_OPTION = click.option("--url", help="The daemon's HTTP API (default: the configured address).")
CONFIG_OPTION = click.option(
    "--config", "config_file", type=click.Path(path_type=Path), help="TOML file."
)


@main.command()
@URL_OPTION
@CONFIG_OPTION
def stats(url: str | None, config_file: Path | None) -> None:
    """Print the daemon's statistics (GET /stats) as JSON."""
    import json

    click.echo(json.dumps(_get_json(_http_url(url, config_file), "/stats"), indent=2))


@main.command()
@URL_OPTION
@CONFIG_OPTION
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Compact this data directory in-process instead (no daemon may hold it).",
)
def compact(url: str | None, config_file: Path | None, data_dir: Path | None) -> None:
    """Compact the store of a running daemon (POST /compact), or of a data directory no daemon
    holds; prints the bytes on disk before and after as JSON."""
    import json

    if data_dir is None:
        import httpx

        base = _http_url(url, config_file)
        try:
            response = httpx.post(f"{base}/compact", timeout=None)
        except httpx.HTTPError as exc:
            fail(f"cannot reach the daemon at {base}: {exc}")
        if response.status_code != 200:
            _http_error(response)
        click.echo(json.dumps(response.json()))
        return
    if url is not None:
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


@main.command("list-indexes")
@URL_OPTION
@CONFIG_OPTION
def list_indexes(url: str | None, config_file: Path | None) -> None:
    """List the indexes with their keys, state, entry counts and conditions."""
    for index in _get_json(_http_url(url, config_file), "/indexes")["indexes"]:
        state = index["state"]
        if "build" in index:
            state += f" {index['build']['percent']:g}%"
        line = f"{index['name']}\t{','.join(index['keys'])}\t{state}\t{index['entries']}"
        click.echo(line + (f"\tWHERE {index['where']}" if index.get("where") else ""))


@main.command()
@click.argument("name")
@URL_OPTION
@CONFIG_OPTION
@click.option("--eq", help="JSON: the key (or a prefix of it, as a list) to match.")
@click.option("--low", help="JSON: the lower bound (a value or a list prefix).")
@click.option("--high", help="JSON: the upper bound.")
@click.option(
    "--inclusion",
    type=click.Choice(["both", "low", "high", "neither"]),
    default="both",
    show_default=True,
)
@click.option(
    "--consistency", type=click.Choice(["any", "request_plus"]), default="any", show_default=True
)
@click.option(
    "--at-plus",
    "at_plus",
    help='JSON: wait for a snapshot covering {"vbucket": seqno, ...}, or the line '
    "`indexer feed --wait visible` prints (session consistency).",
)
@click.option("--limit", type=click.IntRange(0))
@click.option("--timeout", type=click.FloatRange(0), default=120, show_default=True)
@click.option(
    "--cluster-map",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Scan every node of this cluster map and merge the rows in index order.",
)
def scan(
    name: str,
    url: str | None,
    config_file: Path | None,
    eq: str | None,
    low: str | None,
    high: str | None,
    inclusion: str,
    consistency: str,
    at_plus: str | None,
    limit: int | None,
    timeout: float,
    cluster_map: Path | None,
) -> None:
    """Print index NAME's entries (JSONL, index order) from the running daemon, or from every
    node of a cluster map."""
    import json

    import httpx

    if eq is not None and (low is not None or high is not None):
        fail("give --eq or --low/--high, not both", 2)
    params: dict[str, Any] = {
        "consistency": consistency,
        "inclusion": inclusion,
        "timeout": timeout,
    }
    for key, value in (("eq", eq), ("low", low), ("high", high)):
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
    if limit is not None:
        params["limit"] = limit
    if cluster_map is not None:
        if url is not None:
            fail("give --url or --cluster-map, not both", 2)
        _scan_cluster(cluster_map, name, params, timeout + 30)
        return
    base = _http_url(url, config_file)
    try:
        with httpx.stream(
            "GET", f"{base}/indexes/{name}/scan", params=params, timeout=timeout + 30
        ) as response:
            if response.status_code != 200:
                response.read()
                _http_error(response)
            out = sys.stdout
            for line in response.iter_lines():
                if line:
                    out.write(line + "\n")
    except httpx.HTTPError as exc:
        fail(f"cannot reach the daemon at {base}: {exc}")
    except BrokenPipeError:
        sys.stderr.close()


def _scan_cluster(path: Path, name: str, params: dict[str, Any], timeout: float) -> None:
    import json

    from indexer.cluster import ClusterMapError, ClusterScanError, load_cluster_map, scan_cluster

    try:
        cluster = load_cluster_map(path)
    except ClusterMapError as exc:
        fail(str(exc), 2)
    try:
        with scan_cluster(cluster, name, params, timeout) as rows:
            out = sys.stdout
            for row in rows:
                out.write(json.dumps(row, ensure_ascii=False, separators=(", ", ": ")) + "\n")
    except ClusterScanError as exc:
        fail(str(exc))
    except BrokenPipeError:
        sys.stderr.close()


@main.command("create-index")
@click.argument("name")
@click.option("--keys", required=True, help="Field paths of the key, comma-separated.")
@click.option("--where", help='A condition for a partial index, like "age >= 18".')
@click.option(
    "--wait",
    is_flag=True,
    help="Wait until the index is active, with a progress bar while it is built.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=3600.0,
    show_default=True,
    help="Seconds --wait waits at most.",
)
@URL_OPTION
@CONFIG_OPTION
def create_index(
    name: str,
    keys: str,
    where: str | None,
    wait: bool,
    timeout: float,
    url: str | None,
    config_file: Path | None,
) -> None:
    """Create index NAME on a running daemon. Over data already streamed it is built first
    (state building, then catchup) and becomes active once caught up."""
    import httpx

    base = _http_url(url, config_file)
    body: dict[str, Any] = {"name": name, "keys": [k.strip() for k in keys.split(",") if k.strip()]}
    if where is not None:
        body["where"] = where
    try:
        response = httpx.post(f"{base}/indexes", json=body, timeout=120)
    except httpx.HTTPError as exc:
        fail(f"cannot reach the daemon at {base}: {exc}")
    if response.status_code != 201:
        _http_error(response)
    created = response.json()
    condition = f" WHERE {created['where']}" if created.get("where") else ""
    click.echo(
        f"created {created['name']}({', '.join(created['keys'])}){condition}: {created['state']}"
    )
    if wait and created["state"] != "active":
        _wait_built(base, name, timeout)


def _wait_built(base: str, name: str, timeout: float) -> None:
    """Poll the index's state, showing its build progress, until it is active."""
    import time

    deadline = time.monotonic() + timeout
    shown = 0
    with click.progressbar(length=100, label=f"building {name}", file=sys.stderr) as bar:
        while True:
            indexes = {i["name"]: i for i in _get_json(base, "/indexes")["indexes"]}
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


@main.command("drop-index")
@click.argument("name")
@URL_OPTION
@CONFIG_OPTION
def drop_index(name: str, url: str | None, config_file: Path | None) -> None:
    """Drop index NAME on a running daemon and delete its entries."""
    import httpx

    base = _http_url(url, config_file)
    try:
        response = httpx.delete(f"{base}/indexes/{name}", timeout=600)
    except httpx.HTTPError as exc:
        fail(f"cannot reach the daemon at {base}: {exc}")
    if response.status_code != 204:
        _http_error(response)
    click.echo(f"dropped {name}")
