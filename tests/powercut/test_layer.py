"""The power-loss layer itself: a pass-through run loses nothing, a cut loses exactly what was
not made durable; and LevelDB under it, the cut that loses writes a synchronous write seemed to
cover, and the project's fix (`indexer.storage.ClosedLogs`) that keeps them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import plyvel
import pytest

from tests.powercut import PowerCutError, PowerLoss, build_library


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_library(tmp_path_factory.mktemp("powercut"))


@pytest.fixture
def layer(library: Path, tmp_path: Path) -> Iterator[PowerLoss]:
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "old.txt").write_bytes(b"o" * 100)
    (tmp_path / "root" / "gone.txt").write_bytes(b"g" * 10)
    (tmp_path / "root" / "CURRENT").write_bytes(b"one")
    yield PowerLoss(library, tmp_path / "root", tmp_path / "work")


def run_killed(layer: PowerLoss, script: str) -> str:
    """Run `script` under the layer (ROOT is its directory); it ends by SIGKILL."""
    code = f"import os, signal\nROOT = {str(layer.root)!r}\n" + textwrap.dedent(script)
    code += "\nos.kill(os.getpid(), signal.SIGKILL)\n"
    done = subprocess.run(
        [sys.executable, "-c", code], env=layer.env(), capture_output=True, text=True
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    return done.stdout


WRITES = """
def path(name):
    return os.path.join(ROOT, name)

with open(path("a.bin"), "wb") as a:
    a.write(b"a" * 100)
    a.flush()
    os.fsync(a.fileno())      # a: 100 bytes durable; its create committed
    a.write(b"A" * 50)        # not synced
    a.flush()
    b = open(path("b.bin"), "wb")
    b.write(b"b" * 30)        # never synced
    b.flush()
    with open(path("CURRENT.tmp"), "wb") as t:
        t.write(b"two")
        t.flush()
        os.fsync(t.fileno())  # commits b's create and the temporary file's
    os.replace(path("CURRENT.tmp"), path("CURRENT"))  # no fsync after: undone
    os.unlink(path("gone.txt"))                        # undone
    with open(path("c.bin"), "wb") as c:               # created after the last commit
        c.write(b"c" * 5)
    with open(path("old.txt"), "ab") as old:
        old.write(b"O" * 7)                            # not synced
"""


def contents(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def test_pass_through_loses_nothing(layer: PowerLoss) -> None:
    run_killed(layer, WRITES)
    before = contents(layer.root)
    report = layer.cut(drop=False)
    assert contents(layer.root) == before
    assert before["a.bin"] == b"a" * 100 + b"A" * 50 and before["CURRENT"] == b"two"
    assert "gone.txt" not in before and before["c.bin"] == b"c" * 5
    assert report.bytes_lost == 50 + 30 + 7 + 5  # what a cut would take (c.bin too)


def test_a_cut_loses_exactly_what_was_not_durable(layer: PowerLoss) -> None:
    run_killed(layer, WRITES)
    report = layer.cut()
    assert contents(layer.root) == {
        "CURRENT": b"one",  # the rename is undone: the old file is back
        "CURRENT.tmp": b"two",  # synced, and its create committed
        "a.bin": b"a" * 100,  # cut back to its fsync
        "b.bin": b"",  # its create committed, its data never synced
        "gone.txt": b"g" * 10,  # the unlink is undone
        "old.txt": b"o" * 100,
    }
    assert report.bytes_lost == 50 + 30 + 7
    assert len(report.renames_undone) == 1 and len(report.unlinks_undone) == 1
    assert [Path(p).name for p in report.creates_undone] == ["c.bin"]
    # Armed again: a second cut with nothing written changes nothing.
    assert layer.cut().bytes_lost == 0 and contents(layer.root)["a.bin"] == b"a" * 100


# LevelDB under the layer: batches without sync until its memtable (1 MiB here) is switched to
# a new log, then at once one synchronous write, acknowledged, and the process killed: the
# background compaction is still writing the old memtable out. `fix` runs the project's
# ClosedLogs after the synchronous write, as IndexStore.sync and SourceLog.append do.
LEVELDB = """
import plyvel
from pathlib import Path
from indexer.storage import ClosedLogs
path = Path(ROOT) / "db"
db = plyvel.DB(str(path), create_if_missing=True, write_buffer_size=1 << 20)
logs = ClosedLogs(path)
before = set(path.glob("*.log"))
for i in range(ROUND * 3000, ROUND * 3000 + 3000):
    db.put(b"k%08d" % i, b"v" * 1000)
    if set(path.glob("*.log")) - before:
        break
