"""The router side of the feed: documents -> vbuckets, seqnos and index keys -> frames over TCP."""

from indexer.router.documents import Document, read_jsonl, vbucket_of
from indexer.router.feed import FeedError, FeedResult, feed
from indexer.router.workload import Workload, generate

__all__ = [
    "Document",
    "FeedError",
    "FeedResult",
    "Workload",
    "feed",
    "generate",
    "read_jsonl",
    "vbucket_of",
]
