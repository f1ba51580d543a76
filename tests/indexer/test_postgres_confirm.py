"""What the PostgreSQL source confirms to its slot: never past a change not yet in the log.

Before PostgreSQL 15 a transaction with no change of the followed table still arrives, as an
empty BEGIN/COMMIT. Read while a cut is being appended, its end must not be confirmed before
that cut is synced, or a power cut then would lose the cut's changes for good."""

from __future__ import annotations

import struct
from types import SimpleNamespace

import trio

from indexer.router.inputs.postgres.stream import StreamReader
from indexer.router.inputs.postgres.table import Position

EPOCH_2000 = 0  # pgoutput times count microseconds from 2000-01-01


def begin(final_lsn: int, xid: int) -> bytes:
    return b"B" + struct.pack("!QqI", final_lsn, EPOCH_2000, xid)


def commit(commit_lsn: int, end_lsn: int) -> bytes:
    return b"C" + struct.pack("!BQQq", 0, commit_lsn, end_lsn, EPOCH_2000)


def reader_at(lsn: int) -> StreamReader:
    follower = SimpleNamespace(progress=SimpleNamespace(transactions=0, skipped=0))
    table = SimpleNamespace(oid=1)
    return StreamReader(follower, table, Position(lsn))  # type: ignore[arg-type]


def test_an_empty_transaction_is_confirmed_only_once_the_cuts_before_it_are_in_the_log() -> None:
    async def main() -> None:
        send, _receive = trio.open_memory_channel[object](1)
        reader = reader_at(100)
        reader.in_flight = 1  # a cut ending at 200 is being appended
        await reader.take(begin(300, 7), send)
        await reader.take(commit(300, 310), send)
        assert reader.confirmed == 100  # not 310: the cut is not synced yet
        reader.appended(200, [])
        assert reader.confirmed == 310  # the cut is in the log: the empty one after it too

    trio.run(main)


def test_an_empty_transaction_with_nothing_in_flight_is_confirmed_at_once() -> None:
    async def main() -> None:
        send, _receive = trio.open_memory_channel[object](1)
        reader = reader_at(100)
        await reader.take(begin(300, 7), send)
        await reader.take(commit(300, 310), send)
        assert reader.confirmed == 310

    trio.run(main)
