"""The bulk input's codec (`POST /docs/_bulk`): NDJSON lines in, one result per line out.

Sans-IO: pure functions over bytes and documents. A bulk body is lines in the router's input
format (`{"id": ..., "doc": {...}}` or `{"id": ..., "deleted": true}`), numbered from 1; blank
lines are skipped and get no result. Each other line gets a result, in line order: where it was
appended (vbucket and seqno) or why it was not. A bad line never fails the others.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from indexer.router.documents import Document, DocumentError, routing_id, vbucket_of
from indexer.router.inputs.lines import parse_numbered

BULK_PATH = "/docs/_bulk"
WAITS = ("persisted", "visible")
DEFAULT_MAX_BULK_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class BulkLine:
    """One non-blank line of a bulk body: its number and bytes, and the document or the error."""

    number: int
    raw: bytes
    document: Document | None
    error: str | None


@dataclass(frozen=True, slots=True)
class BulkRequest:
    """The query of a bulk request: when to answer, for how long to wait for it, and which
    lines' items the answer lists ("all", or "errors" only: a loader needs no more)."""

    wait: str = "persisted"
    timeout_s: float = 30.0
    items: str = "all"


class BulkError(ValueError):
    """A bulk request that cannot be taken at all (its query): a 400 with this message."""


@dataclass
class BulkStatistics:
    """What `GET /stats` shows under `bulk`."""

    requests: int = 0
    lines: int = 0
    appended: int = 0
    failed: int = 0
    timeouts: int = 0  # wait=visible requests answered 504

    def count(self, appended: int, failed: int) -> None:
        """One request: the lines this router appended, and those it answered with an error
        (lines it sent on to their owner are theirs to count)."""
        self.requests += 1
        self.lines += appended + failed
        self.appended += appended
        self.failed += failed


def parse_query(query: dict[str, list[str]]) -> BulkRequest:
    """`wait=persisted|visible`, `timeout=SECONDS` and `items=all|errors`; anything else is a
    BulkError."""
    for name, values in query.items():
        if name not in ("wait", "timeout", "items"):
            raise BulkError(f"unknown parameter {name!r}: _bulk takes wait, timeout and items")
        if len(values) != 1:
            raise BulkError(f"{name} given {len(values)} times")
    wait = query.get("wait", ["persisted"])[0]
    if wait not in WAITS:
        raise BulkError(f"wait must be persisted or visible, not {wait!r}")
    text = query.get("timeout", ["30"])[0]
    try:
        timeout = float(text)
    except ValueError:
        raise BulkError(f"timeout must be a number of seconds, not {text!r}") from None
    if not 0 < timeout <= 3600:
        raise BulkError("timeout must be above 0 and at most 3600 seconds")
    items = query.get("items", ["all"])[0]
    if items not in ("all", "errors"):
        raise BulkError(f"items must be all or errors, not {items!r}")
    return BulkRequest(wait, timeout, items)


def split_lines(body: bytes) -> list[tuple[int, bytes]]:
    """The non-blank lines of a body with their numbers (from 1)."""
    return [(n, line) for n, line in enumerate(body.split(b"\n"), 1) if line.strip()]


def parse_bulk(lines: Iterable[tuple[int, bytes]]) -> list[BulkLine]:
    """Each numbered line parsed as the JSONL input parses it (its `_exp` checked too)."""
    out = []
    for number, raw in lines:
        try:
            document = parse_numbered(number, raw, "line")
        except DocumentError as exc:
            out.append(BulkLine(number, raw, None, str(exc)))
        else:
            out.append(BulkLine(number, raw, document, None if document else "a blank line"))
    return out


def groups(lines: Sequence[BulkLine], limit: int) -> Iterable[list[BulkLine]]:
    """The lines in order, cut into groups of at most `limit` bytes (one line at least)."""
    group: list[BulkLine] = []
    size = 0
    for line in lines:
        if group and size + len(line.raw) > limit:
            yield group
            group, size = [], 0
        group.append(line)
        size += len(line.raw)
    if group:
        yield group


def owner_of(raw: bytes, num_vbuckets: int) -> int | None:
    """The vbucket of a line's document, or None when the line has no readable id."""
    docid = routing_id(raw)
    return None if docid is None else vbucket_of(docid, num_vbuckets)


def join_lines(lines: Sequence[tuple[int, bytes]]) -> bytes:
    """Lines as a bulk body of their own (their numbers are the caller's to keep)."""
    return b"".join(raw.rstrip(b"\r\n") + b"\n" for _, raw in lines)


def document_of(line: BulkLine) -> Document:
    """The document of a good line."""
    assert line.document is not None, line.error
    return line.document


def docid_of(line: BulkLine) -> str | None:
    if line.document is not None:
        return line.document.docid
    docid = routing_id(line.raw)
    return None if docid is None else docid.decode("utf-8", "replace")


def appended_item(line: BulkLine, vbucket: int, seqno: int) -> dict[str, Any]:
    return {"line": line.number, "id": docid_of(line), "vbucket": vbucket, "seqno": seqno}


def error_item(line: BulkLine, error: str) -> dict[str, Any]:
    item: dict[str, Any] = {"line": line.number}
    docid = docid_of(line)
    if docid is not None:
        item["id"] = docid
    item["error"] = error
    return item


def raise_to(vector: dict[int, int], positions: Iterable[tuple[Any, int]]) -> None:
    """Raise an at_plus vector to these (vbucket, seqno) positions."""
    for vb, seqno in positions:
        vb = int(vb)
        if seqno > vector.get(vb, 0):
            vector[vb] = seqno


def answer(
    items: list[dict[str, Any]], appended: int, at_plus: dict[int, int], wait: str, took_s: float
) -> dict[str, Any]:
    """The bulk answer: the items in line order (every line's, or the bad ones' only), the
    counts and the at_plus vector (the highest seqno appended per vbucket)."""
    items.sort(key=lambda item: item["line"])
    failed = sum(1 for item in items if "error" in item)
    return {
        "took_s": round(took_s, 4),
        "wait": wait,
        "errors": failed > 0,
        "appended": appended,
        "failed": failed,
        "at_plus": {str(vb): at_plus[vb] for vb in sorted(at_plus)},
        "items": items,
    }


def renumber(items: Iterable[dict[str, Any]], numbers: Sequence[int]) -> list[dict[str, Any]]:
    """The items of a part of a bulk, sent as a body of its own (lines 1 to k), with the
    numbers those lines have in the whole body."""
    return [{**item, "line": numbers[item["line"] - 1]} for item in items]


def unanswered(lines: Sequence[tuple[int, bytes]], error: str, retry: bool) -> list[dict[str, Any]]:
    """An error item for each of these lines, which no router appended (`retry`: sending them
    again later may succeed, such as when their shard is starting again)."""
    out = []
    for number, raw in lines:
        item = error_item(BulkLine(number, raw, None, error), error)
        if retry:
            item["retry"] = True
        out.append(item)
    return out
