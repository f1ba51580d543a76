"""The bulk codec (indexer/router/inputs/bulk.py) and the visibility waits, without sockets."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from indexer import protocol as p
from indexer.router.inputs import bulk
from indexer.router.source.visibility import BarrierTurn, Visibility


def test_lines_are_numbered_blanks_skipped_and_each_bad_line_says_why() -> None:
    body = b'{"id":"a","doc":{"x":1}}\n\n  \n{"id":2,"deleted":true}\r\nnope\n{"doc":{}}\n\xff\n'
    lines = bulk.parse_bulk(bulk.split_lines(body))
    assert [line.number for line in lines] == [1, 4, 5, 6, 7]
    assert [line.document.docid if line.document else None for line in lines] == [
        "a", "2", None, None, None
    ]  # fmt: skip
    errors = {line.number: line.error for line in lines if line.error}
    assert "not JSON" in (errors[5] or "") and "not UTF-8" in (errors[7] or "")
    assert '"id"' in (errors[6] or "")


def test_the_answer_orders_items_by_line_and_gives_the_last_seqno_per_vbucket() -> None:
    lines = bulk.parse_bulk([(1, b'{"id":"a","doc":{}}'), (2, b"{"), (3, b'{"id":"b","doc":{}}')])
    items = [
        bulk.appended_item(lines[2], 5, 9),
        bulk.error_item(lines[1], "bad"),
        bulk.appended_item(lines[0], 5, 8),
    ]
    at_plus: dict[int, int] = {}
    bulk.raise_to(at_plus, [(5, 9), ("5", 8), (7, 1)])
    answer = bulk.answer(items, 2, at_plus, "persisted", 0.5)
    assert [item["line"] for item in answer["items"]] == [1, 2, 3]
    assert answer["at_plus"] == {"5": 9, "7": 1}
    assert (answer["appended"], answer["failed"], answer["errors"]) == (2, 1, True)
    assert answer["items"][1] == {"line": 2, "error": "bad"}  # no id could be read


def test_groups_stay_under_the_limit_and_keep_order() -> None:
    lines = bulk.parse_bulk((n, b'{"id":"%d","doc":{}}' % n) for n in range(1, 40))
    groups = list(bulk.groups(lines, 100))
    assert [line for group in groups for line in group] == lines
    assert all(sum(len(line.raw) for line in group) <= 100 for group in groups)
    assert len(list(bulk.groups(lines[:1], 1))) == 1  # one line over the limit is one group


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ({"wait": ["soon"]}, "wait must be"),
        ({"wait": ["visible", "visible"]}, "given 2 times"),
        ({"timeout": ["x"]}, "seconds"),
        ({"timeout": ["0"]}, "above 0"),
        ({"pretty": ["1"]}, "unknown parameter"),
        ({"items": ["some"]}, "items must be all or errors"),
    ],
)
def test_bad_queries_are_refused(query: dict[str, list[str]], message: str) -> None:
    with pytest.raises(bulk.BulkError, match=message):
        bulk.parse_query(query)


def test_a_good_query() -> None:
    assert bulk.parse_query({}) == bulk.BulkRequest("persisted", 30.0, "all")
    assert bulk.parse_query({"items": ["errors"]}).items == "errors"
    assert bulk.parse_query({"wait": ["visible"], "timeout": ["2.5"]}) == bulk.BulkRequest(
        "visible", 2.5
    )


def reply(cookie: int, **seqnos: int) -> p.BarrierReply:
    positions = tuple(p.VbucketPosition(int(vb[1:]), s, 1) for vb, s in seqnos.items())
    return p.BarrierReply(cookie, False, positions)


async def test_a_wait_ends_when_every_node_of_the_vbuckets_can_read_them() -> None:
    wakes: list[int] = []
    visibility = Visibility(lambda: wakes.append(1))
    visibility.connected("a", [1, 2])
    visibility.connected("b", [2, 3])
    turn_a = BarrierTurn(visibility, "a", lambda: None)
    turn_b = BarrierTurn(visibility, "b", lambda: None)
    assert turn_a.due(10) is None  # nobody waits
    result: list[list[str]] = []

    async def waiter() -> None:
        result.append(await visibility.wait({1: 5, 2: 7}, 10))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        assert wakes  # the streams were woken to send barriers
        cookie_a, cookie_b = turn_a.due(10), turn_b.due(4)
        assert cookie_a == 1 and cookie_b == 1
        assert turn_a.due(11) is None  # one barrier out at a time
        turn_a.answered(reply(1, v1=5, v2=7))
        await trio.testing.wait_all_tasks_blocked()
        assert not result  # b streams vbucket 2 too and cannot read seqno 7 yet
        turn_b.answered(reply(1, v2=6, v3=1))
        await trio.testing.wait_all_tasks_blocked()
        assert not result
        assert turn_b.due(4) is None  # nothing new sent since its last barrier
        cookie_b = turn_b.due(9)
        assert cookie_b == 2
        turn_b.answered(reply(2, v2=9))
    assert result == [[]]
    assert visibility.waiting == 0


async def test_a_wait_for_a_vbucket_no_node_streams_times_out_saying_so() -> None:
    visibility = Visibility(lambda: None)
    visibility.connected("a", [1])
    lagging = await visibility.wait({1: 0, 7: 3}, 0.05)
    assert lagging == ["1 vbucket that no node streams yet"]


def test_the_ack_rule_waits_for_all_owners_of_a_vbucket_or_a_majority() -> None:
    def three_owners(rule: str) -> Visibility:
        visibility = Visibility(lambda: None, rule)
        for name in ("a", "b", "c"):  # vbucket 1's active node and its two replicas
            visibility.connected(name, [1])
        visibility.connected("d", [2])  # vbucket 2's only owner
        return visibility

    every, most = three_owners("all"), three_owners("majority")
    for visibility in (every, most):
        visibility.answered("a", reply(1, v1=9))
        assert visibility.behind({1: 9}) == ["b", "c"]  # one of three is no majority
        visibility.answered("b", reply(1, v1=9))
        visibility.answered("d", reply(1, v2=3))
    assert every.behind({1: 9, 2: 3}) == ["c"]  # c is down, say: all waits for it
    assert most.behind({1: 9, 2: 3}) == []  # two of three read it
    assert most.behind({1: 9, 2: 4}) == ["d"]  # of one owner, the majority is that one
    with pytest.raises(ValueError, match="ack rule"):
        Visibility(lambda: None, "most")
