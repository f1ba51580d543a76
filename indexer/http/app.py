"""The ASGI application of the daemon's HTTP API: routing and the token check."""

from __future__ import annotations

import logging
import time

from prometheus_client import generate_latest

from indexer.asgi import answer_lifespan
from indexer.client import AUTHORIZATION, RETRY_AFTER
from indexer.config import check_index_name
from indexer.http.changes import ChangeRoutes
from indexer.http.wire import (
    ACTION_PARAMS,
    BUILD_ROUTE,
    DEFAULT_LEASE_S,
    INDEX_ACTIONS,
    LEASE_ROUTE,
    MAX_LEASE_S,
    PIN_ROUTE,
    READ_METHODS,
    ROUTE_PARAMS,
    ROUTES,
    ApiError,
    Receive,
    Scope,
    Send,
    _body_json,
    _headers_only,
    _json,
    _number,
    _only,
    _params,
    _query,
    _respond,
)
from indexer.protocol import bearer_refusal
from indexer.scans import ScanRequestError

log = logging.getLogger("indexer.http")


class HttpApi(ChangeRoutes):
    """The ASGI application: routing and the token check, then each job's methods."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if scope["method"] == "HEAD":
            send = _headers_only(send)
        try:
            await self._route(scope, receive, send)
        except ApiError as exc:
            await _json(send, exc.status, {"error": exc.message}, exc.headers)
        except ScanRequestError as exc:
            await _json(send, 400, {"error": str(exc)})
        except Exception as exc:  # a bug must cost one request, never the daemon
            log.exception("%s %s failed", scope["method"], scope["path"])
            await _json(send, 500, {"error": f"internal error: {type(exc).__name__}"})

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        method = scope["method"]
        path = scope["path"].rstrip("/") or "/"
        query = _query(scope["query_string"])
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        self._authorize(scope, method, path, headers)
        if path in ROUTES or PIN_ROUTE.match(path) or LEASE_ROUTE.match(path):
            # /indexes/NAME... checks its own
            _params(query, ROUTE_PARAMS, path)
        if path == "/health":
            _only(method, "GET", "HEAD")
            if not self.view.ready:
                raise ApiError(503, "starting", {RETRY_AFTER: "1"})
            await _json(send, 200, {"status": "ok"})
        elif path == "/stats":
            _only(method, "GET")
            await self.measure_disk()
            await _json(send, 200, self.stats())
        elif path == "/metrics":
            _only(method, "GET")
            await self.measure_disk()
            body = generate_latest(self.metrics)
            await _respond(send, 200, body, "text/plain; version=0.0.4; charset=utf-8")
        elif path == "/indexes":
            if method == "POST":
                await self.create_index(await _body_json(receive), send)
                return
            _only(method, "GET")
            await _json(send, 200, {"indexes": self.index_list()})
        elif path == BUILD_ROUTE:  # "_build" is no index name: it cannot shadow one
            _only(method, "POST")
            await self.build_indexes(await _body_json(receive), send)
        elif path.startswith("/indexes/"):
            await self._index_route(method, path, query, headers, send)
        elif path == "/compact":
            _only(method, "POST")
            if self.view.compactor is None:
                raise ApiError(503, "compaction is not available")
            result = await self.view.compactor.compact()
            await _json(send, 200, result.as_dict())
        elif match := LEASE_ROUTE.match(path):
            _only(method, "PUT", "DELETE")
            if method == "PUT":
                await self.hold_changes(match.group(1), await _body_json(receive), send)
            else:
                await self.release_changes(match.group(1), send)
        elif path == "/snapshots":
            _only(method, "GET")
            await _json(send, 200, self.snapshot_list())
        elif path == "/snapshots/pin":
            _only(method, "POST")
            await self.pin(await _body_json(receive), send)
        elif match := PIN_ROUTE.match(path):
            pin_id = match.group(1)
            if match.group(2):  # POST /snapshots/ID/renew {"lease_s": ...}
                _only(method, "POST")
                request = await _body_json(receive)
                lease = _number(request.get("lease_s", DEFAULT_LEASE_S), "lease_s", 1, MAX_LEASE_S)
                if self.view.snapshots.renew(pin_id, lease) is None:
                    raise ApiError(404, f"no pin {pin_id!r} (released or expired)")
                await _json(send, 200, {"id": pin_id, "lease_s": lease})
                return
            _only(method, "DELETE")
            if not self.view.snapshots.unpin(pin_id):
                raise ApiError(404, f"no pin {pin_id!r} (released or expired)")
            await _respond(send, 204, b"", "text/plain")
        else:
            raise ApiError(404, f"no such route: {path}")

    async def _index_route(
        self, method: str, path: str, query: dict[str, str], headers: dict[str, str], send: Send
    ) -> None:
        """GET and DELETE /indexes/NAME and GET /indexes/NAME/(scan|count|splits|types); a name that
        is not an index name is a 400, whatever follows it."""
        name, _, action = path[len("/indexes/") :].partition("/")
        problem = check_index_name(name)
        if problem is not None:
            raise ApiError(400, problem)
        if not action:
            _only(method, "GET", "DELETE")
            _params(query, ROUTE_PARAMS, path)
            if method == "GET":
                await _json(send, 200, await self.index_details(name))
                return
            await self._catalog_call(self._catalog().drop(name))
            await _respond(send, 204, b"", "text/plain")
            return
        action, _, docid = action.partition("/")  # /indexes/NAME/docs/ID
        if (action == "docs") != bool(docid):
            raise ApiError(404, f"no such route: {path} (a document is /indexes/NAME/docs/ID)")
        if action not in INDEX_ACTIONS:
            raise ApiError(
                404,
                f"no such route: {path} (an index has /scan, /count, /aggregate, /splits, /types, "
                "/changes, /docs/ID)",
            )
        _only(method, "GET")
        _params(query, ACTION_PARAMS[action], f"/indexes/NAME/{action}")
        with self._scan_slot():
            index = self._index(name, query)
            if action == "splits":
                await self.split(index, query, send)
                return
            if action == "types":
                await self.types(index, query, send)
                return
            if action == "docs":
                await self.lookup(index, docid, query, send)
                return
            if action == "aggregate":
                await self.aggregate(index, query, headers, send)
                return
            if action == "changes":
                await self.changes(index, query, headers, send)
                return
            started = time.perf_counter()
            rows = await self.scan(index, query, headers, send, count_only=action == "count")
            self._served(name, rows, time.perf_counter() - started)

    def _authorize(self, scope: Scope, method: str, path: str, headers: dict[str, str]) -> None:
        """Refuse (401) a call that needs the token and lacks it; log why, never the token."""
        token = self.security.token
        if token is None or path == "/health":
            return
        if method in READ_METHODS and not self.security.scan_token_required:
            return
        refusal = bearer_refusal(headers.get(AUTHORIZATION, ""), token)
        if refusal is None:
            return
        reason, error = refusal
        self.refused["unauthorized"] += 1
        client = scope.get("client")
        who = f"{client[0]}:{client[1]}" if client else "unknown"
        log.warning("HTTP %s %r from %s refused: %s", method, path, who, reason)
        challenge = 'Bearer realm="indexer"' + (f', error="{error}"' if error else "")
        raise ApiError(
            401,
            f"{reason}: this call needs Authorization: Bearer TOKEN (the daemon's security.token)",
            {"www-authenticate": challenge},
        )
