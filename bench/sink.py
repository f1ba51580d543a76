"""A router consumer that only counts: the indexer side of the protocol without an index.

    python bench/sink.py --port P [--rate-bytes-per-s R] [--stats FILE]
                         [--flow-control-bytes W] [--max-frame-bytes F]

It answers the router's HANDSHAKE as a daemon with the default configuration would: the default
configuration's indexes (so the router computes the same keys as for a real daemon), every
vbucket owned, and restart positions at what it has received so far (all zero on the first
connection). When the router asks for flow control it grants a window of
`--flow-control-bytes` and returns credit with BUFFER_ACK as it takes frames, in quarter-window
steps and at once while a frame is incomplete, as `indexer/reader.py` does. It decodes every
frame with `indexer.protocol.FrameDecoder` and counts the records of MUTATIONS frames.

One router connection at a time: a second one waits until the first closes. With
`--rate-bytes-per-s` it reads at most that many bytes per second (a slow indexer); SIGUSR1
lifts the limit. SIGTERM or SIGINT stop it.

Its first stdout line is `listening on HOST:PORT`, then one line of counts per second. With
`--stats FILE` the counts are also written to FILE as one JSON object (replaced atomically),
every 20 ms while they change: `mutations` (records received), `seqno_sum` (per vbucket the last
seqno received, summed: the router's high seqno sum once the sink has everything),
`duplicates` (records at or below what the vbucket had), `bytes`, `frames`, `connections`,
`updated_at` (wall time of the last receive that carried records) and `rate_bytes_per_s`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import trio

from indexer import protocol as p
from indexer.config import parse_config

HOST = "127.0.0.1"
RECEIVE_BYTES = 256 * 1024
STATS_INTERVAL_S = 0.02
PRINT_INTERVAL_S = 1.0


class Pace:
    """At most `rate` bytes per second from when the rate was set (0: unlimited)."""

    def __init__(self, rate: int) -> None:
        self.set(rate)

    def set(self, rate: int) -> None:
        self.rate = rate
        self.started = time.monotonic()
        self.taken = 0

    def receive_size(self) -> int:
        """Bytes to ask for in one receive: a twentieth of a second's worth when limited."""
        return RECEIVE_BYTES if not self.rate else max(1024, min(RECEIVE_BYTES, self.rate // 20))

    async def took(self, nbytes: int) -> None:
        """Account for `nbytes` read; sleep until they fit the rate."""
        if not self.rate:
            return
        self.taken += nbytes
        ahead = self.taken / self.rate - (time.monotonic() - self.started)
        if ahead > 0:
            await trio.sleep(ahead)


class Sink:
    """Counters and per-vbucket positions across connections, and one connection's loop."""

    def __init__(
        self, pace: Pace, indexes: tuple[p.IndexDefinition, ...], window: int, max_frame: int
    ) -> None:
        self.pace = pace
        self.indexes = indexes
        self.window = window
        self.max_frame = max_frame
        self.received: dict[int, int] = {}
        self.vbuuids: dict[int, int] = {}
        self.mutations = 0
        self.seqno_sum = 0
        self.duplicates = 0
        self.bytes = 0
        self.frames = 0
        self.connections = 0
        self.updated_at = 0.0
        self.lock = trio.Lock()

    def counts(self) -> dict[str, Any]:
        return {
            "mutations": self.mutations,
            "seqno_sum": self.seqno_sum,
            "duplicates": self.duplicates,
            "bytes": self.bytes,
            "frames": self.frames,
            "connections": self.connections,
            "updated_at": self.updated_at,
            "rate_bytes_per_s": self.pace.rate,
        }

    def reply(self, handshake: p.Handshake) -> p.HandshakeReply:
        n = handshake.num_vbuckets
        wanted = [vb for vb in handshake.vbuckets if 0 <= vb < n]
        restart = tuple(
            p.VbucketPosition(vb, self.received.get(vb, 0), self.vbuuids.get(vb, 0))
            for vb in wanted
        )
        window = self.window if handshake.flow_control else 0
        return p.HandshakeReply(
            self.indexes, n, tuple(range(n)), restart, self.max_frame, {}, window
        )

    def take(self, batch: p.MutationBatch) -> None:
        seqnos = batch.seqnos
        if not seqnos:
            return
        self.mutations += len(seqnos)
        vb = batch.vbucket
        last = self.received.get(vb, 0)
        if seqnos[0] <= last:
            self.duplicates += sum(1 for s in seqnos if s <= last)
        if seqnos[-1] > last:
            self.received[vb] = seqnos[-1]
            self.seqno_sum += seqnos[-1] - last

    async def handle(self, stream: trio.SocketStream) -> None:
        async with self.lock:
            self.connections += 1
            try:
                await self._serve(stream)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                print(f"connection lost: {exc}", flush=True)
            except p.ProtocolError as exc:
                print(f"protocol error ({exc.code.name}): {exc.message}", flush=True)
                with trio.move_on_after(1):
                    await stream.send_all(p.encode(p.Error(exc.code, exc.message)))
            finally:
                with trio.move_on_after(1, shield=True):
                    await stream.aclose()

    async def _serve(self, stream: trio.SocketStream) -> None:
        decoder = p.FrameDecoder(self.max_frame)
        handshake: p.Handshake | None = None
        credit = 0
        while True:
            data = await stream.receive_some(self.pace.receive_size())
            if not data:
                decoder.close()
                return
            await self.pace.took(len(data))
            self.bytes += len(data)
            unread = decoder.buffered + len(data)
            decoder.feed(data)
            records = 0
            while messages := decoder.messages():
                for message in messages:
                    self.frames += 1
                    if handshake is None:
                        if type(message) is not p.Handshake:
                            raise p.ProtocolError(
                                p.ErrorCode.BAD_HANDSHAKE, "the first frame must be HANDSHAKE"
                            )
                        handshake = message
                        await stream.send_all(p.encode(self.reply(message)))
                    elif type(message) is p.MutationBatch:
                        records += len(message.seqnos)
                        self.take(message)
                    elif type(message) is p.StreamBegin:
                        self.vbuuids[message.vbucket] = message.vbuuid
                    elif type(message) is p.Handshake:
                        raise p.ProtocolError(p.ErrorCode.BAD_HANDSHAKE, "HANDSHAKE sent twice")
            if records:
                self.updated_at = time.time()
            credit += unread - decoder.buffered
            if (
                handshake is not None
                and handshake.flow_control
                and credit
                and (credit >= self.window // 4 or decoder.buffered)
            ):
                await stream.send_all(p.encode(p.BufferAck(credit)))
                credit = 0


async def report(sink: Sink, stats_path: Path | None) -> None:
    """A line per second on stdout; the stats file every 20 ms while the counts change."""
    last: dict[str, Any] | None = None
    next_print = time.monotonic() + PRINT_INTERVAL_S
    while True:
        counts = sink.counts()
        if stats_path is not None and counts != last:
            tmp = stats_path.with_name(stats_path.name + ".tmp")
            tmp.write_text(json.dumps(counts))
            os.replace(tmp, stats_path)
            last = counts
        if time.monotonic() >= next_print:
            print(json.dumps(counts), flush=True)
            next_print += PRINT_INTERVAL_S
        await trio.sleep(STATS_INTERVAL_S)


async def main_async(opts: argparse.Namespace) -> None:
    pace = Pace(opts.rate_bytes_per_s)
    indexes = parse_config().indexes
    sink = Sink(pace, indexes, opts.flow_control_bytes, opts.max_frame_bytes)
    with trio.open_signal_receiver(signal.SIGUSR1, signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(
                functools.partial(trio.serve_tcp, sink.handle, opts.port, host=HOST)
            )
            port = listeners[0].socket.getsockname()[1]
            print(f"listening on {HOST}:{port}", flush=True)
            nursery.start_soon(report, sink, opts.stats)
            async for signum in signals:
                if signum == signal.SIGUSR1:
                    pace.set(0)
                    print("rate limit lifted", flush=True)
                    continue
                break
            nursery.cancel_scope.cancel()
    counts = sink.counts()
    if opts.stats is not None:
        opts.stats.write_text(json.dumps(counts))
    print(json.dumps(counts), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=0, help="TCP port (0: any free one)")
    parser.add_argument(
        "--rate-bytes-per-s", type=int, default=0, help="read at most this fast (0: no limit)"
    )
    parser.add_argument("--stats", type=Path, help="write the counts to this JSON file")
    parser.add_argument("--flow-control-bytes", type=int, default=4 << 20, help="the window")
    parser.add_argument("--max-frame-bytes", type=int, default=1 << 20)
    opts = parser.parse_args()
    if opts.rate_bytes_per_s < 0 or opts.flow_control_bytes < opts.max_frame_bytes:
        parser.error("--rate-bytes-per-s must be >= 0, --flow-control-bytes >= --max-frame-bytes")
    trio.run(main_async, opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
