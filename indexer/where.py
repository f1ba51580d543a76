"""Partial-index conditions: a small N1QL-like WHERE expression, parsed once, run per document.

    condition  := or
    or         := and ("OR" and)*
    and        := not ("AND" not)*
    not        := "NOT" not | "(" or ")" | operand [test]
    test       := compare operand | ["NOT"] "IN" "[" [literal ("," literal)*] "]"
                | "IS" ["NOT"] ("NULL" | "MISSING" | "VALUED")
    compare    := "=" | "==" | "!=" | "<>" | "<" | "<=" | ">" | ">="
    operand    := path | literal
    literal    := JSON number | 'string' | "string" | "TRUE" | "FALSE" | "NULL"

Keywords are case-insensitive; a path is dotted names like index keys (`address.city`), a name
that is a keyword is written in backticks (`` `missing` ``). Values follow N1QL: a comparison
with a MISSING side is MISSING, else with a null side NULL, else it compares by N1QL collation;
a bare operand is true when its value is (N1QL truthiness). A document is indexed only when the
condition is TRUE. `str(expr)` is the canonical text: it parses back to an equal expression.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, TypeAlias

from indexer.grammar import MAX_DEPTH, Parser, tokenize
from indexer.keys import MISSING, JSONValue, collate, field_value

__all__ = [
    "MAX_DEPTH",
    "MAX_LENGTH",
    "And",
    "Compare",
    "Expr",
    "Field",
    "In",
    "Is",
    "Literal",
    "Not",
    "Or",
    "WhereError",
    "evaluate",
    "format_where",
    "matches",
    "normalize_where",
    "parse_where",
]

MAX_LENGTH: Final = 4096

KEYWORDS: Final = frozenset(
    {"AND", "OR", "NOT", "IN", "IS", "NULL", "MISSING", "VALUED", "TRUE", "FALSE"}
)
COMPARISONS: Final = ("=", "!=", "<", "<=", ">", ">=")
TESTS: Final = ("NULL", "MISSING", "VALUED")
_ALIASES: Final = {"==": "=", "<>": "!="}


class WhereError(ValueError):
    """A WHERE expression that does not parse; the message is one line naming the position."""


# ---------------------------------------------------------------------------------------------
# The expression tree


@dataclass(frozen=True, slots=True)
class Field:
    """The document's value at a dotted path; MISSING when absent."""

    path: str

    def __str__(self) -> str:
        return format_where(self)


@dataclass(frozen=True, slots=True, eq=False)
class Literal:
    """A constant: None, a bool, an int, a finite float or a str (equal only to the same type)."""

    value: JSONValue

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Literal)
            and type(other.value) is type(self.value)
            and other.value == self.value
        )

    def __hash__(self) -> int:
        return hash((type(self.value), self.value))

    def __str__(self) -> str:
        return format_where(self)


Operand: TypeAlias = Field | Literal


@dataclass(frozen=True, slots=True)
class Compare:
    """`left op right`, op one of COMPARISONS."""

    op: str
    left: Operand
    right: Operand

    def __str__(self) -> str:
        return format_where(self)


@dataclass(frozen=True, slots=True)
class In:
    """`operand IN [values]`."""

    operand: Operand
    values: tuple[Literal, ...]

    def __str__(self) -> str:
        return format_where(self)


@dataclass(frozen=True, slots=True)
class Is:
    """`operand IS [NOT] test`, test one of TESTS."""

    operand: Operand
    test: str
    negated: bool = False

    def __str__(self) -> str:
        return format_where(self)


@dataclass(frozen=True, slots=True)
class Not:
    """`NOT operand`."""

    operand: Expr

    def __str__(self) -> str:
        return format_where(self)


@dataclass(frozen=True, slots=True)
class And:
    """Two or more operands, none of them an And."""

    operands: tuple[Expr, ...]

    def __str__(self) -> str:
        return format_where(self)


@dataclass(frozen=True, slots=True)
class Or:
    """Two or more operands, none of them an Or."""

    operands: tuple[Expr, ...]

    def __str__(self) -> str:
        return format_where(self)


Expr: TypeAlias = Field | Literal | Compare | In | Is | Not | And | Or


