"""Index key expressions: what each key position of an index holds, parsed once, run per document.

    index_key  := array_key [order] | expr [order]
    order      := "ASC" | "DESC"
    array_key  := ("DISTINCT" | "ALL") "ARRAY" expr "FOR" name "IN" expr "END"
    expr       := term (("+" | "-") term)*
    term       := unary (("*" | "/" | "%") unary)*
    unary      := "-" unary | atom
    atom       := number | string | path | function "(" expr ")" | "META" "(" ")" "." "id"
                | "(" expr ")"
    function   := "LOWER" | "UPPER" | "LENGTH"

A plain field path (`address.city`) is the common key and keeps its text. Values follow N1QL:
an operand that is MISSING makes the result MISSING; LOWER, UPPER and LENGTH of a non-string, and
arithmetic on a non-number or a division by zero, give NULL. `META().id` is the document's id.

An array key gives one value per element of the array `IN` names (`FOR v IN tags`; `v` and `v.x`
are the element and its fields): DISTINCT keeps each value once, ALL every occurrence in the
document's back-index entry; the main index holds each (key, document) pair once either way. An
element whose value is MISSING gives none, and a document whose array is missing, not an array
or empty is in no entry of the index. An index has at most one array key, as in GSI.

`DESC` stores the key position in descending order (indexer/keys.py `encode_desc`). `str()` of a
parsed key is its canonical text: what definitions store and send to routers.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, TypeAlias

from indexer.grammar import Parser, tokenize
from indexer.keys import MISSING, JSONValue, encode_desc, encode_value, join_entries
from indexer.protocol import PRIMARY_KEY

__all__ = [
    "PLAIN_PATH",
    "PRIMARY_KEY",
    "ArrayKey",
    "ExpressionError",
    "IndexKey",
    "KeyExtractor",
    "column_name",
    "evaluate",
    "normalize_keys",
    "parse_key",
]

MAX_LENGTH: Final = 4096

FUNCTIONS: Final = frozenset({"LOWER", "UPPER", "LENGTH"})
KEYWORDS: Final = frozenset({"DISTINCT", "ALL", "ARRAY", "FOR", "IN", "END", "ASC", "DESC", "META"})
PLAIN_PATH: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
"""A key that is a plain field path (`address.city`): the common case, read without parsing."""


class ExpressionError(ValueError):
    """An index key expression is not valid; the message says where (1-based position)."""


# ---------------------------------------------------------------------------------------------
# The tree


@dataclass(frozen=True, slots=True)
class Path:
    """A dotted field path; inside an array key, one that starts with the variable is the
    element's."""

    steps: tuple[str, ...]

    def __str__(self) -> str:
        return ".".join(f"`{s}`" if s.upper() in KEYWORDS | FUNCTIONS else s for s in self.steps)


