"""Ingest benchmark: mutations/s from a router process into the daemon, against two references.

    python bench/ingest.py [--mutations N] [--keys K] [--seed S] [--skip-naive]
                           [--naive-mutations M] [--raw-repeats R] [--keep]

End to end: the daemon (`python -m indexer serve`, default configuration and indexes) and a router
run as separate processes on 127.0.0.1. The router pre-encodes every frame, then the clock runs
from its first byte sent to the ack saying a persisted snapshot covers every vbucket's last seqno.

Raw (the storage limit): the very puts and deletes the daemon ends up writing, computed beforehand
by the daemon's own flush code (workers/flush.IndexWriter, records split by worker, flushed every
50,000 mutations like the daemon's flush windows, so superseded mutations inside a window are
skipped as in the daemon), then written alone into a fresh LevelDB in WriteBatches of 10,000
operations plus one sync; best of --raw-repeats. For reference, the same without deduplication
(every mutation applied on its own, in seqno order) is measured once as "raw per mutation".

Naive: `bench/naive_server.py`, an asyncio server doing per mutation a back-index `get` per index
and individual deletes and puts, fed the same pre-encoded frames.

Queue memory is computed offline: the workload's records allocated in a SlabPool of the default
configuration's sizes.

During the end-to-end run a thread of the bench reads the daemon's `GET /stats` every 150 ms
(about 1 ms of the daemon's CPU each, under 1% of its event loop): the JSON's `timeline` holds,
per sample, the seconds since the router's first byte, the received, readable and persisted seqno
sums, the records queued in the workers' rings, the slab bytes in use and the throttle's state.
The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from itertools import islice
from pathlib import Path
from typing import Any

import psutil
from common import (  # bench/common.py: run as `python bench/...`
    HOST,
    Daemon,
    StatsSampler,
    in_workdir,
    ratio,
    say,
)
from ingest_raw import (  # bench/ingest_raw.py
    RAW_METHOD,
    RawOps,
    compare_stores,
    flush_ops,
    measure_raw,
    per_mutation_ops,
)

from indexer import protocol as p
from indexer.config import Config, parse_config
from indexer.router.inputs.workload import Workload, generate
from indexer.router.streams.encoders import StreamEncoder
from indexer.router.streams.records import default_vbuuid
from indexer.storage import IndexStore
from slab import SlabPool

SEND_CHUNK = 1 << 20  # bytes per sendall: large sends, as the spec asks
DELETE_RATIO = 0.1
ROUTER_NAME = "ingest-bench"
# "snapshot persisted: seqnos summing to N, lag L ms" (older daemons: "N mutations covered").
PERSISTED = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*snapshot persisted: \D*(\d+)[^,]*, lag (\d+) ms",
    re.MULTILINE,
)
STALLS = re.compile(r"(\d+) stalls on full queues, (\d+) memory throttle pauses")
BENCH_DIR = Path(__file__).resolve().parent
RING_SLOT_BYTES = 4 * struct.calcsize("P") + 1  # vbucket, seqno, chunk, length lists + USED flag
SMALL_INT = 256  # CPython caches ints up to this one
STATS_INTERVAL_S = 0.15  # GET /stats during the end-to-end run: ~1 ms of the daemon's CPU each


# --------------------------------------------------------------------------------------------
# The workload as frames


def workload_of(mutations: int, keys: int, seed: int) -> Workload:
    """The benchmark's workload: `keys` docids (0: N/5), 10% deletes."""
    return Workload(mutations, keys, DELETE_RATIO, seed)


def handshake_reply(config: Config) -> p.HandshakeReply:
    """The reply a fresh daemon with `config` gives: every vbucket owned, all from seqno 0."""
    n = config.server.num_vbuckets
    return p.HandshakeReply(config.indexes, n, tuple(range(n)), (), config.server.max_frame_bytes)


