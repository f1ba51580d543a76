"""Document expiry: the `_exp` property, read as Sync Gateway and memcached read it (pure).

`_exp` may be a number of seconds (a time to live when under 30 days, else a unix time), the
same number as a string, an ISO-8601 date, or null (no expiry); 0 means no expiry. The router
stores the absolute unix time in the document when it appends it, so a replay or a backfill
later expires it at the same moment. The router's expiry pager (`SourceLog.due_expiries` and
`Appender.expire`) then deletes the document once that time has passed, as Couchbase's KV engine
does: the expiration travels as a delete, with its own seqno, to every node.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

from indexer.router.documents import Document, DocumentError

EXPIRY_FIELD = "_exp"
RELATIVE_LIMIT_S = 30 * 24 * 3600
"""Below this, a number is seconds from now; from it on, a unix time (memcached's rule)."""


def absolute_expiry(value: Any, now: float) -> int | None:
    """The unix time (whole seconds) an `_exp` value means, or None for no expiry."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise DocumentError(f"{EXPIRY_FIELD}: {value!r} is not a time")
    if isinstance(value, str):
        text = value.strip()
        try:
            value = float(text)
        except ValueError:
            try:
                date = datetime.fromisoformat(text.replace("Z", "+00:00"))
            except ValueError:
                raise DocumentError(
                    f"{EXPIRY_FIELD}: {value!r} is neither seconds nor an ISO-8601 date"
                ) from None
            if date.tzinfo is None:
                date = date.replace(tzinfo=UTC)
            return max(1, math.ceil(date.timestamp()))
    if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise DocumentError(f"{EXPIRY_FIELD}: {value!r} is not a time (seconds >= 0)")
    if value == 0:
        return None
    if value < RELATIVE_LIMIT_S:
        return math.ceil(now + value)
    return math.ceil(value)


def with_absolute_expiry(document: Document, now: float) -> Document:
    """The document with its `_exp` as an absolute unix time (unchanged without one)."""
    if not document.has_expiry:
        return document
    body = document.body
    assert body is not None
    when = absolute_expiry(body[EXPIRY_FIELD], now)
    if when is None or body[EXPIRY_FIELD] == when:
        return document  # no expiry (null, 0) or already absolute
    return Document(document.docid, {**body, EXPIRY_FIELD: when})


def expiry_of(document: Document) -> int | None:
    """The absolute expiry of a stored document (see `with_absolute_expiry`), if any."""
    if not document.has_expiry:
        return None
    body = document.body
    assert body is not None
    value = body.get(EXPIRY_FIELD)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
