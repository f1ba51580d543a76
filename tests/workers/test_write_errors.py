"""Write errors of the flush (a full disk): the batch is kept and retried until it is written,
the fault-injection hooks, and the store moving to a new log after a failed write."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import trio

from indexer.storage import IndexStore, StoreWriteError
from workers.flush import BatchWrites, InjectedFaults


class FailingBatch:
    """A WriteBatch whose first `failures` writes fail as plyvel does when the disk is full."""

    def __init__(self, store: IndexStore, failures: int) -> None:
        self.batch = store.write_batch()
        self.batch.put(b"i-key", b"value")
        self.failures = failures
        self.attempts = 0

    def write(self) -> None:
        self.attempts += 1
        if self.attempts <= self.failures:
            raise StoreWriteError(b"IO error: 000003.log: No space left on device")
        self.batch.write()


@pytest.fixture
def store(tmp_path: Path) -> Any:
    with IndexStore(tmp_path) as s:
        yield s


async def test_a_failed_write_is_retried_until_written(
    store: IndexStore, caplog: pytest.LogCaptureFixture
) -> None:
    writes = BatchWrites(3, InjectedFaults())
    batch = FailingBatch(store, failures=4)
    caplog.set_level(logging.INFO, logger="indexer.flush")
    seen: list[bool] = []

    async def watch() -> None:
        while True:
            seen.append(writes.statistics().write_failing)
            await trio.sleep(0.01)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        await writes.write(store, batch, 17)
        nursery.cancel_scope.cancel()
    assert batch.attempts == 5
    assert store.get(b"i-key") == b"value"
    stats = writes.statistics()
    assert (stats.write_errors, stats.write_failing) == (4, False)
    assert stats.write_error == "IO error: 000003.log: No space left on device"
    assert True in seen
    messages = [r.getMessage() for r in caplog.records if r.name == "indexer.flush"]
    assert len(messages) == 2, messages  # one line when it starts failing, one when it ends
    assert "worker 3 keeps its batch of 17 mutations" in messages[0]
    assert "No space left on device" in messages[0]
    assert "succeeded after 4 failed attempts" in messages[1]


def test_the_injected_enospc_is_the_error_plyvel_raises(store: IndexStore, tmp_path: Path) -> None:
    flag = tmp_path / "full"
    faults = InjectedFaults(enospc_file=flag)
    faults.before_write(store)  # no file: no fault
    flag.touch()
    with pytest.raises(StoreWriteError, match="No space left on device"):
        faults.before_write(store)
    assert isinstance(StoreWriteError(b""), OSError)


def test_faults_are_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not InjectedFaults.from_environment().active
    monkeypatch.setenv("INDEXER_FAULT_SLOW_WRITE_MS", "250")
    monkeypatch.setenv("INDEXER_FAULT_ENOSPC_FILE", "/nonexistent/full")
    faults = InjectedFaults.from_environment()
    assert faults.slow_write_s == 0.25 and faults.enospc_file == Path("/nonexistent/full")


def test_after_a_failed_write_the_store_moves_to_a_new_log(store: IndexStore) -> None:
    def logs() -> list[str]:
        return sorted(p.name for p in store.path.glob("*.log"))

    store.write([(b"i-a", b"")], [])
    before = logs()
    with pytest.raises(StoreWriteError):
        store.commit(FailingBatch(store, failures=1))
    assert logs() == before  # nothing done yet: a torn record may be at the log's end
    store.commit(FailingBatch(store, failures=0))
    after = logs()
    assert after != before and len(after) == 1  # the memtable went to a table, a new log began
    store.sync()
    assert logs() == after  # once only
    assert store.get(b"i-a") == b"" and store.get(b"i-key") == b"value"