@dataclass(frozen=True, slots=True)
class Constant:
    value: JSONValue

    def __str__(self) -> str:
        if isinstance(self.value, float):
            return repr(self.value)
        return json.dumps(self.value, ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class MetaId:
    def __str__(self) -> str:
        return PRIMARY_KEY


@dataclass(frozen=True, slots=True)
class Call:
    function: str
    argument: Expr

    def __str__(self) -> str:
        return f"{self.function}({self.argument})"


@dataclass(frozen=True, slots=True)
class Negate:
    operand: Expr

    def __str__(self) -> str:
        inner = str(self.operand)
        return f"-({inner})" if isinstance(self.operand, Arithmetic) else f"-{inner}"


@dataclass(frozen=True, slots=True)
class Arithmetic:
    op: str
    left: Expr
    right: Expr

    def __str__(self) -> str:
        def side(e: Expr) -> str:
            return f"({e})" if isinstance(e, Arithmetic) else str(e)

        return f"{side(self.left)} {self.op} {side(self.right)}"


Expr: TypeAlias = Path | Constant | MetaId | Call | Negate | Arithmetic


@dataclass(frozen=True, slots=True)
class ArrayKey:
    """`DISTINCT|ALL ARRAY element FOR variable IN source END`."""

    distinct: bool
    element: Expr
    variable: str
    source: Expr

    def __str__(self) -> str:
        kind = "DISTINCT" if self.distinct else "ALL"
        return f"{kind} ARRAY {self.element} FOR {self.variable} IN {self.source} END"


@dataclass(frozen=True, slots=True)
class IndexKey:
    """One key position of an index: a scalar expression or an array key, and its order."""

    value: Expr | ArrayKey
    desc: bool = False

    def __str__(self) -> str:
        if isinstance(self.value, Path) and not self.desc:
            return ".".join(self.value.steps)  # a plain path keeps its text, keywords too
        return f"{self.value} DESC" if self.desc else str(self.value)

    @property
    def array(self) -> bool:
        return isinstance(self.value, ArrayKey)


# ---------------------------------------------------------------------------------------------
# Parsing

_SEGMENT: Final = r"(?:[A-Za-z_][A-Za-z0-9_]*|`[A-Za-z_][A-Za-z0-9_]*`)"
_TOKEN: Final = re.compile(
    rf"""
    (?P<space>\s+)
  | (?P<number>(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
  | (?P<name>{_SEGMENT}(?:\.{_SEGMENT})*)
  | (?P<op>[-+*/%])
  | (?P<punct>[().])
    """,
    re.VERBOSE | re.DOTALL,
)


class _Parser(Parser):
    """Recursive descent over an index key's tokens."""

    error = ExpressionError

    def __init__(self, text: str) -> None:
        super().__init__(tokenize(text, _TOKEN, KEYWORDS | FUNCTIONS, ExpressionError))

    def key(self) -> IndexKey:
        value: Expr | ArrayKey
        t = self.token
        if t.kind == "keyword" and t.text in ("DISTINCT", "ALL"):
            value = self.array_key()
        else:
            value = self.expr()
        desc = False
        if self.accept("keyword", "DESC"):
            desc = True
        else:
            self.accept("keyword", "ASC")
        if self.token.kind != "end":
            raise self.fail("an operator, ASC, DESC or the end")
        return IndexKey(value, desc)

    def array_key(self) -> ArrayKey:
        distinct = self.token.text == "DISTINCT"
        self.i += 1
        self.expect("keyword", "ARRAY", "ARRAY after DISTINCT or ALL")
        start = self.i
        depth = 0
        # The element expression names the variable that FOR binds later: find it first.
        while not (self.token.kind == "keyword" and self.token.text == "FOR" and depth == 0):
            if self.token.kind == "end":
                raise self.fail("FOR")
            if self.token.text == "(":
                depth += 1
            elif self.token.text == ")":
                depth -= 1
            self.i += 1
        self.i += 1
        t = self.token
        if t.kind != "name" or "." in t.text:
            raise self.fail("a variable name after FOR")
        variable = t.text.replace("`", "")
        self.i += 1
        self.expect("keyword", "IN", "IN after the variable")
        source = self.expr()
        self.expect("keyword", "END", "END")
        end = self.i
        self.i = start
        element = self.expr()
        if not (self.token.kind == "keyword" and self.token.text == "FOR"):
            raise self.fail("FOR")
        self.i = end
        if _names_variable(source, variable):
            raise ExpressionError(f"the array after IN cannot use the variable {variable!r}")
        return ArrayKey(distinct, element, variable, source)

    def expr(self) -> Expr:
        left = self.term()
        while (t := self.token).kind == "op" and t.text in "+-":
            self.i += 1
            left = Arithmetic(t.text, left, self.term())
        return left

    def term(self) -> Expr:
        left = self.unary()
        while (t := self.token).kind == "op" and t.text in "*/%":
            self.i += 1
            left = Arithmetic(t.text, left, self.unary())
        return left

    def unary(self) -> Expr:
        if self.accept("op", "-"):
            self.nested()
            operand = self.unary()
            self.depth -= 1
            if isinstance(operand, Constant) and _is_number(operand.value):
                return Constant(-operand.value)
            return Negate(operand)
        return self.atom()

    def atom(self) -> Expr:
        t = self.token
        if t.kind == "name":
            self.i += 1
            return Path(tuple(s.replace("`", "") for s in t.text.split(".")))
        found, value = self.literal()
        if found:
            return Constant(value)
        if t.kind == "keyword" and t.text in FUNCTIONS:
            self.i += 1
            self.expect("punct", "(", f"'(' after {t.text}")
            self.nested()
            argument = self.expr()
            self.depth -= 1
            self.expect("punct", ")", "')'")
            return Call(t.text, argument)
        if t.kind == "keyword" and t.text == "META":
            self.i += 1
            self.expect("punct", "(", "'(' after META")
            self.expect("punct", ")", "')': META() takes no argument")
            self.expect("punct", ".", "'.id' after META()")
            if not (self.token.kind == "name" and self.token.text.lower() == "id"):
                raise self.fail("META().id")
            self.i += 1
            return MetaId()
        if self.accept("punct", "("):
            self.nested()
            inner = self.expr()
            self.depth -= 1
            self.expect("punct", ")", "')'")
            return inner
        raise self.fail("a field, a value, a function, META().id or '('")


def _is_number(value: JSONValue) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _names_variable(expr: Expr, variable: str) -> bool:
    match expr:
        case Path(steps):
            return steps[0] == variable
        case Call(_, argument):
            return _names_variable(argument, variable)
        case Negate(operand):
            return _names_variable(operand, variable)
        case Arithmetic(_, left, right):
            return _names_variable(left, variable) or _names_variable(right, variable)
    return False


def parse_key(text: str) -> IndexKey:
    """The parsed key of `text`; ExpressionError (with the position) if it is not valid."""
    if not isinstance(text, str):
        raise ExpressionError(f"{text!r} is not a key expression (a string)")
    if len(text) > MAX_LENGTH:
        raise ExpressionError(f"longer than {MAX_LENGTH} characters ({len(text)})")
    if not text.strip():
        raise ExpressionError("empty key expression")
    if PLAIN_PATH.match(text):
        return IndexKey(Path(tuple(text.split("."))))
    return _Parser(text).key()


def _bound(expr: Expr, variable: str, source: Expr) -> Expr:
    """`expr` with the array variable's paths read from the array (`t.name` in `kids` is
    `kids.name`): how a column of an array key is named."""
    match expr:
        case Path(steps) if steps[0] == variable:
            if isinstance(source, Path):
                return Path(source.steps + steps[1:])
            return expr
        case Call(function, argument):
            return Call(function, _bound(argument, variable, source))
        case Negate(operand):
            return Negate(_bound(operand, variable, source))
        case Arithmetic(op, left, right):
            return Arithmetic(op, _bound(left, variable, source), _bound(right, variable, source))
    return expr


def column_name(text: str) -> str:
    """A name for a key as a column (Spark's, Arrow's): a path with `_` for dots, an expression
    with `_` for every run of other characters (`LOWER(name)` is `LOWER_name`), an array key by
    its element read from the array (`DISTINCT ARRAY LOWER(t) FOR t IN tags END` is
    `LOWER_tags`); DESC left out."""
    key = parse_key(text)
    value = key.value
    if isinstance(value, ArrayKey):
        value = _bound(value.element, value.variable, value.source)
    shown = ".".join(value.steps) if isinstance(value, Path) else str(value)
    return re.sub(r"[^A-Za-z0-9_]+", "_", shown).strip("_") or "key"


def normalize_keys(texts: Sequence[str]) -> tuple[str, ...]:
    """The canonical texts of an index's keys, checked together: at most one array key, and
    the leading key neither a constant nor DESC-only noise (ExpressionError says which key)."""
    keys = []
    for i, text in enumerate(texts):
        try:
            keys.append(parse_key(text))
        except ExpressionError as exc:
            raise ExpressionError(f"key {i + 1} ({str(text)[:60]!r}): {exc}") from None
    arrays = [i for i, k in enumerate(keys) if k.array]
    if len(arrays) > 1:
        raise ExpressionError(
            f"keys {arrays[0] + 1} and {arrays[1] + 1} are both array keys: "
            "an index has at most one"
        )
    for i, key in enumerate(keys):
        if isinstance(key.value, Constant):
            raise ExpressionError(f"key {i + 1} is the constant {key.value}: index a field")
    return tuple(str(k) for k in keys)


# ---------------------------------------------------------------------------------------------
# Evaluation


def _arithmetic(op: str, a: JSONValue, b: JSONValue) -> JSONValue:
    if a is MISSING or b is MISSING:
        return MISSING
    if not (_is_number(a) and _is_number(b)):
        return None
    if op == "+":
        result = a + b
    elif op == "-":
        result = a - b
    elif op == "*":
        result = a * b
    elif b == 0:
        return None  # N1QL: division by zero is NULL
    elif op == "/":
        if isinstance(a, int) and isinstance(b, int) and a % b == 0:
            return a // b  # exact, even beyond 2**53
        result = a / b
    else:  # % keeps the dividend's sign, as N1QL's MOD does
        if isinstance(a, int) and isinstance(b, int):
            r = abs(a) % abs(b)
            return r if a >= 0 else -r
        result = math.fmod(a, b)
    if isinstance(result, float) and not math.isfinite(result):
        return None
    return result


def evaluate(
    expr: Expr, doc: JSONValue, docid: str, variable: str | None = None, element: JSONValue = None
) -> JSONValue:
    """The value of `expr` on a document (and an array element bound to `variable`)."""
    match expr:
        case Path(steps):
            if steps[0] == variable:
                value, steps = element, steps[1:]
            else:
                value = doc
            for step in steps:
                value = value.get(step, MISSING) if isinstance(value, dict) else MISSING
            return value
        case Constant(value):
            return value
        case MetaId():
            return docid
        case Call(function, argument):
            a = evaluate(argument, doc, docid, variable, element)
            if a is MISSING:
                return MISSING
            if not isinstance(a, str):
                return None
            if function == "LENGTH":
                return len(a)
            return a.lower() if function == "LOWER" else a.upper()
        case Negate(operand):
            a = evaluate(operand, doc, docid, variable, element)
            if a is MISSING:
                return MISSING
            return -a if _is_number(a) else None
        case Arithmetic(op, left, right):
            return _arithmetic(
                op,
                evaluate(left, doc, docid, variable, element),
                evaluate(right, doc, docid, variable, element),
            )
    raise TypeError(f"not a key expression: {expr!r}")


class KeyExtractor:
    """One index's key of a document, encoded: b"" when the document is in no entry (its
    leading key MISSING, or an array key with no value), else the encoded key, or for an array
    index every entry's key joined (`keys.join_entries`)."""

    def __init__(self, texts: Sequence[str]) -> None:
        self.keys = [parse_key(t) for t in texts]
        self.array = next((i for i, k in enumerate(self.keys) if k.array), None)
        self._encoders: list[Callable[[JSONValue], bytes]] = [
            encode_desc if k.desc else encode_value for k in self.keys
        ]

    def __call__(self, doc: JSONValue, docid: str) -> bytes:
        parts: list[bytes] = []
        for i, (key, encode) in enumerate(zip(self.keys, self._encoders, strict=True)):
            if i == self.array:
                parts.append(b"")  # filled per element below
                continue
            assert not isinstance(key.value, ArrayKey)
            value = evaluate(key.value, doc, docid)
            if value is MISSING and i == 0:
                return b""  # N1QL leaves out a document whose leading key is missing
            parts.append(encode(value))
        if self.array is None:
            return b"".join(parts)
        array = self.keys[self.array].value
        assert isinstance(array, ArrayKey)
        values = evaluate(array.source, doc, docid)
        if not isinstance(values, list):
            return b""
        encode = self._encoders[self.array]
        elements: list[bytes] = []
        for item in values:
            value = evaluate(array.element, doc, docid, array.variable, item)
            if value is not MISSING:
                elements.append(encode(value))
        if array.distinct:
            elements = list(dict.fromkeys(elements))
        if not elements:
            return b""
        a = self.array
        head, tail = b"".join(parts[:a]), b"".join(parts[a + 1 :])
        return join_entries([head + e + tail for e in elements])
