"""Aggregates computed in the index (GSI's aggregate pushdown): per group of a leading prefix of
the keys, count, count_distinct, min, max, sum and avg of a key position.

The input is a scan's entry batches (`scans.entry_batches`): distinct keys decoded once per
batch, with their rows' codes. Entries come in index order, so the rows of one group are
contiguous: each group is finished, and given out, as soon as the next one starts, and memory
holds one group at a time (and, for count_distinct, its distinct values). Sans-IO.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from indexer.keys import MISSING, collate
from indexer.scans import EntryBatch, json_text, key_names

FUNCTIONS = ("count", "count_distinct", "min", "max", "sum", "avg")
_CALL = re.compile(r"^(count|count_distinct|min|max|sum|avg)(?:\((.+)\))?$")


class AggregateError(ValueError):
    """An aggregate request that cannot be answered: the message says why."""


@dataclass(frozen=True)
class Aggregate:
    """One aggregate: its function, the key position it reads (-1: the rows, for count), and
    its name in the answer (`avg(age)`)."""

    function: str
    position: int
    name: str


def parse_aggregates(text: str, paths: Sequence[str]) -> list[Aggregate]:
    """`count,min(age),avg(age)`: comma-separated functions of the index's keys, each named
    by its path, its text or its column name (`scans.key_names`)."""
    names = key_names(paths)
    out = []
    for item in (part.strip() for part in text.split(",")):
        found = _CALL.match(item)
        if found is None:
            raise AggregateError(
                f"aggregates: {item!r} is not one of {', '.join(FUNCTIONS)} (of a key path: "
                "min(age)); count alone counts the rows"
            )
        function, path = found.group(1), found.group(2)
        if path is None:
            if function != "count":
                raise AggregateError(f"aggregates: {function} needs a key path: {function}(PATH)")
            out.append(Aggregate("count", -1, "count"))
            continue
        position = names.get(path.strip())
        if position is None:
            keys = ", ".join(paths)
            raise AggregateError(f"aggregates: {path!r} is not a key of the index ({keys})")
        out.append(Aggregate(function, position, f"{function}({path})"))
    if not out or len({a.name for a in out}) != len(out):
        raise AggregateError("aggregates: one or more, each once")
    return out


def decoded_values(group_by: int, aggregates: Sequence[Aggregate]) -> int:
    """How many leading key values the aggregates need decoded: the groups' and those read."""
    return max([group_by, *(a.position + 1 for a in aggregates)])


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _distinct(value: Any) -> Any:
    """A hashable stand-in for a key value (arrays and objects by their JSON text)."""
    return json_text(value) if isinstance(value, list | dict) else (type(value), value)


@dataclass
class _Group:
    """One group's figures so far, per key position read."""

    key: tuple[Any, ...]
    rows: int = 0
    present: dict[int, int] = field(default_factory=dict)  # rows with a value (not MISSING/null)
    seen: dict[int, set[Any]] = field(default_factory=dict)
    low: dict[int, Any] = field(default_factory=dict)
    high: dict[int, Any] = field(default_factory=dict)
    total: dict[int, float] = field(default_factory=dict)
    numbers: dict[int, int] = field(default_factory=dict)

    def add(self, values: Sequence[Any], count: int, needs: dict[int, set[str]]) -> None:
        """The rows of one distinct key: `count` of them; `needs`: the functions per position."""
        self.rows += count
        for p, functions in needs.items():
            value = values[p]
            if value is MISSING or value is None:
                continue  # as N1QL's aggregates: MISSING and null are left out
            self.present[p] = self.present.get(p, 0) + count
            if "count_distinct" in functions:
                self.seen.setdefault(p, set()).add(_distinct(value))
            if "min" in functions and (p not in self.low or collate(value, self.low[p]) < 0):
                self.low[p] = value
            if "max" in functions and (p not in self.high or collate(value, self.high[p]) > 0):
                self.high[p] = value
            if _number(value):
                self.total[p] = self.total.get(p, 0) + value * count
                self.numbers[p] = self.numbers.get(p, 0) + count

    def answer(self, aggregates: Sequence[Aggregate]) -> dict[str, Any]:
        out: dict[str, Any] = {"group": [None if v is MISSING else v for v in self.key]}
        missing = [i for i, v in enumerate(self.key) if v is MISSING]
        if missing:
            out["missing"] = missing
        for a in aggregates:
            p = a.position
            if a.function == "count":
                out[a.name] = self.rows if p < 0 else self.present.get(p, 0)
            elif a.function == "count_distinct":
                out[a.name] = len(self.seen.get(p, ()))
            elif a.function == "min":
                out[a.name] = self.low.get(p)
            elif a.function == "max":
                out[a.name] = self.high.get(p)
            elif a.function == "sum":
                out[a.name] = self.total.get(p) if p in self.numbers else None
            else:
                n = self.numbers.get(p)
                out[a.name] = self.total[p] / n if n else None
        return out


def aggregate(
    batches: Iterable[EntryBatch], group_by: int, aggregates: Sequence[Aggregate]
) -> Iterator[dict[str, Any]]:
    """The groups of the entries (by their first `group_by` key values; 0: one group of all), in
    index order, each with its aggregates."""
    needs: dict[int, set[str]] = {}
    for a in aggregates:
        if a.position >= 0:
            needs.setdefault(a.position, set()).add(a.function)
    group: _Group | None = None
    for batch in batches:
        counts = np.bincount(np.asarray(batch.codes), minlength=len(batch.keys)).tolist()
        # A batch's distinct keys are coded in the order they first come: index order.
        for values, count in zip(batch.keys, counts, strict=True):
            if not count:
                continue
            key = tuple(values[:group_by])
            if group is None or not (
                (key == group.key and all(map(_alike, key, group.key))) or _same(group.key, key)
            ):
                if group is not None:
                    yield group.answer(aggregates)
                group = _Group(key)
            group.add(values, count, needs)
    if group is not None:
        yield group.answer(aggregates)
    elif group_by == 0:
        yield _Group(()).answer(aggregates)  # no entries: one empty group, as SQL's COUNT(*)


def _alike(a: Any, b: Any) -> bool:
    """Values Python finds equal are one group value when of one type (True == 1 is not)."""
    return type(a) is type(b)


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether two group keys are equal by N1QL collation (1 and 1.0 are one group)."""
    return all(
        (x is MISSING) == (y is MISSING) and (x is MISSING or collate(x, y) == 0)
        for x, y in zip(a, b, strict=True)
    )
