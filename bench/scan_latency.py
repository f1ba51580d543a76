"""The scan benchmark's latency run (bench/scan.py, step 4): request_plus counts timed while a
feeder process continues the workload at a steady rate, and the publishes of snapshots polled
to time each cycle's flush. The feeder is scan.py's own `--feeder` mode (`run_feeder`)."""

from __future__ import annotations

import argparse
import json
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice, pairwise
from pathlib import Path
from typing import Any

import httpx
from common import (  # bench/common.py: run as `python bench/...`
    HOST,
    Daemon,
)

from indexer import protocol as p
from indexer.config import load_config
from indexer.router.inputs.workload import Workload, generate
from indexer.router.streams.encoders import StreamEncoder
from indexer.router.streams.records import default_vbuuid

COUNT_INDEX = "by_age"
FEED_TICK_S = 0.05
WARMUP_S = 2.0
ANY_EVERY = 4
POLL_S = 0.06  # below the 100 ms interval, so no publish is missed; ~2 ms of daemon each
DELETE_RATIO = 0.1


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear between closest ranks."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


# --------------------------------------------------------------------------------------------
# The feeder process (`--feeder`): the workload continued at a steady rate


class AckDrain(threading.Thread):
    """Reads the daemon's frames (acks) so its sends never block; keeps the first error."""

    def __init__(self, sock: socket.socket, decoder: p.FrameDecoder) -> None:
        super().__init__(daemon=True)
        self.sock = sock
        self.decoder = decoder
        self.error: str | None = None
        self.acks = 0

    def run(self) -> None:
        try:
            while True:
                data = self.sock.recv(1 << 16)
                if not data:
                    return
                self.decoder.feed(data)
                for message in self.decoder.messages():
                    if isinstance(message, p.Error):
                        self.error = f"{message.code.name}: {message.message}"
                    elif isinstance(message, p.Ack):
                        self.acks += 1
        except (OSError, p.ProtocolError) as exc:
            if self.error is None:
                self.error = f"ack reader: {exc}"


def read_reply(sock: socket.socket, decoder: p.FrameDecoder) -> p.HandshakeReply:
    """The handshake reply on a blocking socket."""
    while True:
        messages = decoder.messages()
        if messages:
            reply = messages[0]
            if not isinstance(reply, p.HandshakeReply) or len(messages) > 1:
                raise RuntimeError(f"expected a handshake reply alone, got {messages!r}")
            return reply
        data = sock.recv(1 << 16)
        if not data:
            raise RuntimeError("the daemon closed the connection during the handshake")
        decoder.feed(data)


