"""The compactor's schedule and its measurements, on a real LevelDB store."""

from __future__ import annotations

from pathlib import Path

import trio

from indexer.compaction import Compactor, compact_store, disk_bytes
from indexer.storage import IndexStore


def fill(store: IndexStore, rounds: int) -> None:
    for r in range(rounds):
        puts = [(b"k%06d" % i, b"v%d" % r * 50) for i in range(5_000)]
        store.write(puts, [])


def test_a_compaction_reports_the_space_it_frees(tmp_path: Path) -> None:
    with IndexStore(tmp_path) as store:
        # Six versions of every key, five of them garbage. The first is compacted into a table
        # first: LevelDB drops old versions only where tables are merged, and the memtable's
        # one table alone would keep them all.
        fill(store, 1)
        store.compact()
        fill(store, 5)
        result = compact_store(store, "requested")
        assert result.bytes_before > result.bytes_after > 0
        assert result.bytes_after == disk_bytes(store.path)
        assert store.get(b"k000001") == b"v4" * 50


def test_the_schedule_compacts_every_interval_and_never_when_off(tmp_path: Path) -> None:
    with IndexStore(tmp_path) as store:
        fill(store, 2)
        scheduled = Compactor(store, 0.2)
        off = Compactor(store, 0.0)

        async def main() -> None:
            with trio.move_on_after(1.0):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(scheduled.run)
                    nursery.start_soon(off.run)
            # Asked for while none runs: it runs at once, one at a time.
            await off.compact()

        trio.run(main)
        assert 2 <= scheduled.runs <= 5 and scheduled.last is not None
        assert scheduled.last.reason == "scheduled"
        assert off.runs == 1 and off.statistics()["last"]["reason"] == "requested"
        assert not off.statistics()["running"]


def test_tables_written_with_and_without_compression_read_back_either_way(tmp_path: Path) -> None:
    """`compaction.compression` changes only the files written next: a store holding both
    kinds reads every entry, whatever the setting it is opened with."""
    with IndexStore(tmp_path, compression="snappy") as store:
        fill(store, 3)
        snappy = compact_store(store, "requested").bytes_after
    with IndexStore(tmp_path, compression=None) as store:
        assert store.get(b"k004999") == b"v2" * 50
        store.write([(b"n%06d" % i, b"w" * 100) for i in range(5_000)], [])
        compact_store(store, "requested")
    with IndexStore(tmp_path, compression="snappy") as store:
        assert store.get(b"k000000") == b"v2" * 50 and store.get(b"n004999") == b"w" * 100
    with IndexStore(tmp_path, compression=None) as store:
        fill(store, 1)
        plain = compact_store(store, "requested").bytes_after - 5_000 * 100
        assert store.get(b"n000000") == b"w" * 100
    # Uncompressed, the same entries take more room: the setting reached the files.
    assert plain > snappy
