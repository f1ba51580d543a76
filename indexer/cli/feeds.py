"""The commands that put documents in: `feed`, `router` and `shard-state`."""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import trio

from indexer.cli.common import (
    DIR,
    FILE,
    TLS_CA_OPTION,
    TLS_OPTION,
    TOKEN_FILE_OPTION,
    TOKEN_OPTION,
    _address,
    _feed_security,
    _token,
    fail,
    log_options,
)
from indexer.config import TOKEN_ENV
from indexer.routes import ROUTER_ROUTES, routes_help

if TYPE_CHECKING:
    from indexer.router.streams.feed import FeedSecurity

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


@click.command()
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


@click.command(epilog="HTTP routes (--http):\n\n" + routes_help(ROUTER_ROUTES))
@click.option(
    "--state",
    type=DIR,
    metavar="DIR",
    help="The router's source log (created if missing); needed but with --drop-slot.",
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
@click.option(
    "--cluster",
    metavar="URL",
    help="Stream to the nodes of the cluster's map in etcd (etcd://HOST:PORT[,...]/PREFIX, "
    "watched) instead of --to.",
)
@JSONL_OPTION
@click.option("--follow", is_flag=True, help="Keep reading lines appended to --jsonl (tail -f).")
@click.option(
    "--http",
    "http_address",
    metavar="HOST:PORT",
    help="Serve the HTTP routes below here (port 0: any).",
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
    "--ack",
    "ack_rule",
    type=click.Choice(["all", "majority"]),
    default="all",
    show_default=True,
    help="Which owners of a vbucket (its active node and replicas) must read a bulk request's "
    "documents before a wait=visible request is answered: all of them, or a majority.",
)
@click.option(
    "--bulk-max-mb",
    type=click.FloatRange(0.001, 1024),
    metavar="MB",
    default=16.0,
    show_default=True,
    help="Largest body of a POST /docs/_bulk request; a larger one gets 413.",
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
@click.option(
    "--postgres",
    metavar="DSN",
    help="Follow a PostgreSQL table (--table) through logical replication: a connection "
    "string such as 'host=db dbname=shop user=indexer'.",
)
@click.option(
    "--table",
    metavar="NAME",
    help="With --postgres: the table (schema.table) whose rows are the documents.",
)
@click.option(
    "--id-column",
    metavar="NAME",
    help="With --postgres: the column of the document id (default: the primary key).",
)
@click.option(
    "--doc-column",
    metavar="NAME",
    help="With --postgres: a JSON column that is the document (default: every column).",
)
@click.option(
    "--slot",
    metavar="NAME",
    help="With --postgres: the replication slot and publication (default indexer_SCHEMA_TABLE).",
)
@click.option(
    "--drop-slot",
    metavar="NAME",
    help="With --postgres: drop this replication slot (and its publication), then exit.",
)
@TOKEN_OPTION
@TOKEN_FILE_OPTION
@TLS_OPTION
@TLS_CA_OPTION
@log_options
def router(
    state: Path | None,
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
    bulk_max_mb: float,
    ack_rule: str,
    vbucket_range: str | None,
    source_id: str | None,
    cluster_map: Path | None,
    cluster: str | None,
    shards: int,
    parent_pipe: bool,
    process_name: str | None,
    token: str | None,
    token_file: Path | None,
    tls: bool,
    tls_ca: Path | None,
    postgres: str | None,
    table: str | None,
    id_column: str | None,
    doc_column: str | None,
    slot: str | None,
    drop_slot: str | None,
    log_level: str | None,
    log_format: str,
) -> None:
    """Run a router until SIGINT or SIGTERM: append the inputs to the source log in --state and
    stream it to every --to node, then each new document as it comes. With --postgres, the
    input is a table: its rows, then its changes.

    Examples:

    \b
      indexer router --state router --to 127.0.0.1:9105 --jsonl docs.jsonl --follow
      indexer router --state router --shards 2 --cluster-map map.toml --http 127.0.0.1:9110
    """
    from indexer.logs import configure as configure_logging
    from indexer.router import SourceError, SourceLog, Workload
    from indexer.router.inputs.postgres.table import PostgresError, PostgresOptions
    from indexer.router.service import RouterOptions, run_router
    from indexer.storage import COMPACTION_NICE

    if drop_slot is not None:
        if postgres is None:
            fail("--drop-slot needs --postgres DSN", 2)
        from indexer.router.inputs.postgres.table import drop_slot as drop

        try:
            existed = drop(postgres, drop_slot)
        except PostgresError as exc:
            fail(str(exc))
        click.echo(f"slot {drop_slot} dropped" if existed else f"no slot named {drop_slot}")
        return
    if state is None:
        fail("--state DIR is needed: the router's source log", 2)
    postgres_options = None
    if postgres is not None:
        if table is None:
            fail("--postgres needs --table: the table whose rows are the documents", 2)
        if jsonl is not None or generate is not None or shards > 1:
            fail("--postgres is the router's input: not with --jsonl, --generate or --shards", 2)
        postgres_options = PostgresOptions(postgres, table, id_column, doc_column, slot)
    elif table or id_column or doc_column or slot:
        fail("--table, --id-column, --doc-column and --slot go with --postgres DSN", 2)
    if follow and jsonl is None:
        fail("--follow needs --jsonl FILE", 2)
    if cluster_map is not None and cluster is not None:
        fail("--cluster-map or --cluster: one of the two", 2)
    where: Path | str | None = cluster_map if cluster_map is not None else cluster
    if bool(targets) == (where is not None):
        fail(
            "give the nodes with --to HOST:PORT, --cluster-map FILE or --cluster URL (one of them)",
            2,
        )
    if where is not None:
        from indexer.cluster.map import ClusterMapError
        from indexer.cluster.store import load_map

        try:
            load_map(where)
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
            *(["--cluster", cluster] if cluster is not None else []),
            "--memory-mb", str(memory_mb),
            "--bulk-max-mb", str(bulk_max_mb),
            "--ack", ack_rule,
            "--log-level", log_level or "info",
            "--log-format", log_format,
            *(["--tls"] if tls else []),
            *(["--tls-ca", str(tls_ca)] if tls_ca is not None else []),
        ]  # fmt: skip
        _run_shards(
            state, shards, vbuckets, source_id, shard_args, _token(token, token_file),
            memory_mb, jsonl, follow, workload, rate, http, int(bulk_max_mb * (1 << 20)),
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
        cluster_map=where,
        security=_feed_security(token, token_file, tls, tls_ca),
        parent_pipe=parent_pipe,
        bulk_max_bytes=int(bulk_max_mb * (1 << 20)),
        postgres=postgres_options,
        ack_rule=ack_rule,
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
        except (OSError, PostgresError) as exc:
            fail(str(exc))
        except KeyboardInterrupt:
            fail("interrupted during start-up", 130)


@click.command("shard-state")
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
    from indexer.router.shards.layout import ShardLayout, open_layout
    from indexer.router.source.log import split_log

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
    bulk_max_bytes: int,
) -> None:
    """`indexer router --shards K`: this process starts the shards and feeds them."""
    from indexer.router import SourceError
    from indexer.router.shards.layout import lock_state, open_layout
    from indexer.router.shards.parent import run_sharded_router
    from indexer.router.shards.process import ShardedOptions, ShardStartError

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
        bulk_max_bytes=bulk_max_bytes,
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
    from indexer.cluster.map import ClusterMapError, parse_vbuckets

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
