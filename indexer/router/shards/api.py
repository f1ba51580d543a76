"""The sharded router's HTTP API in the parent: documents and bulks forwarded to the shard
of their vbuckets, `/stats` and `/metrics` summed over the shards."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any
from urllib.parse import parse_qs

import httpx
import trio

from indexer.asgi import answer_lifespan
from indexer.metrics import process_started_at, version
from indexer.router.api import read_body
from indexer.router.inputs import bulk
from indexer.router.inputs.bulk import DEFAULT_MAX_BULK_BYTES
from indexer.router.inputs.bulk_forward import MARGIN_S, Forwarded, forward_lines
from indexer.router.shards.layout import ShardLayout
from indexer.router.shards.process import Shard
from indexer.router.source.log import describe_vbuckets

log = logging.getLogger("indexer.router")

PROXY_TIMEOUT_S = 30.0


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
