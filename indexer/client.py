"""The one client of the daemon's HTTP API: how a caller presents its token and checks TLS
(`Access`), what an error answer says (`error_text`), when a 503 may be retried
(`retry_after`), and one request with those rules (`request`, on the standard library so that
Spark executors need nothing more). The CLI, the cluster scan and the Spark source all use it;
the header names and media types are the server's too (`indexer/http.py`).
"""

from __future__ import annotations

import dataclasses
import json
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Header names and media types of the API, for the server and its clients alike.
AUTHORIZATION = "authorization"
RETRY_AFTER = "retry-after"
SNAPSHOT_HEADER = "x-indexer-snapshot"  # the snapshot a scan read
SEQNO_SUM_HEADER = "x-indexer-seqno-sum"  # and the sum of its seqnos
VBUCKETS_HEADER = "x-indexer-vbuckets"  # the vbuckets whose documents it holds, as ranges
ACTIVE_HEADER = "x-indexer-active"  # in a cluster in etcd: those it is the active node of
NEXT_HEADER = "x-indexer-next"  # a full page's continuation token (pass it as next=)
JSON = "application/json"
IDEMPOTENT = ("GET", "HEAD", "PUT", "DELETE")  # sent again once if the server closed unanswered
NDJSON = "application/x-ndjson"
ARROW_STREAM = "application/vnd.apache.arrow.stream"

MAX_RETRY_WAIT_S = 10.0  # the longest Retry-After a client honours before asking again


class ClientError(Exception):
    """A call to the daemon failed: it could not be reached, or it answered with an error.
    The message is one line naming the daemon and the cause; `status` is the HTTP status of
    the answer (None: no answer)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def index_path(name: str, *rest: str) -> str:
    """The URL path of an index's resource: `/indexes/NAME/REST...`, the name quoted (a
    primary index is `#primary`, which a URL must not take for a fragment)."""
    return "/".join(("/indexes", urllib.parse.quote(name, safe=""), *rest))


def bearer(token: str | None) -> dict[str, str]:
    """The Authorization header of a token (none without one)."""
    return {AUTHORIZATION: f"Bearer {token}"} if token else {}


@dataclass(frozen=True)
class Access:
    """How requests reach a daemon: the bearer token of its `[security]`, the CA certificates
    (PEM text, so that it travels to Spark executors) its TLS certificate must chain to, and
    whether cluster map nodes are asked over HTTPS. The token is kept out of reprs."""

    token: str | None = dataclasses.field(default=None, repr=False)
    ca_pem: str | None = None
    tls: bool = False

    def headers(self) -> dict[str, str]:
        return bearer(self.token)

    def context(self) -> ssl.SSLContext | None:
        """The TLS context checking the daemon: the given CAs, else None (the system's)."""
        if self.ca_pem is None:
            return None
        context = ssl.create_default_context(cadata=self.ca_pem)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        return context


def error_text(body: bytes | str, fallback: str = "") -> str:
    """What an error answer says: its JSON `{"error": ...}`, else its text (cut to a line)."""
    try:
        message = json.loads(body)["error"]
        if isinstance(message, str):
            return message
    except (ValueError, KeyError, TypeError):
        pass
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    return text.strip()[:200] or fallback


def retry_after(status: int, headers: Mapping[str, str]) -> float | None:
    """Seconds to wait before asking again after a 503 that says when (bounded), else None."""
    if status != 503:
        return None
    value = next((v for k, v in headers.items() if k.lower() == RETRY_AFTER), "")
    try:
        return min(max(float(value), 0.1), MAX_RETRY_WAIT_S)
    except ValueError:
        return None


def request(
    method: str,
    url: str,
    path: str,
    *,
    params: Mapping[str, Any] | None = None,
    body: Any = None,
    content: bytes | None = None,
    content_type: str = JSON,
    accept: str = JSON,
    timeout: float = 120.0,
    access: Access | None = None,
) -> Any:
    """Send one request; the open response on 2xx, else ClientError naming the cause.

    The body is `body` as JSON, or `content` as it is (of `content_type`). A 503 with
    Retry-After (starting, no snapshot yet, short of memory) is asked again until `timeout`
    seconds have passed. `access` adds the bearer token and checks TLS with its CAs.
    """
    query = ("?" + urllib.parse.urlencode(params)) if params else ""
    data = json.dumps(body).encode() if body is not None else content
    deadline = time.monotonic() + timeout
    access = access or Access()
    context = access.context()
    retried = method not in IDEMPOTENT  # a request sent once may not be sent again
    while True:
        call = urllib.request.Request(url + path + query, data=data, method=method)
        call.add_header("Accept", accept)
        for name, value in access.headers().items():
            call.add_header(name, value)
        if data is not None:
            call.add_header("Content-Type", content_type)
        try:
            return urllib.request.urlopen(call, timeout=timeout, context=context)
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            wait = retry_after(exc.code, dict(exc.headers.items()))
            if wait is not None and time.monotonic() + wait < deadline:
                time.sleep(wait)
                continue
            message = error_text(raw, str(exc.reason))
            raise ClientError(
                f"indexer at {url}: {method} {path}: HTTP {exc.code}: {message}", exc.code
            ) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, ConnectionResetError) and not retried:
                # The server closed the connection before answering (a restart, a kept-alive
                # connection closed as the request came): an idempotent request goes once more.
                retried = True
                continue
            raise ClientError(f"cannot reach the indexer at {url}: {reason}") from None


def call_json(method: str, url: str, path: str, **kwargs: Any) -> Any:
    """`request` and its JSON answer."""
    with request(method, url, path, **kwargs) as response:
        return json.loads(response.read())