# ---------------------------------------------------------------------------------------------
# Canonical text


_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _format_literal(value: JSONValue) -> str:
    if value is None:
        return "NULL"
    if value is True:
        return "TRUE"
    if value is False:
        return "FALSE"
    if isinstance(value, float):
        return repr(value)
    return json.dumps(value, ensure_ascii=False)


def _format_path(path: str) -> str:
    return f"`{path}`" if path.upper() in KEYWORDS else path


def format_where(expr: Expr) -> str:
    """The canonical text: upper-case keywords, single spaces, `=` and `!=`, JSON literals."""
    match expr:
        case Field(path):
            return _format_path(path)
        case Literal(value):
            return _format_literal(value)
        case Compare(op, left, right):
            return f"{format_where(left)} {op} {format_where(right)}"
        case In(operand, values):
            return f"{format_where(operand)} IN [{', '.join(format_where(v) for v in values)}]"
        case Is(operand, test, negated):
            return f"{format_where(operand)} IS {'NOT ' if negated else ''}{test}"
        case Not(operand):
            inner = format_where(operand)
            return f"NOT ({inner})" if isinstance(operand, And | Or) else f"NOT {inner}"
        case And(operands):
            return " AND ".join(
                f"({format_where(o)})" if isinstance(o, And | Or) else format_where(o)
                for o in operands
            )
        case Or(operands):
            return " OR ".join(
                f"({format_where(o)})" if isinstance(o, Or) else format_where(o) for o in operands
            )
    raise TypeError(f"not a WHERE expression: {expr!r}")


# ---------------------------------------------------------------------------------------------
# Parsing

_SEGMENT: Final = r"(?:[A-Za-z_][A-Za-z0-9_]*|`[A-Za-z_][A-Za-z0-9_]*`)"
_TOKEN: Final = re.compile(
    rf"""
    (?P<space>\s+)
  | (?P<number>-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
  | (?P<name>{_SEGMENT}(?:\.{_SEGMENT})*)
  | (?P<op>==|!=|<>|<=|>=|=|<|>)
  | (?P<punct>[()\[\],])
    """,
    re.VERBOSE | re.DOTALL,
)


class _Parser(Parser):
    """Recursive descent over the tokens; `depth` counts open parentheses and NOTs."""

    error = WhereError

    def __init__(self, text: str) -> None:
        super().__init__(tokenize(text, _TOKEN, KEYWORDS, WhereError))

    def parse(self) -> Expr:
        expr = self.or_()
        if self.token.kind != "end":
            raise self.fail("AND, OR or the end")
        return expr

    def _chain(self, word: str, item: Callable[[], Expr], node: type[And] | type[Or]) -> Expr:
        items: list[Expr] = []
        while True:
            expr = item()
            items.extend(expr.operands if isinstance(expr, node) else (expr,))
            if self.accept("keyword", word) is None:
                break
        return items[0] if len(items) == 1 else node(tuple(items))

    def or_(self) -> Expr:
        return self._chain("OR", self.and_, Or)

    def and_(self) -> Expr:
        return self._chain("AND", self.not_, And)

    def not_(self) -> Expr:
        if self.accept("keyword", "NOT"):
            self.nested()
            expr: Expr = Not(self.not_())
            self.depth -= 1
            return expr
        if self.accept("punct", "("):
            self.nested()
            expr = self.or_()
            self.expect("punct", ")", "')'")
            self.depth -= 1
            return expr
        operand = self.operand("a field, a value, NOT or '('")
        return self.test(operand)

    def test(self, operand: Operand) -> Expr:
        t = self.token
        if self.accept("op"):
            op = _ALIASES.get(t.text, t.text)
            return Compare(op, operand, self.operand(f"a field or a value after '{t.text}'"))
        if self.accept("keyword", "IS"):
            negated = self.accept("keyword", "NOT") is not None
            word = self.token.text if self.token.kind == "keyword" else ""
            if word not in TESTS:
                raise self.fail("NULL, MISSING or VALUED")
            self.i += 1
            return Is(operand, word, negated)
        negated = self.accept("keyword", "NOT") is not None
        if negated or (self.token.kind == "keyword" and self.token.text == "IN"):
            self.expect("keyword", "IN", "IN")
            expr: Expr = In(operand, self.literals())
            return Not(expr) if negated else expr
        return operand

    def literals(self) -> tuple[Literal, ...]:
        self.expect("punct", "[", "'[' after IN")
        values: list[Literal] = []
        if self.accept("punct", "]"):
            return ()
        while True:
            operand = self.operand("a value")
            if not isinstance(operand, Literal):
                raise WhereError(
                    f"IN takes a list of values, not the field {operand.path!r} "
                    f"at position {self.tokens[self.i - 1].pos + 1}"
                )
            values.append(operand)
            if self.accept("punct", "]"):
                return tuple(values)
            self.expect("punct", ",", "',' or ']'")

    def operand(self, expected: str) -> Operand:
        t = self.token
        if t.kind == "name":
            self.i += 1
            return Field(t.text.replace("`", ""))
        found, value = self.literal()
        if found:
            return Literal(value)
        if t.kind == "keyword" and t.text in ("TRUE", "FALSE", "NULL"):
            self.i += 1
            return Literal({"TRUE": True, "FALSE": False, "NULL": None}[t.text])
        raise self.fail(expected)


