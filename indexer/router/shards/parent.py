"""A router as K processes (`indexer router --shards K`): the parent reads the input and serves
the HTTP API, and each shard owns a contiguous range of vbuckets with its own source log,
Mutation Manager and node connections.

A shard is `indexer router` itself, started by the parent with the shard's range, the shared
source identity and the parent's pipe as its input (`input.py`). The parent reads the
input a piece at a time, hands each line to the shard of its document's vbucket
(`documents.routing_id`, CRC32 of the id), and keeps every message until the shard acknowledges
it appended. A shard that dies is started again and given the messages it did not acknowledge;
its log records how far it holds the input, so it skips what it had (`messages.py`). A parent
started again resumes the input from the earliest shard's position, the same way.

State directory:

    DIR/shards.json     {"identity", "vbuckets", "shards"}: fixed when the directory is made
    DIR/shard-I/source  shard I's source log (its range and the identity recorded in it)
"""

from __future__ import annotations

import logging
import signal

import trio

from indexer.asgi import serve_asgi
from indexer.collector import rare_collections
from indexer.router.inputs.bulk_forward import PARENT_URL_ENV
from indexer.router.shards.api import ShardsApi
from indexer.router.shards.dispatch import LineRouter, generate_lines, read_jsonl
from indexer.router.shards.process import Shard, ShardedOptions, run_shard
from indexer.router.source.appender import append_bytes

log = logging.getLogger("indexer.router")


async def run_sharded_router(options: ShardedOptions) -> None:
    """Run the shards, the input and the API until SIGINT or SIGTERM; then stop the shards
    (each finishes its append) and return. ShardStartError if a shard cannot start."""
    layout = options.layout
    shards = [
        Shard(i, first, last, options.state / f"shard-{i}")
        for i, (first, last) in enumerate(layout.ranges())
    ]
    stopping = False
    batch_bytes = append_bytes(options.memory_bytes) * layout.count  # a shard's share as before
    signals_of = trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM)
    with signals_of as signals, rare_collections():  # the router's policy (collector.py)
        async with trio.open_nursery() as nursery:

            async def wait_signal() -> None:
                nonlocal stopping
                async for signum in signals:
                    log.info("%s received: stopping the shards", signal.Signals(signum).name)
                    stopping = True
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(wait_signal)
            if options.http is not None:  # first: a shard sends it bulk lines of other shards
                api = ShardsApi(layout, shards, options.bulk_max_bytes)
                url = await nursery.start(serve_asgi, options.http, api, "indexer.router.http")
                options.env[PARENT_URL_ENV] = url
            for shard in shards:
                nursery.start_soon(run_shard, options, shard, lambda: stopping)
            for shard in shards:
                await shard.ready.wait()
                log.info(
                    "%s/%d: vbuckets %s, pid %d, API on %s",
                    shard.name, layout.count, shard.vbuckets, shard.pid, shard.url,
                )  # fmt: skip
            if options.http is not None:
                log.info(
                    "router API on %s (PUT and DELETE /docs/ID, POST /docs/_bulk, "
                    "POST /failover/VB, GET /stats, GET /metrics)",
                    url,
                )
            router = LineRouter(layout, shards)
            if options.jsonl is not None:
                nursery.start_soon(read_jsonl, options.jsonl, options.follow, router, batch_bytes)
            if options.generate is not None:
                nursery.start_soon(generate_lines, options.generate, options.rate, router)
            log.info(
                "router running with %d shards: state in %s, %d vbuckets, source %s",
                layout.count, options.state, layout.num_vbuckets, layout.identity,
            )  # fmt: skip
    log.info("stopped")
