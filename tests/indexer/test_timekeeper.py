"""Timekeeper alignment and snapshots, with real workers, slab pool and LevelDB store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio

from indexer import protocol as p
from indexer.keys import encode_key
from indexer.snapshots import (
    SnapshotFileError,
    SnapshotStore,
    read_snapshot_file,
    write_snapshot_file,
)
from indexer.storage import IndexStore
from indexer.streams import StreamItem
from indexer.timekeeper import Timekeeper
from indexer.timestamps import HighWaterTimestamp, StabilityTimestamp
from slab import MutationRing, SlabPool
from workers.flush import BackIndexCache, IndexWriter
from workers.worker import Worker

N = 8
DEFS = [p.IndexDefinition("by_n", ("n",))]


def test_stability_timestamp_stops_at_the_last_complete_snapshot() -> None:
    hwt = HighWaterTimestamp(StabilityTimestamp.zero(N))
    hwt.record_marker(1, 1, 10)
    hwt.record_mutations(1, 4)
    assert hwt.stability_timestamp().seqnos[1] == 0  # half a snapshot is not stable
    assert hwt.high_water().seqnos[1] == 4
    hwt.record_mutations(1, 10)
    assert hwt.stability_timestamp().seqnos[1] == 10
    hwt.record_marker(1, 11, 20)
    hwt.record_mutations(1, 15)
    assert hwt.stability_timestamp().seqnos[1] == 10
    # The source deduplicated 16-20: the next marker closes the snapshot at what arrived.
    hwt.record_marker(1, 21, 30)
    assert hwt.stability_timestamp().seqnos[1] == 15
    assert hwt.stability_timestamp().seqnos[0] == 0


def test_snapshot_file_round_trip_and_checksum(tmp_path: Path) -> None:
    ts = StabilityTimestamp(tuple(range(N)), tuple(range(100, 100 + N)))
    assert read_snapshot_file(tmp_path, N) is None
    write_snapshot_file(tmp_path, ts)
    found = read_snapshot_file(tmp_path, N)
    assert found is not None and found[0] == ts
    path = tmp_path / "snapshot.json"
    body = json.loads(path.read_text())
    body["seqnos"][3] = 999
    path.write_text(json.dumps(body))
    with pytest.raises(SnapshotFileError, match="checksum"):
        read_snapshot_file(tmp_path, N)
    with pytest.raises(SnapshotFileError, match="vbuckets"):
        write_snapshot_file(tmp_path, ts)
        read_snapshot_file(tmp_path, N + 1)


def batch(vb: int, seqnos: list[int]) -> p.MutationBatch:
    records = [
        p.encode_record(p.Mutation(s, b"v%d-%d" % (vb, s), (encode_key([s]),))) for s in seqnos
    ]
    decoder = p.FrameDecoder()
    decoder.feed(p.encode_mutations(vb, 1, records))
    [message] = decoder.messages()
    assert isinstance(message, p.MutationBatch)
    return message


async def test_cut_flushes_aligned_snapshots_and_persist_records_them(tmp_path: Path) -> None:
    with IndexStore(tmp_path) as store:
        indexes = store.ensure_indexes(DEFS)
        cache = BackIndexCache(100, 1)
        start = StabilityTimestamp.zero(N)
        hwt = HighWaterTimestamp(start)
        pool = SlabPool(1 << 20, 1 << 16)
        workers = [
            Worker(i, pool, MutationRing(64), hwt, IndexWriter(store, indexes, cache))
            for i in range(2)
        ]
        snapshots = SnapshotStore(start)
        keeper = Timekeeper(hwt, workers, store, snapshots, tmp_path, 0.01, 0.01, [0], indexes)
        sends = []
        async with trio.open_nursery() as nursery:
            for w in workers:
                send, receive = trio.open_memory_channel[list[StreamItem]](4)
                sends.append(send)
                nursery.start_soon(w.run, receive)
            # vbucket 2 (worker 0): one complete snapshot; vbucket 3 (worker 1): half of one.
            await sends[0].send(
                [p.StreamBegin(2, 7), p.SnapshotMarker(2, 1, 3), batch(2, [1, 2, 3])]
            )
            await sends[1].send([p.StreamBegin(3, 9), p.SnapshotMarker(3, 1, 4), batch(3, [1, 2])])
            await trio.testing.wait_all_tasks_blocked()
            await keeper.cut()
            assert snapshots.stable is not None
            assert snapshots.stable.timestamp.seqnos[2:4] == (3, 0)
            assert workers[1].statistics().queued == 2  # held back: its snapshot is open
            await keeper.persist()
            found = read_snapshot_file(tmp_path, N)
            assert found is not None and found[0].seqnos[2:4] == (3, 0)
            assert found[0].vbuuids[2] == 7
            await sends[1].send([batch(3, [3, 4])])
            await trio.testing.wait_all_tasks_blocked()
            await keeper.cut()
            assert snapshots.stable.timestamp.seqnos[2:4] == (3, 4)
            assert snapshots.stable.entry_counts == {"by_n": 7}
            assert keeper.statistics().entry_counts == (7,)
            for s in sends:
                await s.aclose()
        assert snapshots.stable is not None
        keys = list(store.main_entries(indexes[0], snapshots.stable.store_snapshot))
        assert len(keys) == 7
        snapshots.close()


async def test_stopped_flushes_writes_all_queued_or_only_complete_snapshots(
    tmp_path: Path,
) -> None:
    """An index build's merge stops flushes at complete snapshots (`aligned`); what follows
    stays queued. A rollback stops them after writing everything queued."""
    with IndexStore(tmp_path) as store:
        indexes = store.ensure_indexes(DEFS)
        start = StabilityTimestamp.zero(N)
        hwt = HighWaterTimestamp(start)
        pool = SlabPool(1 << 20, 1 << 16)
        cache = BackIndexCache(100, 1)
        worker = Worker(0, pool, MutationRing(64), hwt, IndexWriter(store, indexes, cache))
        keeper = Timekeeper(
            hwt, [worker], store, SnapshotStore(start), tmp_path, 60, 60, [0], indexes
        )
        async with trio.open_nursery() as nursery:
            send, receive = trio.open_memory_channel[list[StreamItem]](4)
            nursery.start_soon(worker.run, receive)
            # vbucket 2: a complete snapshot 1-3 and half of 4-6; vbucket 5: half of 1-4.
            await send.send(
                [
                    p.StreamBegin(2, 7), p.SnapshotMarker(2, 1, 3), batch(2, [1, 2, 3]),
                    p.SnapshotMarker(2, 4, 6), batch(2, [4, 5]),
                    p.StreamBegin(5, 8), p.SnapshotMarker(5, 1, 4), batch(5, [1, 2]),
                ]
            )  # fmt: skip
            await trio.testing.wait_all_tasks_blocked()
            async with keeper.stopped_flushes(aligned=True) as upto:
                assert (upto[2], upto[5]) == (3, 0)
                assert worker.statistics().queued == 4  # 4, 5 of vbucket 2; 1, 2 of vbucket 5
                assert len(list(store.main_entries(indexes[0]))) == 3
                # Held off: a cut meanwhile waits.
                cut = trio.Event()

                async def cut_now() -> None:
                    await keeper.cut()
                    cut.set()

                nursery.start_soon(cut_now)
                await trio.testing.wait_all_tasks_blocked()
                assert not cut.is_set()
            await cut.wait()
            async with keeper.stopped_flushes() as upto:
                assert (upto[2], upto[5]) == (5, 2)
                assert worker.statistics().queued == 0
            # Written past its complete snapshots, vbucket 2 counts from there when aligned.
            async with keeper.stopped_flushes(aligned=True) as upto:
                assert (upto[2], upto[5]) == (5, 2)
            await send.aclose()
        assert len(list(store.main_entries(indexes[0]))) == 7


class FakeStoreSnapshot:
    """Stands in for a plyvel snapshot handle only to observe close()."""

    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_snapshot_handles_close_when_the_last_reader_lets_go() -> None:
    store = SnapshotStore(StabilityTimestamp.zero(N))
    first_handle = FakeStoreSnapshot()
    first = store.publish(StabilityTimestamp.zero(N), first_handle)
    pin = store.pin(first, lease_s=60)
    scan = first.acquire()
    second_handle = FakeStoreSnapshot()
    store.publish(StabilityTimestamp((1,) * N, (0,) * N), second_handle)
    assert not first_handle.closed  # pinned and being scanned
    scan.release()
    assert not first_handle.closed
    assert store.unpin(pin.pin_id)
    assert first_handle.closed and not first.is_open
    assert not store.unpin(pin.pin_id)
    expiring = store.pin(store.stable, lease_s=0)  # type: ignore[arg-type]
    assert store.expire_pins() == 1 and expiring.pin_id not in store.pins
    store.close()
    assert second_handle.closed


def test_a_snapshot_made_while_vbuckets_are_deleted_answers_without_them() -> None:
    """Given-up vbuckets being deleted: snapshots made meanwhile leave them out of every
    answer, also one that asks for no vbuckets (a merged scan's map may no longer name them)."""
    from indexer.http.scans import snapshot_filter
    from indexer.scans import VbucketFilter

    owned = bytearray([1] * 8)
    store = SnapshotStore(StabilityTimestamp.zero(8), owned)
    before = store.publish(StabilityTimestamp.zero(8), None)
    assert snapshot_filter(before, None) is None
    store.leaving.update({2, 5})
    owned[2] = owned[5] = 0
    during = store.publish(StabilityTimestamp.zero(8), None)
    store.leaving.difference_update({2, 5})
    after = store.publish(StabilityTimestamp.zero(8), None)
    only = snapshot_filter(during, None)
    assert only is not None and only.vbuckets == {0, 1, 3, 4, 6, 7} and only.num == 8
    asked = snapshot_filter(during, VbucketFilter(frozenset({1, 2}), 8))
    assert asked is not None and asked.vbuckets == {1}
    assert snapshot_filter(after, None) is None and after.leaving == frozenset()
