"""The `indexer` command line: serve, feed, router, dump, and the HTTP API's clients (stats,
list-indexes, scan, count, health, create-index, drop-index, compact).

Every error ends the command with a non-zero exit and one line on stderr saying what is wrong.
The same thing has the same placeholder in every command's help: FILE, DIR, HOST:PORT, URL,
NAME, N, JSON, SECONDS.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re
import ssl
import sys
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click
import trio

from indexer.config import (
    LOG_LEVELS,
    TOKEN_ENV,
    Config,
    ConfigError,
    check_index_name,
    check_path,
    check_token,
    client_ssl_context,
    load_config,
    read_token_file,
)
from indexer.logs import LOG_FORMATS

if TYPE_CHECKING:
    from indexer.router.feed import FeedSecurity


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


def _data_dir(value: Path | None, option: str = "--data-dir") -> Path | None:
    """A data directory given on the command line, refused (exit 2) if it has `..` steps."""
    if value is None:
        return None
    try:
        return check_path(value, option)
    except ConfigError as exc:
        fail(str(exc), 2)


def _index_name(name: str) -> str:
    """An index name given on the command line, refused (exit 2) unless it is one."""
    problem = check_index_name(name)
    if problem is not None:
        fail(problem, 2)
    return name


def _token(token: str | None, token_file: Path | None, fallback: str | None = None) -> str | None:
    """The shared token to present: --token-file, else --token, else $INDEXER_TOKEN, else
    `fallback` (a configuration's); None if none. Exit 2 when it is malformed."""
    if token is not None and token_file is not None:
        fail("give --token or --token-file, not both", 2)
    try:
        if token_file is not None:
            return read_token_file(token_file, "--token-file")
        if token is not None:
            return check_token(token.strip(), "--token")
        from_env = os.environ.get(TOKEN_ENV)
        if from_env:
            return check_token(from_env.strip(), TOKEN_ENV)
    except ConfigError as exc:
        fail(str(exc), 2)
    return fallback


def _tls_context(tls: bool, tls_ca: Path | None) -> ssl.SSLContext | None:
    """The client TLS context of --tls / --tls-ca (None: plain); exit 2 if the CA is bad."""
    if not tls and tls_ca is None:
        return None
    try:
        return client_ssl_context(tls_ca, "--tls-ca")
    except ConfigError as exc:
        fail(str(exc), 2)


def _feed_security(
    token: str | None, token_file: Path | None, tls: bool, tls_ca: Path | None
) -> FeedSecurity:
    """What `feed` and `router` present to the daemon (token) and check it with (TLS)."""
    from indexer.router.feed import FeedSecurity

    return FeedSecurity(_token(token, token_file) or "", _tls_context(tls, tls_ca))


TOKEN_HELP = (
    "The indexer's shared token (default: $INDEXER_TOKEN). On the command line it shows in the "
    "process list: prefer --token-file or the variable."
)
TOKEN_OPTION = click.option("--token", metavar="TOKEN", help=TOKEN_HELP)
TOKEN_FILE_OPTION = click.option(
    "--token-file",
    type=click.Path(dir_okay=False, path_type=Path),
    metavar="FILE",
    help="A file holding the indexer's shared token (its first line).",
)
TLS_CA_OPTION = click.option(
    "--tls-ca",
    type=click.Path(dir_okay=False, path_type=Path),
    metavar="FILE",
    help="A PEM file of CA certificates to check the indexer's TLS certificate with (for a "
    "self-signed certificate, the certificate itself).",
)
TLS_OPTION = click.option(
    "--tls",
    is_flag=True,
    help="Connect to the feed port with TLS, checking its certificate with the system's CAs "
    "(or --tls-ca, which implies --tls).",
)


# The types of the placeholders FILE, DIR and PORT.
FILE = click.Path(dir_okay=False, path_type=Path)
DIR = click.Path(file_okay=False, path_type=Path)
PORT = click.IntRange(0, 65535)
SERVE_CONFIG_HELP = "A TOML configuration overriding the embedded default's keys."


def log_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add --log-level and --log-format (the long-running commands' log on stderr)."""
    level = click.option(
        "--log-level",
        type=click.Choice(LOG_LEVELS, case_sensitive=False),
        help="Log records of this level and above (default: server.log_level for serve, info "
        "for router).",
    )
    form = click.option(
        "--log-format",
        type=click.Choice(LOG_FORMATS),
        default="text",
        show_default=True,
        help="text: one line per record; json: one JSON object per line (time, level, logger, "
        "message).",
    )
    return level(form(command))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="indexer", prog_name="indexer", message="%(prog)s %(version)s")
def main() -> None:
    """A secondary-index daemon fed by routers over TCP, persisting to LevelDB.

    Examples:

    \b
      indexer serve --config my.toml
      indexer router --state router --to 127.0.0.1:9105 --jsonl docs.jsonl --follow
    """


@main.command()
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
@click.option("--node", metavar="NAME", help="This node's name in --cluster-map.")
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
    node: str | None,
    adopt_source: bool,
) -> None:
    """Run the daemon until SIGINT or SIGTERM (then drain, persist and exit 0).

    Examples:

    \b
      indexer serve --config my.toml --data-dir /srv/idx --feed-port 9200
      indexer serve --cluster-map cluster.toml --node a --log-format json
    """
    from indexer.daemon import StartError
    from indexer.daemon import serve as run_daemon
    from indexer.logs import configure as configure_logging
    from indexer.storage import StoreError

    slice_of: dict[str, Any] = {}
    data_dir = _data_dir(data_dir)
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


