"""The budgets of the randomized tests: hypothesis examples and bounded fuzzing runs.

Each test file names its budget for `make test`; INDEXER_TEST_EXAMPLES multiplies them all
(`INDEXER_TEST_EXAMPLES=10` gives ten times the examples and ten times the fuzzing time, as the
soak runs them; 0.2 a fifth, never less than one example).
"""

from __future__ import annotations

import os

ENV = "INDEXER_TEST_EXAMPLES"


def factor() -> float:
    """The multiplier INDEXER_TEST_EXAMPLES sets (1 without it)."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return 1.0
    value = float(text)
    if not value > 0:
        raise ValueError(f"{ENV} must be a positive number, not {text!r}")
    return value


def examples(base: int) -> int:
    """A hypothesis budget of `base` examples, scaled (at least one)."""
    return max(1, round(base * factor()))


def seconds(base: float) -> float:
    """A bounded run of `base` seconds, scaled."""
    return base * factor()