def run_feeder(port: int, skip: int, keys: int, seed: int, rate: float) -> dict[str, Any]:
    """Continue the workload after its first `skip` mutations at `rate` mutations/s until stdin
    closes; every FEED_TICK_S, send the frames of everything generated since the last tick."""
    sock = socket.create_connection((HOST, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    decoder = p.FrameDecoder(64 << 20)
    n = load_config(None).server.num_vbuckets
    sock.sendall(p.encode(p.Handshake("scan-bench-feeder", n, tuple(range(n)))))
    reply = read_reply(sock, decoder)
    encoder = StreamEncoder(reply)
    # Long enough for any run: the generator is lazy.
    documents = generate(Workload(skip + 10**9, keys, DELETE_RATIO, seed))
    # The daemon's restart timestamp covers these: the encoder skips them (frames, if any, are
    # of mutations it did not report persisted; they go out with the first tick).
    frames: list[bytes] = []
    for document in islice(documents, skip):
        frames.extend(encoder.add(document))
    stop = threading.Event()

    def wait_stdin() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=wait_stdin, daemon=True).start()
    drain = AckDrain(sock, decoder)
    drain.start()
    print("feeding", flush=True)
    sent_before = encoder.sent
    started = time.perf_counter()
    sent_bytes = 0
    behind = 0.0
    tick = 0
    while not stop.is_set() and drain.error is None:
        tick += 1
        due = started + tick * FEED_TICK_S
        want = int(rate * tick * FEED_TICK_S) - (encoder.sent - sent_before)
        for document in islice(documents, max(want, 0)):
            frames.extend(encoder.add(document))
        frames.extend(encoder.finish())
        payload = b"".join(frames)
        frames.clear()
        sock.sendall(payload)
        sent_bytes += len(payload)
        late = time.perf_counter() - due
        behind = max(behind, late)
        if late < 0:
            stop.wait(-late)
    seconds = time.perf_counter() - started
    if drain.error is None:
        ends = [p.encode(p.StreamEnd(vb, default_vbuuid(vb))) for vb in sorted(encoder.begun)]
        sock.sendall(b"".join(ends))
    sock.close()
    return {
        "skipped": encoder.skipped,
        "sent": encoder.sent - sent_before,
        "resent": sent_before,
        "seconds": seconds,
        "bytes": sent_bytes,
        "max_late_s": behind,
        "acks": drain.acks,
        "error": drain.error,
    }


# --------------------------------------------------------------------------------------------
# request_plus latency while the feeder runs


class SnapshotPoller(threading.Thread):
    """Polls GET /snapshots: when each readable snapshot was published, which were persisted."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.created: dict[int, float] = {}
        self.persisted: set[int] = set()
        self.polls = 0
        self.stopped = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.stopped.is_set():
                body = client.get(self.url + "/snapshots").json()
                self.polls += 1
                if body["stable"]:
                    self.created[body["stable"]["snapshot"]] = body["stable"]["created_at"]
                if body["persisted"]:
                    self.persisted.add(body["persisted"]["snapshot"])
                self.stopped.wait(POLL_S)

    def flush_times(self, interval_s: float) -> tuple[list[float], list[float]]:
        """Per cycle between consecutive publishes: (gap - interval) without and with a persist."""
        plain: list[float] = []
        persisting: list[float] = []
        numbers = sorted(self.created)
        for a, b in pairwise(numbers):
            if b != a + 1:
                continue
            extra = self.created[b] - self.created[a] - interval_s
            (persisting if a in self.persisted else plain).append(extra)
        return plain, persisting


@dataclass
class Latency:
    """request_plus and any latencies under the feed, and what the feed and the daemon did."""

    request_plus_ms: list[float]
    any_ms: list[float]
    wait_ms: list[float]
    flush_ms: list[float]
    persist_cycle_ms: list[float]
    polls: int
    feeder: dict[str, Any]
    feed_seconds: float
    ingested: int
    daemon_main_cpu_s: float
    daemon_thread_cpu_s: float
    queued_at_end: int


def measure_latency(
    daemon: Daemon, opts: argparse.Namespace, interval_s: float, workdir: Path
) -> Latency:
    """Start the feeder, let it settle, time the requests, stop the feeder."""
    command = [
        sys.executable,
        str(Path(__file__).resolve().with_name("scan.py")),  # its --feeder mode
        "--feeder",
        str(daemon.port),
        "--mutations",
        str(opts.mutations),
        "--keys",
        str(opts.keys),
        "--seed",
        str(opts.seed),
        "--feed-rate",
        str(opts.feed_rate),
    ]
    errors_path = workdir / "feeder.err"
    with open(errors_path, "wb") as errors:
        feeder = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, text=True
        )
    assert feeder.stdin is not None and feeder.stdout is not None
    rng = random.Random(opts.seed)
    plus: list[tuple[float, float, int]] = []  # (wall time sent, ms, snapshot number)
    anys: list[float] = []
    count_url = f"{daemon.url}/indexes/{COUNT_INDEX}/count"
    poller = SnapshotPoller(daemon.url)
    try:
        line = feeder.stdout.readline()
        if line.strip() != "feeding":
            raise RuntimeError(f"the feeder did not start: {line!r} {errors_path.read_text()}")
        time.sleep(WARMUP_S)
        with httpx.Client(timeout=60) as client:

            def timed(consistency: str) -> tuple[float, float, int]:
                time.sleep(rng.uniform(0, interval_s))
                sent = time.time()
                t0 = time.perf_counter()
                response = client.get(count_url, params={"consistency": consistency})
                ms = (time.perf_counter() - t0) * 1000
                if response.status_code != 200:
                    raise RuntimeError(f"count: HTTP {response.status_code}: {response.text}")
                return sent, ms, int(response.json()["snapshot"])

            before = client.get(daemon.url + "/stats").json()
            cpu_before = daemon.cpu()
            started = time.perf_counter()
            poller.start()
            for i in range(opts.requests):
                if feeder.poll() is not None:
                    raise RuntimeError(f"the feeder stopped early: {errors_path.read_text()}")
                plus.append(timed("request_plus"))
                if i % ANY_EVERY == ANY_EVERY - 1:
                    anys.append(timed("any")[1])
            seconds = time.perf_counter() - started
            cpu_after = daemon.cpu()
            after = client.get(daemon.url + "/stats").json()
            poller.stopped.set()
            poller.join()
        out, _ = feeder.communicate(input="", timeout=60)
        result = json.loads(out.strip().splitlines()[-1])
        if result["error"]:
            raise RuntimeError(f"the feeder failed: {result['error']}")
    finally:
        poller.stopped.set()
        if feeder.poll() is None:
            feeder.kill()
            feeder.wait()
    plain, persisting = poller.flush_times(interval_s)
    # How long each request waited for the snapshot it read to be published (0: it was already).
    waits = [
        max(0.0, (poller.created[number] - sent) * 1000)
        for sent, _, number in plus
        if number in poller.created
    ]
    return Latency(
        request_plus_ms=[ms for _, ms, _ in plus],
        any_ms=anys,
        wait_ms=waits,
        flush_ms=[s * 1000 for s in plain],
        persist_cycle_ms=[s * 1000 for s in persisting],
        polls=poller.polls,
        feeder=result,
        feed_seconds=seconds,
        ingested=after["vbuckets"]["received_seqno_sum"] - before["vbuckets"]["received_seqno_sum"],
        daemon_main_cpu_s=cpu_after[0] - cpu_before[0],
        daemon_thread_cpu_s=cpu_after[1] - cpu_before[1],
        queued_at_end=sum(q["queued"] for q in after["queues"]),
    )


def summarize_ms(values: Sequence[float]) -> str:
    """p50 / p99 / max of a list of milliseconds."""
    return (
        f"p50 {percentile(values, 50):.1f} ms, p99 {percentile(values, 99):.1f} ms, "
        f"max {max(values):.1f} ms"
    )