def encode_frames(
    reply: p.HandshakeReply, workload: Workload, limit: int | None = None
) -> tuple[list[bytes], StreamEncoder]:
    """Every frame of the workload's first `limit` documents, as the router sends them."""
    encoder = StreamEncoder(reply)
    frames: list[bytes] = []
    for document in islice(generate(workload), limit):
        frames.extend(encoder.add(document))
    frames.extend(encoder.finish())
    return frames, encoder


def mutation_batches(frames: Sequence[bytes], max_frame_bytes: int) -> list[p.MutationBatch]:
    """The MUTATIONS frames decoded, in sending order (markers and stream begins dropped)."""
    decoder = p.FrameDecoder(max_frame_bytes)
    out: list[p.MutationBatch] = []
    for frame in frames:
        decoder.feed(frame)
        out.extend(m for m in decoder.messages() if isinstance(m, p.MutationBatch))
    return out


def chunks_of(data: bytes, size: int = SEND_CHUNK) -> Iterator[memoryview]:
    """`data` in slices of `size` bytes, without copying."""
    view = memoryview(data)
    for start in range(0, len(data), size):
        yield view[start : start + size]


# --------------------------------------------------------------------------------------------
# The router process (`--router`)


class AckWatcher(threading.Thread):
    """Reads the daemon's acks on a socket; `done` is set once every target seqno is acked."""

    def __init__(self, sock: socket.socket, decoder: p.FrameDecoder) -> None:
        super().__init__(daemon=True)
        self.sock = sock
        self.decoder = decoder
        self.targets: dict[int, int] = {}
        self.acked: dict[int, int] = {}
        self.acks = 0
        self.error: str | None = None
        self.done_at = 0.0
        self.done = threading.Event()
        self.armed = threading.Event()

    def arm(self, targets: dict[int, int]) -> None:
        """Start checking against `targets` (vbucket -> last seqno sent)."""
        self.targets = targets
        self.armed.set()

    def _covered(self) -> bool:
        acked = self.acked
        return all(acked.get(vb, 0) >= s for vb, s in self.targets.items())

    def run(self) -> None:
        """Receive until covered, an error frame, or the connection closes."""
        self.armed.wait()
        try:
            while not self.done.is_set():
                data = self.sock.recv(1 << 16)
                if not data:
                    self.error = "the daemon closed the connection"
                    break
                self.decoder.feed(data)
                for message in self.decoder.messages():
                    if isinstance(message, p.Error):
                        self.error = f"{message.code.name}: {message.message}"
                    elif isinstance(message, p.Ack):
                        self.acks += 1
                        for pos in message.positions:
                            self.acked[pos.vbucket] = pos.seqno
                if self.error is None and self._covered():
                    self.done_at = time.time()
                    break
                if self.error is not None:
                    break
        except (OSError, p.ProtocolError) as exc:
            self.error = f"ack reader: {exc}"
        self.done.set()


def read_message(sock: socket.socket, decoder: p.FrameDecoder) -> p.Message:
    """The next whole message on a blocking socket."""
    while True:
        messages = decoder.messages()
        if messages:
            if len(messages) > 1:
                raise RuntimeError("unexpected frames right after the handshake reply")
            return messages[0]
        data = sock.recv(1 << 16)
        if not data:
            raise RuntimeError("the daemon closed the connection during the handshake")
        decoder.feed(data)


