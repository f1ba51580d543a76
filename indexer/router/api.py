"""The router's HTTP API (an ASGI app): documents (`PUT`/`DELETE /docs/ID`, `POST
/docs/_bulk`), failovers, `/stats` and `/metrics`; every write goes through the appender, as the
other inputs' do."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

import httpx
import trio
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest

from indexer import protocol as p
from indexer.asgi import answer_lifespan, serve_asgi
from indexer.collector import CollectorPauses
from indexer.metrics import process_started_at, version
from indexer.router.documents import (
    Document,
    DocumentError,
    loads_document,
    vbucket_of,
)
from indexer.router.expiry import with_absolute_expiry
from indexer.router.inputs import bulk
from indexer.router.inputs.bulk import BULK_PATH, DEFAULT_MAX_BULK_BYTES, BulkStatistics
from indexer.router.inputs.bulk_forward import MARGIN_S, forward_lines
from indexer.router.inputs.postgres.follower import TableFollower
from indexer.router.metrics import RouterCollector
from indexer.router.source.appender import Appender, append_bytes
from indexer.router.source.log import SourceError, describe_vbuckets
from indexer.router.streams.node_stream import (
    NodeProgress,
)
from indexer.router.streams.nodes import Address, Nodes
from indexer.routes import ROUTER_ROUTES

log = logging.getLogger("indexer.router")

MAX_BODY = 1 << 20
MAX_DOCID_BYTES = 250
PARSE_SLICE_LINES = 4096  # of a bulk parsed between two checkpoints (about 20 ms)


class DocsApi:
    """The ASGI app of the router: PUT and DELETE /docs/ID, POST /failover/VB, GET /stats and
    GET /metrics (Prometheus text format, indexer/router/metrics.py).

    With a `token` (the router's --token, the one its nodes require), every call but GETs needs
    `Authorization: Bearer TOKEN`: otherwise 401 and nothing changes.
    """

    def __init__(
        self,
        appender: Appender,
        nodes: Nodes,
        token: str = "",
        collector: CollectorPauses | None = None,
        bulk_max_bytes: int = DEFAULT_MAX_BULK_BYTES,
        parent_url: str | None = None,
        postgres: TableFollower | None = None,
    ) -> None:
        self.appender = appender
        self.postgres = postgres  # the followed table, shown in /stats
        # A shard's parent: bulk lines of other shards' vbuckets go there, it sends them on.
        self.parent_url = parent_url
        self.client: httpx.AsyncClient | None = None  # made for the first forwarded bulk
        self.nodes = nodes
        self.token = token
        self.collector = collector
        self.bulk_max_bytes = bulk_max_bytes
        self.bulk = BulkStatistics()
        self.refused = 0
        self.started_at = process_started_at()
        self.version = version()
        # The app's own registry: two apps in one process (the tests) never share metrics.
        self.metrics = CollectorRegistry()
        self.metrics.register(RouterCollector(self))
        ProcessCollector(registry=self.metrics)

    async def __call__(
        self,
        scope: dict[str, Any],
        receive: Callable[[], Awaitable[dict[str, Any]]],
        send: Callable[[dict[str, Any]], Awaitable[None]],
    ) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send, self._close)
            return
        if scope["type"] != "http":
            return
        if scope["path"] == "/metrics" and scope["method"] == "GET":
            await send_metrics(send, generate_latest(self.metrics))
            return
        headers = [(b"content-type", b"application/json")]
        if self._authorized(scope):
            status, answer = await self.handle(scope["method"], scope, receive)
        else:
            status = 401
            answer = {"error": "this router requires Authorization: Bearer TOKEN for changes"}
            headers.append((b"www-authenticate", b'Bearer realm="indexer-router"'))
            # The refused request's body is read and dropped: answered with part of it unread,
            # the server closes the connection after the answer, and a client that sent its
            # next request on it meanwhile sees it disconnect without an answer.
            _, too_large = await read_body(receive)
            if too_large is not None:
                headers.append((b"connection", b"close"))
        body = json.dumps(answer).encode() + b"\n"
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _close(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    @property
    def progress(self) -> dict[str, NodeProgress]:
        """Each node's stream, by HOST:PORT (and HOST:PORT/build:NAME)."""
        return self.nodes.progress

    def _authorized(self, scope: dict[str, Any]) -> bool:
        """Whether the request may go on: a read, no token configured, or the right bearer
        token (compared in constant time; refusals are logged, never the token)."""
        if not self.token or scope["method"] in ("GET", "HEAD"):
            return True
        given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        refusal = p.bearer_refusal(given, self.token)
        if refusal is None:
            return True
        self.refused += 1
        method, path, client = scope["method"], scope["path"], scope.get("client") or ("?", 0)
        log.warning("refused %s %s from %s: %s", method, path, client[0], refusal[0])
        return False

    async def handle(
        self, method: str, scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]]
    ) -> tuple[int, dict[str, Any]]:
        """(status, JSON answer) of one request."""
        path: str = scope["path"]  # percent-decoded already
        if path == "/stats":
            if method != "GET":
                return 405, {"error": f"{method} is not allowed here: GET"}
            return 200, self.stats()
        if path == "/metrics":  # a GET is answered before this
            return 405, {"error": f"{method} is not allowed here: GET"}
        if path.startswith("/failover/"):
            if method != "POST":
                return 405, {"error": f"{method} is not allowed here: POST"}
            return await self.failover(path[len("/failover/") :], receive)
        if path == BULK_PATH and method == "POST":  # PUT and DELETE: the document "_bulk"
            return await self.bulk_append(scope, receive)
        if not path.startswith("/docs/"):
            routes = ", ".join(f"{r.method} {r.path}" for r in ROUTER_ROUTES)
            return 404, {"error": f"not found: the routes are {routes}"}
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
                value = loads_document(body)
            except DocumentError as exc:
                return 400, {"error": f"the document cannot be indexed: {exc}"}
            except ValueError as exc:
                return 400, {"error": f"the body is not JSON: {exc}"}
            if not isinstance(value, dict):
                return 400, {"error": "the body must be a JSON object (the document)"}
            document = Document(docid, value)
            try:
                with_absolute_expiry(document, 0.0)
            except DocumentError as exc:
                return 400, {"error": str(exc)}
        if not self.appender.owns(docid):
            source = self.appender.source
            assert source.vbuckets is not None
            return 421, {
                "error": f"document {docid!r} is in vbucket "
                f"{vbucket_of(docid.encode(), source.num_vbuckets)}, not among this router's "
                f"{describe_vbuckets(source.vbuckets)}: send it to the router that owns it"
            }
        ((vbucket, seqno),) = await self.appender.append([document])
        return 200, {"vbucket": vbucket, "seqno": seqno}

    async def bulk_append(
        self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]]
    ) -> tuple[int, dict[str, Any]]:
        """POST /docs/_bulk: every good line appended (synced) in line order, a result per line;
        with wait=visible, answered once the nodes can read them (indexer/router/inputs/bulk.py)."""
        started = time.monotonic()
        try:
            request = bulk.parse_query(parse_qs(scope.get("query_string", b"").decode("latin-1")))
        except bulk.BulkError as exc:
            return 400, {"error": str(exc)}
        body, error = await read_body(receive, self.bulk_max_bytes, "bulk")
        if error is not None:
            return error
        numbered = bulk.split_lines(body)
        del body
        lines: list[bulk.BulkLine] = []
        for start in range(0, len(numbered), PARSE_SLICE_LINES):
            # A big bulk is parsed a slice at a time: the streams and the nodes' acks go on
            # between (the JSONL input does the same per read).
            lines += bulk.parse_bulk(numbered[start : start + PARSE_SLICE_LINES])
            await trio.lowlevel.checkpoint()
        items: list[dict[str, Any]] = []
        mine: list[bulk.BulkLine] = []
        foreign: list[tuple[int, bytes]] = []
        source = self.appender.source
        owns_all = source.vbuckets is None
        for line in lines:
            if line.document is None:
                items.append(bulk.error_item(line, line.error or "bad line"))
            elif owns_all or self.appender.owns(line.document.docid):
                mine.append(line)
            elif self.parent_url is not None:
                foreign.append((line.number, line.raw))
            else:
                assert source.vbuckets is not None
                vb = vbucket_of(line.document.docid.encode(), source.num_vbuckets)
                ours = describe_vbuckets(source.vbuckets)
                reason = f"vbucket {vb} is not among this router's {ours}: send it to its owner"
                items.append(bulk.error_item(line, reason))
        own_failures = len(items)
        forwarded = None
        if foreign:
            if self.client is None:
                self.client = httpx.AsyncClient()
            forwarded = await forward_lines(
                self.client,
                self.parent_url,
                "the parent router",
                foreign,
                scope.get("query_string", b""),
                scope["headers"],
                request.timeout_s + MARGIN_S,
            )
            items.extend(forwarded.items)
        at_plus: dict[int, int] = {}
        if forwarded is not None:
            bulk.raise_to(at_plus, forwarded.at_plus.items())
        limit = append_bytes(self.appender.mm.capacity)
        for group in bulk.groups(mine, limit):
            positions = await self.appender.append([bulk.document_of(line) for line in group])
            bulk.raise_to(at_plus, positions)
            if request.items == "all":
                items.extend(
                    bulk.appended_item(line, vb, seqno)
                    for line, (vb, seqno) in zip(group, positions, strict=True)
                )
        appended = len(mine) + (forwarded.appended if forwarded is not None else 0)
        answer = bulk.answer(items, appended, at_plus, request.wait, 0.0)
        self.bulk.count(len(mine), own_failures)
        late = [forwarded.error] if forwarded is not None and forwarded.status == 504 else []
        if request.wait == "visible":
            # The others' owners waited for theirs.
            targets = {vb: seqno for vb, seqno in at_plus.items() if source.owns(vb)}
            lagging = await self.appender.visibility.wait(targets, request.timeout_s)
            if lagging:
                late.insert(
                    0,
                    f"appended, but not readable within {request.timeout_s:g} s: "
                    + ", ".join(lagging),
                )
        if late:
            self.bulk.timeouts += 1
            answer["error"] = "; ".join(late)
            answer["took_s"] = round(time.monotonic() - started, 4)
            return 504, answer
        answer["took_s"] = round(time.monotonic() - started, 4)
        return 200, answer

    async def failover(
        self, vbucket_text: str, receive: Callable[[], Awaitable[dict[str, Any]]]
    ) -> tuple[int, dict[str, Any]]:
        """Simulate a failover of one vbucket's source (tests, demos): new vbuuid, history
        after the chosen seqno discarded; every node handshakes again and may roll back."""
        if not vbucket_text.isdigit():
            return 400, {"error": f"the vbucket must be a number, not {vbucket_text!r}"}
        if not self.appender.source.owns(int(vbucket_text)):
            return 421, {"error": f"vbucket {vbucket_text} is not among this router's"}
        body, error = await read_body(receive)
        if error is not None:
            return error
        seqno = None
        if body.strip():
            try:
                value = json.loads(body)
            except ValueError as exc:
                return 400, {"error": f"the body is not JSON: {exc}"}
            if not isinstance(value, dict) or set(value) - {"seqno"}:
                return 400, {"error": 'the body must be {"seqno": N} or empty'}
            seqno = value.get("seqno")
            if seqno is not None and (type(seqno) is not int or seqno < 0):
                return 400, {"error": "seqno must be a whole number >= 0"}
        try:
            vbuuid, at = await self.appender.failover(int(vbucket_text), seqno)
        except SourceError as exc:
            return 400, {"error": str(exc)}
        self.nodes.reconnect_all()
        log.warning("vbucket %s failed over at seqno %d (vbuuid %d)", vbucket_text, at, vbuuid)
        return 200, {"vbucket": int(vbucket_text), "vbuuid": vbuuid, "seqno": at}

    def stats(self) -> dict[str, Any]:
        """The version and uptime, the Mutation Manager's sizes and counters, and each node's
        connection."""
        source = self.appender.source
        return {
            "version": self.version,
            "uptime_s": round(time.time() - self.started_at, 3),
            "source_id": source.identity,
            # A peer's range of vbuckets (null: all), and the input documents left to its peers.
            "vbuckets": None if source.vbuckets is None else describe_vbuckets(source.vbuckets),
            "foreign_documents": self.appender.foreign,
            "mutation_manager": dataclasses.asdict(self.appender.mm.stats()),
            "nodes": {
                name: dataclasses.asdict(progress) for name, progress in self.nodes.progress.items()
            },
            "http_refused": self.refused,
            "bulk": dataclasses.asdict(self.bulk),
            "collector": (
                None if self.collector is None else dataclasses.asdict(self.collector.statistics())
            ),
            "expiry": {
                "pending": source.pending_expiries,
                "expired": self.appender.expired,
            },
            "postgres": None if self.postgres is None else self.postgres.progress.as_json(),
            "source": {
                "vbuckets": source.num_vbuckets,
                "vbuckets_used": len(source.vbuckets_with_history()),
                "high_seqno_sum": sum(
                    source.high_seqno(vb) for vb in source.vbuckets_with_history()
                ),
            },
        }


