"""The router's record encoder: its fast path gives exactly the keys of `index_key`, index by
index, and a key no index can hold is left out of that index only."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from indexer import protocol as p
from indexer.keys import KeyEncodingError, index_key
from indexer.router.documents import Document
from indexer.router.streams.records import RecordEncoder
from tests.budget import examples

INDEXES = [
    p.IndexDefinition("ab_c", ("a.b", "c")),
    p.IndexDefinition("c", ("c",)),
    p.IndexDefinition("a", ("a",)),
    p.IndexDefinition("c_ab_d", ("c", "a.b", "d.e.f")),
]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from(["a", "b", "c", "d", "e", "f"]), inner, max_size=3),
    ),
    max_leaves=8,
)
documents = st.dictionaries(st.sampled_from(["a", "b", "c", "d", "x"]), values, max_size=4)


def reference(body: dict[str, Any]) -> tuple[bytes, ...]:
    keys = []
    for index in INDEXES:
        try:
            keys.append(index_key(body, index.keys))
        except KeyEncodingError:
            keys.append(b"")  # left out of that index
    return tuple(keys)


@settings(max_examples=examples(150), deadline=None)
@given(st.lists(documents, min_size=1, max_size=8))
def test_the_fast_path_gives_the_keys_of_index_key(bodies: list[dict[str, Any]]) -> None:
    encoder = RecordEncoder(INDEXES)
    for i, body in enumerate(bodies * 2):  # twice: the second time from the scalar cache
        assert encoder.keys(Document(f"d{i}", body), i) == reference(body), body


def test_equal_scalars_of_other_types_keep_their_own_keys() -> None:
    encoder = RecordEncoder([p.IndexDefinition("c", ("c",))])
    for value in (1, True, 1.0, "1", 0, False, None):
        assert encoder.keys(Document("d", {"c": value})) == (index_key({"c": value}, ("c",)),)


@settings(max_examples=examples(100), deadline=None)
@given(
    st.lists(st.one_of(st.none(), documents), min_size=1, max_size=8),
    st.sampled_from([p.DEFAULT_MAX_FRAME_BYTES, 160]),
)
def test_records_of_stored_items_are_those_of_their_parsed_documents(
    bodies: list[dict[str, Any] | None], max_frame_bytes: int
) -> None:
    """A Mutation Manager item (seqno, docid, payload) encodes as its document parsed would: a
    delete without a payload, keys read from the line, and a line that is not strict JSON
    (NaN), a path through a non-object or a record over a small frame the full way."""
    import json

    encoder = RecordEncoder(INDEXES, max_frame_bytes)
    items: list[tuple[int, bytes, bytes | None]] = []
    expected = []
    reference_encoder = RecordEncoder(INDEXES, max_frame_bytes)
    for i, body in enumerate(bodies):
        docid = f"d{i}é"
        line = None if body is None else json.dumps({"id": docid, "doc": body}).encode()
        items.append((i + 1, docid.encode(), line))
        expected.append(reference_encoder.record(i + 1, Document(docid, body)))
    assert encoder.stored_records(items) == expected
    if max_frame_bytes == p.DEFAULT_MAX_FRAME_BYTES:
        # And against the model: `index_key` of the body as written, not as any code re-read it.
        for (seqno, docid, _), body, record in zip(items, bodies, expected, strict=True):
            mutation = p.parse_record(record[4:], len(INDEXES))
            assert (mutation.seqno, mutation.docid) == (seqno, docid)
            assert mutation.deleted == (body is None)
            assert mutation.keys == ((b"",) * len(INDEXES) if body is None else reference(body))