db.put(b"marker%d" % ROUND, b"", sync=True)
if FIX:
    logs.sync()
print("acknowledged", i, flush=True)
"""


@pytest.mark.parametrize("fix", [False, True])
def test_leveldb_loses_what_a_closed_log_held_unless_closed_logs_are_synced(
    layer: PowerLoss, fix: bool
) -> None:
    lost_rounds = 0
    for round_ in range(6):
        script = f"ROUND = {round_}\nFIX = {fix}\n" + LEVELDB
        out = run_killed(layer, script).split()
        assert out[0] == "acknowledged", out
        last = int(out[1])
        layer.cut()
        db = plyvel.DB(str(layer.root / "db"))
        try:
            assert db.get(b"marker%d" % round_) == b""  # the synchronous write survived
            missing = sum(db.get(b"k%08d" % i) is None for i in range(round_ * 3000, last + 1))
        finally:
            db.close()
        lost_rounds += missing > 0
        layer.arm()
    if fix:
        assert lost_rounds == 0
    else:  # the upstream behaviour the fix is for: it shows in most rounds
        assert lost_rounds > 0


def test_the_environment_names_the_layer(layer: PowerLoss) -> None:
    env = layer.env({})
    assert env["LD_PRELOAD"].endswith("libpowercut.so")
    assert Path(env["POWERCUT_DIR"]) == layer.root and os.path.isabs(env["POWERCUT_JOURNAL"])


def test_a_file_written_outside_the_layer_is_refused_at_the_cut(layer: PowerLoss) -> None:
    """A process started without the layer's environment syncs what the layer never sees; a
    cut would take it as unsynced. The cut refuses instead of guessing."""
    code = f"open({str(layer.root / 'stray.ldb')!r}, 'wb').write(b'x' * 10)"
    subprocess.run([sys.executable, "-c", code], check=True)  # no layer.env()
    with pytest.raises(PowerCutError, match=r"outside the power-loss layer.*stray\.ldb"):
        layer.cut()


def test_an_empty_file_the_journal_missed_is_a_create_the_cut_undoes(layer: PowerLoss) -> None:
    """A kill between the real open and its journal line leaves an empty file the journal
    never names; no fsync is known to follow, so the cut takes it (and does not refuse)."""
    (layer.root / "snapshot.tmp").write_bytes(b"")  # as the open left it, unjournaled
    report = layer.cut()
    assert report.creates_undone == [str(layer.root / "snapshot.tmp")]
    assert not (layer.root / "snapshot.tmp").exists()


SYNCS = """
import time
def synced(name):
    with open(os.path.join(ROOT, name), "wb") as f:
        f.write(b"x" * 10)
        f.flush()
        start = time.monotonic()
        os.fsync(f.fileno())
        return time.monotonic() - start
print(synced("000005.ldb"), synced("000006.log"), flush=True)
"""


def test_a_slow_sync_slows_the_files_it_names_and_still_counts(layer: PowerLoss) -> None:
    """POWERCUT_SLOW_SYNC: a slow disk for one kind of file, so that a test can cut the power
    while a process waits on such a sync."""
    code = f"import os\nROOT = {str(layer.root)!r}\n" + SYNCS
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=layer.env(slow_sync=(".ldb", 300)),
        capture_output=True,
        text=True,
        check=True,
    )
    table, log = (float(field) for field in done.stdout.split())
    assert table >= 0.3 and log < 0.3, (table, log)
    report = layer.cut()
    assert report.bytes_lost == 0 and report.creates_undone == []  # both syncs count
