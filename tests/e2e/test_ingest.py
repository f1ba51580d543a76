"""The daemon and the router as real processes over 127.0.0.1, checked against a model."""

from __future__ import annotations

import random
import signal
import socket
import struct
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from indexer import protocol as p
from indexer.router import Workload, generate
from indexer.router.documents import Document
from tests.e2e.conftest import (
    INDEXES,
    WAIT_S,
    Daemon,
    dump,
    indexer_command,
    model,
    run_feed,
    write_jsonl,
)

pytestmark = pytest.mark.e2e


def workload(n: int, keys: int, seed: int) -> list[Document]:
    return list(generate(Workload(n, keys, 0.1, seed)))


def assert_indexes_match(daemon: Daemon, documents: list[Document]) -> None:
    for name, paths in INDEXES.items():
        got = dump(daemon, name)
        want = model(documents, paths)
        assert len(got) == len(want), name
        assert got == want, name


def test_feed_persists_every_entry_and_a_replay_sends_nothing(
    daemon_factory: Any, tmp_path: Path
) -> None:
    documents = workload(6_000, 1_500, seed=1)
    jsonl = write_jsonl(tmp_path / "docs.jsonl", documents)
    daemon = daemon_factory().start()
    fed = run_feed(daemon, jsonl)
    assert fed.returncode == 0, fed.stderr
    assert "6000 mutations persisted" in fed.stderr
    again = run_feed(daemon, jsonl)
    assert again.returncode == 0, again.stderr
    assert "0 mutations persisted" in again.stderr and "6000 already persisted" in again.stderr
    assert daemon.stop(signal.SIGTERM) == 0
    assert "stopped cleanly" in daemon.log()
    assert_indexes_match(daemon, documents)


