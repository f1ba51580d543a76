"""Document expiry: `_exp` formats (indexer/router/expiry.py) and the source log's expiry index,
which follows each document's latest version through updates, deletes, failovers and reopening."""

from __future__ import annotations

from pathlib import Path

import pytest

from indexer.router.documents import Document, DocumentError
from indexer.router.expiry import RELATIVE_LIMIT_S, absolute_expiry, with_absolute_expiry
from indexer.router.source.log import SourceLog

NOW = 1_800_000_000.25


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        (0, None),
        (10, 1_800_000_011),  # a time to live, rounded up
        (10.5, 1_800_000_011),
        ("10", 1_800_000_011),
        (RELATIVE_LIMIT_S - 1, 1_800_000_000 + RELATIVE_LIMIT_S),
        (RELATIVE_LIMIT_S, RELATIVE_LIMIT_S),  # from 30 days on: a unix time
        (1_900_000_000, 1_900_000_000),
        ("2027-01-15T08:00:00Z", 1_800_000_000),
        ("2027-01-15T09:00:00+01:00", 1_800_000_000),
        ("2027-01-15T08:00:00", 1_800_000_000),  # no zone: UTC
    ],
)
def test_exp_values(value: object, expected: int | None) -> None:
    assert absolute_expiry(value, NOW) == expected


@pytest.mark.parametrize("value", [True, -1, "soon", float("nan"), [1], {"s": 1}])
def test_bad_exp_values_are_refused(value: object) -> None:
    with pytest.raises(DocumentError, match="_exp"):
        absolute_expiry(value, NOW)


def test_a_document_keeps_its_body_but_an_absolute_exp() -> None:
    doc = Document("d", {"a": 1, "_exp": 5})
    assert with_absolute_expiry(doc, NOW) == Document("d", {"a": 1, "_exp": 1_800_000_006})
    stored = with_absolute_expiry(doc, NOW)
    assert with_absolute_expiry(stored, NOW + 100) == stored  # absolute: unchanged later
    for unchanged in (Document("d", {"a": 1}), Document("d", None), Document("d", {"_exp": 0})):
        assert with_absolute_expiry(unchanged, NOW) is unchanged


def test_the_expiry_index_follows_the_latest_version(tmp_path: Path) -> None:
    with SourceLog(tmp_path, 4) as log:
        log.append(
            [
                Document("a", {"_exp": 10}),
                Document("b", {"_exp": 20}),
                Document("c", {"x": 1}),
                Document("d", {"_exp": 30}),
                Document("e", {"_exp": 5}),
            ],
            NOW,
        )
        assert log.due_expiries(NOW) == []
        assert log.due_expiries(NOW + 11) == ["e", "a"]
        assert log.pending_expiries == 4
        # Updated without expiry, deleted, given a later expiry: the old entries go.
        log.append(
            [Document("a", {"x": 2}), Document("b", None), Document("e", {"_exp": 100})], NOW
        )
        assert log.due_expiries(NOW + 40) == ["d"]
        assert log.due_expiries(NOW + 200) == ["d", "e"]
        assert log.due_expiries(NOW + 200, limit=1) == ["d"]
    with SourceLog(tmp_path) as log:  # kept across a reopen
        assert log.pending_expiries == 2
        assert log.due_expiries(NOW + 200) == ["d", "e"]


def test_a_failover_brings_back_the_expiries_of_the_surviving_versions(tmp_path: Path) -> None:
    with SourceLog(tmp_path, 1) as log:
        log.append([Document("a", {"_exp": 10}), Document("b", {"x": 1})], NOW)  # seqnos 1, 2
        log.append([Document("a", {"x": 2}), Document("b", {"_exp": 20})], NOW)  # seqnos 3, 4
        assert log.due_expiries(NOW + 100) == ["b"]
        log.failover(0, 2)  # the second batch is lost: a expires again, b does not
        assert log.due_expiries(NOW + 100) == ["a"]
        assert log.pending_expiries == 1
        log.failover(0, 0)
        assert log.due_expiries(NOW + 100) == [] and log.pending_expiries == 0
