"""Input lines to documents: each line parsed as the router's input format and checked whole,
its `_exp` too, so that a bad line is reported and the others go on. Sans-IO."""

from __future__ import annotations

from collections.abc import Sequence

from indexer.router.documents import Document, DocumentError, parse_line
from indexer.router.expiry import with_absolute_expiry


def parse_lines(lines: Sequence[tuple[int, bytes]], where: str) -> tuple[list[Document], list[str]]:
    """The documents of numbered JSONL lines, and one message per bad line; blanks skipped."""
    documents = []
    errors = []
    for number, raw in lines:
        try:
            text = raw.decode("utf-8")
            if text.strip():
                document = parse_line(text, f"{where}:{number}", raw.strip())
                try:
                    with_absolute_expiry(document, 0.0)  # a bad `_exp` is a bad line
                except DocumentError as exc:
                    raise DocumentError(f"{where}:{number}: {exc}") from None
                documents.append(document)
        except UnicodeDecodeError:
            errors.append(f"{where}:{number}: not UTF-8")
        except DocumentError as exc:
            errors.append(str(exc))
    return documents, errors
