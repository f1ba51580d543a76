"""A reproducible workload: a seeded stream of upserts and deletes over a fixed key space."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any

import trio

from indexer.router.documents import Document

GENERATE_BATCH = 10_000  # generated documents appended as one synced batch
RATE_TICK_S = 0.05  # a rate-limited generator appends what is due this often

CITIES = [
    "Amsterdam", "Berlin", "Cairo", "Delhi", "Edinburgh", "Florence", "Geneva", "Hanoi",
    "Istanbul", "Jakarta", "Kyoto", "Lima", "Madrid", "Nairobi", "Oslo", "Paris", "Quito",
    "Rome", "Seoul", "Tokyo", "Utrecht", "Vienna", "Warsaw", "Xi'an", "York", "Zurich",
]  # fmt: skip


@dataclass(frozen=True)
class Workload:
    """`mutations` changes over `keys` document ids; a `delete_ratio` share are deletes."""

    mutations: int
    keys: int = 0  # 0: a fifth of the mutations
    delete_ratio: float = 0.1
    seed: int = 42

    @property
    def key_space(self) -> int:
        return self.keys or max(1, self.mutations // 5)


def _document(rng: random.Random, n: int) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "name": f"user{rng.randrange(1_000_000)}",
        "age": rng.randrange(18, 90),
        "score": round(rng.uniform(-100, 100), 3),
        "active": rng.random() < 0.5,
        "address": {"city": rng.choice(CITIES), "zip": f"{rng.randrange(100000):05d}"},
        "tags": rng.sample(["a", "b", "c", "d", "e"], rng.randrange(0, 3)),
    }
    r = rng.random()
    if r < 0.03:
        del doc["address"]["city"]  # not in indexes led by address.city
    elif r < 0.06:
        doc["age"] = None
    elif r < 0.08:
        del doc["age"]  # a trailing MISSING component
    elif r < 0.10:
        doc["age"] = rng.uniform(18, 90)  # floats mixed with ints
    doc["n"] = n
    return doc


def generate(workload: Workload) -> Iterator[Document]:
    """The workload's documents in order; the same workload always gives the same stream."""
    rng = random.Random(workload.seed)
    space = workload.key_space
    for n in range(workload.mutations):
        docid = f"doc{rng.randrange(space):08d}"
        if rng.random() < workload.delete_ratio:
            yield Document(docid, None)
        else:
            yield Document(docid, _document(rng, n))


async def paced(documents: Iterator[Document], rate: float | None) -> AsyncIterator[list[Document]]:
    """The documents in batches: as fast as they are taken, or about `rate` per second in
    small batches (a steady feed for demos and benchmarks). Ends after the last."""
    started = trio.current_time()
    total = 0
    while True:
        if rate is None:
            size = GENERATE_BATCH
        else:
            await trio.sleep(RATE_TICK_S)
            size = min(int((trio.current_time() - started) * rate) - total, GENERATE_BATCH)
        batch = list(islice(documents, max(size, 0)))
        total += len(batch)
        if batch:
            yield batch
        if size > 0 and len(batch) < size:
            return