def _address(value: str, allow_zero: bool = False) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not int(not allow_zero) <= int(port) < 65536:
        raise click.BadParameter(f"{value!r} is not HOST:PORT")
    return host, int(port)


APPEND_CHUNK = 50_000  # documents per append to a source log (one synced WriteBatch each)

JSONL_OPTION = click.option(
    "--jsonl",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    metavar="FILE",
    help='Documents, one per line: {"id":..,"doc":{..}} or {"id":..,"deleted":true}.',
)
GENERATE_OPTION = click.option(
    "--generate",
    type=click.IntRange(1),
    metavar="N",
    help="Generate N mutations: a seeded workload of documents and deletes.",
)
KEYS_OPTION = click.option(
    "--keys",
    type=click.IntRange(1),
    metavar="N",
    help="The document ids --generate draws from (default: a fifth of its N).",
)
DELETE_RATIO_OPTION = click.option(
    "--delete-ratio",
    type=click.FloatRange(0, 1),
    metavar="RATIO",
    default=0.1,
    show_default=True,
    help="The share of --generate's mutations that are deletes.",
)
SEED_OPTION = click.option(
    "--seed",
    type=int,
    metavar="N",
    default=42,
    show_default=True,
    help="The seed of --generate: the same seed gives the same mutations.",
)


