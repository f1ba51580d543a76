"""The long-running router (`indexer router`): it opens the source, starts the inputs and one
task per indexer node, and stops them together.

The inputs (`inputs/`: a JSONL file read to its end or followed like `tail -f`, the generated
workload, a PostgreSQL table, and the HTTP API of `api.py`) append through the source's
`Appender`: the `SourceLog` gives each document its vbucket and seqno, the `MutationManager`
keeps it in memory, and the append wakes the node tasks (`streams/nodes.py`), each holding one
connection that reads memory while its node keeps up and the log when it is behind.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import trio

from indexer.collector import rare_collections
from indexer.router.api import serve_http
from indexer.router.documents import (
    Document,
    LineSplitter,
)
from indexer.router.inputs.bulk import DEFAULT_MAX_BULK_BYTES
from indexer.router.inputs.bulk_forward import PARENT_URL_ENV
from indexer.router.inputs.lines import parse_lines
from indexer.router.inputs.postgres.follower import TableFollower
from indexer.router.inputs.postgres.table import PostgresError, PostgresOptions
from indexer.router.inputs.workload import Workload, generate, paced
from indexer.router.shards.input import follow_parent_stdio
from indexer.router.source.appender import READ_BYTES, Appender, append_bytes
from indexer.router.source.log import SourceLog
from indexer.router.source.mutations import MutationManager
from indexer.router.streams.feed import FeedSecurity
from indexer.router.streams.nodes import ROUTER_NAME, Address, Nodes, stream_to_node

log = logging.getLogger("indexer.router")

POLL_S = 0.2  # how often a followed file at its end is looked at again
MAP_WAIT_S = 30.0  # the map is read again at least this often (a file's every 2 s)
EXPIRY_PAGER_S = 1.0  # how often the expiry pager looks for expired documents
EXPIRY_BATCH = 10_000  # expired documents deleted per append
DEFAULT_MEMORY_BYTES = 256 << 20  # the Mutation Manager's cap


@dataclass(frozen=True)
class RouterOptions:
    """What `indexer router` runs: its indexer nodes and inputs."""

    targets: Sequence[Address]
    jsonl: Path | None = None
    follow: bool = False
    http: Address | None = None
    router_name: str = ROUTER_NAME
    memory_bytes: int = DEFAULT_MEMORY_BYTES
    generate: Workload | None = None
    rate: float | None = None  # generated documents per second; None: as fast as appended
    cluster_map: Path | str | None = None  # the nodes come from this map (a file or etcd), followed
    # The nodes' shared token (in every handshake) and TLS context (None: plain TCP).
    security: FeedSecurity = field(default_factory=FeedSecurity)
    # A shard of `indexer router --shards`: the input is the parent's, on stdin (needs `http`).
    parent_pipe: bool = False
    bulk_max_bytes: int = DEFAULT_MAX_BULK_BYTES  # of a POST /docs/_bulk body
    postgres: PostgresOptions | None = None  # a table followed through logical replication
    ack_rule: str = "all"  # which owners of a vbucket a wait=visible request waits for


async def read_jsonl_input(path: Path, follow: bool, appender: Appender) -> None:
    """Append the file's documents; with `follow`, keep reading what is appended to it.

    A bad line is logged and skipped. A followed file that shrinks was truncated: it is read
    again from the start.
    """
    splitter = LineSplitter()
    where = str(path)
    total = 0
    batch_bytes = append_bytes(appender.mm.capacity)
    async with await trio.open_file(path, "rb") as f:
        offset = 0
        batch: list[Document] = []
        taken = 0  # input bytes in `batch`
        while True:
            data = await f.read(READ_BYTES)
            # Input is waiting until a read finds nothing more (index builds give way meanwhile).
            appender.input_waiting = bool(data)
            before = splitter.line
            read = splitter.feed(data) if data else ([] if follow else splitter.finish())
            lines = list(enumerate(read, before + 1))
            offset += len(data)
            documents, errors = parse_lines(lines, where)
            for error in errors:
                log.error("skipped a bad input line: %s", error)
            batch += documents
            taken += len(data)
            if data and taken < batch_bytes:
                # Reads are parsed a piece at a time, the loop serving others in between; the
                # append waits for more: a bigger batch is a bigger snapshot per vbucket, so
                # the per-snapshot work is spread over more documents.
                await trio.lowlevel.checkpoint()
                continue
            await appender.append(batch)
            total += len(batch)
            batch, taken = [], 0
            if data:
                continue
            if not follow:
                log.info("read %d documents from %s", total, where)
                if appender.foreign:
                    log.info(
                        "%d of the input's documents are in other routers' vbuckets: left to them",
                        appender.foreign,
                    )
                return
            await trio.sleep(POLL_S)
            size = (await trio.to_thread.run_sync(os.stat, path)).st_size
            if size < offset:
                log.warning("%s was truncated: reading it again from the start", where)
                await f.seek(0)
                offset = 0
                splitter = LineSplitter()


async def expire_documents(appender: Appender) -> None:
    """The expiry pager: every EXPIRY_PAGER_S, delete what has expired (as a delete mutation)."""
    while True:
        await trio.sleep(EXPIRY_PAGER_S)
        while await appender.expire() >= EXPIRY_BATCH:
            pass  # more are due: go on at once


async def generate_input(workload: Workload, rate: float | None, appender: Appender) -> None:
    """Append the workload's documents (`workload.paced`: as fast as the log takes them, or
    about `rate` per second)."""
    total = 0
    async for batch in paced(generate(workload), rate):
        await appender.append(batch)
        total += len(batch)
    log.info("generated %d documents", total)


class ClusterWatch:
    """The targets of a cluster map (a file, or etcd): read again when it changes or a node
    says NOT_MY_SLICE, and handed to `reconcile` whenever they differ."""

    def __init__(self, where: Path | str) -> None:
        from indexer.cluster.store import map_source

        self.source = map_source(where)
        self._poked = trio.Event()

    def poke(self) -> None:
        self._poked.set()

    def load(self) -> list[Address] | None:
        """The map's feed addresses, or None if it is unchanged or (logged) unreadable.
        Blocking (etcd is asked over HTTP): in a thread."""
        from indexer.cluster.map import ClusterMapError

        try:
            cluster = self.source.changed(force=self._poked.is_set())
        except ClusterMapError as exc:
            log.error("%s; keeping the nodes as they are", exc)
            return None
        return None if cluster is None else [node.feed for node in cluster.nodes]

    async def run(self, reconcile: Callable[[list[Address]], None]) -> None:
        while True:
            async with trio.open_nursery() as nursery:
                # Whichever comes first: a change of the map, a node's NOT_MY_SLICE, the poll.
                async def first(wait: Callable[[], Awaitable[None]]) -> None:
                    await wait()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(first, self._poked.wait)
                nursery.start_soon(first, functools.partial(self.source.wait_change, MAP_WAIT_S))
            targets = await trio.to_thread.run_sync(self.load)
            self._poked = trio.Event()
            if targets is not None:
                reconcile(targets)


async def run_router(source: SourceLog, options: RouterOptions) -> None:
    """Run the router until SIGINT or SIGTERM; then close the connections and return."""
    highs = {vb: source.high_seqno(vb) for vb in source.vbuckets_with_history()}
    appender = Appender(
        source, MutationManager(options.memory_bytes, high_seqnos=highs), options.ack_rule
    )
    targets = list(options.targets)
    watch = ClusterWatch(options.cluster_map) if options.cluster_map is not None else None
    if watch is not None:
        found: list[Address] | None = await trio.to_thread.run_sync(watch.load)
        targets = found or targets
    nodes = Nodes(targets)
    running: dict[Address, trio.CancelScope] = {}
    url = ""
    follower = None if options.postgres is None else TableFollower(options.postgres, appender)
    failed: list[PostgresError] = []
    signals_of = trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM)
    with signals_of as signals, rare_collections() as collector:
        async with trio.open_nursery() as nursery:

            async def node_task(address: Address, scope: trio.CancelScope) -> None:
                try:
                    with scope:
                        await stream_to_node(
                            address,
                            source,
                            appender,
                            nodes,
                            options.router_name,
                            options.security,
                        )
                finally:
                    if running.get(address) is scope:
                        del running[address]

            def start_node(address: Address) -> None:
                scope = running[address] = trio.CancelScope()
                nursery.start_soon(node_task, address, scope)

            def reconcile(wanted: list[Address]) -> None:
                for address in [a for a in running if a not in wanted]:
                    log.info("%s:%d left the cluster map: closing its streams", *address)
                    running.pop(address).cancel()
                for address in wanted:
                    if address not in running:
                        log.info("%s:%d is in the cluster map: streaming to it", *address)
                        start_node(address)

            for address in targets:
                start_node(address)
            if watch is not None:
                nodes.on_not_my_slice = watch.poke
                nursery.start_soon(watch.run, reconcile)
            if options.http is not None:
                url = await nursery.start(
                    serve_http,
                    options.http,
                    appender,
                    nodes,
                    options.security.token,
                    collector,
                    options.bulk_max_bytes,
                    os.environ.get(PARENT_URL_ENV) if options.parent_pipe else None,
                    follower,
                )
                log.log(
                    logging.DEBUG if options.parent_pipe else logging.INFO,  # the parent says it
                    "router API on %s (PUT and DELETE /docs/ID, POST /docs/_bulk, "
                    "POST /failover/VB, GET /stats, GET /metrics)",
                    url,
                )
            if options.parent_pipe:

                async def parent_input() -> None:
                    await follow_parent_stdio(appender, url)
                    log.info("the parent router closed its pipe: stopping")
                    nursery.cancel_scope.cancel()

                nursery.start_soon(parent_input)
            nursery.start_soon(expire_documents, appender)
            if options.jsonl is not None:
                nursery.start_soon(read_jsonl_input, options.jsonl, options.follow, appender)
            if options.generate is not None:
                nursery.start_soon(generate_input, options.generate, options.rate, appender)
            if follower is not None:

                async def follow_table() -> None:
                    try:
                        await follower.run()
                    except PostgresError as exc:
                        failed.append(exc)
                        nursery.cancel_scope.cancel()

                nursery.start_soon(follow_table)
            log.info(
                "router running: source log in %s, %d vbuckets; streaming to %s",
                source.path,
                source.num_vbuckets,
                ", ".join(f"{host}:{port}" for host, port in targets),
            )
            async for signum in signals:
                log.info("%s received: stopping", signal.Signals(signum).name)
                nursery.cancel_scope.cancel()
                break
    if failed:
        raise failed[0]
    log.info("stopped")
