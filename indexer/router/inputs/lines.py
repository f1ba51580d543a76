"""Input lines to documents: each line parsed as the router's input format and checked whole,
its `_exp` too, so that a bad line is reported and the others go on. Sans-IO."""

from __future__ import annotations

from collections.abc import Sequence

from indexer.router.documents import Document, DocumentError, parse_line, quick_document
from indexer.router.expiry import with_absolute_expiry


def parse_numbered(number: int, raw: bytes, where: str) -> Document | None:
    """The document of one numbered line (None: a blank line); DocumentError says why not."""
    stripped = raw.strip()
    if not stripped:
        return None
    document = quick_document(stripped)
    if document is not None:
        return document
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise DocumentError(f"{where}:{number}: not UTF-8") from None
    if not text.strip():
        return None
    document = parse_line(text, f"{where}:{number}", raw.strip())
    try:
        with_absolute_expiry(document, 0.0)  # a bad `_exp` is a bad line
    except DocumentError as exc:
        raise DocumentError(f"{where}:{number}: {exc}") from None
    return document


def parse_lines(lines: Sequence[tuple[int, bytes]], where: str) -> tuple[list[Document], list[str]]:
    """The documents of numbered JSONL lines, and one message per bad line; blanks skipped."""
    documents = []
    errors = []
    for number, raw in lines:
        try:
            document = parse_numbered(number, raw, where)
        except DocumentError as exc:
            errors.append(str(exc))
        else:
            if document is not None:
                documents.append(document)
    return documents, errors
