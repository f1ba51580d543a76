"""The dispatcher: fans lists of stream items out to the worker queues by vbucket.

All connection readers send into one channel; the dispatcher splits each list so that worker
`vb % workers` gets every item of vbucket `vb`, in arrival order, again as one list per send.
An IndexChange marker goes to every worker.
"""

from __future__ import annotations

from collections.abc import Sequence

import trio

from indexer.streams import IndexChange, StreamItem


async def dispatch(
    incoming: trio.MemoryReceiveChannel[list[StreamItem]],
    workers: Sequence[trio.MemorySendChannel[list[StreamItem]]],
) -> None:
    """Run until every reader has closed its clone of the incoming channel, then close workers."""
    n = len(workers)
    async with incoming:
        try:
            async for items in incoming:
                if n == 1:
                    await workers[0].send(items)
                    continue
                lists: list[list[StreamItem]] = [[] for _ in range(n)]
                for item in items:
                    if isinstance(item, IndexChange):
                        for batch in lists:  # every worker must see it
                            batch.append(item)
                    else:
                        lists[item.vbucket % n].append(item)
                for worker, batch in zip(workers, lists, strict=True):
                    if batch:
                        await worker.send(batch)
        finally:
            for worker in workers:
                await worker.aclose()
