"""Queue memory for the indexer: slab pool, per-worker mutation rings and the memory throttle."""

from slab.pool import SlabPool, SlabStatistics
from slab.ring import MutationRing, RingStatistics
from slab.throttle import MemoryThrottle, ThrottlePolicy, ThrottleStatistics, parse_size

__all__ = [
    "MemoryThrottle",
    "MutationRing",
    "RingStatistics",
    "SlabPool",
    "SlabStatistics",
    "ThrottlePolicy",
    "ThrottleStatistics",
    "parse_size",
]
