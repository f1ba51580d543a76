"""Partial-index conditions: parsing, canonical text, N1QL evaluation, and where they travel."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from indexer import protocol as p
from indexer.config import ConfigError, parse_config
from indexer.keys import MISSING
from indexer.router.documents import Document
from indexer.router.streams.encoders import StreamEncoder
from indexer.router.streams.feed import FeedError
from indexer.storage import IndexStore, StoreError
from indexer.where import (
    MAX_DEPTH,
    MAX_LENGTH,
    And,
    Compare,
    Expr,
    Field,
    In,
    Is,
    Literal,
    Not,
    Or,
    WhereError,
    evaluate,
    matches,
    normalize_where,
    parse_where,
)

# ---------------------------------------------------------------------------------------------
# Parsing and canonical text


@pytest.mark.parametrize(
    "text, canonical",
    [
        ("age>=18", "age >= 18"),
        ("age == 18", "age = 18"),
        ("age <> 18", "age != 18"),
        ("  address.city   =  'Oslo' ", 'address.city = "Oslo"'),
        ("a = 'it\\'s' and b = \"q\\\"\\n\"", 'a = "it\'s" AND b = "q\\"\\n"'),
        ("a = -1.5e2 or b = 0 or c = 12", "a = -150.0 OR b = 0 OR c = 12"),
        ("x in [1, 'a', null, TRUE, false]", 'x IN [1, "a", NULL, TRUE, FALSE]'),
        ("x not in []", "NOT x IN []"),
        ("x Is Not Null and y is missing or z is not valued", None),
        ("(a = 1)", "a = 1"),
        ("((a = 1 and b = 2) and c = 3)", "a = 1 AND b = 2 AND c = 3"),
        ("(a = 1 or b = 2) or (c = 3 or d = 4)", "a = 1 OR b = 2 OR c = 3 OR d = 4"),
        ("(a = 1 or b = 2) and c = 3", "(a = 1 OR b = 2) AND c = 3"),
        ("a = 1 or b = 2 and c = 3", "a = 1 OR b = 2 AND c = 3"),
        ("not (a = 1 and b = 2)", "NOT (a = 1 AND b = 2)"),
        ("not not a", "NOT NOT a"),
        ("`null` is null and `Missing`.x = 1", "`null` IS NULL AND Missing.x = 1"),
        ("active", "active"),
        ("18 <= age", "18 <= age"),
        ("a = b.c", "a = b.c"),
    ],
)
def test_canonical_text(text: str, canonical: str | None) -> None:
    expr = parse_where(text)
    if canonical is None:
        canonical = "x IS NOT NULL AND y IS MISSING OR z IS NOT VALUED"
    assert str(expr) == normalize_where(text) == canonical
    assert parse_where(canonical) == expr


def test_precedence_and_trees() -> None:
    a, b, c = (Compare("=", Field(n), Literal(1)) for n in "abc")
    assert parse_where("a = 1 or b = 1 and c = 1") == Or((a, And((b, c))))
    assert parse_where("not a = 1 and b = 1") == And((Not(a), b))
    assert parse_where("x not in [1]") == Not(In(Field("x"), (Literal(1),)))
    assert parse_where("x is not valued") == Is(Field("x"), "VALUED", True)
    assert parse_where("address.zip > '1'") == Compare(">", Field("address.zip"), Literal("1"))
    # Literals are equal only to the same type: 1, 1.0 and TRUE are three literals.
    assert parse_where("a = 1") != parse_where("a = 1.0") != parse_where("a = true")


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty condition"),
        ("   ", "empty condition"),
        ("a =", "expected a field or a value after '=', found the end at position 4"),
        ("a = = 1", "found '=' at position 5"),
        ("(a = 1", "expected ')', found the end at position 7"),
        ("a = 1)", "expected AND, OR or the end, found ')' at position 6"),
        ("a = 1 b = 2", "found 'b' at position 7"),
        ("a in [b]", "IN takes a list of values, not the field 'b' at position 7"),
        ("a in 1", "expected '[' after IN, found '1' at position 6"),
        ("a in [1 2]", "expected ',' or ']', found '2' at position 9"),
        ("a is 1", "expected NULL, MISSING or VALUED, found '1' at position 6"),
        ("a not = 1", "expected IN, found '=' at position 7"),
        ("'abc", "unterminated string at position 1"),
        ("a = 'x\\q'", "bad escape '\\\\q' in a string at position 7"),
        ("a = 'x\\\n'", "bad escape '\\\\\\n' in a string at position 7"),
        ("a ~ 1", "unexpected character '~' at position 3"),
        ("a = 1e999", "number out of range at position 5"),
        ("and = 1", "expected a field, a value, NOT or '(', found 'AND' at position 1"),
        ("a = missing", "found 'MISSING' at position 5"),
        ("a.", "unexpected character '.' at position 2"),
        ("a = -b", "unexpected character '-' at position 5"),
        ("a = 1\n and", "found the end at position 11"),
    ],
)
def test_parse_errors_are_one_line_with_a_position(text: str, message: str) -> None:
    with pytest.raises(WhereError) as info:
        parse_where(text)
    assert message in str(info.value)
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)


def test_length_and_depth_limits() -> None:
    long = " OR ".join(f"a{i} = {i}" for i in range(MAX_LENGTH // 8))
    assert len(long) > MAX_LENGTH
    with pytest.raises(WhereError, match=f"longer than {MAX_LENGTH} characters"):
        parse_where(long)
    assert len(str(parse_where(long[: MAX_LENGTH - 20].rsplit(" OR ", 1)[0]))) < MAX_LENGTH
    deep = "(" * MAX_DEPTH + "a = 1" + ")" * MAX_DEPTH
    assert str(parse_where(deep)) == "a = 1"
    with pytest.raises(WhereError, match=f"nested more than {MAX_DEPTH} levels"):
        parse_where("(" + deep + ")")
    with pytest.raises(WhereError, match="nested"):
        parse_where("NOT " * (MAX_DEPTH + 1) + "a")


# ---------------------------------------------------------------------------------------------
# Evaluation

DOC: dict[str, Any] = {
    "age": 30,
    "name": "Ann",
    "nil": None,
    "active": True,
    "zero": 0,
    "empty": "",
    "tags": ["a"],
    "score": 1.5,
    "big": 9007199254740993,
    "address": {"city": "Oslo"},
}


@pytest.mark.parametrize(
    "text, value",
    [
        ("age = 30", True),
        ("age == 30.0", True),
        ("age != 30", False),
        ("age <> 31", True),
        ("age < 'a'", True),  # numbers sort before strings
        ("age = '30'", False),
        ("active < 0", True),  # booleans sort before numbers
        ("active = 1", False),
        ("name > 'Al' and name <= 'Ann'", True),
        ("score > 1 and score < 2", True),
        ("big = 9007199254740993", True),
        ("big = 9007199254740992", False),  # ints compare exactly, beyond doubles
        ("big > 9007199254740992.0", True),
        ("address.city = 'Oslo'", True),
        ("nope = 1", MISSING),
        ("nil = 1", None),
        ("1 >= nil", None),
        ("nil = nope", MISSING),
        ("address.city.x = 1", MISSING),
        ("age IN [1, 30]", True),
        ("age IN [1, 2]", False),
        ("age IN []", False),
        ("age IN [1, null]", None),
        ("age IN [null, 30.0]", True),
        ("nope IN [1]", MISSING),
        ("nil IN [null]", None),
        ("age NOT IN [1]", True),
        ("nope NOT IN [1]", MISSING),
        ("nil IS NULL", True),
        ("age IS NULL", False),
        ("nope IS NULL", MISSING),
        ("nil IS NOT NULL", False),
        ("age IS NOT NULL", True),
        ("nope IS NOT NULL", MISSING),
        ("nope IS MISSING", True),
        ("nil IS MISSING", False),
        ("nope IS NOT MISSING", False),
        ("name.x IS MISSING", True),
        ("age IS VALUED", True),
        ("nil IS VALUED", False),
        ("nope IS VALUED", False),
        ("nil IS NOT VALUED", True),
        ("NOT age = 1", True),
        ("NOT nope = 1", MISSING),
        ("NOT nil = 1", None),
        ("age = 30 AND nope = 1", MISSING),
        ("age = 30 AND nil = 1", None),
        ("nope = 1 AND nil = 1", MISSING),
        ("nope = 1 AND age = 1", False),
        ("age = 30 AND name = 'Ann'", True),
        ("nope = 1 OR nil = 1", None),
        ("nope = 1 OR age = 1", MISSING),
        ("nope = 1 OR age = 30", True),
        ("age = 1 OR age = 2", False),
        ("NOT zero", True),
        ("NOT tags", False),
        ("'x' AND 2", True),
        ("0.0 OR ''", False),
    ],
)
def test_evaluation_follows_n1ql(text: str, value: Any) -> None:
    assert evaluate(parse_where(text), DOC) is value
    assert matches(parse_where(text), DOC) is (value is True)


@pytest.mark.parametrize(
    "text, matched",
    [
        ("active", True),
        ("zero", False),
        ("empty", False),
        ("name", True),
        ("tags", True),
        ("address", True),
        ("score", True),
        ("nope", False),
        ("nil", False),
        ("0", False),
        ("'0'", True),
    ],
)
def test_a_bare_operand_is_its_truthiness(text: str, matched: bool) -> None:
    expr = parse_where(text)
    assert isinstance(expr, Field | Literal)
    assert matches(expr, DOC) is matched


def test_matches_only_true_and_none_matches_everything() -> None:
    assert matches(None, {}) and matches(None, {"a": 1})
    expr = parse_where("age >= 18 and address.city in ['Oslo', 'Berlin']")
    assert matches(expr, {"age": 18, "address": {"city": "Berlin"}})
    assert not matches(expr, {"age": 17.5, "address": {"city": "Berlin"}})
    assert not matches(expr, {"age": 20, "address": "Berlin"})
    assert not matches(expr, {"age": None, "address": {"city": "Oslo"}})
    assert not matches(expr, {"address": {"city": "Oslo"}})


# ---------------------------------------------------------------------------------------------
# Properties

_NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,6}", fullmatch=True) | st.sampled_from(
    ["null", "Missing", "and", "in", "valued"]
)
_FIELDS = st.lists(_NAMES, min_size=1, max_size=3).map(lambda names: Field(".".join(names)))
_LITERALS = st.builds(
    Literal,
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
)
_OPERANDS = _FIELDS | _LITERALS


def _flat(node: type[And] | type[Or], items: list[Expr]) -> Expr:
    out: list[Expr] = []
    for item in items:
        out.extend(item.operands if isinstance(item, node) else (item,))
    return node(tuple(out))


_LEAVES = (
    _OPERANDS
    | st.builds(Compare, st.sampled_from(["=", "!=", "<", "<=", ">", ">="]), _OPERANDS, _OPERANDS)
    | st.builds(In, _OPERANDS, st.lists(_LITERALS, max_size=4).map(tuple))
    | st.builds(Is, _OPERANDS, st.sampled_from(["NULL", "MISSING", "VALUED"]), st.booleans())
)
EXPRS = st.recursive(
    _LEAVES,
    lambda inner: (
        st.builds(Not, inner)
        | st.lists(inner, min_size=2, max_size=4).map(lambda items: _flat(And, items))
        | st.lists(inner, min_size=2, max_size=4).map(lambda items: _flat(Or, items))
    ),
    max_leaves=16,
)


def _parse_or_skip(text: str) -> Expr:
    try:
        return parse_where(text)
    except WhereError as exc:
        assume("nested" not in str(exc) and "longer" not in str(exc))
        raise


@given(EXPRS)
def test_canonical_text_parses_back_to_the_same_tree(expr: Expr) -> None:
    text = str(expr)
    again = _parse_or_skip(text)
    assert again == expr
    assert str(again) == text


_DOCS = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.sampled_from(["", "a", "b"]),
    lambda inner: st.dictionaries(_NAMES, inner, max_size=3),
    max_leaves=6,
).filter(lambda d: isinstance(d, dict))


@given(EXPRS, _DOCS)
def test_not_and_or_keep_three_valued_logic(expr: Expr, doc: dict[str, Any]) -> None:
    value = evaluate(expr, doc)
    negated = evaluate(Not(expr), doc)
    if value is MISSING or value is None:
        assert negated is value
    else:
        assert matches(Not(expr), doc) is not matches(expr, doc)
    assert matches(And((expr, Not(expr))), doc) is False
    assert matches(Or((expr, Not(expr))), doc) is (value is not MISSING and value is not None)


_WORDS = st.sampled_from(
    [" ", "a", "b.c", "`in`", "1", "-2.5", "'x'", '"y"', "'", "AND", "or", "NOT", "in", "is",
     "null", "missing", "valued", "true", "=", "<>", ">=", "(", ")", "[", "]", ",", "\\", "~",
     "\n"]
)  # fmt: skip


@given(st.lists(_WORDS, max_size=12).map(" ".join))
def test_any_text_parses_or_raises_where_error(text: str) -> None:
    try:
        expr = parse_where(text)
    except WhereError as exc:
        assert "\n" not in str(exc)
        return
    assert parse_where(str(expr)) == expr


# ---------------------------------------------------------------------------------------------
# Where a condition travels: handshake, configuration, store, router


def _reply(*indexes: p.IndexDefinition) -> p.HandshakeReply:
    return p.HandshakeReply(indexes, 4, (0, 1, 2, 3), ())


def test_handshake_reply_carries_where_only_when_set() -> None:
    reply = _reply(p.IndexDefinition("all", ("age",)), p.IndexDefinition("adults", ("age",), "a"))
    frame = p.encode(reply)
    assert frame.count(b'"where"') == 1
    decoder = p.FrameDecoder()
    decoder.feed(frame)
    assert decoder.messages() == [reply]
    # A reply without any where (an older daemon's) still decodes, to indexes without one.
    old = b'{"indexes":[{"name":"a","keys":["x"]}],"num_vbuckets":4,"owned":[0],"restart":[]}'
    message = p.decode_payload(p.MessageType.HANDSHAKE_REPLY, old)
    assert isinstance(message, p.HandshakeReply)
    assert message.indexes == (p.IndexDefinition("a", ("x",)),)
    bad = old.replace(b'["x"]}', b'["x"],"where":1}')
    with pytest.raises(p.ProtocolError, match="where must be a string"):
        p.decode_payload(p.MessageType.HANDSHAKE_REPLY, bad)


def test_config_accepts_a_where_and_stores_its_canonical_text() -> None:
    config = parse_config('[indexes.adults]\nkeys = ["age"]\nwhere = "age>=18 AND x IN [\'a\']"\n')
    assert config.indexes[0].where == 'age >= 18 AND x IN ["a"]'
    assert parse_config('[indexes.all]\nkeys = ["age"]\n').indexes[0].where is None
    with pytest.raises(ConfigError) as info:
        parse_config('[indexes.adults]\nkeys = ["age"]\nwhere = "age >>= 18"\n')
    assert str(info.value).startswith("indexes.adults.where: expected a field or a value")
    assert "position" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ConfigError, match=r"indexes\.adults\.where: a condition as a string"):
        parse_config('[indexes.adults]\nkeys = ["age"]\nwhere = 18\n')


def test_store_keeps_the_where_and_refuses_a_changed_one(tmp_path: Path) -> None:
    adults = p.IndexDefinition("adults", ("age",), "age >= 18")
    with IndexStore(tmp_path) as store:
        store.ensure_indexes([adults, p.IndexDefinition("all", ("age",))])
        store.create_index(p.IndexDefinition("late", ("name",), "name IS VALUED"))
    with IndexStore(tmp_path) as store:
        wheres = {i.definition.name: i.definition.where for i in store.all_indexes()}
        assert wheres == {"adults": "age >= 18", "all": None, "late": "name IS VALUED"}
        assert store.ensure_indexes([adults])[0].definition == adults
        with pytest.raises(StoreError, match="stored with where 'age >= 18', not 'age >= 21'"):
            store.ensure_indexes([p.IndexDefinition("adults", ("age",), "age >= 21")])
        with pytest.raises(StoreError, match="stored with where None"):
            store.ensure_indexes([p.IndexDefinition("all", ("age",), "age >= 21")])


def test_router_sends_an_empty_key_when_the_where_is_not_true() -> None:
    reply = _reply(
        p.IndexDefinition("all", ("age",)),
        p.IndexDefinition("adults", ("age",), "age >= 18 AND active"),
    )
    encoder = StreamEncoder(reply)
    docs = [
        Document("a", {"age": 20, "active": True}),
        Document("b", {"age": 10, "active": True}),
        Document("c", {"age": 30}),
        Document("a", {"age": 5, "active": True}),
        Document("d", None),
    ]
    frames = [f for d in docs for f in encoder.add(d)] + encoder.finish()
    decoder = p.FrameDecoder()
    decoder.feed(b"".join(frames))
    mutations = [
        m for b in decoder.messages() if isinstance(b, p.MutationBatch) for m in b.mutations()
    ]
    got = [(m.docid, [bool(k) for k in m.keys]) for m in sorted(mutations, key=lambda m: m.seqno)]
    assert sorted(got) == [
        (b"a", [True, False]),
        (b"a", [True, True]),
        (b"b", [True, False]),
        (b"c", [True, False]),
        (b"d", [False, False]),
    ]
    assert [keys for docid, keys in got if docid == b"a"] == [[True, True], [True, False]]
    with pytest.raises(FeedError, match="bad where"):
        StreamEncoder(_reply(p.IndexDefinition("x", ("a",), "a ==")))
