"""Sending part of a bulk to the router that owns its vbuckets: a sharded router's parent to its
shards, and a shard to its parent for the lines of other shards. The answer comes back with the
lines' numbers in the whole body, so the caller merges it with its own items."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from indexer.router.inputs import bulk

FORWARDED_HEADERS = (b"authorization", b"content-type")
MARGIN_S = 30.0  # beyond a wait's timeout: the owner appends, waits, then answers
# A shard's environment: its parent's API, where lines of other shards' vbuckets go.
PARENT_URL_ENV = "INDEXER_ROUTER_PARENT_URL"


@dataclass
class Forwarded:
    """What the owner answered for the lines sent to it."""

    items: list[dict[str, Any]]
    at_plus: dict[str, int] = field(default_factory=dict)
    appended: int = 0
    status: int = 200  # the owner's status: 401 and 504 are the whole request's
    error: str = ""  # the owner's error text when it gave one


async def forward_lines(
    client: httpx.AsyncClient,
    url: str | None,
    owner: str,
    lines: Sequence[tuple[int, bytes]],
    query_string: bytes,
    headers: Sequence[tuple[bytes, bytes]],
    timeout_s: float,
) -> Forwarded:
    """POST the lines to the owner's /docs/_bulk (`url` None: it is not running now), waiting
    at most `timeout_s` for its answer."""
    if url is None:
        return Forwarded(bulk.unanswered(lines, f"{owner} is starting again: retry", True))
    target = url + bulk.BULK_PATH + ("?" + query_string.decode("latin-1") if query_string else "")
    kept = [(k, v) for k, v in headers if k.lower() in FORWARDED_HEADERS]
    try:
        answer = await client.post(
            target, content=bulk.join_lines(lines), headers=kept, timeout=timeout_s
        )
    except httpx.HTTPError as exc:
        return Forwarded(bulk.unanswered(lines, f"{owner} did not answer: {exc}: retry", True))
    try:
        value = answer.json()
    except ValueError:
        value = {}
    if answer.status_code in (200, 504) and isinstance(value.get("items"), list):
        numbers = [number for number, _ in lines]
        return Forwarded(
            bulk.renumber(value["items"], numbers),
            value.get("at_plus", {}),
            int(value.get("appended", 0)),
            answer.status_code,
            value.get("error", ""),
        )
    error = value.get("error") or f"HTTP {answer.status_code}"
    retry = answer.status_code in (429, 502, 503)
    failed = Forwarded(
        bulk.unanswered(lines, f"{owner}: {error}", retry), {}, 0, answer.status_code
    )
    failed.error = error
    return failed
