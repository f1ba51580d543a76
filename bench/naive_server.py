"""The naive reference of the ingest benchmark: what a user would write by hand.

An asyncio TCP server over one plyvel database. It reads the router's frames, and for every
mutation and every index does a back-index `get`, then the delete of the old entries and the puts
of the new ones as separate `db.put`/`db.delete` calls: no batching, no cache, no queue. When the
client shuts its side down, it syncs the store, answers with one ACK frame, prints its counters
as one JSON line on stdout and exits.

    python bench/naive_server.py --data-dir DIR [--port 0]

Its first stdout line is `listening PORT`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from indexer import protocol as p
from indexer.config import parse_config
from indexer.keys import entry_tail
from indexer.storage import IndexStore

RECEIVE_BYTES = 256 * 1024


@dataclass
class NaiveCounters:
    """What the naive server did, reported as JSON when it exits."""

    mutations: int = 0
    gets: int = 0
    puts: int = 0
    deletes: int = 0
    first_byte: float = 0.0
    done: float = 0.0


class NaiveIndexer:
    """Applies each mutation on its own: get the back entry, delete the old, put the new."""

    def __init__(self, store: IndexStore, definitions: tuple[p.IndexDefinition, ...]) -> None:
        indexes = store.ensure_indexes(definitions)
        self.store = store
        self.db = store.db
        self.main_prefixes = [i.main_prefix for i in indexes]
        self.back_prefixes = [i.back_prefix for i in indexes]
        self.counters = NaiveCounters()

    def apply(self, mutation: p.Mutation) -> None:
        """One mutation, one index at a time, each operation its own LevelDB write."""
        db = self.db
        c = self.counters
        docid = mutation.docid
        c.mutations += 1
        for j, back_prefix in enumerate(self.back_prefixes):
            new = b"" if mutation.deleted else mutation.keys[j]
            old = db.get(back_prefix + docid) or b""
            c.gets += 1
            if old == new:
                continue
            main_prefix = self.main_prefixes[j]
            if old:
                db.delete(main_prefix + old + entry_tail(docid))
                c.deletes += 1
            if new:
                db.put(main_prefix + new + entry_tail(docid), b"")
                db.put(back_prefix + docid, new)
                c.puts += 2
            else:
                db.delete(back_prefix + docid)
                c.deletes += 1

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one client: apply its MUTATIONS frames, ack once it has sent everything."""
        decoder = p.FrameDecoder(64 << 20)
        while True:
            data = await reader.read(RECEIVE_BYTES)
            if not self.counters.first_byte:
                self.counters.first_byte = time.time()
            if not data:
                break
            decoder.feed(data)
            for message in decoder.messages():
                if isinstance(message, p.MutationBatch):
                    for record in message.records():
                        self.apply(p.parse_record(record, message.nkeys))
        decoder.close()
        self.store.sync()
        self.counters.done = time.time()
        writer.write(p.encode(p.Ack(())))
        await writer.drain()
        writer.close()
        await writer.wait_closed()


async def serve(data_dir: Path, host: str, port: int) -> NaiveCounters:
    """Serve exactly one connection, then return the counters."""
    finished = asyncio.Event()
    with IndexStore(data_dir) as store:
        naive = NaiveIndexer(store, parse_config().indexes)

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await naive.handle(reader, writer)
            finally:
                finished.set()

        server = await asyncio.start_server(handle, host, port)
        async with server:
            bound = server.sockets[0].getsockname()[1]
            print(f"listening {bound}", flush=True)
            await finished.wait()
        return naive.counters


def main(argv: list[str] | None = None) -> None:
    """Command line: --data-dir, --host, --port."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    counters = asyncio.run(serve(args.data_dir, args.host, args.port))
    print(json.dumps(asdict(counters)), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
