"""A shard's process: started by the parent with its range, fed the lines of its vbuckets
over stdin with a window of unacknowledged messages, restarted with backoff when it dies and
given again what it had not acknowledged."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import trio

from indexer.router.inputs.bulk import DEFAULT_MAX_BULK_BYTES
from indexer.router.inputs.workload import Workload
from indexer.router.pipe import MessageReader, PipeError
from indexer.router.shards.layout import ShardLayout
from indexer.router.shards.messages import (
    ACK,
    HELLO,
    InputPosition,
    decode_hello,
    decode_json,
)

log = logging.getLogger("indexer.router")

WINDOW = 4  # messages a shard may hold unacknowledged; the input waits beyond it
BACKOFF_MIN_S = 0.2
BACKOFF_MAX_S = 5.0
STEADY_S = 5.0  # a shard up this long restarts at once if it dies
STOP_S = 30.0  # a stopping shard is killed after this long


@dataclass
class Shard:
    """One shard process as the parent sees it: the messages it has not acknowledged, and its
    address once it said HELLO."""

    index: int
    first: int
    last: int
    state: Path
    window: deque[bytes] = field(default_factory=deque)  # sent or to send, not acknowledged
    sent: int = 0  # of `window`, written to the current process
    url: str | None = None  # its HTTP API while it runs
    pid: int | None = None
    position: InputPosition | None = None  # how far its log held the input at its HELLO
    starts: int = 0
    appended: int = 0  # documents it acknowledged since the parent started
    bad: int = 0
    changed: trio.Event = field(default_factory=trio.Event)
    ready: trio.Event = field(default_factory=trio.Event)  # its first HELLO

    @property
    def name(self) -> str:
        return f"shard {self.index}"

    @property
    def vbuckets(self) -> str:
        return f"{self.first}-{self.last}"

    def wake(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    async def submit(self, message: bytes) -> None:
        """Queue a message for the shard; waits while it holds WINDOW unacknowledged."""
        while len(self.window) >= WINDOW:
            await self.changed.wait()
        self.window.append(message)
        self.wake()

    async def drained(self) -> None:
        """Wait until the shard acknowledged every message."""
        while self.window:
            await self.changed.wait()


@dataclass(frozen=True)
class ShardedOptions:
    """What the parent runs: the shards' command line (less what it adds per shard) and input."""

    state: Path
    layout: ShardLayout
    shard_args: Sequence[str]  # `indexer router` options every shard gets (nodes, memory, TLS)
    memory_bytes: int
    jsonl: Path | None = None
    follow: bool = False
    generate: Workload | None = None
    rate: float | None = None
    http: tuple[str, int] | None = None
    env: dict[str, str] = field(default_factory=dict)  # for the shards (the token)
    bulk_max_bytes: int = DEFAULT_MAX_BULK_BYTES  # of a POST /docs/_bulk body


def shard_command(options: ShardedOptions, shard: Shard) -> list[str]:
    layout = options.layout
    return [
        sys.executable, "-m", "indexer", "router",
        "--state", str(shard.state),
        "--vbuckets", str(layout.num_vbuckets),
        "--vbucket-range", shard.vbuckets,
        "--source-id", layout.identity,
        "--http", "127.0.0.1:0",
        "--parent-pipe",
        "--process-name", f"{shard.name}/{layout.count}",
        *options.shard_args,
    ]  # fmt: skip


class ShardStartError(Exception):
    """A shard exited before it was ready the first time (its own log line says why)."""


async def run_shard(options: ShardedOptions, shard: Shard, stopping: Callable[[], bool]) -> None:
    """Keep the shard's process running, feeding it the window; start it again if it dies."""
    backoff = BACKOFF_MIN_S
    env = {**os.environ, **options.env}
    while True:
        started = trio.current_time()
        process = await trio.lowlevel.open_process(
            shard_command(options, shard),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,  # the parent alone takes SIGINT and stops its shards
        )
        shard.starts += 1
        try:
            await _talk_to(shard, process)
        except PipeError as exc:  # a bug on one side: start the shard again rather than stop
            log.error("%s: %s", shard.name, exc)
            process.kill()
        finally:
            shard.url = None
            with trio.CancelScope(shield=True):
                await _stop(shard, process)
        if stopping():
            return
        if not shard.ready.is_set():
            raise ShardStartError(
                f"{shard.name} (vbuckets {shard.vbuckets}) could not start: "
                f"{_exit_reason(process.returncode)}"
            )
        ran = trio.current_time() - started
        backoff = BACKOFF_MIN_S if ran >= STEADY_S else min(backoff * 2, BACKOFF_MAX_S)
        log.error(
            "%s (vbuckets %s, pid %s) %s: starting it again, %d messages to resend",
            shard.name,
            shard.vbuckets,
            process.pid,
            _exit_reason(process.returncode),
            len(shard.window),
        )
        await trio.sleep(0 if ran >= STEADY_S else backoff)


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


async def _stop(shard: Shard, process: trio.Process) -> None:
    """Close the shard's input (it stops when its pipe closes) and wait; kill it if it hangs."""
    if process.stdin is not None:
        with trio.move_on_after(1):
            await process.stdin.aclose()
    with trio.move_on_after(STOP_S) as waited:
        await process.wait()
    if waited.cancelled_caught:
        log.warning("%s did not stop in %d s: killing it", shard.name, STOP_S)
        process.kill()
        await process.wait()
    if process.stdout is not None:
        await process.stdout.aclose()


async def _talk_to(shard: Shard, process: trio.Process) -> None:
    """Read the shard's HELLO, then send its window and take its acknowledgements until it
    exits (its stdout ends)."""
    assert process.stdin is not None and process.stdout is not None
    stdin, stdout = process.stdin, process.stdout
    reader = MessageReader()

    async def next_message() -> tuple[int, bytes] | None:
        while (message := reader.next()) is None:
            data = await stdout.receive_some(1 << 16)
            if not data:
                return None
            reader.feed(data)
        return message

    message = await next_message()
    if message is None:
        return
    kind, body = message
    if kind != HELLO:
        raise PipeError(f"{shard.name} began with message kind {kind}")
    shard.url, shard.position, shard.pid = decode_hello(body)
    shard.sent = 0  # a new process: everything not acknowledged goes again
    if shard.ready.is_set():
        log.info("%s is back (pid %d)", shard.name, shard.pid)
    shard.ready.set()
    shard.wake()

    async def send_window() -> None:
        try:
            while True:
                while shard.sent < len(shard.window):
                    message = shard.window[shard.sent]
                    shard.sent += 1
                    await stdin.send_all(message)
                await shard.changed.wait()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # it exited: its stdout ends too, and the caller starts it again

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_window)
        while (message := await next_message()) is not None:
            kind, body = message
            if kind != ACK or not shard.window:
                raise PipeError(f"{shard.name} sent message kind {kind} out of turn")
            answer = decode_json(body)
            shard.window.popleft()
            shard.sent -= 1
            shard.appended += int(answer.get("appended", 0))
            shard.bad += int(answer.get("bad", 0))
            shard.wake()
        nursery.cancel_scope.cancel()


# ------------------------------------------------------------------------------------------
# The input: lines to shards


# How writers start a line: compact (the router's own output) or as json.dumps does.
