"""CPU per document per stage, from a py-spy sampling profile of one process.

    python bench/stages.py PROFILE.txt --cpu-s SECONDS --documents N [--depth 1]

PROFILE.txt is py-spy's raw output (`py-spy record --format raw`): one line per distinct stack,
root first, frames as `function (path:line)`, then the number of samples. Each sample is
charged to the innermost frame of the project's own code (a module of indexer/, workers/ or
slab/): the C and library code it calls (orjson, plyvel, the socket) counts for the module
that called it, so a stage is a module with what it asks of libraries. Samples without a
project frame, or whose innermost one only started trio's scheduler (the samples of the
scheduler itself, between tasks: `trio.run` called from the command's entry point), are
"runtime". A stage's CPU
per document is its share of the samples times the process's CPU seconds over N.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("indexer", "workers", "slab")
RUNTIME = "runtime"
SCHEDULER = ("run", "unrolled_run", "start_guest_run")  # trio's, in trio/_core/_run.py
_FRAME = re.compile(r"^(?P<function>.*) \((?P<path>[^()]*?)(?::(?P<line>\d+))?\)$")


@dataclass(frozen=True)
class Stage:
    """One stage of a process's profile: its samples, their share, and CPU per document."""

    name: str
    samples: int
    share: float
    us_per_document: float


def module_of(path: str) -> str | None:
    """The project module a frame's file is (indexer.router.streams.records), else None."""
    parts = Path(path).with_suffix("").parts
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] in PACKAGES and "site-packages" not in parts[:i]:
            name = ".".join(parts[i:])
            return name.removesuffix(".__init__")
    return None


def _in_scheduler(frames: Sequence[str]) -> bool:
    """Whether frames (those inside the innermost project frame) are trio's scheduler."""
    for frame in frames:
        match = _FRAME.match(frame)
        if (
            match is not None
            and match["function"] in SCHEDULER
            and match["path"].replace("\\", "/").endswith("trio/_core/_run.py")
        ):
            return True
    return False


def stage_of(stack: Sequence[str], depth: int = 0) -> str:
    """The stage a sample's stack (root first) is charged to: its innermost project module,
    with the function when `depth` > 0 (module:function)."""
    for at in range(len(stack) - 1, -1, -1):
        match = _FRAME.match(stack[at])
        if match is None:
            continue
        module = module_of(match["path"])
        if module is not None:
            if _in_scheduler(stack[at + 1 :]):
                return RUNTIME
            return f"{module}:{match['function']}" if depth else module
    return RUNTIME


def read_samples(lines: Iterable[str], depth: int = 0) -> Counter[str]:
    """Samples per stage of py-spy's raw lines."""
    counts: Counter[str] = Counter()
    for line in lines:
        line = line.rstrip("\n")
        if not line:
            continue
        stack_text, _, count = line.rpartition(" ")
        counts[stage_of(stack_text.split(";"), depth)] += int(count)
    return counts


def stages(counts: Counter[str], cpu_s: float, documents: int) -> list[Stage]:
    """The stages, most CPU first."""
    total = sum(counts.values())
    if total == 0 or documents <= 0:
        return []
    per_sample_us = cpu_s / total / documents * 1e6
    return [Stage(name, n, n / total, n * per_sample_us) for name, n in counts.most_common()]


def table(found: Sequence[Stage], limit: int = 20) -> str:
    """The stages as lines: µs per document, share, samples, name; the rest summed."""
    lines = [f"{'µs/doc':>8} {'share':>6} {'samples':>8}  stage"]
    shown = list(found[:limit])
    for s in shown:
        lines.append(f"{s.us_per_document:8.2f} {s.share:6.1%} {s.samples:8d}  {s.name}")
    rest = found[limit:]
    if rest:
        us = sum(s.us_per_document for s in rest)
        share = sum(s.share for s in rest)
        samples = sum(s.samples for s in rest)
        lines.append(f"{us:8.2f} {share:6.1%} {samples:8d}  ({len(rest)} more)")
    total = sum(s.us_per_document for s in found)
    lines.append(f"{total:8.2f} {1:6.1%} {sum(s.samples for s in found):8d}  all")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("profile", type=Path)
    parser.add_argument("--cpu-s", type=float, required=True, help="the process's CPU seconds")
    parser.add_argument("--documents", type=int, required=True)
    parser.add_argument("--depth", type=int, default=0, help="1: per function, not module")
    parser.add_argument("--limit", type=int, default=20)
    opts = parser.parse_args(argv)
    with opts.profile.open() as f:
        counts = read_samples(f, opts.depth)
    print(table(stages(counts, opts.cpu_s, opts.documents), opts.limit))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