@pytest.mark.parametrize(
    "count, keys, persist_ms",
    [pytest.param(40_000, 8_000, 100), pytest.param(120_000, 15_000, 300, marks=pytest.mark.soak)],
)
def test_kill_9_at_random_moments_then_resume_gives_the_same_index(
    daemon_factory: Any, tmp_path: Path, count: int, keys: int, persist_ms: int
) -> None:
    documents = workload(count, keys, seed=2)
    jsonl = write_jsonl(tmp_path / "docs.jsonl", documents)
    # Snapshots persisted often: each kill lands after some, and a restart resumes from them.
    daemon = daemon_factory(snapshots={"persist_interval_ms": persist_ms})
    rng = random.Random(7)
    # Each kill lands while the feed streams: once the daemon has received a random share of
    # the input, later kills further in (a restart resumes from what was persisted).
    shares = sorted(rng.uniform(0.1, 0.9) for _ in range(3))
    for share in shares:
        daemon.start()
        feeder = subprocess.Popen(
            indexer_command("feed", "--to", daemon.address, "--jsonl", str(jsonl)),
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + WAIT_S
        while daemon.stats()["vbuckets"]["received_seqno_sum"] < share * len(documents):
            assert feeder.poll() is None, "the feed ended before the kill"
            assert time.monotonic() < deadline, daemon.stats()["vbuckets"]
            time.sleep(0.01)
        daemon.kill()
        _, err = feeder.communicate(timeout=60)
        # The kill hit a running feed: it fails with one line naming the indexer.
        assert feeder.returncode != 0, err
        assert "indexer" in err and err.count("\n") == 1, err
    daemon.start()
    fed = run_feed(daemon, jsonl)
    assert fed.returncode == 0, fed.stderr
    assert daemon.stop() == 0
    assert_indexes_match(daemon, documents)


def test_slab_pool_exhausted_stalls_reads_and_loses_nothing(
    daemon_factory: Any, tmp_path: Path
) -> None:
    documents = workload(60_000, 30_000, seed=3)
    jsonl = write_jsonl(tmp_path / "docs.jsonl", documents)
    # A 1 MiB pool and rare snapshots: the queues fill long before the timekeeper flushes.
    daemon = daemon_factory(
        server={"max_frame_bytes": 65536},
        slab={"pool": 1 << 20, "slab_bytes": 65536},
        snapshots={"in_memory_interval_ms": 500},
    ).start()
    fed = run_feed(daemon, jsonl)
    assert fed.returncode == 0, fed.stderr
    stats = daemon.stats()
    assert stats["slab"]["waits"] > 0  # allocations waited for a flush to free room
    assert sum(queue["stalls"] for queue in stats["queues"]) > 0
    assert stats["slab"]["chunks_in_use"] == 0  # and every chunk came back
    assert daemon.stop() == 0
    assert_indexes_match(daemon, documents)


def frame_exchange(daemon: Daemon, frames: bytes, *, half_close: bool = False) -> list[Any]:
    """Send a handshake and `frames` on a fresh connection; every message the daemon answers."""
    sock = socket.create_connection(("127.0.0.1", daemon.port), timeout=10)
    with sock:
        sock.sendall(p.encode(p.Handshake("test", 1024, tuple(range(4)))))
        sock.sendall(frames)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        decoder = p.FrameDecoder(1 << 24)
        while True:
            data = sock.recv(65536)
            if not data:
                break
            decoder.feed(data)
        return decoder.messages()


def mutation_frame(vb: int, seqnos: list[int]) -> bytes:
    records = [p.encode_record(p.Mutation(s, b"d%d" % s, (b"", b""))) for s in seqnos]
    return p.encode_mutations(vb, 2, records)


BAD_FRAMES = {
    "unknown type": (struct.pack(">IBB", 2, 1, 77), p.ErrorCode.PROTOCOL),
    "oversized": (
        struct.pack(">IBB", 10 << 20, 1, p.MessageType.MUTATIONS),
        p.ErrorCode.FRAME_TOO_LARGE,
    ),
    "not begun": (mutation_frame(1, [1]), p.ErrorCode.STREAM_NOT_BEGUN),
    "seqno backwards": (
        p.encode(p.StreamBegin(1, 5))
        + p.encode(p.SnapshotMarker(1, 1, 9))
        + mutation_frame(1, [1, 2])
        + mutation_frame(1, [2]),
        p.ErrorCode.SEQNO_BACKWARDS,
    ),
    "unowned vbucket": (p.encode(p.StreamBegin(900, 5)), p.ErrorCode.NOT_MY_SLICE),
}


def test_bad_frames_get_error_frames_and_other_connections_go_on(
    daemon_factory: Any, tmp_path: Path
) -> None:
    documents = workload(10_000, 3_000, seed=4)
    jsonl = write_jsonl(tmp_path / "docs.jsonl", documents)
    # The node owns vbuckets 0-511 only; the feed's documents all hash somewhere in 0-1023,
    # so feed a filtered set that this node owns.
    from indexer.router.documents import vbucket_of

    owned = [d for d in documents if vbucket_of(d.docid.encode(), 1024) < 512]
    jsonl = write_jsonl(tmp_path / "owned.jsonl", owned)
    daemon = daemon_factory(server={"owned_vbuckets": ["0-511"]}).start()
    feeder = subprocess.Popen(
        indexer_command("feed", "--to", daemon.address, "--jsonl", str(jsonl)),
        stderr=subprocess.PIPE,
        text=True,
    )
    for name, (frames, code) in BAD_FRAMES.items():
        answers = frame_exchange(daemon, frames)
        errors = [m for m in answers if isinstance(m, p.Error)]
        assert [e.code for e in errors] == [code], name
    for _ in range(5):  # a router that sends a bad frame and resets at once
        sock = socket.create_connection(("127.0.0.1", daemon.port), timeout=10)
        sock.sendall(p.encode(p.Handshake("rst", 1024, ())) + struct.pack(">IBB", 2, 1, 77))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    truncated = p.encode(p.StreamBegin(2, 1))[:-4]
    answers = frame_exchange(daemon, truncated, half_close=True)
    assert [m.code for m in answers if isinstance(m, p.Error)] == [p.ErrorCode.PROTOCOL]
    _, err = feeder.communicate(timeout=120)
    assert feeder.returncode == 0, err
    assert daemon.running
    assert daemon.stop() == 0
    # Nothing from the refused frames reached the index: only the fed documents are there.
    assert_indexes_match(daemon, owned)
    # Reset connections are refused or seen as disconnected, depending on timing.
    assert daemon.log().count("refused:") >= len(BAD_FRAMES) + 1


def test_feed_to_an_unowned_vbucket_exits_with_one_line(
    daemon_factory: Any, tmp_path: Path
) -> None:
    jsonl = write_jsonl(tmp_path / "docs.jsonl", workload(2_000, 500, seed=5))
    daemon = daemon_factory(server={"owned_vbuckets": ["0-511"]}).start()
    fed = run_feed(daemon, jsonl)
    assert fed.returncode != 0
    assert fed.stderr.count("\n") == 1 and "NOT_MY_SLICE" in fed.stderr, fed.stderr
    assert daemon.stop() == 0


def test_dump_refuses_while_the_daemon_holds_the_store(daemon_factory: Any) -> None:
    daemon = daemon_factory().start()
    out = subprocess.run(
        indexer_command("dump", "by_age", "--config", str(daemon.config)),
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0
    assert out.stderr.count("\n") == 1 and "daemon" in out.stderr, out.stderr
    assert daemon.stop() == 0
    assert dump(daemon, "by_age") == []


@pytest.mark.parametrize(
    "text, key",
    [
        ("[server]\nfeed_prot = 1\n", "server.feed_prot"),
        ("[pipeline]\nworkers = 0\n", "pipeline.workers"),
        ('[slab]\npool = "lots"\n', "slab.pool"),
        ("[memory]\nlow_mark = 0.95\n", "memory.low_mark"),
        ('[indexes.bad]\nkeys = ["a..b"]\n', "indexes.bad.keys"),
        ("[nonsense]\n", "nonsense"),
    ],
)
def test_bad_configuration_exits_with_one_line_naming_the_key(
    tmp_path: Path, text: str, key: str
) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(text)
    out = subprocess.run(
        indexer_command("serve", "--config", str(config)), capture_output=True, text=True
    )
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and key in out.stderr, out.stderr


def test_feed_reports_a_bad_input_line(daemon_factory: Any, tmp_path: Path) -> None:
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text('{"id": "a", "doc": {"age": 1}}\n{"id": "b", "doc": 5}\n')
    daemon = daemon_factory().start()
    fed = run_feed(daemon, jsonl)
    assert fed.returncode != 0
    assert "bad.jsonl:2" in fed.stderr and fed.stderr.count("\n") == 1
    assert daemon.stop() == 0
