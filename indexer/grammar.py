"""What the two small N1QL-like languages share (sans-IO, pure): tokens, quoted strings, and a
recursive-descent base whose errors say what was expected and at which position.

`indexer/where.py` parses partial-index conditions with it, `indexer/expressions.py` index keys.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Final

MAX_DEPTH: Final = 32
_ESCAPES: Final = {
    '"': '"', "'": "'", "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t",
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Token:
    kind: str  # number, string, name, keyword, op, punct, end
    text: str
    pos: int


def unquote(text: str, pos: int, error: type[ValueError]) -> str:
    """The value of a quoted string token: backslash escapes as in JSON, plus \\'."""
    out: list[str] = []
    i, end = 1, len(text) - 1
    while i < end:
        c = text[i]
        if c != "\\":
            out.append(c)
            i += 1
            continue
        e = text[i + 1]
        if e in _ESCAPES:
            out.append(_ESCAPES[e])
            i += 2
        elif e == "u" and re.fullmatch(r"[0-9A-Fa-f]{4}", text[i + 2 : i + 6]):
            out.append(chr(int(text[i + 2 : i + 6], 16)))
            i += 6
        else:
            escape = text[i : i + 2]
            raise error(f"bad escape {escape!r} in a string at position {pos + i + 1}")
    return "".join(out)


def tokenize(
    text: str, pattern: re.Pattern[str], keywords: Collection[str], error: type[ValueError]
) -> list[Token]:
    """The tokens of `text` by `pattern`'s named groups (`space` dropped, a `name` that is a
    keyword upper-cased as a `keyword`), then an `end` token."""
    out: list[Token] = []
    pos = 0
    while pos < len(text):
        m = pattern.match(text, pos)
        if m is None:
            if text[pos] in "\"'":
                raise error(f"unterminated string at position {pos + 1}")
            raise error(f"unexpected character {text[pos]!r} at position {pos + 1}")
        kind = m.lastgroup or ""
        word = m.group()
        if kind == "name" and word.upper() in keywords:
            out.append(Token("keyword", word.upper(), pos))
        elif kind != "space":
            out.append(Token(kind, word, pos))
        pos = m.end()
    out.append(Token("end", "", len(text)))
    return out


class Parser:
    """Recursive descent over tokens; `depth` bounds nesting. Errors are of class `error`."""

    error: type[ValueError] = ValueError

    def __init__(self, tokens: list[Token]) -> None:
        self.tokens = tokens
        self.i = 0
        self.depth = 0

    @property
    def token(self) -> Token:
        return self.tokens[self.i]

    def fail(self, expected: str) -> ValueError:
        t = self.token
        found = "the end" if t.kind == "end" else repr(t.text)
        return self.error(f"expected {expected}, found {found} at position {t.pos + 1}")

    def accept(self, kind: str, text: str | None = None) -> Token | None:
        t = self.token
        if t.kind == kind and (text is None or t.text == text):
            self.i += 1
            return t
        return None

    def expect(self, kind: str, text: str, expected: str) -> None:
        if self.accept(kind, text) is None:
            raise self.fail(expected)

    def literal(self) -> tuple[bool, object]:
        """A number or quoted string token taken, as (True, its value); else (False, None)."""
        t = self.token
        if t.kind == "number":
            self.i += 1
            value = float(t.text) if any(c in t.text for c in ".eE") else int(t.text)
            if isinstance(value, float) and not math.isfinite(value):
                raise self.error(f"number out of range at position {t.pos + 1}")
            return True, value
        if t.kind == "string":
            self.i += 1
            return True, unquote(t.text, t.pos, self.error)
        return False, None

    def nested(self) -> None:
        """One level deeper (a parenthesis, a NOT, a function); refused past MAX_DEPTH."""
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise self.error(
                f"nested more than {MAX_DEPTH} levels deep at position {self.token.pos + 1}"
            )