def run_router(port: int, mutations: int, keys: int, seed: int) -> dict[str, Any]:
    """Handshake, pre-encode every frame, send them all, wait for the covering ack."""
    sock = socket.create_connection((HOST, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    decoder = p.FrameDecoder(64 << 20)
    config = parse_config()
    n = config.server.num_vbuckets
    sock.sendall(p.encode(p.Handshake(ROUTER_NAME, n, tuple(range(n)))))
    reply = read_message(sock, decoder)
    if not isinstance(reply, p.HandshakeReply):
        raise RuntimeError(f"expected a handshake reply, got {reply!r}")
    started = time.perf_counter()
    frames, encoder = encode_frames(reply, workload_of(mutations, keys, seed))
    payload = b"".join(frames)
    nframes = len(frames)
    del frames
    encode_s = time.perf_counter() - started
    targets = encoder.targets()
    watcher = AckWatcher(sock, decoder)
    watcher.start()
    watcher.arm(targets)
    first = time.time()
    try:
        for chunk in chunks_of(payload):
            sock.sendall(chunk)
    except OSError as exc:
        watcher.done.wait(5)
        raise RuntimeError(f"send failed: {exc}; daemon said: {watcher.error}") from None
    sent = time.time()
    watcher.done.wait()
    if watcher.error is not None:
        raise RuntimeError(watcher.error)
    ends = b"".join(p.encode(p.StreamEnd(vb, default_vbuuid(vb))) for vb in sorted(targets))
    sock.sendall(ends)
    sock.close()
    return {
        "first_byte": first,
        "sent": sent,
        "done": watcher.done_at,
        "mutations": encoder.sent,
        "bytes": len(payload),
        "frames": nframes,
        "vbuckets": len(targets),
        "acks": watcher.acks,
        "encode_s": encode_s,
    }


# --------------------------------------------------------------------------------------------
# The daemon process


class ProcessSampler(threading.Thread):
    """Samples a process's RSS on a timer (never per mutation) and keeps the peak."""

    def __init__(self, pid: int, interval: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.process = psutil.Process(pid)
        self.interval = interval
        self.peak_rss = 0
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                self.peak_rss = max(self.peak_rss, self.process.memory_info().rss)
            except psutil.Error:
                return
            self.stopped.wait(self.interval)

    def cpu(self) -> tuple[float, float]:
        """CPU seconds of the main thread and of all other threads together."""
        total = self.process.cpu_times()
        main = sum(
            t.user_time + t.system_time for t in self.process.threads() if t.id == self.process.pid
        )
        return main, total.user + total.system - main


@dataclass
class EndToEnd:
    """The end-to-end run: router timings, daemon resources and exit."""

    mutations: int
    seconds: float
    send_seconds: float
    tail_seconds: float
    wire_bytes: int
    frames: int
    acks: int
    encode_seconds: float
    daemon_main_cpu_s: float
    daemon_thread_cpu_s: float
    daemon_peak_rss: int
    daemon_exit: int
    persists: int
    readable_seconds: float | None
    stalls: tuple[int, int] | None  # (stalls on full queues, memory throttle pauses)
    store: Path
    timeline: dict[str, list[float]]  # GET /stats by column, `t_s` from the first byte
    timeline_failures: int

    @property
    def per_s(self) -> float:
        return self.mutations / self.seconds


def readable_at(log: str, mutations: int) -> float | None:
    """When the in-memory snapshot that the first persist covering everything saved was cut.

    From the daemon's "snapshot persisted: N mutations covered, lag L ms" line: logged at
    persist time, L ms after that snapshot was published (local time, millisecond precision).
    """
    for found in PERSISTED.finditer(log):
        if int(found.group(2)) >= mutations:
            logged = datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            return logged - int(found.group(3)) / 1000
    return None


def measure_e2e(opts: argparse.Namespace, workdir: Path) -> EndToEnd:
    """Daemon and router processes; the router's first byte to its covering ack."""
    extra = ""
    if opts.recovery_points is not None:
        extra = f"[snapshots]\nrecovery_points = {opts.recovery_points}\n"
    if opts.history is not None:
        extra += f"[changes]\nhistory = {'true' if opts.history == 'on' else 'false'}\n"
    daemon = Daemon.in_workdir(workdir, extra)
    try:
        daemon.start()
        port = daemon.port
        assert daemon.proc is not None
        sampler = ProcessSampler(daemon.proc.pid)
        sampler.start()
        timeline = StatsSampler(daemon.url, STATS_INTERVAL_S)
        timeline.start()
        cpu_before = sampler.cpu()
        router = subprocess.run(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "--router",
                str(port),
                "--mutations",
                str(opts.mutations),
                "--keys",
                str(opts.keys),
                "--seed",
                str(opts.seed),
            ],
            capture_output=True,
            text=True,
            timeout=opts.timeout,
        )
        cpu_after = sampler.cpu()
        sampler.stopped.set()
        sampler.join()
        timeline.stop()
        if router.returncode != 0:
            raise RuntimeError(
                f"the router failed ({router.returncode}):\n{router.stderr}\n"
                f"daemon log:\n{daemon.log()[-4000:]}"
            )
        result = json.loads(router.stdout.strip().splitlines()[-1])
        code = daemon.stop_cleanly()
        log = daemon.log()
        if code != 0 or "stopped cleanly" not in log:
            raise RuntimeError(f"the daemon exited with {code}:\n{log[-4000:]}")
        readable = readable_at(log, result["mutations"])
        found = STALLS.search(log)
        stalls = (int(found.group(1)), int(found.group(2))) if found else None
    finally:
        daemon.kill()
    return EndToEnd(
        mutations=result["mutations"],
        seconds=result["done"] - result["first_byte"],
        send_seconds=result["sent"] - result["first_byte"],
        tail_seconds=result["done"] - result["sent"],
        wire_bytes=result["bytes"],
        frames=result["frames"],
        acks=result["acks"],
        encode_seconds=result["encode_s"],
        daemon_main_cpu_s=cpu_after[0] - cpu_before[0],
        daemon_thread_cpu_s=cpu_after[1] - cpu_before[1],
        daemon_peak_rss=sampler.peak_rss,
        daemon_exit=code,
        persists=log.count("snapshot persisted"),
        readable_seconds=(None if readable is None else readable - result["first_byte"]),
        stalls=stalls,
        store=daemon.data_dir / "store",
        timeline=timeline.series(result["first_byte"], result["done"]),
        timeline_failures=timeline.failures,
    )


# --------------------------------------------------------------------------------------------
# Naive: the hand-written server


@dataclass
class Naive:
    """The naive server's run on the first `mutations` mutations of the workload."""

    mutations: int
    seconds: float
    gets: int
    puts: int
    deletes: int

    @property
    def per_s(self) -> float:
        return self.mutations / self.seconds


def measure_naive(payload: bytes, mutations: int, workdir: Path) -> Naive:
    """Start the naive server, send it the pre-encoded frames, time first byte to its ack."""
    proc = subprocess.Popen(
        [sys.executable, str(BENCH_DIR / "naive_server.py"), "--data-dir", str(workdir)],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("listening "):
            raise RuntimeError(f"the naive server did not start: {line!r}")
        port = int(line.split()[1])
        decoder = p.FrameDecoder(64 << 20)
        with socket.create_connection((HOST, port)) as sock:
            first = time.time()
            for chunk in chunks_of(payload):
                sock.sendall(chunk)
            sock.shutdown(socket.SHUT_WR)
            ack = read_message(sock, decoder)
            done = time.time()
        if not isinstance(ack, p.Ack):
            raise RuntimeError(f"the naive server answered {ack!r}")
        out, _ = proc.communicate(timeout=60)
        counters = json.loads(out.strip().splitlines()[-1])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if counters["mutations"] != mutations:
        raise RuntimeError(f"the naive server applied {counters['mutations']} of {mutations}")
    return Naive(mutations, done - first, counters["gets"], counters["puts"], counters["deletes"])


# --------------------------------------------------------------------------------------------
# Queue memory


@dataclass
class QueueMemory:
    """Slab chunk bytes vs record payload bytes for every mutation of the workload."""

    mutations: int
    payload_bytes: int
    chunk_bytes: int
    classes: dict[int, int]
    ring_bytes: int  # ring slots (4 list pointers + 1 flag byte) and the boxed ints they hold
    ring_preallocated: int  # every worker's ring, allocated at start whatever is queued

    @property
    def payload_per_mutation(self) -> float:
        return self.payload_bytes / self.mutations

    @property
    def ring_per_mutation(self) -> float:
        return self.ring_bytes / self.mutations

    @property
    def chunk_per_mutation(self) -> float:
        return self.chunk_bytes / self.mutations


def queue_memory(config: Config, batches: Sequence[p.MutationBatch]) -> QueueMemory:
    """Allocate every record as a worker would; when the pool is full, count and free it."""
    pool = SlabPool(config.slab.pool_bytes, config.slab.slab_bytes, config.slab.min_chunk)
    held: list[tuple[list[int], list[int]]] = []
    payload = chunk = 0
    classes: Counter[int] = Counter()

    def release() -> None:
        nonlocal payload, chunk
        stats = pool.statistics()
        payload += stats.payload_bytes_in_use
        chunk += stats.chunk_bytes_in_use
        for chunks, lengths in held:
            pool.free_many(chunks, lengths)
        held.clear()

    mutations = ring = 0
    for batch in batches:
        got = pool.try_alloc_many(batch.lengths)
        if got is None:
            release()
            got = pool.try_alloc_many(batch.lengths)
            assert got is not None
        held.append((got, batch.lengths))
        classes.update(pool.chunk_size(c) for c in got)
        mutations += len(got)
        # Ints above 256 are separate objects; vbuckets and record lengths stay below here.
        ring += sum(sys.getsizeof(v) for v in (*batch.seqnos, *got) if v > SMALL_INT)
    release()
    ring += mutations * RING_SLOT_BYTES
    preallocated = config.pipeline.workers * config.pipeline.ring_slots * RING_SLOT_BYTES
    return QueueMemory(mutations, payload, chunk, dict(sorted(classes.items())), ring, preallocated)


# --------------------------------------------------------------------------------------------
# Main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line; --router PORT is the child process's mode."""
    parser = argparse.ArgumentParser(
        description="Ingest benchmark: end to end vs raw storage vs a naive server."
    )
    parser.add_argument("--mutations", type=int, default=1_000_000, help="default 1,000,000")
    parser.add_argument("--keys", type=int, default=0, help="docids (default mutations/5)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--skip-naive", action="store_true", help="do not run the naive server")
    parser.add_argument(
        "--naive-mutations",
        type=int,
        default=None,
        help="run the naive server on this prefix of the workload only (default: all of it)",
    )
    parser.add_argument("--raw-repeats", type=int, default=3, help="raw writes, best kept")
    parser.add_argument(
        "--recovery-points",
        type=int,
        default=None,
        help="snapshots.recovery_points of the daemon (default: the configuration's, 5); "
        "0 writes no undo records",
    )
    parser.add_argument(
        "--history",
        choices=("on", "off"),
        default=None,
        help="changes.history of the daemon (default: the configuration's, on); off writes no "
        "change-history records",
    )
    parser.add_argument("--keep", action="store_true", help="keep the temp directory")
    parser.add_argument("--timeout", type=float, default=1800, help="router timeout, seconds")
    parser.add_argument("--router", type=int, metavar="PORT", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.mutations < 1 or opts.keys < 0 or opts.raw_repeats < 1:
        parser.error("--mutations and --raw-repeats must be >= 1, --keys >= 0")
    if opts.naive_mutations is None:
        opts.naive_mutations = opts.mutations
    opts.naive_mutations = max(1, min(opts.naive_mutations, opts.mutations))
    return opts


def report_e2e(e2e: EndToEnd) -> None:
    """The end-to-end lines."""
    readable = (
        "?"
        if e2e.readable_seconds is None
        else f"{e2e.mutations / e2e.readable_seconds:,.0f} mutations/s"
        f" ({e2e.readable_seconds:.2f} s)"
    )
    say(
        f"end to end: {e2e.per_s:,.0f} mutations/s ({e2e.mutations} in {e2e.seconds:.2f} s: "
        f"send {e2e.send_seconds:.2f} s + wait for the persisted ack {e2e.tail_seconds:.2f} s; "
        f"{e2e.wire_bytes / e2e.mutations:.1f} wire B/mutation, {e2e.frames} frames, "
        f"{e2e.acks} acks, {e2e.persists} persists; router pre-encoding {e2e.encode_seconds:.1f} s"
        " untimed)"
    )
    say(f"  readable (first byte to the in-memory snapshot covering everything): {readable}")
    say(
        f"  daemon: CPU {e2e.daemon_main_cpu_s:.2f} s main thread + "
        f"{e2e.daemon_thread_cpu_s:.2f} s other threads over {e2e.seconds:.2f} s; "
        f"peak RSS {e2e.daemon_peak_rss / 2**20:.0f} MiB; SIGINT exit code {e2e.daemon_exit}"
        + (
            ""
            if e2e.stalls is None
            else f"; {e2e.stalls[0]} stalls on full queues, {e2e.stalls[1]} throttle pauses"
        )
    )
    series = e2e.timeline
    if series["t_s"]:
        say(
            f"  timeline: {len(series['t_s'])} samples of GET /stats every "
            f"{STATS_INTERVAL_S * 1000:.0f} ms ({e2e.timeline_failures} failed); at most "
            f"{max(series['queued']):,.0f} records queued, "
            f"{max(series['slab_bytes']) / 2**20:.1f} MiB of slab chunks in use"
        )


def report_raw(name: str, raw: RawOps, times: Sequence[float], mutations: int) -> None:
    """One raw line: best of `times`."""
    best = min(times)
    runs = ", ".join(f"{t:.2f}" for t in times)
    say(
        f"{name}: {mutations / best:,.0f} mutations/s, {raw.ops / best:,.0f} ops/s "
        f"({raw.ops} ops: {raw.puts} puts, {raw.deletes} deletes; {runs} s; {raw.method})"
    )


def run(opts: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Every measurement in order; the JSON summary."""
    config = parse_config()
    reply = handshake_reply(config)
    workload = workload_of(opts.mutations, opts.keys, opts.seed)
    n = opts.mutations
    say(
        f"workload: {n} mutations over {workload.key_space} docids, "
        f"{DELETE_RATIO:.0%} deletes, seed {opts.seed}; indexes: "
        + ", ".join(f"{i.name}({', '.join(i.keys)})" for i in config.indexes)
        + f"; {os.cpu_count()} cores, Python {sys.version.split()[0]}"
    )

    e2e = measure_e2e(opts, workdir / "e2e")
    report_e2e(e2e)

    frames, _ = encode_frames(reply, workload)
    batches = mutation_batches(frames, config.server.max_frame_bytes)
    with IndexStore(workdir / "layout") as layout:
        indexes = layout.ensure_indexes(config.indexes)

    raw = flush_ops(config, indexes, batches, workload.key_space)
    raw_times, raw_store = measure_raw(config, raw, workdir / "raw", opts.raw_repeats)
    report_raw("raw", raw, raw_times, n)
    raw_s = min(raw_times)
    matches, rows = compare_stores(e2e.store, raw_store)
    raw_counts = {"raw_ops": raw.ops, "raw_puts": raw.puts, "raw_deletes": raw.deletes}
    del raw

    every = per_mutation_ops(indexes, batches)
    every_times, every_store = measure_raw(config, every, workdir / "raw-per-mutation", 1)
    report_raw("raw per mutation (reference)", every, every_times, n)
    every_s = every_times[0]
    every_matches, _ = compare_stores(e2e.store, every_store)
    every_ops = every.ops
    del every
    say(
        ("check: " if matches and every_matches else "WARNING: ")
        + f"daemon store {'==' if matches else '!='} raw store, "
        f"{'==' if every_matches else '!='} raw per mutation store "
        f"({rows} main and back entries)"
    )

    naive: Naive | None = None
    if opts.skip_naive:
        say("naive: skipped (--skip-naive)")
    else:
        if opts.naive_mutations < n:
            frames, _ = encode_frames(reply, workload, opts.naive_mutations)
        naive = measure_naive(b"".join(frames), opts.naive_mutations, workdir / "naive")
        prefix = "" if naive.mutations == n else f"; the first {naive.mutations} mutations only"
        say(
            f"naive: {naive.per_s:,.0f} mutations/s ({naive.mutations} in {naive.seconds:.2f} s: "
            f"{naive.gets} gets, {naive.puts} puts, {naive.deletes} deletes, one call each"
            f"{prefix})"
        )
    del frames

    memory = queue_memory(config, batches)
    say(
        f"queue memory: {memory.chunk_per_mutation:.1f} slab B/mutation for "
        f"{memory.payload_per_mutation:.1f} payload B/mutation "
        f"({memory.chunk_bytes / memory.payload_bytes:.2f}x; chunk classes used: "
        + ", ".join(f"{size} B x {k}" for size, k in memory.classes.items())
        + f"); ring bookkeeping {memory.ring_per_mutation:.1f} B/mutation more "
        f"({RING_SLOT_BYTES} B slot + boxed seqno and chunk offset), "
        f"{memory.ring_preallocated / 2**20:.0f} MiB of ring slots preallocated"
    )

    raw_per_s = n / raw_s
    naive_per_s = naive.per_s if naive else None
    summary: dict[str, Any] = {
        "mutations": n,
        "keys": workload.key_space,
        "seed": opts.seed,
        "e2e_per_s": round(e2e.per_s),
        "raw_per_s": round(raw_per_s),
        "naive_per_s": round(naive_per_s) if naive_per_s else None,
        "ratio_vs_raw": ratio(e2e.per_s, raw_per_s),
        "ratio_vs_naive": ratio(e2e.per_s, naive_per_s),
        "e2e_seconds": round(e2e.seconds, 3),
        "e2e_send_seconds": round(e2e.send_seconds, 3),
        "e2e_tail_seconds": round(e2e.tail_seconds, 3),
        "readable_per_s": (round(n / e2e.readable_seconds) if e2e.readable_seconds else None),
        "daemon_main_cpu_s": round(e2e.daemon_main_cpu_s, 2),
        "daemon_thread_cpu_s": round(e2e.daemon_thread_cpu_s, 2),
        "daemon_peak_rss_bytes": e2e.daemon_peak_rss,
        "daemon_exit_code": e2e.daemon_exit,
        "raw_method": RAW_METHOD,
        "raw_seconds": [round(t, 3) for t in raw_times],
        **raw_counts,
        "raw_ops_per_s": round(raw_counts["raw_ops"] / raw_s),
        "raw_per_mutation_per_s": round(n / every_s),
        "raw_per_mutation_ops": every_ops,
        "ratio_vs_raw_per_mutation": ratio(e2e.per_s, n / every_s),
        "store_matches_raw": matches and every_matches,
        "naive_mutations": naive.mutations if naive else 0,
        "naive_seconds": round(naive.seconds, 3) if naive else None,
        "slab_bytes_per_mutation": round(memory.chunk_per_mutation, 1),
        "payload_bytes_per_mutation": round(memory.payload_per_mutation, 1),
        "ring_bytes_per_mutation": round(memory.ring_per_mutation, 1),
        "wire_bytes_per_mutation": round(e2e.wire_bytes / e2e.mutations, 1),
        "cores": os.cpu_count(),
        "slab_pool_bytes": config.slab.pool_bytes,
        "timeline_interval_s": STATS_INTERVAL_S,
        "timeline_failures": e2e.timeline_failures,
        "timeline": e2e.timeline,
    }
    summary["targets_met"] = {
        "e2e_vs_raw_ge_0.5": bool(summary["ratio_vs_raw"] and summary["ratio_vs_raw"] >= 0.5),
        "e2e_vs_naive_ge_2": bool(summary["ratio_vs_naive"] and summary["ratio_vs_naive"] >= 2),
    }
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    """Router mode for the child process, else the whole benchmark."""
    opts = parse_args(argv)
    if opts.router is not None:
        result = run_router(opts.router, opts.mutations, opts.keys, opts.seed)
        print(json.dumps(result), flush=True)
        return 0
    return in_workdir("ingest-bench-", opts.keep, lambda workdir: run(opts, workdir))


if __name__ == "__main__":
    sys.exit(main())
