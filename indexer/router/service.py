"""The long-running router (`indexer router`): inputs append to the source log, and one task per
indexer node streams the log to it and then each append as it comes.

The inputs are a JSONL file (read to its end, or followed like `tail -f`) and a small HTTP API
(`PUT /docs/ID`, `DELETE /docs/ID`). Every document is appended to the `SourceLog`, which gives
it its vbucket and seqno, and the append wakes the node tasks. A node task holds one connection
(`feed.follow_log`) and reconnects with backoff when the indexer is down, restarts or asks to
handshake again, resuming from the restart positions of the new handshake.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from indexer import protocol as p
from indexer.router.documents import Document, DocumentError, parse_line, vbucket_of
from indexer.router.feed import RECONNECT_CODES, FeedError, follow_log
from indexer.router.source import SourceLog

log = logging.getLogger("indexer.router")

ROUTER_NAME = "indexer-router"
READ_BYTES = 1 << 20  # of the JSONL input per read, appended as one synced batch
POLL_S = 0.2  # how often a followed file at its end is looked at again
BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 5.0
STEADY_S = 2.0  # a connection up this long resets the backoff
MAX_BODY = 1 << 20
MAX_DOCID_BYTES = 250

Address = tuple[str, int]


@dataclass(frozen=True)
class RouterOptions:
    """What `indexer router` runs: its indexer nodes and inputs."""

    targets: Sequence[Address]
    jsonl: Path | None = None
    follow: bool = False
    http: Address | None = None
    router_name: str = ROUTER_NAME


class LineSplitter:
    """Bytes in, numbered complete lines out (sans-IO); a partial last line waits for the rest."""

    def __init__(self) -> None:
        self.partial = b""
        self.number = 0

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        """The lines `data` completes, with their 1-based numbers."""
        *lines, self.partial = (self.partial + data).split(b"\n")
        return self._numbered(lines)

    def finish(self) -> list[tuple[int, bytes]]:
        """At the end of an input that is not followed: the last line, if it has no newline."""
        lines, self.partial = [self.partial] if self.partial else [], b""
        return self._numbered(lines)

    def _numbered(self, lines: list[bytes]) -> list[tuple[int, bytes]]:
        out = []
        for line in lines:
            self.number += 1
            out.append((self.number, line))
        return out


def parse_lines(lines: Sequence[tuple[int, bytes]], where: str) -> tuple[list[Document], list[str]]:
    """The documents of numbered JSONL lines, and one message per bad line; blanks skipped."""
    documents = []
    errors = []
    for number, raw in lines:
        try:
            text = raw.decode("utf-8")
            if text.strip():
                documents.append(parse_line(text, f"{where}:{number}"))
        except UnicodeDecodeError:
            errors.append(f"{where}:{number}: not UTF-8")
        except DocumentError as exc:
            errors.append(str(exc))
    return documents, errors


class Appender:
    """Appends documents to the source log, one batch at a time, and wakes who waits for more."""

    def __init__(self, source: SourceLog) -> None:
        self.source = source
        self.lock = trio.Lock()
        self._changed = trio.Event()

    def next_change(self) -> trio.Event:
        """The event the next append sets."""
        return self._changed

    async def append(self, documents: Sequence[Document]) -> list[tuple[int, int]]:
        """Append (one synced batch, off the event loop); the (vbucket, seqno) of each document."""
        if not documents:
            return []
        async with self.lock:
            # The log's in-memory state changes in one step after the batch is written, so the
            # streaming tasks read either the log before this batch or after it.
            positions = await trio.to_thread.run_sync(self._append, documents)
        self._changed.set()
        self._changed = trio.Event()
        return positions

    def _append(self, documents: Sequence[Document]) -> list[tuple[int, int]]:
        n = self.source.num_vbuckets
        highs: dict[int, int] = {}
        positions = []
        for document in documents:
            vb = vbucket_of(document.docid.encode(), n)
            seqno = highs.get(vb, self.source.high_seqno(vb)) + 1
            highs[vb] = seqno
            positions.append((vb, seqno))
        self.source.append(documents)
        return positions


async def read_jsonl_input(path: Path, follow: bool, appender: Appender) -> None:
    """Append the file's documents; with `follow`, keep reading what is appended to it.

    A bad line is logged and skipped. A followed file that shrinks was truncated: it is read
    again from the start.
    """
    splitter = LineSplitter()
    where = str(path)
    total = 0
    async with await trio.open_file(path, "rb") as f:
        offset = 0
        while True:
            data = await f.read(READ_BYTES)
            lines = splitter.feed(data) if data else []
            if not data and not follow:
                lines = splitter.finish()
            offset += len(data)
            documents, errors = parse_lines(lines, where)
            for error in errors:
                log.error("skipped a bad input line: %s", error)
            await appender.append(documents)
            total += len(documents)
            if data:
                continue
            if not follow:
                log.info("read %d documents from %s", total, where)
                return
            await trio.sleep(POLL_S)
            size = (await trio.to_thread.run_sync(os.stat, path)).st_size
            if size < offset:
                log.warning("%s was truncated: reading it again from the start", where)
                await f.seek(0)
                offset = 0
                splitter = LineSplitter()


async def stream_to_node(
    address: Address, source: SourceLog, appender: Appender, router_name: str = ROUTER_NAME
) -> None:
    """Keep the node fed until cancelled: connect, stream, reconnect with backoff on errors."""
    host, port = address
    name = f"{host}:{port}"
    backoff = BACKOFF_MIN_S
    last_failure = ""
    while True:
        connected: float | None = None  # when the handshake was answered

        def on_connected(reply: p.HandshakeReply, pending: int) -> None:
            nonlocal connected
            connected = trio.current_time()
            restart = sum(position.seqno for position in reply.restart)
            log.info(
                "%s: connected; resuming from restart seqno sum %d, %d mutations to send",
                name,
                restart,
                pending,
            )

        def on_rollback(vbucket: int, seqno: int) -> None:
            log.warning("%s: vbucket %d: the indexer rolled back to seqno %d", name, vbucket, seqno)

        try:
            await follow_log(
                host,
                port,
                source,
                appender.next_change,
                router_name=router_name,
                on_rollback=on_rollback,
                on_connected=on_connected,
            )
        except (FeedError, OSError) as exc:
            code = exc.code if isinstance(exc, FeedError) else None
            delay = backoff
            if connected is not None:
                if trio.current_time() - connected >= STEADY_S:
                    backoff = BACKOFF_MIN_S  # a connection that worked a while: start over
                delay = 0 if code in RECONNECT_CODES else backoff
                log.warning("%s: disconnected: %s", name, exc)
                last_failure = ""
            elif str(exc) != last_failure:  # once per kind of failure while it lasts
                log.warning("%s: %s; retrying", name, exc)
                last_failure = str(exc)
            backoff = min(backoff * 2, BACKOFF_MAX_S)
            await trio.sleep(delay)


class DocsApi:
    """The ASGI app of the router's input: PUT and DELETE /docs/ID."""

    def __init__(self, appender: Appender) -> None:
        self.appender = appender

    async def __call__(
        self,
        scope: dict[str, Any],
        receive: Callable[[], Awaitable[dict[str, Any]]],
        send: Callable[[dict[str, Any]], Awaitable[None]],
    ) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        status, answer = await self.handle(scope["method"], scope, receive)
        body = json.dumps(answer).encode() + b"\n"
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def handle(
        self, method: str, scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]]
    ) -> tuple[int, dict[str, Any]]:
        """(status, JSON answer) of one request."""
        path: str = scope["path"]  # percent-decoded already
        if not path.startswith("/docs/"):
            return 404, {"error": "not found: the routes are PUT and DELETE /docs/ID"}
        docid = path[len("/docs/") :]
        if method not in ("PUT", "DELETE"):
            return 405, {"error": f"{method} is not allowed here: PUT or DELETE"}
        if not docid or len(docid.encode()) > MAX_DOCID_BYTES:
            return 400, {"error": f"the document id must be 1 to {MAX_DOCID_BYTES} bytes"}
        if method == "DELETE":
            document = Document(docid, None)
        else:
            body, error = await read_body(receive)
            if error is not None:
                return error
            try:
                value = json.loads(body)
            except ValueError as exc:
                return 400, {"error": f"the body is not JSON: {exc}"}
            if not isinstance(value, dict):
                return 400, {"error": "the body must be a JSON object (the document)"}
            document = Document(docid, value)
        ((vbucket, seqno),) = await self.appender.append([document])
        return 200, {"vbucket": vbucket, "seqno": seqno}


