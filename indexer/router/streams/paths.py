"""Plain field paths read from a document's JSONL line, with only those paths decoded (pure).

A parsed document costs several times its parse once it is held: a dict and a string per field,
tracked by the cycle collector. An index on plain paths needs a few values of each document, so
`LinePaths` decodes the line with msgspec into small structs that hold just those values and
skips the rest in C. The values are the ones a full parse gives (a property test holds the two to
the same answer); where a line cannot be read this way (a path goes through a value that is not
an object, a number beyond a double), `read` raises `Unreadable` and the caller parses the line.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter
from typing import Any

import msgspec

from indexer.keys import MISSING

Unreadable = msgspec.DecodeError
"""The line's paths cannot be read without a full parse (msgspec's error, ValidationError too)."""

_LEAF = ""  # a tree node's mark that a path ends there ("" is never a step of a plain path)


def _tree(paths: Sequence[tuple[str, ...]]) -> dict[str, Any]:
    """The paths as a tree of their steps; a node where a path ends holds _LEAF."""
    tree: dict[str, Any] = {}
    for steps in paths:
        node = tree
        for step in steps:
            node = node.setdefault(step, {})
        node[_LEAF] = True
    return tree


class LinePaths:
    """The values at `paths` (field steps under the line's "doc") of lines in the JSONL shape.

    A path's node is a struct field down to the first step where some path ends; that field
    holds the whole value (any JSON), and the path's remaining steps are read from it as dicts.
    An absent field reads as MISSING, and an absent object as its struct's empty instance, so
    one `attrgetter` call (in C) reads every path.
    """

    def __init__(self, paths: Sequence[tuple[str, ...]]) -> None:
        self.paths = [tuple(steps) for steps in paths]
        count = 0

        def struct_of(node: dict[str, Any]) -> tuple[type, dict[str, tuple[str, Any]]]:
            """A node's struct, and per step its field's attribute and its child's (struct,
            steps) (None where a path ends: the field holds the whole value)."""
            nonlocal count
            fields: list[tuple[str, Any, Any]] = []
            rename: dict[str, str] = {}
            steps: dict[str, tuple[str, Any]] = {}
            for step, child in node.items():
                if step == _LEAF:
                    continue
                # Attributes are generated: a step may be a keyword or start with "_".
                attribute = f"f{count}"
                count += 1
                rename[attribute] = step
                inner = None if _LEAF in child else struct_of(child)
                steps[step] = (attribute, inner)
                if inner is None:
                    fields.append((attribute, Any, MISSING))
                else:  # frozen: one empty instance is every absent object's default
                    fields.append((attribute, inner[0], inner[0]()))
            struct = msgspec.defstruct("Fields", fields, rename=rename, gc=False, frozen=True)
            return struct, steps

        doc, top = struct_of(_tree(self.paths))
        line = msgspec.defstruct("Line", [("doc", doc, doc())], gc=False, frozen=True)
        self._decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder(line)
        dotted: list[str] = []
        # Paths that go on below a node where a shorter path ends: (position, dict keys).
        self._below: list[tuple[int, tuple[str, ...]]] = []
        for path in self.paths:
            attributes = ["doc"]
            level = top
            for i, step in enumerate(path):
                attribute, inner = level[step]
                attributes.append(attribute)
                if inner is None:
                    if path[i + 1 :]:
                        self._below.append((len(dotted), path[i + 1 :]))
                    break
                level = inner[1]
            dotted.append(".".join(attributes))
        self._get = attrgetter(*dotted) if dotted else None
        self._one = len(dotted) == 1

    def read(self, line: bytes) -> list[Any]:
        """The value at each path (MISSING where absent); `Unreadable` if it takes a full parse."""
        get = self._get
        if get is None:
            return []
        got = get(self._decoder.decode(line))
        values: list[Any] = [got] if self._one else list(got)
        for at, keys in self._below:
            value = values[at]
            for key in keys:
                value = value.get(key, MISSING) if type(value) is dict else MISSING
            values[at] = value
        return values