@main.command()
@click.option("--to", "address", metavar="HOST:PORT", help="The indexer's feed address.")
@JSONL_OPTION
@GENERATE_OPTION
@KEYS_OPTION
@DELETE_RATIO_OPTION
@SEED_OPTION
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
    metavar="N",
    help="Vbuckets of the key space (default 1024, or the count the --state log was made with).",
)
@click.option(
    "--state",
    type=DIR,
    metavar="DIR",
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
    metavar="SEQNO",
    help="Where --failover starts the new history (default: the high seqno, losing nothing).",
)
@TOKEN_OPTION
@TOKEN_FILE_OPTION
@TLS_OPTION
@TLS_CA_OPTION
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
    token: str | None,
    token_file: Path | None,
    tls: bool,
    tls_ca: Path | None,
) -> None:
    """Push documents to an indexer through a router feed.

    With --state DIR the router keeps its source on disk: --failover runs first, then the input
    (if any) is appended, then (with --to) the log is streamed from where the indexer stands.

    Examples:

    \b
      indexer feed --to 127.0.0.1:9105 --jsonl docs.jsonl --wait visible
      indexer feed --state router --jsonl docs.jsonl --to 127.0.0.1:9105
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
    security = _feed_security(token, token_file, tls, tls_ca)
    if state is None:
        assert documents is not None and target is not None
        _feed_input(target, documents, total, wait, vbuckets or 1024, security)
    else:
        _feed_state(state, target, documents, wait, vbuckets, failover, failover_seqno, security)


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
    from indexer.collector import rare_collections
    from indexer.router import FeedError, SourceError
    from indexer.router.documents import DocumentError

    try:
        with rare_collections():  # the feed allocates per document too
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
    security: FeedSecurity,
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
                security=security,
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
    security: FeedSecurity,
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
                security=security,
            )

        result = _run_feed(run)
    _report(result)


@main.command()
@click.option(
    "--state",
    required=True,
    type=DIR,
    metavar="DIR",
    help="The router's source log (created if missing).",
)
@click.option(
    "--to", "targets", multiple=True, metavar="HOST:PORT", help="An indexer node (repeat)."
)
@click.option(
    "--cluster-map",
    type=FILE,
    metavar="FILE",
    help="Stream to the nodes of this cluster map (re-read when it changes) instead of --to.",
)
@JSONL_OPTION
@click.option("--follow", is_flag=True, help="Keep reading lines appended to --jsonl (tail -f).")
@click.option(
    "--http",
    "http_address",
    metavar="HOST:PORT",
    help="Serve PUT/DELETE /docs/ID, GET /stats and POST /failover/VB here (port 0: any).",
)
@click.option(
    "--vbuckets",
    type=click.IntRange(1, 65536),
    metavar="N",
    help="Vbuckets of a new --state log (default 1024; an existing log keeps its count).",
)
@GENERATE_OPTION
@KEYS_OPTION
@DELETE_RATIO_OPTION
@SEED_OPTION
@click.option(
    "--rate",
    type=click.FloatRange(min=0, min_open=True),
    metavar="N",
    help="Generate about N mutations per second (default: as fast as appended).",
)
@click.option(
    "--memory-mb",
    type=click.FloatRange(0.01, 1 << 20),
    metavar="MB",
    default=256.0,
    show_default=True,
    help="Cap of recent mutations kept in memory; nodes further behind read the source log.",
)
@click.option(
    "--vbucket-range",
    metavar="RANGE",
    help="Own only these vbuckets (like 0-511, or 0-255,768-1023), as one of several peer "
    "routers of one source that read the same input; fixed when --state is created.",
)
@click.option(
    "--source-id",
    metavar="ID",
    help="The source identity to create --state with (32 hex digits): peer routers of one "
    "source share it. Default: a new one.",
)
@click.option(
    "--shards",
    type=click.IntRange(1, 64),
    default=1,
    show_default=True,
    metavar="N",
    help="Run as N processes, each owning a contiguous range of vbuckets with its own source "
    "log, memory and node connections; this process reads the input and serves --http. Fixed "
    "when --state is created.",
)
@click.option(
    "--parent-pipe",
    is_flag=True,
    hidden=True,
    help="Run as a shard of --shards: the input comes from the parent on stdin (internal).",
)
@click.option(
    "--process-name",
    hidden=True,
    metavar="NAME",
    help="The shard's name in its log lines (internal).",
)
@TOKEN_OPTION
@TOKEN_FILE_OPTION
@TLS_OPTION
@TLS_CA_OPTION
@log_options
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
    vbucket_range: str | None,
    source_id: str | None,
    cluster_map: Path | None,
    shards: int,
    parent_pipe: bool,
    process_name: str | None,
    token: str | None,
    token_file: Path | None,
    tls: bool,
    tls_ca: Path | None,
    log_level: str | None,
    log_format: str,
) -> None:
    """Run a router until SIGINT or SIGTERM: append the inputs to the source log in --state and
    stream it to every --to node, then each new document as it comes.

    Examples:

    \b
      indexer router --state router --to 127.0.0.1:9105 --jsonl docs.jsonl --follow
      indexer router --state router --shards 2 --cluster-map map.toml --http 127.0.0.1:9110
    """
    from indexer.logs import configure as configure_logging
    from indexer.router import SourceError, SourceLog, Workload
    from indexer.router.service import RouterOptions, run_router
    from indexer.storage import COMPACTION_NICE

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
    if source_id is not None and not re.fullmatch(r"[0-9a-f]{32}", source_id):
        fail(f"--source-id: {source_id!r} is not 32 lowercase hex digits", 2)
    if parent_pipe and http is None:
        fail("--parent-pipe needs --http", 2)
    configure_logging(log_level or "info", log_format, process=process_name)
    if shards > 1:
        if vbucket_range is not None:
            fail("--shards splits all the vbuckets: peers with --vbucket-range run one each", 2)
        shard_args = [
            *(arg for address in addresses for arg in ("--to", f"{address[0]}:{address[1]}")),
            *(["--cluster-map", str(cluster_map)] if cluster_map is not None else []),
            "--memory-mb", str(memory_mb),
            "--log-level", log_level or "info",
            "--log-format", log_format,
            *(["--tls"] if tls else []),
            *(["--tls-ca", str(tls_ca)] if tls_ca is not None else []),
        ]  # fmt: skip
        _run_shards(
            state, shards, vbuckets, source_id, shard_args, _token(token, token_file),
            memory_mb, jsonl, follow, workload, rate, http,
        )  # fmt: skip
        return
    options = RouterOptions(
        addresses,
        jsonl,
        follow,
        http,
        memory_bytes=int(memory_mb * (1 << 20)),
        generate=workload,
        rate=rate,
        cluster_map=cluster_map,
        security=_feed_security(token, token_file, tls, tls_ca),
        parent_pipe=parent_pipe,
    )
    try:
        log = SourceLog(
            state,
            vbuckets,
            compaction_nice=COMPACTION_NICE,
            identity=source_id,
            vbuckets=_vbucket_range(vbucket_range, vbuckets),
        )
    except SourceError as exc:
        fail(str(exc))
    with log:
        try:
            trio.run(run_router, log, options)
        except OSError as exc:
            fail(str(exc))
        except KeyboardInterrupt:
            fail("interrupted during start-up", 130)


@main.command("shard-state")
@click.option(
    "--from",
    "old_state",
    required=True,
    type=DIR,
    metavar="DIR",
    help="The --state of a router without shards (stopped; left as it is).",
)
@click.option(
    "--into", required=True, type=DIR, metavar="DIR", help="The new --state (must not exist)."
)
@click.option(
    "--shards",
    required=True,
    type=click.IntRange(2, 64),
    metavar="N",
    help="The number of shards of the new --state (as indexer router --shards N).",
)
def shard_state(old_state: Path, into: Path, shards: int) -> None:
    """Copy a router's source log into the state directory of `indexer router --shards K`,
    with its history as it is (vbuckets, seqnos, failover logs, expiries, identity), so its
    nodes go on from where they are without a rollback.

    Examples:

    \b
      indexer shard-state --from router --into router-sharded --shards 2
      indexer router --state router-sharded --shards 2 --to 127.0.0.1:9105 ...
    """
    from indexer.router import SourceError, SourceLog
    from indexer.router.shards import ShardLayout, open_layout
    from indexer.router.source import split_log

    if into.exists():
        fail(f"--into: {into} exists already: give a new directory", 2)
    try:
        with SourceLog(old_state, create=False) as old:
            layout = ShardLayout(old.identity, old.num_vbuckets, shards)
        if shards > layout.num_vbuckets:
            fail(f"--shards {shards} is more than the {layout.num_vbuckets} vbuckets", 2)
        targets = [
            (into / f"shard-{i}", tuple(range(first, last + 1)))
            for i, (first, last) in enumerate(layout.ranges())
        ]
        copied = split_log(old_state, targets)
        open_layout(into, shards, layout.num_vbuckets, layout.identity)
    except SourceError as exc:
        fail(str(exc))
    click.echo(
        f"copied {copied} records of {old_state} into {shards} shards in {into}: run "
        f"indexer router --state {into} --shards {shards}"
    )


def _run_shards(
    state: Path,
    count: int,
    vbuckets: int | None,
    source_id: str | None,
    shard_args: list[str],
    token: str | None,
    memory_mb: float,
    jsonl: Path | None,
    follow: bool,
    workload: Any,
    rate: float | None,
    http: tuple[str, int] | None,
) -> None:
    """`indexer router --shards K`: this process starts the shards and feeds them."""
    from indexer.router import SourceError
    from indexer.router.shards import (
        ShardedOptions,
        ShardStartError,
        lock_state,
        open_layout,
        run_sharded_router,
    )

    try:
        layout = open_layout(state, count, vbuckets, source_id)
        lock = lock_state(state)
    except SourceError as exc:
        fail(str(exc))
    options = ShardedOptions(
        state,
        layout,
        shard_args,
        int(memory_mb * (1 << 20)),
        jsonl,
        follow,
        workload,
        rate,
        http,
        env={} if token is None else {TOKEN_ENV: token},
    )
    try:
        trio.run(run_sharded_router, options)
    except ShardStartError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        fail("interrupted during start-up", 130)
    finally:
        os.close(lock)


def _vbucket_range(value: str | None, count: int | None) -> tuple[int, ...] | None:
    """--vbucket-range as vbucket numbers (None: all), checked against the vbucket count."""
    if value is None:
        return None
    from indexer.cluster import ClusterMapError, parse_vbuckets

    items: list[int | str] = [
        int(item) if item.strip().isdigit() else item.strip() for item in value.split(",")
    ]
    try:  # the log checks them against its own vbucket count
        return parse_vbuckets(items, count or 1 << 16, "--vbucket-range")
    except ClusterMapError as exc:
        fail(str(exc), 2)


class _NoBar:
    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: int) -> None:
        return None


@main.command()
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


@dataclass(frozen=True)
class Api:
    """Where and how the CLI calls the daemon's HTTP API: the base URL, the bearer token (kept
    out of reprs) and how its TLS certificate is checked."""

    base: str
    token: str | None = field(default=None, repr=False)
    verify: ssl.SSLContext | bool = True

    @property
    def headers(self) -> dict[str, str]:
        """The Authorization header of the token, if any."""
        from indexer.client import bearer

        return bearer(self.token)


def _api(
    url: str | None,
    config_file: Path | None,
    token: str | None = None,
    token_file: Path | None = None,
    tls_ca: Path | None = None,
) -> Api:
    """The API of --url, else the configured address (https when the configuration has TLS),
    with the token and certificate check of `_client_security`."""
    config = _config(config_file) if url is None or config_file is not None else None
    if url:
        base = url.rstrip("/")
    else:
        assert config is not None
        scheme = "https" if config.security.tls else "http"
        base = f"{scheme}://{config.server.host}:{config.server.http_port}"
    bearer, context = _client_security(config, token, token_file, tls_ca)
    return Api(base, bearer, context if context is not None else True)


def _client_security(
    config: Config | None, token: str | None, token_file: Path | None, tls_ca: Path | None
) -> tuple[str | None, ssl.SSLContext | None]:
    """The token to present (the options, $INDEXER_TOKEN or the configuration's) and the TLS
    context to check the daemon with (--tls-ca, or the configuration's when it has TLS)."""
    security = config.security if config is not None else None
    context = None
    if tls_ca is not None:
        context = _tls_context(True, tls_ca)
    elif security is not None and security.tls:
        try:
            context = security.client_ssl_context()
        except ConfigError as exc:
            fail(str(exc), 2)
    fallback = security.token if security is not None else None
    return _token(token, token_file, fallback), context


def _http_error(response: Any) -> NoReturn:
    from indexer.client import error_text

    fail(f"HTTP {response.status_code}: {error_text(response.content)}")


def _get_json(
    api: Api, path: str, params: dict[str, Any] | None = None, timeout: float = 30
) -> Any:
    import httpx

    try:
        response = httpx.get(
            api.base + path, params=params, timeout=timeout, headers=api.headers, verify=api.verify
        )
    except httpx.HTTPError as exc:
        fail(f"cannot reach the daemon at {api.base}: {exc}")
    if response.status_code != 200:
        _http_error(response)
    return response.json()


URL_ENV = "INDEXER_URL"
URL_OPTION = click.option(
    "--url",
    metavar="URL",
    envvar=URL_ENV,
    show_envvar=True,
    help="The daemon's HTTP API, like http://127.0.0.1:9102 (default: the address of --config "
    "if given, else $INDEXER_URL, else the embedded configuration's).",
)
CONFIG_OPTION = click.option(
    "--config",
    "config_file",
    type=FILE,
    metavar="FILE",
    help="A TOML configuration: its address, token and tls_ca are used unless given otherwise.",
)


@dataclass(frozen=True)
class ApiOptions:
    """How to reach the HTTP API as the command line says: --url, --config, --token,
    --token-file and --tls-ca (see `api_options`)."""

    url: str | None
    config_file: Path | None
    token: str | None = field(repr=False)
    token_file: Path | None
    tls_ca: Path | None
    env_url: str | None = None  # $INDEXER_URL: below --url and --config

    def connect(self) -> Api:
        url = self.url or (self.env_url if self.config_file is None else None)
        return _api(url, self.config_file, self.token, self.token_file, self.tls_ca)


def api_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add the options of `ApiOptions` to a command, which gets them as one `daemon` argument."""

    @functools.wraps(command)
    def with_api(
        *args: Any,
        url: str | None,
        config_file: Path | None,
        token: str | None,
        token_file: Path | None,
        tls_ca: Path | None,
        **kwargs: Any,
    ) -> Any:
        env_url = None
        source = click.get_current_context().get_parameter_source("url")
        if source is click.core.ParameterSource.ENVIRONMENT:
            url, env_url = None, url  # --cluster-map or --data-dir may go with it
        daemon = ApiOptions(url, config_file, token, token_file, tls_ca, env_url)
        return command(*args, daemon=daemon, **kwargs)

    wrapped: Callable[..., Any] = with_api
    for option in (TLS_CA_OPTION, TOKEN_FILE_OPTION, TOKEN_OPTION, CONFIG_OPTION, URL_OPTION):
        wrapped = option(wrapped)
    return wrapped


JSON_OUTPUT_OPTION = click.option(
    "--json", "as_json", is_flag=True, help="Print the API's answer as JSON instead of a table."
)


@main.command()
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


@main.command()
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
        import httpx

        api = daemon.connect()
        try:
            response = httpx.post(
                f"{api.base}/compact", timeout=None, headers=api.headers, verify=api.verify
            )
        except httpx.HTTPError as exc:
            fail(f"cannot reach the daemon at {api.base}: {exc}")
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


@main.command("list-indexes")
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
    inclusion: str,
    consistency: str,
    at_plus: str | None,
    timeout: float,
) -> dict[str, Any]:
    """The query string of `query_options`' values; exit 2 when they are not JSON or clash."""
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
    return params


@main.command()
@click.argument("name")
@api_options
@query_options
@click.option(
    "--limit", type=click.IntRange(0), metavar="N", help="Print N entries at most (the first)."
)
@click.option(
    "--cluster-map",
    type=FILE,
    metavar="FILE",
    help="Scan every node of this cluster map and merge the rows in index order.",
)
def scan(
    name: str,
    daemon: ApiOptions,
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
    node of a cluster map.

    Examples:

    \b
      indexer scan by_city --low '"Berlin"' --high '"Oslo"' --limit 10
      indexer scan by_age --eq 30 --consistency request_plus
    """
    import httpx

    _index_name(name)
    params = _query_params(eq, low, high, inclusion, consistency, at_plus, timeout)
    if limit is not None:
        params["limit"] = limit
    if cluster_map is not None:
        if daemon.url is not None:
            fail("give --url or --cluster-map, not both", 2)
        # The nodes' addresses come from the map; a configuration gives its token and TLS.
        config = _config(daemon.config_file) if daemon.config_file is not None else None
        bearer, context = _client_security(config, daemon.token, daemon.token_file, daemon.tls_ca)
        _scan_cluster(cluster_map, name, params, timeout + 30, bearer, context)
        return
    api = daemon.connect()
    base = api.base
    try:
        with httpx.stream(
            "GET",
            f"{base}/indexes/{name}/scan",
            params=params,
            timeout=timeout + 30,
            headers=api.headers,
            verify=api.verify,
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


def _scan_cluster(
    path: Path,
    name: str,
    params: dict[str, Any],
    timeout: float,
    token: str | None,
    ssl_context: ssl.SSLContext | None,
) -> None:
    import json

    from indexer.cluster import ClusterMapError, ClusterScanError, load_cluster_map, scan_cluster

    try:
        cluster = load_cluster_map(path)
    except ClusterMapError as exc:
        fail(str(exc), 2)
    try:
        with scan_cluster(
            cluster, name, params, timeout, token=token, ssl_context=ssl_context
        ) as rows:
            out = sys.stdout
            for row in rows:
                out.write(json.dumps(row, ensure_ascii=False, separators=(", ", ": ")) + "\n")
    except ClusterScanError as exc:
        fail(str(exc))
    except BrokenPipeError:
        sys.stderr.close()


@main.command()
@click.argument("name")
@api_options
@query_options
def count(
    name: str,
    daemon: ApiOptions,
    eq: str | None,
    low: str | None,
    high: str | None,
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
    params = _query_params(eq, low, high, inclusion, consistency, at_plus, timeout)
    # The daemon answers 504 after `timeout`: the client waits a little longer.
    answer = _get_json(daemon.connect(), f"/indexes/{name}/count", params, timeout + 30)
    click.echo(answer["count"])


@main.command()
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
    import httpx

    api = daemon.connect()
    try:
        response = httpx.get(
            f"{api.base}/health", timeout=timeout, headers=api.headers, verify=api.verify
        )
    except httpx.HTTPError as exc:
        fail(f"cannot reach the daemon at {api.base}: {exc}")
    if response.status_code != 200:
        try:
            reason = response.json()["error"]
        except (ValueError, KeyError, TypeError):
            reason = response.text.strip()[:200]
        fail(f"the daemon at {api.base} is not healthy: HTTP {response.status_code}: {reason}")
    click.echo(f"{api.base}: ok")


@main.command("create-index")
@click.argument("name")
@click.option(
    "--keys", required=True, metavar="PATHS", help="Field paths of the key, comma-separated."
)
@click.option(
    "--where", metavar="CONDITION", help='A condition for a partial index, like "age >= 18".'
)
@click.option(
    "--wait",
    is_flag=True,
    help="Wait until the index is active, with a progress bar while it is built.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    metavar="SECONDS",
    default=3600.0,
    show_default=True,
    help="How long --wait waits at most.",
)
@api_options
def create_index(
    name: str,
    keys: str,
    where: str | None,
    wait: bool,
    timeout: float,
    daemon: ApiOptions,
) -> None:
    """Create index NAME on a running daemon. Over data already streamed it is built first
    (state building, then catchup) and becomes active once caught up.

    Examples:

    \b
      indexer create-index by_zip --keys address.zip,name --wait
      indexer create-index adults --keys age --where "age >= 18"
    """
    import httpx

    _index_name(name)
    api = daemon.connect()
    base = api.base
    body: dict[str, Any] = {"name": name, "keys": [k.strip() for k in keys.split(",") if k.strip()]}
    if where is not None:
        body["where"] = where
    try:
        response = httpx.post(
            f"{base}/indexes", json=body, timeout=120, headers=api.headers, verify=api.verify
        )
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
        _wait_built(api, name, timeout)


def _wait_built(api: Api, name: str, timeout: float) -> None:
    """Poll the index's state, showing its build progress, until it is active."""
    import time

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


@main.command("drop-index")
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
    import httpx

    _index_name(name)
    api = daemon.connect()
    base = api.base
    try:
        response = httpx.delete(
            f"{base}/indexes/{name}", timeout=600, headers=api.headers, verify=api.verify
        )
    except httpx.HTTPError as exc:
        fail(f"cannot reach the daemon at {base}: {exc}")
    if response.status_code != 204:
        _http_error(response)
    click.echo(f"dropped {name}")