async def read_body(
    receive: Callable[[], Awaitable[dict[str, Any]]],
) -> tuple[bytes, tuple[int, dict[str, Any]] | None]:
    """The request body, or the error answer when it is over MAX_BODY bytes."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if len(body) > MAX_BODY:
            return b"", (413, {"error": f"the body is over {MAX_BODY} bytes"})
        if not message.get("more_body"):
            return body, None


async def serve_http(
    address: Address,
    appender: Appender,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The documents API under hypercorn until cancelled; reports the bound address."""
    from hypercorn.config import Config as HypercornConfig
    from hypercorn.trio import serve as hypercorn_serve

    host, port = address
    hyper = HypercornConfig()
    hyper.bind = [f"{host}:{port}"]
    hyper.accesslog = None
    hyper.errorlog = logging.getLogger("indexer.router.http")
    hyper.graceful_timeout = 1.0
    app = DocsApi(appender)

    async def started(task_status: trio.TaskStatus[list[str]]) -> None:
        await hypercorn_serve(app, hyper, mode="asgi", task_status=task_status)  # type: ignore[arg-type]

    async with trio.open_nursery() as nursery:
        binds = await nursery.start(started)
        task_status.started(binds[0] if binds else f"http://{host}:{port}")


async def run_router(source: SourceLog, options: RouterOptions) -> None:
    """Run the router until SIGINT or SIGTERM; then close the connections and return."""
    appender = Appender(source)
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            for address in options.targets:
                nursery.start_soon(stream_to_node, address, source, appender, options.router_name)
            if options.http is not None:
                url = await nursery.start(serve_http, options.http, appender)
                log.info("documents API on %s (PUT and DELETE /docs/ID)", url)
            if options.jsonl is not None:
                nursery.start_soon(read_jsonl_input, options.jsonl, options.follow, appender)
            log.info(
                "router running: source log in %s, %d vbuckets; streaming to %s",
                source.path,
                source.num_vbuckets,
                ", ".join(f"{host}:{port}" for host, port in options.targets),
            )
            async for signum in signals:
                log.info("%s received: stopping", signal.Signals(signum).name)
                nursery.cancel_scope.cancel()
                break
    log.info("stopped")