def parse_where(text: str) -> Expr:
    """The expression tree of `text`; WhereError if it is not a valid condition."""
    if len(text) > MAX_LENGTH:
        raise WhereError(f"longer than {MAX_LENGTH} characters ({len(text)})")
    if not text.strip():
        raise WhereError("empty condition")
    return _Parser(text).parse()


def normalize_where(text: str) -> str:
    """The canonical text of a condition (what definitions store and send to routers)."""
    return format_where(parse_where(text))


# ---------------------------------------------------------------------------------------------
# Evaluation


def _truth(value: JSONValue) -> bool:
    """N1QL truthiness of a value that is neither MISSING nor null."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return value != 0
    return len(value) > 0  # str, list, dict


def _compare(op: str, a: JSONValue, b: JSONValue) -> bool:
    c = collate(a, b)
    if op == "=":
        return c == 0
    if op == "!=":
        return c != 0
    if op == "<":
        return c < 0
    if op == "<=":
        return c <= 0
    if op == ">":
        return c > 0
    return c >= 0


def evaluate(expr: Expr, doc: JSONValue) -> JSONValue:
    """The value of expr on doc: a JSON value, or MISSING (N1QL's four-valued logic)."""
    match expr:
        case Field(path):
            return field_value(doc, path)
        case Literal(value):
            return value
        case Compare(op, left, right):
            a, b = evaluate(left, doc), evaluate(right, doc)
            if a is MISSING or b is MISSING:
                return MISSING
            if a is None or b is None:
                return None
            return _compare(op, a, b)
        case In(operand, values):
            a = evaluate(operand, doc)
            if a is MISSING or a is None:
                return a
            if any(v.value is not None and collate(a, v.value) == 0 for v in values):
                return True
            return None if any(v.value is None for v in values) else False
        case Is(operand, test, negated):
            a = evaluate(operand, doc)
            if test == "NULL":
                if a is MISSING:
                    return MISSING
                return (a is None) != negated
            if test == "MISSING":
                return (a is MISSING) != negated
            return (a is not MISSING and a is not None) != negated
        case Not(operand):
            a = evaluate(operand, doc)
            return a if a is MISSING or a is None else not _truth(a)
        case And(operands):
            missing = null = False
            for o in operands:
                a = evaluate(o, doc)
                if a is MISSING:
                    missing = True
                elif a is None:
                    null = True
                elif not _truth(a):
                    return False
            return MISSING if missing else None if null else True
        case Or(operands):
            missing = null = False
            for o in operands:
                a = evaluate(o, doc)
                if a is MISSING:
                    missing = True
                elif a is None:
                    null = True
                elif _truth(a):
                    return True
            return None if null else MISSING if missing else False
    raise TypeError(f"not a WHERE expression: {expr!r}")


def matches(expr: Expr | None, doc: JSONValue) -> bool:
    """True when doc satisfies expr (its value is TRUE); every document matches None."""
    if expr is None:
        return True
    value = evaluate(expr, doc)
    return value is not MISSING and value is not None and _truth(value)
