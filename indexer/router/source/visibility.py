"""Read-your-writes for the router's inputs: what each node can read, and who waits for it.

A bulk request with `wait=visible` registers the seqnos it appended and wakes the node streams.
A node stream with everything sent and someone waiting sends a barrier; the node answers it
once everything sent before it is in a readable snapshot, with the seqnos that covers per
vbucket. The request is answered when the owners of each of its vbuckets can read it: by the
ack rule, every node that streams the vbucket (`all`, the default: its active node and its
replicas), or more than half of them (`majority`: a dead or stopped replica does not hold the
answer up, and a failover to any of the others loses none of it; docs/cluster.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

import trio

from indexer import protocol as p

ACK_RULES = ("all", "majority")  # which owners of a vbucket a wait=visible request waits for


class NodeReadable:
    """One node's maintenance stream: its vbuckets and the seqnos it can read of each."""

    def __init__(self, vbuckets: Iterable[int]) -> None:
        self.vbuckets = frozenset(vbuckets)
        self.readable: dict[int, int] = {}


class Visibility:
    """What the nodes can read, by consumer name, and how many requests wait for more."""

    def __init__(self, wake: Callable[[], None], rule: str = "all") -> None:
        if rule not in ACK_RULES:
            raise ValueError(f"ack rule: {rule!r} is not one of {', '.join(ACK_RULES)}")
        self.wake = wake  # the node streams' wake-up (the appender's)
        self.rule = rule  # which owners of a vbucket must read it: all, or a majority
        self.nodes: dict[str, NodeReadable] = {}
        self.waiting = 0
        self.generation = 0  # moves at every new wait: a barrier sent before it is not enough
        self._changed = trio.Event()

    def connected(self, consumer: str, vbuckets: Iterable[int]) -> None:
        """A node's maintenance stream is up with these vbuckets (what it could read stays)."""
        node = self.nodes.get(consumer)
        readable = {} if node is None else node.readable
        self.nodes[consumer] = NodeReadable(vbuckets)
        self.nodes[consumer].readable = readable
        self._notify()

    def answered(self, consumer: str, reply: p.BarrierReply) -> None:
        """A node answered a barrier: it can read these seqnos."""
        node = self.nodes.get(consumer)
        if node is None:
            return
        for position in reply.positions:
            if position.seqno > node.readable.get(position.vbucket, 0):
                node.readable[position.vbucket] = position.seqno
        self._notify()

    def behind(self, targets: Mapping[int, int]) -> list[str]:
        """What stands between `targets` and being readable: nodes that cannot read them yet
        where the ack rule needs them, or a vbucket no node streams. Empty when the rule's
        owners of every vbucket can."""
        owners: dict[int, list[str]] = {vb: [] for vb in targets}
        late: dict[int, list[str]] = {vb: [] for vb in targets}
        for name, node in sorted(self.nodes.items()):
            for vb in targets:
                if vb in node.vbuckets:
                    owners[vb].append(name)
                    if node.readable.get(vb, 0) < targets[vb]:
                        late[vb].append(name)
        lagging: set[str] = set()
        for vb, names in owners.items():
            need = len(names) if self.rule == "all" else len(names) // 2 + 1
            if len(names) - len(late[vb]) < need:
                lagging.update(late[vb])
        unstreamed = sum(1 for names in owners.values() if not names)
        found = sorted(lagging)
        if unstreamed:
            plural = "s" if unstreamed != 1 else ""
            found.append(f"{unstreamed} vbucket{plural} that no node streams yet")
        return found

    async def wait(self, targets: Mapping[int, int], timeout_s: float) -> list[str]:
        """Wait until every node that streams the targets' vbuckets can read them; what still
        lags when `timeout_s` ran out (empty: all visible)."""
        if not targets:
            return []
        self.waiting += 1
        self.generation += 1
        self.wake()  # an idle stream sends its barrier now
        try:
            with trio.move_on_after(timeout_s):
                while self.behind(targets):
                    await self._changed.wait()
            return self.behind(targets)
        finally:
            self.waiting -= 1

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()


class BarrierTurn:
    """A node stream's side: when to send a barrier (everything sent, someone waiting, no
    barrier out, and something new since the last one)."""

    def __init__(self, visibility: Visibility, consumer: str, wake: Callable[[], None]) -> None:
        self.visibility = visibility
        self.consumer = consumer
        self.wake = wake  # the stream's own: a wait that came while a barrier was out is due
        self.cookie = 0
        self.out = False
        self.asked: tuple[int, float] = (-1, math.nan)  # (generation, items sent) last asked

    def due(self, sent: int) -> int | None:
        """The cookie of a barrier to send now, if one is due."""
        if self.out or not self.visibility.waiting:
            return None
        now = (self.visibility.generation, float(sent))
        if now == self.asked:
            return None
        self.asked = now
        self.cookie += 1
        self.out = True
        return self.cookie

    def answered(self, reply: p.BarrierReply) -> None:
        if reply.cookie == self.cookie:
            self.out = False
        self.visibility.answered(self.consumer, reply)
        self.wake()