async def send_metrics(send: Callable[[dict[str, Any]], Awaitable[None]], body: bytes) -> None:
    """Answer 200 with a Prometheus text exposition."""
    headers = [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def read_body(
    receive: Callable[[], Awaitable[dict[str, Any]]],
    limit: int = MAX_BODY,
    what: str = "document",
) -> tuple[bytes, tuple[int, dict[str, Any]] | None]:
    """The request body, or the error answer when it is over `limit` bytes."""
    pieces: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        piece = message.get("body", b"")
        size += len(piece)
        if size > limit:
            return b"", (413, {"error": f"the body is over the {what} limit of {limit} bytes"})
        pieces.append(piece)
        if not message.get("more_body"):
            return b"".join(pieces), None


async def serve_http(
    address: Address,
    appender: Appender,
    nodes: Nodes,
    token: str = "",
    collector: CollectorPauses | None = None,
    bulk_max_bytes: int = DEFAULT_MAX_BULK_BYTES,
    parent_url: str | None = None,
    postgres: TableFollower | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The documents API until cancelled; reports the bound address. With a token, changes
    need it as a bearer token."""
    app = DocsApi(appender, nodes, token, collector, bulk_max_bytes, parent_url, postgres)
    await serve_asgi(address, app, "indexer.router.http", task_status=task_status)
