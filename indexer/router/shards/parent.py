"""A router as K processes (`indexer router --shards K`): the parent reads the input and serves
the HTTP API, and each shard owns a contiguous range of vbuckets with its own source log,
Mutation Manager and node connections.

A shard is `indexer router` itself, started by the parent with the shard's range, the shared
source identity and the parent's pipe as its input (`shard_input.py`). The parent reads the
input a piece at a time, hands each line to the shard of its document's vbucket
(`documents.routing_id`, CRC32 of the id), and keeps every message until the shard acknowledges
it appended. A shard that dies is started again and given the messages it did not acknowledge;
its log records how far it holds the input, so it skips what it had (`shard_pipe.py`). A parent
started again resumes the input from the earliest shard's position, the same way.

State directory:

    DIR/shards.json     {"identity", "vbuckets", "shards"}: fixed when the directory is made
    DIR/shard-I/source  shard I's source log (its range and the identity recorded in it)
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
import zlib
from bisect import bisect_right
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import httpx
import trio

from indexer.asgi import answer_lifespan, serve_asgi
from indexer.collector import rare_collections
from indexer.metrics import process_started_at, version
from indexer.router.documents import LineSplitter, routing_id, vbucket_of
from indexer.router.inputs import bulk
from indexer.router.inputs.bulk import DEFAULT_MAX_BULK_BYTES
from indexer.router.inputs.bulk_forward import MARGIN_S, PARENT_URL_ENV, Forwarded, forward_lines
from indexer.router.inputs.workload import Workload, generate, paced
from indexer.router.pipe import MessageReader, PipeError
from indexer.router.service import read_body
from indexer.router.shards.messages import (
    ACK,
    HELLO,
    InputPosition,
    LineBatch,
    decode_hello,
    decode_json,
    encode_lines,
)
from indexer.router.source.appender import READ_BYTES, append_bytes
from indexer.router.source.log import STATE_DIR, SourceError, describe_vbuckets
from indexer.router.source.log import encode_document as encode_line

log = logging.getLogger("indexer.router")

LAYOUT_FILE = "shards.json"
LOCK_FILE = "router.lock"
WINDOW = 4  # messages a shard may hold unacknowledged; the input waits beyond it
POLL_S = 0.2
BACKOFF_MIN_S = 0.2
BACKOFF_MAX_S = 5.0
STEADY_S = 5.0  # a shard up this long restarts at once if it dies
STOP_S = 30.0  # a stopping shard is killed after this long
PROXY_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ShardLayout:
    """How a sharded router's vbuckets are split: K contiguous ranges of one source."""

    identity: str
    num_vbuckets: int
    count: int

    def ranges(self) -> list[tuple[int, int]]:
        """(first, last) vbucket of each shard."""
        n, k = self.num_vbuckets, self.count
        return [(i * n // k, (i + 1) * n // k - 1) for i in range(k)]

    @functools.cached_property
    def _owners(self) -> list[int]:
        starts = [first for first, _ in self.ranges()]
        return [bisect_right(starts, vb) - 1 for vb in range(self.num_vbuckets)]

    def owners(self) -> list[int]:
        """The shard of each vbucket."""
        return self._owners

    def shard_of(self, docid: str) -> int:
        return self._owners[vbucket_of(docid.encode(), self.num_vbuckets)]


def open_layout(
    state: Path, count: int, num_vbuckets: int | None, identity: str | None
) -> ShardLayout:
    """The state directory's layout, made on first use (SourceError: one line saying why not)."""
    if (state / STATE_DIR).is_dir():
        raise SourceError(
            f"{state} holds the source log of a router without shards: run it without --shards "
            "(or give --shards a new --state)"
        )
    path = state / LAYOUT_FILE
    if path.exists():
        try:
            item = json.loads(path.read_text())
            layout = ShardLayout(str(item["identity"]), int(item["vbuckets"]), int(item["shards"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SourceError(f"{path} is unreadable: {exc}") from None
        if layout.count != count:
            raise SourceError(
                f"{state} was made with --shards {layout.count}: a state directory keeps its "
                f"shard count (run with --shards {layout.count}, or give a new --state)"
            )
        if num_vbuckets is not None and num_vbuckets != layout.num_vbuckets:
            raise SourceError(f"{state} has {layout.num_vbuckets} vbuckets, not {num_vbuckets}")
        if identity is not None and identity != layout.identity:
            raise SourceError(f"{state} has source id {layout.identity}, not {identity}")
        return layout
    n = 1024 if num_vbuckets is None else num_vbuckets
    if count > n:
        raise SourceError(f"--shards {count} is more than the {n} vbuckets")
    layout = ShardLayout(identity or uuid.uuid4().hex, n, count)
    body = {"identity": layout.identity, "vbuckets": n, "shards": count}
    try:
        state.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(".tmp")
        with open(temporary, "w") as f:
            json.dump(body, f)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
        directory = os.open(state, os.O_RDONLY)  # the new name survives a power cut
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    except OSError as exc:
        raise SourceError(f"cannot create {path}: {exc.strerror}") from None
    return layout


def lock_state(state: Path) -> int:
    """Hold the state directory for this process (SourceError if another router has it)."""
    fd = os.open(state / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SourceError(f"another router runs on {state}") from None
    return fd


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
_ID_PREFIXES = (b'{"id":"', b'{"id": "')


def plain_ids(lines: Sequence[bytes]) -> list[bytes] | None:
    """The document ids of lines that all start the same way, {"id":"ID" or {"id": "ID", with
    no escape in ID and "id" once, found without a parse; None if any line does not (then
    each is read by `routing_id`)."""
    piece = b"\n".join(lines)
    n = len(lines)
    prefix = next((p for p in _ID_PREFIXES if piece.startswith(p)), None)
    if prefix is None or piece.count(b"\n" + prefix) != n - 1:
        return None
    if piece.count(b'"id"') != n:  # a second "id" in a line: JSON keeps the last one
        return None
    at = len(prefix)
    ids = [line[at : line.find(b'"', at)] for line in lines]
    if b"\\" in b"".join(ids):
        return None
    return ids


class LineRouter:
    """Lines of one input to their shards' messages: each piece of the input becomes one
    LINES message per shard (possibly empty: its position still moves)."""

    def __init__(self, layout: ShardLayout, shards: Sequence[Shard]) -> None:
        self.owners = layout.owners()
        self.num_vbuckets = layout.num_vbuckets
        self.shards = shards
        self._clear(InputPosition("", 0, 0))

    def _clear(self, start: InputPosition) -> None:
        self.start = start  # of the piece being gathered
        self.count = 0  # lines in it so far
        self.indexes: list[list[int]] = [[] for _ in self.shards]
        self.parts: list[list[bytes]] = [[] for _ in self.shards]

    def begin(self, key: str, offset: int, line: int) -> None:
        """Where the next piece starts (what comes before is sent or held)."""
        self._clear(InputPosition(key, offset, line))

    def add(self, lines: Sequence[bytes]) -> None:
        """Gather lines into the piece, each for the shard of its document (-1: blank)."""
        base = self.count
        indexes, parts = self.indexes, self.parts
        for j, shard in enumerate(self._shards_of(lines)):
            if shard >= 0:
                indexes[shard].append(base + j)
                parts[shard].append(lines[j])
        self.count += len(lines)

    def _shards_of(self, lines: Sequence[bytes]) -> list[int]:
        owners, n, crc32 = self.owners, self.num_vbuckets, zlib.crc32
        ids = plain_ids(lines) if lines else []
        if ids is not None:
            return [owners[crc32(docid) % n] for docid in ids]
        out = []
        for line in lines:
            if not line or line.isspace():
                out.append(-1)
                continue
            docid = routing_id(line)
            # A line without an id is bad: shard 0 parses it and reports why.
            out.append(0 if docid is None else owners[crc32(docid) % n])
        return out

    async def send(self, end: int, end_line: int) -> None:
        """Send every shard its lines of the piece, which ends at `end` after `end_line`."""
        start = self.start
        for shard, indexes, part in zip(self.shards, self.indexes, self.parts, strict=True):
            batch = LineBatch(start.key, start.offset, end, start.line, end_line, indexes, part)
            await shard.submit(encode_lines(batch))
        self._clear(InputPosition(start.key, end, end_line))

    async def drained(self) -> int:
        """Wait until every shard appended all it was sent; the documents they appended."""
        for shard in self.shards:
            await shard.drained()
        return sum(shard.appended for shard in self.shards)


def resume_point(
    shards: Sequence[Shard], base: str, size: int | None
) -> tuple[InputPosition, list[int]]:
    """Where to start reading the input `base`: the key to use (`base` and a generation) and
    the earliest position of any shard on that key (offset 0 for the start), and the later
    positions of the others, where pieces must be cut so each shard holds a piece whole.

    A generation counts the times a followed file was truncated; a position beyond the file's
    `size` means it was truncated while no router ran: a new generation, from the start.
    """
    generations = []
    for shard in shards:
        held = shard.position
        if held is not None and held.key.rsplit("|", 1)[0] == base:
            generations.append(int(held.key.rsplit("|", 1)[1]))
    generation = max(generations, default=0)
    key = f"{base}|{generation}"
    start = InputPosition(key, 0, 0)
    held_here = [s.position for s in shards if s.position is not None and s.position.key == key]
    if len(held_here) < len(shards):
        return start, sorted({p.offset for p in held_here if p.offset > 0})
    if size is not None and max(p.offset for p in held_here) > size:
        log.warning("%s is shorter than the shards hold: reading it from the start", base)
        return InputPosition(f"{base}|{generation + 1}", 0, 0), []
    earliest = min(held_here, key=lambda p: p.offset)
    return earliest, sorted({p.offset for p in held_here if p.offset > earliest.offset})


async def read_jsonl(path: Path, follow: bool, router: LineRouter, batch_bytes: int) -> None:
    """Hand the file's lines to the shards; with `follow`, keep reading what is appended."""
    info = await trio.to_thread.run_sync(os.stat, path)
    base = f"{path.resolve()}|{info.st_ino}"
    start, cuts = resume_point(router.shards, base, info.st_size)
    key = start.key
    generation = int(key.rsplit("|", 1)[1])
    splitter = LineSplitter(start.offset, start.line)
    router.begin(key, start.offset, start.line)
    if start.offset:
        log.info("%s: resuming at line %d (byte %d)", path, start.line + 1, start.offset)
    async with await trio.open_file(path, "rb") as f:
        await f.seek(start.offset)
        taken = 0
        while True:
            # A piece ends at the next shard's position, if any: that shard holds it up to
            # there and skips the piece whole.
            read_to = splitter.offset + len(splitter.partial)
            while cuts and cuts[0] <= read_to:  # inside a line (one without its newline yet)
                cuts.pop(0)
            data = await f.read(READ_BYTES if not cuts else min(READ_BYTES, cuts[0] - read_to))
            lines = splitter.feed(data) if data else ([] if follow else splitter.finish())
            router.add(lines)
            taken += len(data)
            at_cut = bool(cuts) and splitter.offset >= cuts[0]
            if at_cut:
                cuts.pop(0)
            if data and taken < batch_bytes and not at_cut:
                await trio.lowlevel.checkpoint()
                continue
            if taken or lines:
                await router.send(splitter.offset, splitter.line)
            taken = 0
            if data:
                continue
            if not follow:
                appended = await router.drained()
                log.info("read %d documents from %s", appended, path)
                return
            await trio.sleep(POLL_S)
            size = (await trio.to_thread.run_sync(os.stat, path)).st_size
            if size < splitter.offset:
                log.warning("%s was truncated: reading it again from the start", path)
                generation += 1
                key = f"{base}|{generation}"
                await f.seek(0)
                splitter = LineSplitter()
                router.begin(key, 0, 0)
                cuts = []


async def generate_lines(workload: Workload, rate: float | None, router: LineRouter) -> None:
    """Hand the workload's documents to the shards as input lines (numbered by document)."""
    base = "generated|" + ",".join(str(v) for v in dataclasses.astuple(workload))
    start, cuts = resume_point(router.shards, base, None)
    done = start.offset
    router.begin(start.key, done, done)
    async for batch in paced(islice(generate(workload), done, None), rate):
        while batch:
            # Pieces end where the shards stand too (see read_jsonl).
            size = len(batch) if not cuts else min(len(batch), cuts[0] - done)
            if cuts and done + size >= cuts[0]:
                cuts.pop(0)
            router.add([encode_line(d) for d in batch[:size]])
            done += size
            await router.send(done, done)
            batch = batch[size:]
    log.info("generated %d documents", await router.drained())


# ------------------------------------------------------------------------------------------
# The HTTP API: the shards' APIs behind one address


class ShardsApi:
    """The parent's ASGI app: `PUT`/`DELETE /docs/ID` and `POST /failover/VB` go to the shard
    that owns the vbucket (its answer, as it gave it); `GET /stats` adds the shards' up; `GET
    /metrics` gives every shard's metrics with a `shard` label. Tokens are the shards' to check:
    the request's headers go with it."""

    def __init__(
        self,
        layout: ShardLayout,
        shards: Sequence[Shard],
        bulk_max_bytes: int = DEFAULT_MAX_BULK_BYTES,
    ) -> None:
        self.layout = layout
        self.shards = shards
        self.bulk_max_bytes = bulk_max_bytes
        self.bulk_failed = 0
        self.client = httpx.AsyncClient(timeout=PROXY_TIMEOUT_S)
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per forwarded request
        self.started_at = process_started_at()
        self.version = version()

    async def __call__(
        self,
        scope: dict[str, Any],
        receive: Callable[[], Awaitable[dict[str, Any]]],
        send: Callable[[dict[str, Any]], Awaitable[None]],
    ) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send, self.client.aclose)
            return
        if scope["type"] != "http":
            return
        status, headers, body = await self.handle(scope, receive)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def handle(
        self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]]
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        method, path = scope["method"], scope["path"]
        if path == "/stats" and method == "GET":
            return _json(200, await self.stats())
        if path == "/metrics" and method == "GET":
            return await self.metrics()
        if path == bulk.BULK_PATH and method == "POST":
            return await self.bulk(scope, receive)
        if path.startswith("/docs/") and len(path) > len("/docs/"):
            shard = self.shards[self.layout.shard_of(path[len("/docs/") :])]
        elif path.startswith("/failover/"):
            text = path[len("/failover/") :]
            if not text.isdigit() or int(text) >= self.layout.num_vbuckets:
                return _json(400, {"error": f"the vbucket must be 0 to "
                                   f"{self.layout.num_vbuckets - 1}, not {text!r}"})  # fmt: skip
            shard = self.shards[self.layout.owners()[int(text)]]
        else:
            shard = self.shards[0]  # its answer: 404 or 405, naming the routes
        return await self.forward(shard, scope, receive)

    async def forward(
        self, shard: Shard, scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]]
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        body, error = await read_body(receive)  # bounded as the shard bounds it
        if error is not None:
            return _json(*error)
        if shard.url is None:
            return _json(
                503, {"error": f"{shard.name} is starting again: retry"}, [(b"retry-after", b"1")]
            )
        target = shard.url + scope.get("raw_path", scope["path"].encode()).decode("latin-1")
        headers = [
            (k, v) for k, v in scope["headers"] if k.lower() in (b"authorization", b"content-type")
        ]
        try:
            answer = await self.client.request(
                scope["method"], target, content=body, headers=headers
            )
        except httpx.HTTPError as exc:
            return _json(503, {"error": f"{shard.name} did not answer: {exc}"},
                         [(b"retry-after", b"1")])  # fmt: skip
        kept = [
            (k.encode(), v.encode())
            for k, v in answer.headers.items()
            if k.lower() in ("content-type", "www-authenticate", "retry-after")
        ]
        return answer.status_code, kept, answer.content

    async def bulk(
        self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]]
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """POST /docs/_bulk: each shard gets its lines as a bulk of its own, all at once; the
        answers merge back in line order. A line without an id is answered here."""
        started = time.monotonic()
        query = scope.get("query_string", b"")
        try:
            request = bulk.parse_query(parse_qs(query.decode("latin-1")))
        except bulk.BulkError as exc:
            return _json(400, {"error": str(exc)})
        body, error = await read_body(receive, self.bulk_max_bytes, "bulk")
        if error is not None:
            return _json(*error)
        items: list[dict[str, Any]] = []
        parts: list[list[tuple[int, bytes]]] = [[] for _ in self.shards]
        owners = self.layout.owners()
        for number, raw in bulk.split_lines(body):
            vb = bulk.owner_of(raw, self.layout.num_vbuckets)
            if vb is None:  # parsed in full for the reason
                (line,) = bulk.parse_bulk([(number, raw)])
                items.append(bulk.error_item(line, line.error or "no document id"))
                self.bulk_failed += 1
            else:
                parts[owners[vb]].append((number, raw))
        answers: list[Forwarded] = []

        async def one(shard: Shard, lines: list[tuple[int, bytes]]) -> None:
            answers.append(
                await forward_lines(
                    self.client,
                    shard.url,
                    shard.name,
                    lines,
                    query,
                    scope["headers"],
                    request.timeout_s + MARGIN_S,
                )
            )

        async with trio.open_nursery() as nursery:
            for shard, lines in zip(self.shards, parts, strict=True):
                if lines:
                    nursery.start_soon(one, shard, lines)
        refused = [a for a in answers if a.status == 401]
        if refused:
            return _json(401, {"error": refused[0].error},
                         [(b"www-authenticate", b'Bearer realm="indexer-router"')])  # fmt: skip
        at_plus: dict[int, int] = {}
        for forwarded in answers:
            items.extend(forwarded.items)
            bulk.raise_to(at_plus, forwarded.at_plus.items())
        appended = sum(forwarded.appended for forwarded in answers)
        merged = bulk.answer(items, appended, at_plus, request.wait, time.monotonic() - started)
        late = [a.error for a in answers if a.status == 504]
        if late:
            merged["error"] = "; ".join(late)
            return _json(504, merged)
        return _json(200, merged)

    async def _gather(self, path: str) -> list[httpx.Response | None]:
        answers: list[httpx.Response | None] = [None] * len(self.shards)

        async def one(i: int, shard: Shard) -> None:
            if shard.url is not None:
                with contextlib.suppress(httpx.HTTPError):  # a shard starting again: left out
                    answers[i] = await self.client.get(shard.url + path)

        async with trio.open_nursery() as nursery:
            for i, shard in enumerate(self.shards):
                nursery.start_soon(one, i, shard)
        return answers

    async def stats(self) -> dict[str, Any]:
        """The shards' figures added up, and each shard's own under `shards`."""
        answers = await self._gather("/stats")
        each = [a.json() if a is not None and a.status_code == 200 else None for a in answers]
        merged: dict[str, Any] = {
            "version": self.version,
            "uptime_s": round(time.time() - self.started_at, 3),
            "source_id": self.layout.identity,
            "vbuckets": None,
        }
        keys = ("foreign_documents", "http_refused", "mutation_manager", "expiry", "source", "bulk")
        for key in keys:
            merged[key] = _sum([s[key] for s in each if s is not None])
        merged["source"]["vbuckets"] = self.layout.num_vbuckets
        if merged["bulk"] is not None:  # lines without an id, answered here
            merged["bulk"]["failed"] += self.bulk_failed
            merged["bulk"]["lines"] += self.bulk_failed
        nodes: dict[str, list[Any]] = {}
        for s in each:
            for name, progress in (s or {}).get("nodes", {}).items():
                nodes.setdefault(name, []).append(progress)
        merged["nodes"] = {name: _sum(values) for name, values in nodes.items()}
        merged["shards"] = [
            {
                "shard": shard.index,
                "vbuckets": describe_vbuckets(tuple(range(shard.first, shard.last + 1))),
                "pid": shard.pid,
                "url": shard.url,  # its own API: a client may send a shard its lines directly
                "running": shard.url is not None,
                "starts": shard.starts,
                "unacknowledged": len(shard.window),
                "appended": shard.appended,
                "bad_lines": shard.bad,
                "stats": s,
            }
            for shard, s in zip(self.shards, each, strict=True)
        ]
        return merged

    async def metrics(self) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """Every shard's metrics, each sample labelled with its shard."""
        answers = await self._gather("/metrics")
        out: list[str] = []
        seen: set[str] = set()
        for shard, answer in zip(self.shards, answers, strict=True):
            if answer is None or answer.status_code != 200:
                continue
            for line in answer.text.splitlines():
                if line.startswith("#"):
                    if line not in seen:  # HELP and TYPE once per family
                        seen.add(line)
                        out.append(line)
                    continue
                label = f'shard="{shard.index}"'
                if "{" in line:  # name{labels} value: a label value may hold spaces
                    end = line.rindex("}")
                    out.append(f"{line[:end]},{label}{line[end:]}")
                else:
                    name, _, rest = line.partition(" ")
                    out.append(f"{name}{{{label}}} {rest}")
        headers = [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]
        return 200, headers, ("\n".join(out) + "\n").encode()


def _sum(values: list[Any]) -> Any:
    """Numbers added, flags any-true, dicts key by key; other values: the first's."""
    if not values:
        return None
    first = values[0]
    if isinstance(first, bool):
        return any(values)
    if isinstance(first, int | float):
        total = sum(v for v in values if isinstance(v, int | float))
        return round(total, 6) if isinstance(total, float) else total
    if isinstance(first, dict):
        keys = dict.fromkeys(k for v in values if isinstance(v, dict) for k in v)
        return {k: _sum([v[k] for v in values if isinstance(v, dict) and k in v]) for k in keys}
    return first


def _json(
    status: int, value: dict[str, Any], extra: list[tuple[bytes, bytes]] | None = None
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    headers = [(b"content-type", b"application/json"), *(extra or [])]
    return status, headers, json.dumps(value).encode() + b"\n"


# ------------------------------------------------------------------------------------------


async def run_sharded_router(options: ShardedOptions) -> None:
    """Run the shards, the input and the API until SIGINT or SIGTERM; then stop the shards
    (each finishes its append) and return. ShardStartError if a shard cannot start."""
    layout = options.layout
    shards = [
        Shard(i, first, last, options.state / f"shard-{i}")
        for i, (first, last) in enumerate(layout.ranges())
    ]
    stopping = False
    batch_bytes = append_bytes(options.memory_bytes) * layout.count  # a shard's share as before
    signals_of = trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM)
    with signals_of as signals, rare_collections():  # the router's policy (collector.py)
        async with trio.open_nursery() as nursery:

            async def wait_signal() -> None:
                nonlocal stopping
                async for signum in signals:
                    log.info("%s received: stopping the shards", signal.Signals(signum).name)
                    stopping = True
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(wait_signal)
            if options.http is not None:  # first: a shard sends it bulk lines of other shards
                api = ShardsApi(layout, shards, options.bulk_max_bytes)
                url = await nursery.start(serve_asgi, options.http, api, "indexer.router.http")
                options.env[PARENT_URL_ENV] = url
            for shard in shards:
                nursery.start_soon(run_shard, options, shard, lambda: stopping)
            for shard in shards:
                await shard.ready.wait()
                log.info(
                    "%s/%d: vbuckets %s, pid %d, API on %s",
                    shard.name, layout.count, shard.vbuckets, shard.pid, shard.url,
                )  # fmt: skip
            if options.http is not None:
                log.info(
                    "router API on %s (PUT and DELETE /docs/ID, POST /docs/_bulk, "
                    "POST /failover/VB, GET /stats, GET /metrics)",
                    url,
                )
            router = LineRouter(layout, shards)
            if options.jsonl is not None:
                nursery.start_soon(read_jsonl, options.jsonl, options.follow, router, batch_bytes)
            if options.generate is not None:
                nursery.start_soon(generate_lines, options.generate, options.rate, router)
            log.info(
                "router running with %d shards: state in %s, %d vbuckets, source %s",
                layout.count, options.state, layout.num_vbuckets, layout.identity,
            )  # fmt: skip
    log.info("stopped")
